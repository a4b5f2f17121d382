"""Speculative decoding: a draft proposes K tokens, the target checks them all in one forward.

One step, for each sequence whose next token ("pending") is chosen but not yet run through the target:
  1. draft    d_1..d_K with d_i ~ q_i                       (DraftSource.propose)
  2. target   p_1..p_{K+1} from ONE forward over [pending, d_1..d_K], on the target's KV cache
  3. verify   keep d_1..d_n, accepting each d_i with probability min(1, p_i(d_i) / q_i(d_i));
              then one more token: from norm(max(0, p_{n+1} - q_{n+1})) after a rejection,
              or the bonus token ~ p_{K+1} if all K were accepted
  4. rollback the target's KV cache to [.., pending, d_1..d_n]; the source rolls back its own (commit)
The tokens emitted are distributed exactly as the target's own samples (Leviathan et al. 2023,
Thm. 1; Chen et al. 2023), and at temperature 0 they are the target's greedy tokens.

A source may propose a tree instead of a chain (``Proposal.parents``; ``TreeDrafting`` asks for one):
every node is verified in the same one forward, under a tree attention mask, and the cache keeps the
accepted path.

There is one decoder: ``speculative_decode_batch`` decodes B prompts, one target forward and one verify per step
for all of them (how the rows share the cache and the forward: ``specdraft.decoding.rows``), and one prompt is a
batch of one (``speculative_decode``, ``plain_decode``). A step (``_Decode.step``) is: propose, one forward,
verify (``_verify_chains`` or ``_verify_trees``), keep each row's accepted slots, commit; one host sync.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import islice

import torch
import torch.nn.functional as F

from specdraft.contract import Proposal, check_capabilities
from specdraft.decoding import verify as verify_lib
from specdraft.decoding.compiled_verify import compiled_verify
from specdraft.decoding.kv_cache import keep_slots
from specdraft.decoding.rows import StepLayout, prefill_rows, propose_rows, row_outputs
from specdraft.decoding.sampling import (
    SamplingParams,
    draw_exponentials,
    draw_uniforms,
    logits_to_probs,
    sample_with_exponentials,
)
from specdraft.decoding.tree_verify import TreeVerifyInputs, verify_tree
from specdraft.decoding.trees import TreeDrafting, check_tree, tree_depths
from specdraft.errors import SpecdraftError
from specdraft.sdpa import cudnn_attention_off


@dataclass
class StepStats:
    """What one draft-and-verify step did."""

    num_drafted: int  # K' <= K: a source may propose fewer (prompt lookup without a match: 0); a tree's nodes
    num_accepted: int  # n: the step emitted n + 1 tokens
    draft_seconds: float  # propose + commit
    target_seconds: float  # the (K'+1)-position forward + verify + cache rollback
    # alpha predicted = sum_x min(p(x), q(x)) at each *tested* position: the n accepted drafts
    # and the rejected one. Later positions were conditioned on a rejected token: not counted.
    # Empty for a tree step.
    alpha_predicted: list[float] = field(default_factory=list)
    depth: int | None = None  # a tree's depth: the most drafts the step could accept (None: a chain, K')

    @property
    def max_accepted(self) -> int:
        return self.num_drafted if self.depth is None else self.depth


@dataclass(frozen=True)
class Forward:
    """One decode-phase target forward of a decode call, as the verify-cost curve prices it
    (``specdraft.evaluation.verify_cost``): what kind of step, how wide, and the drafting it waited for."""

    kind: str  # "plain" (one new token per row), "chain" or "tree" (a verify)
    width: int  # positions per row the forward read: drafts + 1 (a compiled verify: its padded width)
    draft_seconds: float  # the step's propose + commit (0 for plain decoding)


@dataclass
class DecodeOutput:
    tokens: list[int]  # generated tokens (prompt excluded), ending with the stop token if one was hit
    steps: list[StepStats]  # empty for plain decoding
    prefill_seconds: float  # prompt forward + source.start + first token
    seconds: float  # wall clock of the whole call (batched: of the whole batch)
    batch_rows: int = 1  # prompts decoded together in that call (``speculative_decode_batch``)
    # Every target forward after the prefill, in order (batched: the call's, one list shared by its rows).
    forwards: list[Forward] = field(default_factory=list)


@dataclass(frozen=True)
class VerifyRules:
    """How a decode call verifies drafts: the sampling that warps p (and q), and the acceptance test."""

    params: SamplingParams
    lenience: float = 1.0  # LOSSY below 1: accept while u < p / (lenience * q)
    typical_acceptance: bool = False  # LOSSY: Medusa's typical acceptance instead of exact verify
    backend: str = "reference"  # verify.resolve_verify_backend's answer: triton | reference


@dataclass
class _RowVerdict:
    """What one row's verify decided."""

    path: list[int]  # the accepted drafts' node indices (a chain: 0..n-1)
    tokens: list[int]  # the accepted drafts, then the correction or bonus token
    depth: int | None  # a tree's depth (None: a chain)


@torch.no_grad()
def speculative_decode(
    target,  # FrozenTarget: target(ids, past_key_values=..., use_cache=True) -> TargetOutputs
    source,  # DraftSource
    prompt_ids: torch.Tensor,  # [1, L] on the target's device
    *,
    k: int = 5,
    params: SamplingParams = SamplingParams(),
    max_new_tokens: int = 128,
    eos_token_ids: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    lenience: float = 1.0,  # LOSSY below 1: accept while u < p / (lenience * q)
    typical_acceptance: bool = False,  # LOSSY: Medusa's typical acceptance instead of exact verify
    timing: bool = True,  # split each step's time into draft and target (on CUDA: a sync per split)
    compile_target: bool | str = False,  # the verify's forward compiled (True, or a torch.compile mode)
    verify_backend: str = "auto",  # auto | triton | reference: see verify.resolve_verify_backend
) -> DecodeOutput:
    """Generate up to ``max_new_tokens`` tokens for one prompt with drafts from ``source``, K per step (a tree
    each step if the source proposes one, see ``TreeDrafting``): ``speculative_decode_batch`` with one row."""
    check_decode_args(target, prompt_ids, max_new_tokens, k=k, lenience=lenience)
    return speculative_decode_batch(
        target, [source], [prompt_ids], k=k, params=params, max_new_tokens=max_new_tokens,
        eos_token_ids=eos_token_ids, generator=generator, lenience=lenience, typical_acceptance=typical_acceptance,
        timing=timing, compile_target=compile_target, verify_backend=verify_backend,
    )[0]  # fmt: skip


@torch.no_grad()
def plain_decode(
    target,
    prompt_ids: torch.Tensor,
    *,
    params: SamplingParams = SamplingParams(),
    max_new_tokens: int = 128,
    eos_token_ids: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    compile_target: bool | str = False,  # each step's forward compiled, as speculative_decode's verify
) -> DecodeOutput:
    """The baseline: the same decoder, target and KV cache code, one token per forward."""
    check_decode_args(target, prompt_ids, max_new_tokens)
    return speculative_decode_batch(target, None, [prompt_ids], params=params, max_new_tokens=max_new_tokens,
                                    eos_token_ids=eos_token_ids, generator=generator,
                                    compile_target=compile_target)[0]  # fmt: skip


@torch.no_grad()
def speculative_decode_batch(
    target,
    sources: list | None,  # one DraftSource per prompt (``rows.fresh_sources`` makes them), or None: plain decoding
    prompts: list[torch.Tensor],  # B prompts of token ids, [L_b] or [1, L_b], on the target's device
    *,
    k: int = 5,
    params: SamplingParams = SamplingParams(),
    max_new_tokens: int = 128,
    eos_token_ids: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    lenience: float = 1.0,  # LOSSY below 1: accept while u < p / (lenience * q)
    typical_acceptance: bool = False,  # LOSSY: Medusa's typical acceptance instead of exact verify
    timing: bool = True,  # split each step's time into draft and target (on CUDA: a sync per split)
    compile_target: bool | str = False,  # one prompt only: the verify's forward compiled over a static cache
    verify_backend: str = "auto",  # auto | triton | reference: see verify.resolve_verify_backend
) -> list[DecodeOutput]:
    """Decode B prompts together; returns one ``DecodeOutput`` per prompt, in order. ``sources=None`` decodes
    plainly (one token per row per forward), the baseline. Sources may propose chains or trees (``TreeDrafting``;
    ``k`` is then the tree's depth). Each output's ``seconds`` is the whole batch's wall clock: tokens/s per
    request = len(tokens) / seconds. ``timing=False`` leaves the steps' seconds at 0 and the hot loop free of
    clock syncs. ``compile_target`` runs each verify as wide as the widest step (a tree: its nodes + 1) over a
    static cache, compiled (``specdraft.decoding.compiled_verify``). At temperature 0 each row's output is what
    the prompt gives alone."""
    prompts = [p.reshape(1, -1) for p in prompts]
    batch = len(prompts)
    if batch == 0:
        raise SpecdraftError("speculative_decode_batch needs at least one prompt")
    if sources is not None and len(sources) != batch:
        raise SpecdraftError(f"got {len(sources)} sources for {batch} prompts: give one source per prompt "
                             "(fresh_sources(source, B) makes them)")
    if compile_target and batch > 1:
        raise SpecdraftError("compile_target compiles one prompt's decode; batches run eager: drop compile_target, "
                             "or decode one prompt at a time")
    if sources is not None and batch > 1:  # one prompt's decode reads no capabilities (``rows.propose_rows``)
        for source in sources:
            check_capabilities(source)  # what the rows' drafting reads: a declaration without its methods fails here
    budgets = []
    for b, prompt in enumerate(prompts):
        try:
            budgets.append(check_decode_args(target, prompt, max_new_tokens, k=k, lenience=lenience))
        except SpecdraftError as e:
            if batch == 1:
                raise
            raise SpecdraftError(f"prompt {b} of the batch: {e}") from e
    stop_ids = _stop_ids(eos_token_ids)
    device = prompts[0].device
    rules = VerifyRules(params, lenience, typical_acceptance,
                        verify_lib.resolve_verify_backend(verify_backend, device))  # a bad choice fails here
    start = _clock(device)
    clock = (lambda: _clock(device)) if timing and sources is not None else (lambda: 0.0)  # plain: nothing to split

    # Rows run longest prompt first, so that the prefill reads them in groups of similar length; the outputs
    # go back in the caller's order at the end.
    order = sorted(range(batch), key=lambda b: -prompts[b].shape[1])
    prompts, budgets = [prompts[b] for b in order], [budgets[b] for b in order]
    sources = None if sources is None else [sources[b] for b in order]
    # Every step appends up to k + 1 slots per row (a TreeDrafting's tree: its nodes + 1) and keeps at most the
    # longest accepted path: room for the budget and one step; the cache doubles in the rare case it is outgrown.
    widest = 0 if sources is None else max(most_drafts(s, k) for s in sources)
    verifier, static = target, None
    if compile_target:  # the steps run compiled, 1 + widest wide over a static cache; the prefill stays eager
        verifier = compiled_verify(target, compile_target)
        static = verifier.new_cache(prompts[0].shape[1] + budgets[0], 1 + widest,
                                    sources is not None and isinstance(sources[0], TreeDrafting))  # fmt: skip
    with cudnn_attention_off(device):  # every step's key length is new: no per-shape attention plans
        cache, valid, last_logits = prefill_rows(target, prompts, sources, room=max(budgets) + widest + 1,
                                                 static=static)
        pending = _first_tokens(last_logits, params, generator)  # [B]
        decode = _Decode(verifier, static, sources, cache, valid, pending, budgets, k, rules, generator, clock,
                         stop_ids)
        prefill_seconds = _clock(device) - start
        while rows := decode.active_rows():
            decode.step(rows)
        decode.alphas_to_host()
    tokens, steps, forwards = decode.tokens, decode.steps, decode.forwards
    seconds = _clock(device) - start
    outputs = [DecodeOutput(_truncate(tokens[b], budgets[b], stop_ids), steps[b], prefill_seconds, seconds, batch,
                            forwards) for b in range(batch)]  # fmt: skip
    return [outputs[order.index(b)] for b in range(batch)]


class _Decode:
    """One decode call's rows between steps: what every step reads (the target's verify, the sources, the rules, the
    budgets) and each row's state (its tokens and steps, its pending token, which cache slots are its own)."""

    def __init__(self, verifier, static, sources, cache, valid: torch.Tensor, pending: torch.Tensor, budgets: list[int],
                 k: int, rules: VerifyRules, generator, clock, stop_ids: set[int]):  # fmt: skip
        # valid [B, S]: which cache slots hold each row's kept tokens; one row's are all its own (None: no mask)
        self.verifier, self.static, self.sources, self.cache = verifier, static, sources, cache
        self.valid = valid if len(budgets) > 1 else None
        self.budgets, self.k, self.rules, self.generator, self.clock, self.stop_ids = (budgets, k, rules, generator,
                                                                                       clock, stop_ids)  # fmt: skip
        self.pending, self.pending_host = pending, pending.tolist()  # [B] on the device, and the same on the host
        self.tokens = [[t] for t in self.pending_host]
        self.stopped = [t in stop_ids for t in self.pending_host]
        self.steps: list[list[StepStats]] = [[] for _ in budgets]
        self.alphas: list[tuple[torch.Tensor, list[tuple[StepStats, int]]]] = []  # per step: on the device, and whose
        self.forwards: list[Forward] = []  # the call's target forwards, shared by every row's output

    def active_rows(self) -> list[int]:
        return [b for b, budget in enumerate(self.budgets) if len(self.tokens[b]) < budget and not self.stopped[b]]

    def step(self, rows: list[int]) -> None:
        """One step of the active ``rows``: propose, one target forward, verify (the step's one host sync), keep
        each row's accepted slots in the cache, commit to the sources."""
        sources, pending, clock, batch = self.sources, self.pending, self.clock, len(self.budgets)
        # 1. draft: each row at most k (never past its budget or the context)
        t0 = clock()
        if sources is None:
            proposals = {b: Proposal(pending.new_zeros(1, 0), None, None) for b in rows}
        else:
            wanted = {b: min(self.k, self.budgets[b] - len(self.tokens[b])) for b in rows}
            proposals = propose_rows(sources, pending, wanted, self.rules.params, self.generator)
            for b in rows:
                if not self.steps[b]:  # a source's first proposal of a call is checked; later ones trusted (no syncs)
                    _check_proposal(sources[b], proposals[b], wanted[b])
        t1 = clock()
        # 2. one target forward over [pending, drafts] for every row, padded to the widest row (a finished row
        # rides along on padding, masked out: the batch keeps its shape and the cache its rows).
        layout = StepLayout(rows, proposals, pending, batch)
        if layout.trees and self.static is not None and not self.static.tree:
            raise SpecdraftError(f"{type(sources[rows[0]]).__name__} proposed a tree, and compile_target sizes its "
                                 "steps by a TreeDrafting's tree: draft trees through TreeDrafting, or decode with "
                                 "compile_target off")  # fmt: skip
        start = self.cache.get_seq_length() if self.valid is None else self.valid.shape[1]  # a host value
        out = layout.forward(self.verifier, self.cache, self.valid)
        # 3. verify (the step's one host sync); the first step checks the verify's inputs, later ones are trusted
        if layout.trees:
            verdicts, alpha, tested = _verify_trees(out.logits, layout, self.rules, self.generator), None, []
        else:
            verdicts, alpha, tested = _verify_chains(out.logits, layout, self.rules, self.generator, not self.forwards)
        # 4. each row keeps the pending token and its accepted path; those slots move to the front of the step's
        # slots and the cache keeps as many as the row that kept most (a chain's path is already in front).
        kept = [[] for _ in range(batch)]
        for b, verdict in zip(rows, verdicts):
            kept[b] = [0] + [node + 1 for node in verdict.path]
        keep_slots(self.cache, start, kept, layout.width)
        if self.valid is not None:  # each row's kept slots, then padding up to the row that kept most
            counts = torch.tensor([len(slots) for slots in kept], device=pending.device)
            kept_valid = torch.arange(max(len(slots) for slots in kept), device=pending.device)[None] < counts[:, None]
            self.valid = torch.cat([self.valid, kept_valid], dim=1)
        t2 = clock()
        # 5. the sources commit what was kept
        commits, stats = 0.0, []
        for b, verdict in zip(rows, verdicts):
            self.tokens[b].extend(verdict.tokens)
            self.pending_host[b] = verdict.tokens[-1]
            self.stopped[b] = bool(self.stop_ids.intersection(verdict.tokens))  # a kept draft may be the stop token
            if sources is not None:
                t3 = clock()
                drafted, n = proposals[b].tokens, len(verdict.path)
                if verdict.depth is None:  # a chain: its first n drafts, at the step's first n + 1 positions
                    kept_ids, where = torch.cat([pending[b].view(1, 1), drafted[:, :n]], dim=1), slice(0, n + 1)
                else:
                    kept_ids = torch.cat([pending[b].view(1, 1), drafted[:, verdict.path]], dim=1)
                    where = torch.tensor(kept[b], device=pending.device)
                sources[b].commit(kept_ids, row_outputs(out, b, where))
                commit_seconds = clock() - t3
                commits += commit_seconds
                # The batch waits for every row's drafts, and shares the target's forward and verify: each row
                # is charged the whole step's drafting and verifying (c is then the batch's draft cost).
                self.steps[b].append(StepStats(drafted.shape[1], n, t1 - t0 + commit_seconds, t2 - t1,
                                               depth=verdict.depth))  # fmt: skip
                stats.append(self.steps[b][-1])
        if alpha is not None and stats:
            self.alphas.append((alpha, list(zip(stats, tested))))
        self.pending = torch.tensor(self.pending_host, device=pending.device)
        kind = "plain" if sources is None else "tree" if layout.trees else "chain"
        width = self.static.width if self.static is not None else layout.width  # a compiled verify is padded
        self.forwards.append(Forward(kind, width, t1 - t0 + commits))

    def alphas_to_host(self) -> None:
        """alpha predicted stayed on the device during decoding; bring it to the host once, into each step."""
        flat = iter(torch.cat([a for a, _ in self.alphas]).tolist()) if self.alphas else iter(())
        for _, rows_tested in self.alphas:
            for stat, count in rows_tested:
                stat.alpha_predicted = list(islice(flat, count))


def _verify_chains(logits: torch.Tensor, layout: StepLayout, rules: VerifyRules, generator,
                   check: bool) -> tuple[list[_RowVerdict], torch.Tensor | None, list[int]]:  # fmt: skip
    """Chains: each active row's verdict; alpha predicted at each row's tested positions (the n accepted drafts and
    the rejected one), flat on the device, and how many each row tested. Greedy by comparison, else ``verify``
    over the ragged batch (rows' drafts concatenated, ``cu_num_draft_tokens`` their cumsum). One host sync."""
    rows, counts, params = layout.rows, layout.counts, rules.params
    device, width = logits.device, logits.shape[1]
    row_logits = logits if len(rows) == logits.shape[0] else logits[rows]  # [R, W, V]
    num_rows = len(rows)
    drafts = [layout.proposals[b].tokens[0] for b in rows]
    alpha = None
    if width == 1:  # no row drafted (plain decoding, or no lookup match): the next token from the one position
        next_tokens = _first_tokens(row_logits[:, 0], params, generator).tolist()  # the step's one host sync
        return [_RowVerdict([], [token], None) for token in next_tokens], None, [0] * num_rows
    if params.is_greedy:
        # Greedy verification is a comparison: d_1..d_n are the drafts equal to the target's argmax at their
        # position, and the argmax after them is the next token (no V-wide p, no q needed: lenience and typical
        # acceptance keep exactly these drafts at a one-hot p as well).
        best = row_logits.argmax(-1)  # [R, W]
        matches = _padded(drafts, width - 1, -1) == best[:, :-1]  # -1 never matches
        num_accepted, emitted, p = matches.int().cumprod(1).sum(1), best, None
    else:
        p, matches = logits_to_probs(row_logits, params), None  # [R, W, V]
        vocab = p.shape[-1]
        flat_p = p[0, : counts[0]] if num_rows == 1 else torch.cat([p[i, :c] for i, c in enumerate(counts)])
        flat_q = _flat_q([layout.proposals[b].probs for b in rows], drafts, vocab)
        flat_drafts = drafts[0] if num_rows == 1 else torch.cat(drafts)
        # One Exp(1) draw per row and vocab entry serves both the bonus token and the token recovered after a
        # rejection: a step uses exactly one of the two, so sharing it keeps both exact.
        noise = draw_exponentials(num_rows, vocab, generator, device)
        if rules.typical_acceptance:
            emitted, num_accepted = _typical_verify(_padded(drafts, width - 1, 0), p, counts, noise)
        else:
            rows_t = torch.arange(num_rows, device=device)
            last = p[:, -1] if num_rows == 1 else p[rows_t, torch.tensor(counts, device=device)]
            bonus = sample_with_exponentials(last, noise)  # [R] ~ p_{K'+1}
            cu = torch.tensor(counts, device=device).cumsum(0)
            inputs = verify_lib.VerifyInputs(
                flat_drafts, cu, flat_q, flat_p, bonus, draw_uniforms(flat_drafts.shape[0], generator, device),
                noise, torch.zeros(num_rows, dtype=torch.bool, device=device), max_spec_len=width - 1,
                lenience=rules.lenience,
            )  # fmt: skip
            emitted, num_accepted = verify_lib.verify(inputs, check=check, backend=rules.backend)
        # sum_x min(p, q) per drafted position; a deterministic draft (q one-hot on d) gives p(d)
        alpha = (flat_p.gather(1, flat_drafts[:, None]).squeeze(1) if flat_q is None
                 else verify_lib.expected_acceptance_rate(flat_p, flat_q))  # fmt: skip
    host = torch.cat([num_accepted[:, None], emitted], dim=1).tolist()  # the step's one host sync
    verdicts = [_RowVerdict(list(range(n)), row[: n + 1], None) for n, *row in host]
    tested = [min(len(v.path) + 1, c) for v, c in zip(verdicts, counts)]  # the accepted drafts and the rejected one
    if matches is not None:  # greedy: sum_x min(p, q) with p one-hot is 1 where the draft is the argmax
        alpha = matches.view(-1).float()
        starts = [i * (width - 1) for i in range(num_rows)]
    else:
        starts = [sum(counts[:i]) for i in range(num_rows)]
    if alpha is not None:
        alpha = alpha[: tested[0]] if num_rows == 1 else alpha[
            torch.tensor([s + j for s, t in zip(starts, tested) for j in range(t)], dtype=torch.long, device=device)]
    return verdicts, alpha, tested


def _verify_trees(logits: torch.Tensor, layout: StepLayout, rules: VerifyRules, generator) -> list[_RowVerdict]:
    """Trees: each active row's verdict (its accepted path's node indices, the tokens it emits: the path's then one
    more, the tree's depth). Greedy or typical: the deepest node whose path passes (``deepest_passing_node``);
    else ``verify_tree`` over the ragged batch. One host sync."""
    params, rows, counts = rules.params, layout.rows, layout.counts
    device = logits.device
    drafts = layout.ids[rows, 1:]  # [R, N]: PAD_ID past a row's nodes
    node = torch.arange(drafts.shape[1], device=device)[None] < torch.tensor(counts, device=device)[:, None]
    depth = torch.where(node, layout.depths, 0).amax(1)  # [R]
    row_logits = logits if len(rows) == logits.shape[0] else logits[rows]  # [R, W, V]: row i + 1 after node i
    if params.is_greedy or rules.typical_acceptance:
        # A node passes if its token is the argmax (greedy) or typical (LOSSY) under its parent's p; the accepted
        # path is the deepest node whose ancestors all pass (greedy: at most one child per node can, as siblings
        # differ). Ties between equally deep typical nodes go to the lowest index.
        if params.is_greedy:
            best = row_logits.argmax(-1)  # [R, W]: row 0 after the pending token, row i + 1 after node i
            passes = node & (drafts == best.gather(1, layout.parents + 1))
        else:
            p = logits_to_probs(row_logits, params)
            parent_p = p.gather(1, (layout.parents + 1)[..., None].expand(-1, -1, p.shape[-1]))  # [R, N, V]
            passes = node & (verify_lib.typical_acceptance(drafts[..., None], parent_p[:, :, None]) > 0)
        last, path_mask = deepest_passing_node(passes, layout.ancestors, layout.depths)
        if params.is_greedy:
            final = best.gather(1, (last + 1)[:, None])
        else:
            after = p.gather(1, (last + 1)[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0]  # [R, V]
            noise = draw_exponentials(len(rows), p.shape[-1], generator, device)
            final = sample_with_exponentials(after, noise)[:, None]
        host = torch.cat([depth[:, None], path_mask.long(), drafts, final], dim=1).tolist()  # one host sync
        width = drafts.shape[1]
        verdicts = []
        for d, *row in host:
            path = [i for i in range(width) if row[i]]
            verdicts.append(_RowVerdict(path, [row[width + i] for i in path] + [row[-1]], d))
        return verdicts
    p = logits_to_probs(row_logits, params)  # [R, W, V]
    flat_q = _flat_q([layout.proposals[b].probs for b in rows], [drafts[i, :c] for i, c in enumerate(counts)],
                     p.shape[-1])  # fmt: skip
    total, most = sum(counts), max(counts)
    inputs = TreeVerifyInputs(
        torch.cat([drafts[i, :c] for i, c in enumerate(counts)]),
        torch.cat([layout.parents[i, :c] for i, c in enumerate(counts)]),
        torch.tensor(counts, device=device).cumsum(0), flat_q, torch.cat([p[i, : c + 1] for i, c in enumerate(counts)]),
        draw_uniforms(total, generator, device), draw_exponentials(len(rows), p.shape[-1], generator, device),
        torch.zeros(len(rows), dtype=torch.bool, device=device), max_depth=most,
    )  # fmt: skip
    output, nodes, num_accepted = verify_tree(inputs, check=False, backend=rules.backend)
    host = torch.cat([num_accepted[:, None], depth[:, None], output, nodes], dim=1).tolist()  # one host sync
    return [_RowVerdict(row[most + 1 : most + 1 + n], row[: n + 1], d) for n, d, *row in host]


def _typical_verify(drafts: torch.Tensor, p: torch.Tensor, counts: list[int], noise: torch.Tensor):
    """LOSSY (Medusa, Cai et al. 2024, Sec. 2.3.1): per row, keep drafts ([R, W-1], any id past a row's
    ``counts``) while p(x) > min(eps, delta e^{-H(p)}), then sample the next token from p ([R, W, V]) at the first
    unkept position. Returns (emitted [R, W]: the kept drafts, then that token; num_accepted [R])."""
    limit = torch.tensor(counts, device=p.device)
    n = torch.minimum(verify_lib.typical_acceptance(drafts, p[:, :-1]), limit)  # [R]
    after = p.gather(1, n[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0]  # [R, V]: p_{n+1}
    next_token = sample_with_exponentials(after, noise)
    emitted = F.pad(drafts, (0, 1), value=verify_lib.PADDING_TOKEN_ID)
    return emitted.scatter(1, n[:, None], next_token[:, None]), n  # drafts beyond n are never read


def deepest_passing_node(passes: torch.Tensor, ancestors: torch.Tensor, depths: torch.Tensor):
    """Rows of trees whose nodes pass or fail a test (``passes`` [R, N]; ``ancestors`` [R, N, N] and ``depths``
    [R, N] from ``ancestor_matrix``): (the deepest node whose ancestors and itself all pass [R], -1 for none;
    that node's path as a mask [R, N]). Equally deep nodes go to the lowest index. On the device: no sync."""
    num_nodes = passes.shape[1]
    if num_nodes == 0:  # empty trees: no node to accept (argmax over nothing would fail)
        return passes.new_full((passes.shape[0],), -1, dtype=torch.long), passes
    on_path = (ancestors <= passes[:, None, :]).all(2)  # every ancestor (and itself) passes
    score = torch.where(on_path, depths * (num_nodes + 1) - torch.arange(num_nodes, device=passes.device), -1)
    last = torch.where(on_path.any(1), score.argmax(1), -1)
    path_mask = ancestors[torch.arange(passes.shape[0], device=passes.device), last.clamp_min(0)] & (last >= 0)[:, None]
    return last, path_mask


def most_drafts(source, k: int) -> int:
    """The most tokens one step of ``source`` proposes: k, or the nodes of a ``TreeDrafting``'s tree."""
    return source.tree.num_nodes if isinstance(source, TreeDrafting) else k


def check_decode_args(target, prompt_ids, max_new_tokens: int, k: int = 1, lenience: float = 1.0) -> int:
    """Reject bad input with a message naming the fix; return the new-token budget.

    The budget is ``max_new_tokens`` capped so that prompt + output fits the target's
    context (max_position_embeddings): no forward ever runs past it.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise SpecdraftError(f"k (drafts per step) must be an integer >= 1, got {k!r}; 4-8 is typical (-k 5).")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SpecdraftError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")
    if not (0.0 < lenience <= 1.0):
        raise SpecdraftError(f"lenience must be in (0, 1], got {lenience}; 1.0 is lossless (the default).")
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 or prompt_ids.shape[1] == 0:
        raise SpecdraftError(
            f"prompt_ids must have shape [1, L] with L >= 1, got {tuple(prompt_ids.shape)}; the decoder "
            "takes one prompt at a time here (speculative_decode_batch takes a list of prompts)."
        )
    prompt_len = prompt_ids.shape[1]
    context = getattr(target.config, "max_position_embeddings", None)
    if context is None:
        return max_new_tokens
    if prompt_len >= context:
        raise SpecdraftError(
            f"the prompt has {prompt_len} tokens but the target's context is {context} tokens "
            "(max_position_embeddings), leaving no room to generate; shorten the prompt "
            "(e.g. a smaller --prefix-tokens, or drop the longest prompts)."
        )
    return min(max_new_tokens, context - prompt_len)


def _check_proposal(source, proposal, k: int) -> None:
    """A chain of at most k drafts, or a well-formed tree at most k deep (host syncs: once per call)."""
    name = type(source).__name__
    tokens, parents = proposal.tokens, proposal.parents
    if parents is None:
        if tokens.shape[1] > k:
            raise SpecdraftError(f"{name}.propose returned {tokens.shape[1]} drafts, asked for at most {k}")
        return
    if tokens.dim() != 2 or tokens.shape[0] != 1 or parents.shape != tokens.shape:
        raise SpecdraftError(
            f"{name} proposed a tree with tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)}; "
            "both must be [1, N] (one prompt, N nodes)"
        )
    check_tree(parents, tokens)
    depth = int(tree_depths(parents[0]).max()) if parents.numel() else 0
    if depth > k:
        raise SpecdraftError(
            f"{name} proposed a tree {depth} deep, asked for at most {k} (k, or what is left of the token "
            "budget): limit the tree's depth to k"
        )


def _first_tokens(logits: torch.Tensor, params: SamplingParams, generator) -> torch.Tensor:
    """[B, V] -> [B] the next token of each row (greedy: argmax, no noise needed; else a draw from the warped p)."""
    if params.is_greedy:
        return logits.argmax(-1)
    p = logits_to_probs(logits, params)
    return sample_with_exponentials(p, draw_exponentials(p.shape[0], p.shape[1], generator, p.device))


def _padded(drafts: list[torch.Tensor], width: int, value: int) -> torch.Tensor:
    """The rows' drafts [K_b] as one [R, width] tensor, ``value`` past a row's."""
    if len(drafts) == 1 and drafts[0].shape[0] == width:
        return drafts[0][None]
    return torch.stack([F.pad(d, (0, width - d.shape[0]), value=value) for d in drafts])


def _flat_q(q: list, drafts: list[torch.Tensor], vocab: int) -> torch.Tensor | None:
    """The rows' q ([1, K_b, V] each, None for deterministic drafts) concatenated for the flat verify layout;
    None if every row's drafts are deterministic, else a deterministic row's q is one-hot on its drafts."""
    if all(x is None for x in q):
        return None
    if len(q) == 1:
        return q[0][0]
    return torch.cat([x[0] if x is not None else F.one_hot(d, vocab).float() for x, d in zip(q, drafts)])


def _stop_ids(eos_token_ids) -> set[int]:
    if eos_token_ids is None:
        return set()
    if isinstance(eos_token_ids, int):
        return {eos_token_ids}
    return set(int(t) for t in eos_token_ids)


def _truncate(tokens: list[int], budget: int, stop_ids: set[int]) -> list[int]:
    """Cut after the first stop token and at the budget (the last step may overshoot both)."""
    tokens = tokens[:budget]
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens


def _clock(device: torch.device) -> float:
    """Wall clock; on CUDA wait for queued kernels first, so draft and target time are split correctly."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
