"""Batched speculative decoding: B prompts, one target forward and one verify per step for all of them.

Rows accept different numbers of drafts, so each keeps its own length. The target's KV cache is one
preallocated cache for the batch (``kv_cache``) in which every step appends the same number of slots to
every row (the widest row's K'+1, or its tree's nodes + 1); a per-row slot mask records which slots hold
the row's kept tokens, and each row's tokens take their own positions (its length + j, or + a node's
depth). After the verify each row's kept slots (pending and its accepted path) move to the front of the
step's slots, where a chain's already are, and the cache is cropped to the most any row kept: a rejection
rolls back by masking, and a cache grows by the longest accepted path per step. This uses only what
transformers' models accept from any caller (a cache, a 4-D boolean mask and position ids), so it holds
across transformers' cache refactors. The prompts are read in groups of similar length (``_prefill``), so
a batch of short and long prompts does not pad every prompt to the longest.

Each row has its own ``DraftSource``. A source that declares its per-sequence state
(``capabilities.row_state``) drafts every row at once: Medusa heads and the MLP speculator, which read one
hidden state, in one ``propose`` over the rows' states stacked; EAGLE and draft LMs, whose rows' KV caches
differ in length (``capabilities.ragged_rows``), in their ``propose_rows`` (one padded, masked draft forward
per draft step). The others (a compiled draft LM; prompt lookup's token history; trees) draft row by row.
The target's forward and the verify (``specdraft.decoding.verify`` for chains, ``tree_verify`` for trees:
both kernels take a ragged batch) are batched. At temperature 0 each row's output is what
``speculative_decode`` gives that prompt alone.
"""

from __future__ import annotations

import copy
import time

import torch
from transformers.cache_utils import Cache

from specdraft.contract import Proposal, TargetOutputs, check_capabilities
from specdraft.decoding import verify as verify_lib
from specdraft.decoding.kv_cache import PreallocatedLayer, preallocated_cache, rows_step_mask
from specdraft.decoding.sampling import (
    SamplingParams,
    draw_exponentials,
    draw_uniforms,
    logits_to_probs,
    sample_with_exponentials,
)
from specdraft.decoding.speculative import (
    DecodeOutput,
    Forward,
    StepStats,
    _check_proposal,
    _stop_ids,
    _truncate,
    check_decode_args,
    deepest_passing_node,
    most_drafts,
)
from specdraft.decoding.tree_verify import verify_tree
from specdraft.decoding.trees import ancestor_matrix
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
    verify_backend: str = "auto",  # auto | triton | reference: see verify.resolve_verify_backend
) -> list[DecodeOutput]:
    """Decode B prompts together; returns one ``DecodeOutput`` per prompt, in order. ``sources=None``
    decodes plainly (one token per row per forward), the batched baseline. Sources may propose chains or
    trees (``TreeDrafting``; ``k`` is then the tree's depth). Each output's ``seconds`` is the whole batch's
    wall clock: tokens/s per request = len(tokens) / seconds."""
    prompts = [p.reshape(1, -1) for p in prompts]
    batch = len(prompts)
    if batch == 0:
        raise SpecdraftError("speculative_decode_batch needs at least one prompt")
    if sources is not None and len(sources) != batch:
        raise SpecdraftError(f"got {len(sources)} sources for {batch} prompts: give one source per prompt "
                             "(fresh_sources(source, B) makes them)")
    for source in sources or ():
        check_capabilities(source)  # what the rows' drafting reads: a declaration without its methods fails here
    budgets = []
    for b, prompt in enumerate(prompts):
        try:
            budgets.append(check_decode_args(target, prompt, max_new_tokens, k=k))
        except SpecdraftError as e:
            raise SpecdraftError(f"prompt {b} of the batch: {e}") from e
    stop_ids = _stop_ids(eos_token_ids)
    device = prompts[0].device
    backend = verify_lib.resolve_verify_backend(verify_backend, device)  # a bad choice fails before the prefill
    start = time.perf_counter()

    # Rows run longest prompt first, so that the prefill reads them in groups of similar length; the outputs
    # go back in the caller's order at the end.
    order = sorted(range(batch), key=lambda b: -prompts[b].shape[1])
    prompts, budgets = [prompts[b] for b in order], [budgets[b] for b in order]
    sources = None if sources is None else [sources[b] for b in order]
    # Every step appends up to k + 1 slots per row (a TreeDrafting's tree: its nodes + 1) and keeps at most the
    # longest accepted path: room for the budget and one step; the cache doubles in the rare case it is outgrown.
    widest = max([k] + [most_drafts(s, k) for s in sources or ()])
    cache, valid, last_logits = _prefill(target, prompts, sources, room=max(budgets) + widest + 1)
    pending = _first_tokens(last_logits, params, generator)  # [B]
    tokens = [[t] for t in pending.tolist()]
    steps: list[list[StepStats]] = [[] for _ in range(batch)]
    prefill_seconds = time.perf_counter() - start

    stopped = [tokens[b][0] in stop_ids for b in range(batch)]
    forwards: list[Forward] = []  # the call's target forwards, shared by every row's output

    def active(b: int) -> bool:
        return len(tokens[b]) < budgets[b] and not stopped[b]

    while any(active(b) for b in range(batch)):
        rows = [b for b in range(batch) if active(b)]
        proposals = {b: Proposal(pending.new_zeros(1, 0), None, None) for b in rows}
        t0 = t1 = time.perf_counter()
        if sources is not None:
            wanted = {b: min(k, budgets[b] - len(tokens[b])) for b in rows}
            for b, proposal in _propose_rows(sources, pending, wanted, params, generator).items():
                if not steps[b]:
                    _check_proposal(sources[b], proposal, k)
                proposals[b] = proposal
            t1 = time.perf_counter()

        # One forward over [pending, drafts] for every row, padded to the widest row (a finished row rides
        # along on padding, masked out: the batch keeps its shape and the cache its rows). A chain's input j
        # sees inputs 0..j at position length + j; a tree's node sees its ancestors at position length + depth.
        step = _StepLayout(rows, proposals, pending, batch)
        positions = valid.sum(1, keepdim=True) + step.offsets
        out = _forward(target, cache, step.ids, positions, valid, step.valid, step.sees)
        if step.trees:
            verified = _verify_tree_rows(out.logits, step, params, generator, backend)
        else:
            verified = _verify_rows(out.logits, rows, {b: proposals[b].tokens for b in rows},
                                    {b: proposals[b].probs for b in rows}, params, generator, backend)  # fmt: skip
        # Each row keeps the pending token and its accepted path; those slots move to the front of the step's
        # slots and the cache keeps as many as the row that kept most (a chain's path is already in front).
        kept = [[] for _ in range(batch)]
        for b, (path, _, _) in zip(rows, verified):
            kept[b] = [0] + [node + 1 for node in path]
        valid = torch.cat([valid, _keep_slots(cache, valid.shape[1], kept, step.ids.shape[1], device)], dim=1)
        t2 = time.perf_counter()
        next_pending = pending.clone()
        commits = 0.0
        for b, (path, new, depth) in zip(rows, verified):  # new: the accepted drafts, then one more token
            tokens[b].extend(new)
            next_pending[b] = new[-1]
            stopped[b] = bool(stop_ids.intersection(new))
            if sources is not None:
                t3 = time.perf_counter()
                drafted = proposals[b].tokens
                where = slice(0, len(path) + 1) if depth is None else torch.tensor(kept[b], device=device)
                sources[b].commit(torch.cat([pending[b].view(1, 1), drafted[:, path]], dim=1), _row(out, b, where))
                commit_seconds = time.perf_counter() - t3
                commits += commit_seconds
                # The batch waits for every row's drafts, and shares the target's forward and verify: each row
                # is charged the whole step's drafting and verifying (c is then the batch's draft cost).
                steps[b].append(StepStats(drafted.shape[1], len(path), t1 - t0 + commit_seconds, t2 - t1,
                                          depth=depth))  # fmt: skip
        pending = next_pending
        kind = "plain" if sources is None else "tree" if step.trees else "chain"
        forwards.append(Forward(kind, step.ids.shape[1], t1 - t0 + commits))

    seconds = time.perf_counter() - start
    outputs = [DecodeOutput(_truncate(tokens[b], budgets[b], stop_ids), steps[b], prefill_seconds, seconds, batch,
                            forwards) for b in range(batch)]  # fmt: skip
    return [outputs[order.index(b)] for b in range(batch)]


PREFILL_PADDING = 1.25  # a prefill group reads at most this many slots per prompt token


def _prefill(target, prompts: list[torch.Tensor], sources, room: int):
    """Read the prompts (longest first) into one cache for the batch, with ``room`` free slots per row; each
    source starts on its row's outputs. Prompts are read in groups of similar length, each group one forward
    left-padded to its longest prompt, so that padding costs at most ``PREFILL_PADDING`` of the tokens read
    (one forward for 16 Spec-Bench questions of 40 to 780 tokens would read 4x their tokens) and only the last
    position's logits are formed. Returns the cache, the slot mask [B, L] of the slots holding each row's
    prompt, and the prompts' last logits [B, V]."""
    lengths = [p.shape[1] for p in prompts]
    device = prompts[0].device
    groups, first = [], 0
    while first < len(prompts):
        end = first + 1  # lengths descend, so a group's first prompt is its longest
        while end < len(prompts) and (end + 1 - first) * lengths[first] <= PREFILL_PADDING * sum(lengths[first : end + 1]):
            end += 1
        groups.append(range(first, end))
        first = end
    caches, valids, last_logits = [], [], []
    for group in groups:
        width = lengths[group[0]]
        pads = torch.tensor([width - lengths[b] for b in group], device=device)[:, None]
        slots = torch.arange(width, device=device)[None]
        ids = torch.full((len(group), width), PAD_ID, dtype=torch.long, device=device)
        for i, b in enumerate(group):
            ids[i, width - lengths[b] :] = prompts[b][0]
        cache = preallocated_cache(target.config, width)
        out = target(ids, attention_mask=rows_step_mask(slots.new_zeros(len(group), 0, dtype=torch.bool), slots >= pads),
                     position_ids=(slots - pads).clamp_min(0), past_key_values=cache, use_cache=True, logits="last")
        if sources is not None:
            for i, b in enumerate(group):
                sources[b].start(prompts[b], _row(out, i, slice(width - lengths[b], width)))
        caches.append(cache)
        valids.append(torch.cat([slots >= pads, pads.new_zeros(len(group), lengths[0] - width, dtype=torch.bool)], 1))
        last_logits.append(out.logits[:, -1])
    layers = [PreallocatedLayer.stacked([c.layers[i] for c in caches], room) for i in range(len(caches[0].layers))]
    return Cache(layers=layers), torch.cat(valids), torch.cat(last_logits)


class _StepLayout:
    """The target's inputs for one step of the active ``rows``: ``ids`` [B, W] (pending, then the drafts;
    ``PAD_ID`` past a row's), ``valid`` [B, W] (real inputs), ``offsets`` [B, W] (position past the row's
    length: j for a chain, the node's depth for a tree), and for trees ``sees`` [B, W, W] (the pending token
    and each node's ancestors) with each row's padded ``parents``, ``ancestors`` and ``depths`` [R, N(, N)]."""

    def __init__(self, rows: list[int], proposals: dict, pending: torch.Tensor, batch: int):
        device = pending.device
        self.rows, self.proposals = rows, proposals
        self.counts = [proposals[b].tokens.shape[1] for b in rows]
        self.trees = any(proposals[b].parents is not None for b in rows)
        width = 1 + max(self.counts)
        self.ids = torch.full((batch, width), PAD_ID, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch, width, dtype=torch.bool, device=device)
        for b, count in zip(rows, self.counts):
            self.ids[b, : 1 + count] = torch.cat([pending[b].view(1), proposals[b].tokens[0]])
            self.valid[b, : 1 + count] = True
        self.offsets = torch.arange(width, device=device)[None].expand(batch, -1)
        self.sees = None
        if self.trees:
            # A chain among trees is the tree whose node i has parent i - 1. Padding nodes hang off the root.
            parents = torch.full((len(rows), width - 1), -1, dtype=torch.long, device=device)
            for i, (b, count) in enumerate(zip(rows, self.counts)):
                given = proposals[b].parents
                parents[i, :count] = torch.arange(-1, count - 1, device=device) if given is None else given[0].long()
            self.parents = parents
            self.ancestors = torch.stack([ancestor_matrix(row) for row in parents])  # [R, N, N]
            self.depths = self.ancestors.sum(2)  # [R, N]
            rows_t = torch.tensor(rows, device=device)
            offsets = torch.zeros(batch, width, dtype=torch.long, device=device)
            offsets[rows_t, 1:] = self.depths
            self.offsets = offsets
            sees = torch.zeros(batch, width, width, dtype=torch.bool, device=device)
            sees[:, :, 0] = True
            sees[rows_t, 1:, 1:] = self.ancestors
            self.sees = sees


def _keep_slots(cache, start: int, kept: list[list[int]], width: int, device) -> torch.Tensor:
    """After a step appended ``width`` slots per row from slot ``start``, keep each row's ``kept`` slots (step
    indices, in order) as the first of those slots, crop every row to the most any row kept, and return the
    kept slots' mask [B, most kept]. Chains keep a prefix: nothing moves, the crop alone rolls back."""
    counts = [len(slots) for slots in kept]
    if any(slots != list(range(len(slots))) for slots in kept):
        order = [slots + sorted(set(range(width)) - set(slots)) for slots in kept]
        index = torch.tensor(order, device=device)[:, None, :, None]
        for layer in cache.layers:
            for step_slots in (layer.keys[:, :, start : start + width], layer.values[:, :, start : start + width]):
                step_slots.copy_(step_slots.gather(2, index.expand_as(step_slots)))  # gather copies before the write
    cache.crop(-(width - max(counts)))
    return torch.arange(max(counts), device=device)[None] < torch.tensor(counts, device=device)[:, None]


def _propose_rows(sources: list, pending: torch.Tensor, wanted: dict[int, int], params, generator) -> dict:
    """Row b -> its proposal of at most ``wanted[b]`` drafts ([1, K_b]).

    Sources declaring their per-sequence state (``capabilities.row_state``) that otherwise share everything
    (copies of one source: same model) draft all rows at once: through their class's ``propose_rows`` where they
    declare ``ragged_rows`` (EAGLE, draft LMs: the rows' KV caches differ in length), else in one ``propose`` on a
    copy holding the rows' states (tensors whose dim 0 is the batch) stacked. Each row keeps the first
    ``wanted[b]`` drafts of its chain, which are what it would draft alone. Any other sources draft row by row."""
    rows = list(wanted)
    first = sources[rows[0]]
    capabilities = first.capabilities
    names = capabilities.row_state
    shared = {name: value for name, value in vars(first).items() if name not in names}

    def same(a, b) -> bool:  # the same object (a model, a tensor), or equal plain values (a vocabulary size)
        return a is b or (not isinstance(a, (torch.Tensor, torch.nn.Module)) and type(a) is type(b) and a == b)

    if len(rows) == 1 or not names or any(
        type(sources[b]) is not type(first) or vars(sources[b]).keys() != vars(first).keys()
        or any(not same(vars(sources[b])[name], value) for name, value in shared.items()) for b in rows
    ):
        return {b: sources[b].propose(pending[b].view(1, 1), wanted[b], params, generator) for b in rows}
    if capabilities.ragged_rows:  # row states of different lengths (a KV cache per row): the source batches them
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
    (``TreeDrafting``) copies that one too, in its ``__copy__``."""
    return [copy.copy(source) for _ in range(count)]


def _forward(target, cache, ids, positions, cached_valid, new_valid, sees=None) -> TargetOutputs:
    """Target forward of ``ids`` [B, W] at ``positions``: query j of row b sees the row's valid cached slots
    and the inputs it may see among its own (``rows_step_mask``: causally, or ``sees``)."""
    mask = rows_step_mask(cached_valid, new_valid, sees)
    return target(ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)


def _row(out: TargetOutputs, b: int, positions: slice | torch.Tensor) -> TargetOutputs:
    """Row b of a batched target output at ``positions`` (a slice, or indices), as a one-row output a source reads."""

    def cut(x):
        return None if x is None else x[b : b + 1, positions]

    logits = out.logits[b : b + 1] if out.last_only else cut(out.logits)
    return TargetOutputs(logits, out.vocab_rows, out.last_only, cut(out.final_hidden), cut(out.aux_hidden), out.taps)


def _first_tokens(logits: torch.Tensor, params: SamplingParams, generator) -> torch.Tensor:
    """[B, V] -> [B] the first token of each row (greedy: argmax; else a draw from the warped p)."""
    if params.is_greedy:
        return logits.argmax(-1)
    p = logits_to_probs(logits, params)
    return sample_with_exponentials(p, draw_exponentials(p.shape[0], p.shape[1], generator, p.device))


def _verify_rows(logits, rows, drafts, q, params, generator, backend) -> list[tuple[list[int], list[int], None]]:
    """Chains: per active row (its accepted drafts' indices, the tokens it emits: those drafts then one more,
    None: no tree depth); greedy by comparison, else ``verify`` over the ragged batch (rows' drafts
    concatenated, ``cu_num_draft_tokens`` their cumsum). One host sync."""
    device = logits.device
    counts = [drafts[b].shape[1] for b in rows]
    width = logits.shape[1]
    row_logits = logits[rows]  # [R, W, V]
    if params.is_greedy:
        best = row_logits.argmax(-1)  # [R, W]
        padded = torch.stack([torch.nn.functional.pad(drafts[b][0], (0, width - 1 - c), value=-1)
                              for b, c in zip(rows, counts)])  # [R, W-1], -1 never matches
        num_accepted, emitted = (padded == best[:, :-1]).int().cumprod(1).sum(1), best
    else:
        p = logits_to_probs(row_logits, params)  # [R, W, V]
        vocab = p.shape[-1]
        flat_drafts = torch.cat([drafts[b][0] for b in rows])
        flat_p = torch.cat([p[i, :c] for i, c in enumerate(counts)])
        flat_q = _flat_q([q[b] for b in rows], [drafts[b][0] for b in rows], vocab)
        noise = draw_exponentials(len(rows), vocab, generator, device)
        bonus = sample_with_exponentials(p[torch.arange(len(rows), device=device),
                                           torch.tensor(counts, device=device)], noise)  # fmt: skip
        cu = torch.tensor(counts, device=device).cumsum(0)
        emitted, num_accepted = verify_lib.verify(
            flat_drafts, cu, flat_q, flat_p, bonus, draw_uniforms(len(flat_drafts), generator, device), noise,
            torch.zeros(len(rows), dtype=torch.bool, device=device), max_spec_len=width - 1, check=False,
            backend=backend,
        )  # fmt: skip
    host = torch.cat([num_accepted[:, None], emitted], dim=1).tolist()  # the step's one host sync
    return [(list(range(n)), row[: n + 1], None) for n, *row in host]


def _verify_tree_rows(logits, step: _StepLayout, params, generator,
                      backend) -> list[tuple[list[int], list[int], int]]:  # fmt: skip
    """Trees: per active row (its accepted path's node indices, the tokens it emits: the path's then one more,
    the tree's depth). Greedy: the deepest node whose path matches the target's argmaxes
    (``deepest_passing_node``, as one prompt decodes); else ``verify_tree`` over the ragged batch. One host sync."""
    device, rows, counts = logits.device, step.rows, step.counts
    drafts = step.ids[rows, 1:]  # [R, N]: PAD_ID past a row's nodes
    node = torch.arange(drafts.shape[1], device=device)[None] < torch.tensor(counts, device=device)[:, None]
    depth = torch.where(node, step.depths, 0).amax(1)  # [R]
    if params.is_greedy:
        best = logits[rows].argmax(-1)  # [R, W]: row 0 after the pending token, row i + 1 after node i
        passes = node & (drafts == best.gather(1, step.parents + 1))
        last, path_mask = deepest_passing_node(passes, step.ancestors, step.depths)
        final = best.gather(1, (last + 1)[:, None])
        host = torch.cat([depth[:, None], path_mask.long(), drafts, final], dim=1).tolist()
        width = drafts.shape[1]
        verified = []
        for d, *row in host:
            path = [i for i in range(width) if row[i]]
            verified.append((path, [row[width + i] for i in path] + [row[-1]], d))
        return verified
    p = logits_to_probs(logits[rows], params)  # [R, W, V]
    flat_q = _flat_q([step.proposals[b].probs for b in rows], [drafts[i, :c] for i, c in enumerate(counts)],
                     p.shape[-1])  # fmt: skip
    total, most = sum(counts), max(counts)
    output, nodes, num_accepted = verify_tree(
        torch.cat([drafts[i, :c] for i, c in enumerate(counts)]),
        torch.cat([step.parents[i, :c] for i, c in enumerate(counts)]),
        torch.tensor(counts, device=device).cumsum(0), flat_q, torch.cat([p[i, : c + 1] for i, c in enumerate(counts)]),
        draw_uniforms(total, generator, device), draw_exponentials(len(rows), p.shape[-1], generator, device),
        torch.zeros(len(rows), dtype=torch.bool, device=device), max_depth=most, check=False, backend=backend,
    )  # fmt: skip
    host = torch.cat([num_accepted[:, None], depth[:, None], output, nodes], dim=1).tolist()
    return [(row[most + 1 : most + 1 + n], row[: n + 1], d) for n, d, *row in host]


def _flat_q(q: list, drafts: list[torch.Tensor], vocab: int) -> torch.Tensor | None:
    """The rows' q ([1, K_b, V] each, None for deterministic drafts) concatenated for the flat verify layout;
    None if every row's drafts are deterministic, else a deterministic row's q is one-hot on its drafts."""
    if all(x is None for x in q):
        return None
    return torch.cat([x[0] if x is not None else torch.nn.functional.one_hot(d, vocab).float() for x, d in zip(q, drafts)])
