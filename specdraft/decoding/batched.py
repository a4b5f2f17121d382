"""Batched speculative decoding: B prompts, one target forward and one verify per step for all of them.

Rows accept different numbers of drafts, so each keeps its own length. The target's KV cache is one
preallocated cache for the batch (``kv_cache``) in which every step appends the same number of slots to
every row (the longest row's K'+1); a per-row slot mask records which slots hold the row's kept tokens,
and each row's tokens take their own positions (its length + j). Rejected drafts' slots stay masked
out, so nothing is copied on a rollback: the attention mask is what rolls back. This costs (K+1)/tau
slots per token of cache, and uses only what transformers' models accept from any caller (a cache, a
4-D boolean mask and position ids), so it holds across transformers' cache refactors.

Each row has its own ``DraftSource``. A source that names its per-sequence state (``row_state``) drafts
every row at once: Medusa heads and the MLP speculator, which read one hidden state, in one ``propose``
over the rows' states stacked; EAGLE and draft LMs, whose rows' KV caches differ in length, in their
``propose_rows`` (one padded, masked draft forward per draft step). The others (a compiled draft LM;
prompt lookup's token history) draft row by row. The target's forward and the verify
(``specdraft.decoding.verify``, whose kernel takes a ragged batch) are batched. At temperature 0
each row's output is what ``speculative_decode`` gives that prompt alone.
"""

from __future__ import annotations

import copy
import time

import torch

from specdraft.contract import Proposal, TargetOutputs
from specdraft.decoding import verify as verify_lib
from specdraft.decoding.kv_cache import preallocated_cache, rows_step_mask
from specdraft.decoding.sampling import (
    SamplingParams,
    draw_exponentials,
    draw_uniforms,
    logits_to_probs,
    sample_with_exponentials,
)
from specdraft.decoding.speculative import (
    DecodeOutput,
    StepStats,
    _check_proposal,
    _stop_ids,
    _truncate,
    check_decode_args,
)
from specdraft.errors import SpecdraftError

PAD_ID = 0  # fills input slots past a row's drafts; their keys are masked out and their outputs never read


@torch.no_grad()
def speculative_decode_batch(
    target,
    sources: list,  # one DraftSource per prompt (``fresh_sources`` makes them), or None for plain decoding
    prompts: list[torch.Tensor],  # B prompts of token ids, [L_b] or [1, L_b], on the target's device
    *,
    k: int = 5,
    params: SamplingParams = SamplingParams(),
    max_new_tokens: int = 128,
    eos_token_ids: int | list[int] | None = None,
    generator: torch.Generator | None = None,
) -> list[DecodeOutput]:
    """Decode B prompts together; returns one ``DecodeOutput`` per prompt, in order. ``sources=None``
    decodes plainly (one token per row per forward), the batched baseline. Each output's ``seconds`` is
    the whole batch's wall clock: tokens/s per request = len(tokens) / seconds."""
    prompts = [p.reshape(1, -1) for p in prompts]
    batch = len(prompts)
    if batch == 0:
        raise SpecdraftError("speculative_decode_batch needs at least one prompt")
    if sources is not None and len(sources) != batch:
        raise SpecdraftError(f"got {len(sources)} sources for {batch} prompts: give one source per prompt "
                             "(fresh_sources(source, B) makes them)")
    budgets = []
    for b, prompt in enumerate(prompts):
        try:
            budgets.append(check_decode_args(target, prompt, max_new_tokens, k=k))
        except SpecdraftError as e:
            raise SpecdraftError(f"prompt {b} of the batch: {e}") from e
    stop_ids = _stop_ids(eos_token_ids)
    device = prompts[0].device
    start = time.perf_counter()

    # Prefill: prompts right-padded into one [B, L_max] forward; pad slots are masked out for good.
    lengths = [p.shape[1] for p in prompts]
    ids = torch.full((batch, max(lengths)), PAD_ID, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, : lengths[b]] = p[0]
    valid = torch.arange(ids.shape[1], device=device)[None] < torch.tensor(lengths, device=device)[:, None]
    # Every step appends up to k + 1 slots per row; the cache doubles if the decode outgrows this.
    cache = preallocated_cache(target.config, ids.shape[1] + max(budgets) + k + 1)
    positions = torch.arange(ids.shape[1], device=device).expand(batch, -1)
    out = _forward(target, cache, ids, positions, valid[:, :0], valid)
    last = torch.tensor(lengths, device=device) - 1
    pending = _first_tokens(out.logits[torch.arange(batch, device=device), last], params, generator)  # [B]
    tokens = [[t] for t in pending.tolist()]
    if sources is not None:
        for b, source in enumerate(sources):
            source.start(prompts[b], _row(out, b, slice(0, lengths[b]), last_logits=True))
    steps: list[list[StepStats]] = [[] for _ in range(batch)]
    prefill_seconds = time.perf_counter() - start

    stopped = [tokens[b][0] in stop_ids for b in range(batch)]

    def active(b: int) -> bool:
        return len(tokens[b]) < budgets[b] and not stopped[b]

    while any(active(b) for b in range(batch)):
        rows = [b for b in range(batch) if active(b)]
        drafts = {b: pending.new_zeros(1, 0) for b in rows}
        q = {b: None for b in rows}
        t0 = t1 = time.perf_counter()
        if sources is not None:
            wanted = {b: min(k, budgets[b] - len(tokens[b])) for b in rows}
            for b, proposal in _propose_rows(sources, pending, wanted, params, generator).items():
                if proposal.parents is not None:
                    raise SpecdraftError("batched decoding verifies chains; decode trees one prompt at a time")
                if not steps[b]:
                    _check_proposal(sources[b], proposal, k)
                drafts[b], q[b] = proposal.tokens, proposal.probs
            t1 = time.perf_counter()

        # One forward over [pending, d_1..d_K'] for every row, padded to the longest row's K'+1 (a finished row
        # rides along on padding, masked out: the batch keeps its shape and the cache its rows).
        width = 1 + max(d.shape[1] for d in drafts.values())
        step_ids = torch.full((batch, width), PAD_ID, dtype=torch.long, device=device)
        step_valid = torch.zeros(batch, width, dtype=torch.bool, device=device)  # real inputs of this step
        for b in rows:
            step_ids[b, : 1 + drafts[b].shape[1]] = torch.cat([pending[b].view(1), drafts[b][0]])
            step_valid[b, : 1 + drafts[b].shape[1]] = True
        positions = valid.sum(1, keepdim=True) + torch.arange(width, device=device)[None]
        out = _forward(target, cache, step_ids, positions, valid, step_valid)
        num_accepted, emitted = _verify_rows(out.logits, rows, drafts, q, params, generator)
        host = torch.cat([num_accepted[:, None], emitted], dim=1).tolist()  # the step's one host sync
        n_host, emitted_host = [row[0] for row in host], [row[1:] for row in host]
        # The kept slots: pending and the accepted drafts of each row; the rest of the step stays masked.
        kept = torch.zeros(batch, width, dtype=torch.bool, device=device)
        for i, b in enumerate(rows):
            kept[b, : n_host[i] + 1] = True
        valid = torch.cat([valid, kept], dim=1)
        t2 = time.perf_counter()
        next_pending = pending.clone()
        for i, b in enumerate(rows):
            n = n_host[i]
            new = emitted_host[i][: n + 1]  # the accepted drafts, then the correction or bonus token
            tokens[b].extend(new)
            next_pending[b] = new[-1]
            stopped[b] = bool(stop_ids.intersection(new))
            if sources is not None:
                t3 = time.perf_counter()
                sources[b].commit(torch.cat([pending[b].view(1, 1), drafts[b][:, :n]], dim=1),
                                  _row(out, b, slice(0, n + 1)))  # fmt: skip
                commit_seconds = time.perf_counter() - t3
                # The batch waits for every row's drafts, and shares the target's forward and verify: each row
                # is charged the whole step's drafting and verifying (c is then the batch's draft cost).
                steps[b].append(StepStats(drafts[b].shape[1], n, t1 - t0 + commit_seconds, t2 - t1))
        pending = next_pending

    seconds = time.perf_counter() - start
    return [DecodeOutput(_truncate(tokens[b], budgets[b], stop_ids), steps[b], prefill_seconds, seconds, batch)
            for b in range(batch)]


def _propose_rows(sources: list, pending: torch.Tensor, wanted: dict[int, int], params, generator) -> dict:
    """Row b -> its proposal of at most ``wanted[b]`` drafts ([1, K_b]).

    Sources naming their per-sequence state (``row_state``) that otherwise share everything (copies of one
    source: same model) draft all rows at once: through their class's ``propose_rows`` where it has one
    (EAGLE, draft LMs: the rows' KV caches differ in length), else in one ``propose`` on a copy holding the rows' states
    (tensors whose dim 0 is the batch) stacked. Each row keeps the first ``wanted[b]`` drafts of its chain,
    which are what it would draft alone. Any other sources draft row by row."""
    rows = list(wanted)
    first = sources[rows[0]]
    names = getattr(first, "row_state", ())
    shared = {name: value for name, value in vars(first).items() if name not in names}

    def same(a, b) -> bool:  # the same object (a model, a tensor), or equal plain values (a vocabulary size)
        return a is b or (not isinstance(a, (torch.Tensor, torch.nn.Module)) and type(a) is type(b) and a == b)

    if len(rows) == 1 or not names or any(
        type(sources[b]) is not type(first) or vars(sources[b]).keys() != vars(first).keys()
        or any(not same(vars(sources[b])[name], value) for name, value in shared.items()) for b in rows
    ):
        return {b: sources[b].propose(pending[b].view(1, 1), wanted[b], params, generator) for b in rows}
    if hasattr(type(first), "propose_rows"):  # ragged row states (a KV cache per row): the source batches them
        proposal = type(first).propose_rows([sources[b] for b in rows], pending[rows].view(-1, 1),
                                            max(wanted.values()), params, generator)  # fmt: skip
    else:
        stacked = copy.copy(first)
        for name in names:
            setattr(stacked, name, torch.cat([getattr(sources[b], name) for b in rows]))
        proposal = stacked.propose(pending[rows].view(-1, 1), max(wanted.values()), params, generator)

    def row(x, i, n):
        return None if x is None else x[i : i + 1, :n]

    return {b: Proposal(row(proposal.tokens, i, wanted[b]), row(proposal.probs, i, wanted[b]),
                        row(proposal.parents, i, wanted[b]))
            for i, b in enumerate(rows)}  # fmt: skip


def fresh_sources(source, count: int) -> list:
    """``count`` independent copies of a DraftSource for the rows of a batch. A source's per-sequence state is
    made by ``start``, so a shallow copy shares only its (read-only) model; a source holding another source
    (``TreeDrafting``) gives its own ``fresh()``."""
    if hasattr(source, "fresh"):
        return [source.fresh() for _ in range(count)]
    return [copy.copy(source) for _ in range(count)]


def _forward(target, cache, ids, positions, cached_valid, new_valid) -> TargetOutputs:
    """Target forward of ``ids`` [B, W] at ``positions``: query j of row b sees the row's valid cached slots
    and its own inputs 0..j (``rows_step_mask``)."""
    mask = rows_step_mask(cached_valid, new_valid)
    return target(ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)


def _row(out: TargetOutputs, b: int, positions: slice, last_logits: bool = False) -> TargetOutputs:
    """Row b of a batched target output at ``positions``, as a one-row output a source reads."""

    def cut(x):
        return None if x is None else x[b : b + 1, positions]

    logits = out.logits[b : b + 1, positions.stop - 1 : positions.stop] if last_logits else cut(out.logits)
    return TargetOutputs(logits, out.vocab_rows, last_logits, cut(out.final_hidden), cut(out.aux_hidden), out.taps)


def _first_tokens(logits: torch.Tensor, params: SamplingParams, generator) -> torch.Tensor:
    """[B, V] -> [B] the first token of each row (greedy: argmax; else a draw from the warped p)."""
    if params.is_greedy:
        return logits.argmax(-1)
    p = logits_to_probs(logits, params)
    return sample_with_exponentials(p, draw_exponentials(p.shape[0], p.shape[1], generator, p.device))


def _verify_rows(logits, rows, drafts, q, params, generator):
    """(num_accepted [R], emitted [R, W]) for the active rows: greedy by comparison, else ``verify`` over the
    ragged batch (rows' drafts concatenated, ``cu_num_draft_tokens`` their cumsum)."""
    device = logits.device
    counts = [drafts[b].shape[1] for b in rows]
    width = logits.shape[1]
    row_logits = logits[rows]  # [R, W, V]
    if params.is_greedy:
        best = row_logits.argmax(-1)  # [R, W]
        padded = torch.stack([torch.nn.functional.pad(drafts[b][0], (0, width - 1 - c), value=-1)
                              for b, c in zip(rows, counts)])  # [R, W-1], -1 never matches
        matches = (padded == best[:, :-1]).int().cumprod(1)
        return matches.sum(1), best
    p = logits_to_probs(row_logits, params)  # [R, W, V]
    vocab = p.shape[-1]
    flat_drafts = torch.cat([drafts[b][0] for b in rows])
    flat_p = torch.cat([p[i, :c] for i, c in enumerate(counts)])
    flat_q = None
    if any(q[b] is not None for b in rows):  # rows with deterministic drafts get one-hot q
        flat_q = torch.cat([q[b][0] if q[b] is not None
                            else torch.nn.functional.one_hot(drafts[b][0], vocab).float() for b in rows])
    noise = draw_exponentials(len(rows), vocab, generator, device)
    bonus = sample_with_exponentials(p[torch.arange(len(rows), device=device), torch.tensor(counts, device=device)],
                                     noise)  # fmt: skip
    cu = torch.tensor(counts, device=device).cumsum(0)
    output, num_accepted = verify_lib.verify(
        flat_drafts, cu, flat_q, flat_p, bonus, draw_uniforms(len(flat_drafts), generator, device), noise,
        torch.zeros(len(rows), dtype=torch.bool, device=device), max_spec_len=width - 1, check=False,
    )  # fmt: skip
    return num_accepted, output
