"""Speculative decoding: a draft proposes K tokens, the target checks them all in one forward.

One step, for a sequence whose next token ("pending") is chosen but not yet run through the target:
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
accepted path (``_verify_tree``). One prompt at a time here; ``specdraft.decoding.batched`` decodes B
prompts together, chains or trees.
"""

from __future__ import annotations

import copy
import time
from itertools import islice
from dataclasses import dataclass, field

import torch

from specdraft.contract import DraftCapabilities
from specdraft.decoding import verify as verify_lib
from specdraft.decoding.compiled_verify import compiled_verify
from specdraft.decoding.kv_cache import preallocated_cache
from specdraft.decoding.tree_verify import verify_tree
from specdraft.decoding.trees import (
    DynamicTree,
    StaticTree,
    ancestor_matrix,
    check_tree,
    check_tree_kind,
    tree_attention_mask,
    tree_depths,
)  # fmt: skip
from specdraft.decoding.sampling import (
    SamplingParams,
    draw_exponentials,
    draw_uniforms,
    logits_to_probs,
    sample,
    sample_with_exponentials,
)
from specdraft.errors import SpecdraftError


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
    """Generate up to ``max_new_tokens`` tokens with drafts from ``source``, K per step (a tree each step
    if the source proposes one, see ``TreeDrafting``). ``timing=False`` leaves the steps' seconds at 0 and
    the hot loop free of clock syncs; the whole call is still timed. ``compile_target`` runs each verify
    K+1 wide (a tree: as wide as its nodes + 1) over a static cache, compiled
    (``specdraft.decoding.compiled_verify``)."""
    budget = check_decode_args(target, prompt_ids, max_new_tokens, k=k, lenience=lenience)
    stop_ids = _stop_ids(eos_token_ids)
    device = prompt_ids.device
    backend = verify_lib.resolve_verify_backend(verify_backend, device)  # a bad choice fails before the prefill
    start = _clock(device)
    clock = (lambda: _clock(device)) if timing else (lambda: 0.0)

    # Prefill: the target reads the prompt, the source sees its outputs (features at every position,
    # logits at the last only: the V-wide logits of the whole prompt are never formed), the first
    # token is drawn from p. The cache is sized for the prompt, the budget and one step's drafts (or tree).
    verifier, cache, out = _prefill(target, prompt_ids, prompt_ids.shape[1] + budget, 1 + most_drafts(source, k),
                                    compile_target, isinstance(source, TreeDrafting))  # fmt: skip
    source.start(prompt_ids, out)
    pending = _next_token(out.logits[:, -1], params, generator)  # [1, 1]
    tokens, steps, alphas, forwards = [pending.item()], [], [], []
    prefill_seconds = _clock(device) - start

    while len(tokens) < budget and tokens[-1] not in stop_ids:
        t0 = clock()
        k_step = min(k, budget - len(tokens))  # never draft past the budget (or the context)
        proposal = source.propose(pending, k_step, params, generator)
        if not steps:  # a source's first proposal of a call is checked; later ones are trusted (no syncs)
            _check_proposal(source, proposal, k_step)
        t1 = clock()
        if proposal.parents is None:
            step = _verify_chain(verifier, cache, pending, proposal, params, generator, lenience, typical_acceptance,
                                 check=not steps, backend=backend)  # fmt: skip
        elif compile_target and not cache.tree:
            raise SpecdraftError(f"{type(source).__name__} proposed a tree, and compile_target sizes its steps by a "
                                 "TreeDrafting's tree: draft trees through TreeDrafting, or decode with compile_target off")
        else:  # a tree: every node verified in the one forward, with a tree attention mask
            step = _verify_tree(verifier, cache, pending, proposal, params, generator, typical_acceptance, backend)
        t2 = clock()
        source.commit(step.kept_ids, step.kept_out)
        t3 = clock()
        steps.append(StepStats(proposal.tokens.shape[1], len(step.tokens) - 1, (t1 - t0) + (t3 - t2), t2 - t1,
                               depth=step.depth))  # fmt: skip
        width = cache.width if compile_target else proposal.tokens.shape[1] + 1  # a compiled verify is padded
        forwards.append(Forward("chain" if proposal.parents is None else "tree", width, steps[-1].draft_seconds))
        alphas.append(step.alpha_predicted)
        pending = step.pending  # the new chosen-but-unverified token, still on the device
        tokens.extend(step.tokens)
        if stop_ids.intersection(step.tokens):  # an accepted draft may be the stop token, not just the last
            break

    # alpha predicted stayed on the device during decoding; bring it to the host once.
    chain_alphas = [a for a in alphas if a is not None]
    flat = iter(torch.cat(chain_alphas).tolist()) if chain_alphas else iter(())
    for step, alpha in zip(steps, alphas):
        step.alpha_predicted = [] if alpha is None else list(islice(flat, alpha.numel()))
    tokens = _truncate(tokens, budget, stop_ids)
    return DecodeOutput(tokens, steps, prefill_seconds, _clock(device) - start, forwards=forwards)


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
    """The baseline: the same target and KV cache code, one token per forward."""
    budget = check_decode_args(target, prompt_ids, max_new_tokens)
    stop_ids = _stop_ids(eos_token_ids)
    device = prompt_ids.device
    start = _clock(device)
    forward, cache, out = _prefill(target, prompt_ids, prompt_ids.shape[1] + budget, 1, compile_target)
    token = _next_token(out.logits[:, -1], params, generator)
    tokens = [token.item()]
    prefill_seconds = _clock(device) - start
    while len(tokens) < budget and tokens[-1] not in stop_ids:
        out = forward(token, past_key_values=cache, use_cache=True, logits="last")
        token = _next_token(out.logits[:, -1], params, generator)
        tokens.append(token.item())
    forwards = [Forward("plain", 1, 0.0)] * (len(tokens) - 1)
    return DecodeOutput(tokens, [], prefill_seconds, _clock(device) - start, forwards=forwards)


def _prefill(target, prompt_ids: torch.Tensor, positions: int, width: int, compile_target: bool | str,
             tree: bool = False):  # fmt: skip
    """The target reads the prompt into a new cache for ``positions`` positions, with room for one step ``width``
    wide past them; returns the forward the decode steps call, the cache, and the prompt's outputs. With
    ``compile_target`` the steps run compiled, ``width`` wide over a static cache (``tree``: tree steps, each
    with its mask); the prefill stays eager."""
    if not compile_target:
        cache = preallocated_cache(target.config, positions + width)
        return target, cache, target(prompt_ids, past_key_values=cache, use_cache=True, logits="last")
    forward = compiled_verify(target, compile_target)
    cache = forward.new_cache(positions, width, tree)
    out = target(prompt_ids, past_key_values=cache.static, use_cache=True, logits="last")
    cache.length = prompt_ids.shape[1]
    return forward, cache, out


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
            "takes one prompt at a time (loop over prompts for a batch)."
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


def _next_token(logits: torch.Tensor, params: SamplingParams, generator) -> torch.Tensor:
    """[1, V] logits -> [1, 1] token drawn from the warped p (greedy: the argmax, no noise needed)."""
    if params.is_greedy:
        return logits.argmax(-1, keepdim=True)
    return sample(logits_to_probs(logits, params), generator).view(1, 1)


@dataclass
class _Verified:
    """What one verify step decided."""

    tokens: list[int]  # the accepted drafts, then the correction or bonus token
    kept_ids: torch.Tensor  # [1, n+1]: pending and the accepted drafts, what the source commits
    kept_out: object  # TargetOutputs for exactly those positions
    pending: torch.Tensor  # [1, 1] the next chosen-but-unverified token
    alpha_predicted: torch.Tensor | None  # sum_x min(p, q) at each tested position (chains), on the device
    depth: int | None = None  # a tree's depth (None for a chain)


def _verify_chain(target, cache, pending, proposal, params, generator, lenience, typical_acceptance,
                  check, backend) -> _Verified:
    """One forward over K'+1 positions, then keep d_1..d_n and one more token; roll the cache back."""
    drafts, q = proposal.tokens, proposal.probs  # [1, K'], [1, K', V] or None (one-hot q)
    num_drafts, device = drafts.shape[1], drafts.device
    # logits[:, i] is p_{i+1}, the target's next-token distribution after [.., pending, d_1..d_i], warped as q was.
    out = target(torch.cat([pending, drafts], dim=1), past_key_values=cache, use_cache=True)
    if params.is_greedy:
        # Greedy verification is a comparison: d_1..d_n are the drafts equal to the target's argmax
        # at their position, and the argmax after them is the next token (no V-wide p, no q needed:
        # lenience and typical acceptance keep exactly these drafts at a one-hot p as well).
        best = out.logits[0].argmax(-1)  # [K'+1]
        matches = drafts[0] == best[:num_drafts]
        num_accepted = matches.int().cumprod(0).sum().view(1)
        emitted, p = best.view(1, -1), None
    else:
        p = logits_to_probs(out.logits[0], params)  # [K'+1, V]
        # One Exp(1) draw per vocab entry serves both the bonus token and the token recovered
        # after a rejection: a step uses exactly one of the two, so sharing it keeps both exact.
        noise = draw_exponentials(1, p.shape[-1], generator, device)
        if typical_acceptance:
            emitted, num_accepted = _typical_verify(drafts[0], p, noise)
        else:
            bonus = sample_with_exponentials(p[num_drafts:], noise)  # [1] ~ p_{K'+1}
            emitted, num_accepted = verify_lib.verify(
                drafts[0], torch.full((1,), num_drafts, device=device), None if q is None else q[0],
                p[:num_drafts], bonus, draw_uniforms(num_drafts, generator, device), noise,
                torch.zeros(1, dtype=torch.bool, device=device), max_spec_len=num_drafts, lenience=lenience,
                check=check, backend=backend,
            )  # fmt: skip
    # The one host sync a step needs: how many drafts survived, and the tokens.
    n, *row = torch.cat([num_accepted, emitted[0]]).tolist()
    # Roll back: the cache holds [.., pending, d_1..d_K']; keep [.., pending, d_1..d_n].
    cache.crop(-(num_drafts - n))
    tested = min(n + 1, num_drafts)  # the n accepted drafts and the rejected one
    # sum_x min(p, q) with p one-hot (greedy) is 1 where the draft is the argmax, whatever q is
    alpha = (matches[:tested].float() if p is None else
             _predicted_alpha(p[:tested], None if q is None else q[0, :tested], drafts[0, :tested]))
    return _Verified(row[: n + 1], torch.cat([pending, drafts[:, :n]], dim=1), out.slice(slice(0, n + 1)),
                     emitted[:, n : n + 1], alpha)  # fmt: skip


def _verify_tree(target, cache, pending, proposal, params, generator, typical_acceptance, backend) -> _Verified:
    """Verify a tree proposal: one target forward over [pending, node_1..node_N] with a tree attention mask
    (each node sees the cache, the pending token and its ancestors, at position past + depth), pick the
    accepted path, and leave exactly [.., pending, path] in the target's cache."""
    drafts, parents = proposal.tokens[0], proposal.parents[0].long()
    device, num_nodes = drafts.device, drafts.shape[0]
    past = cache.get_seq_length()
    ancestors = ancestor_matrix(parents)  # [N, N]: node j is node i or one of its ancestors
    depths = ancestors.sum(1)  # [N], 1 for the root's children
    positions = (past + torch.cat([depths.new_zeros(1), depths]))[None]
    out = target(torch.cat([pending, drafts[None]], dim=1), attention_mask=tree_attention_mask(ancestors, past),
                 position_ids=positions, past_key_values=cache, use_cache=True)  # fmt: skip
    logits = out.logits[0]  # [N+1, V]: row 0 is p after the pending token, row i+1 p after node i
    if params.is_greedy or typical_acceptance:
        # A node passes if its token is the argmax (greedy) or typical (LOSSY) under its parent's p; the accepted
        # path is the deepest node whose ancestors all pass (greedy: at most one child per node can, as siblings
        # differ). Ties between equally deep typical nodes go to the lowest index.
        p = None if params.is_greedy else logits_to_probs(logits, params)
        parent_rows = parents + 1
        if p is None:
            best = logits.argmax(-1)
            passes = drafts == best[parent_rows]
        else:
            passes = verify_lib.typical_acceptance(drafts[:, None], p[parent_rows][:, None]) > 0
        last, path_mask = deepest_passing_node(passes[None], ancestors[None], depths[None])
        last, path_mask = last[0], path_mask[0]
        if p is None:
            final = best[last + 1]
        else:
            final = sample_with_exponentials(p[last + 1], draw_exponentials(1, p.shape[-1], generator, device)[0])
        # The one host sync of the step: the path, the final token, the tree's depth, the nodes' tokens.
        host = torch.cat([path_mask.long(), drafts, final.view(1), depths.max().view(1)]).tolist()
        path = [i for i in range(num_nodes) if host[i]]
        tokens, depth = [host[num_nodes + i] for i in path] + [host[-2]], host[-1]
    else:
        p = logits_to_probs(logits, params)
        vocab = p.shape[-1]
        output, nodes, num_accepted = verify_tree(
            drafts, parents, torch.full((1,), num_nodes, device=device),
            None if proposal.probs is None else proposal.probs[0], p,
            draw_uniforms(num_nodes, generator, device), draw_exponentials(1, vocab, generator, device),
            torch.zeros(1, dtype=torch.bool, device=device), max_depth=num_nodes, check=False, backend=backend,
        )  # fmt: skip
        n, depth, *rest = torch.cat([num_accepted, depths.max().view(1), output[0], nodes[0]]).tolist()
        tokens, path = rest[: n + 1], rest[num_nodes + 1 : num_nodes + 1 + n]
    keep_cache_path(cache, past, path)
    kept = torch.tensor([0] + [i + 1 for i in path], device=device)  # pending, then the path's nodes
    return _Verified(tokens, torch.cat([pending, drafts[None, path]], dim=1), out.slice(kept),
                     torch.tensor([[tokens[-1]]], device=device), None, depth)  # fmt: skip


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


def keep_cache_path(cache, past: int, path: list[int]) -> None:
    """After a tree verify the cache holds [.., pending, node_1..node_N] from position ``past``: keep the
    pending token and the accepted ``path`` (node indices), moved into place, and drop the rest."""
    length = past + 1 + len(path)
    if path != list(range(len(path))):  # a prefix of the nodes is already in place
        index = torch.tensor([past + 1 + i for i in path], device=cache.layers[0].keys.device)
        for layer in cache.layers:
            # index_select copies before the write, so overlapping source and destination are safe
            layer.keys[:, :, past + 1 : length] = layer.keys.index_select(2, index)
            layer.values[:, :, past + 1 : length] = layer.values.index_select(2, index)
    extra = cache.get_seq_length() - length
    if extra:
        cache.crop(-extra)  # transformers' crop counts from the end when negative


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


class TreeDrafting:
    """A ``DraftSource`` that drafts ``tree`` each step through ``source.propose_tree``: how the decoder and
    ``evaluate`` are asked for tree decoding. The decoder's ``k`` caps the tree's depth (the budget's end
    shortens it); ``evaluate`` passes ``depth``. A source declares the trees it drafts in
    ``capabilities.tree_kinds``; this wrapper itself drafts row by row in a batch."""

    capabilities = DraftCapabilities()

    def __init__(self, source, tree: StaticTree | DynamicTree):
        check_tree_kind(source, tree)  # here, so a wrong pairing fails before any decoding
        self.source, self.tree = source, tree

    @property
    def depth(self) -> int:
        return self.tree.depth

    def __copy__(self) -> TreeDrafting:
        """An independent copy for another row of a batch (``batched.fresh_sources``): its source copied too."""
        return TreeDrafting(copy.copy(self.source), self.tree)

    def start(self, prompt_ids, target_out) -> None:
        self.source.start(prompt_ids, target_out)

    def propose(self, pending, k: int, params, generator):
        return self.source.propose_tree(pending, self.tree.limited(k), params, generator)

    def commit(self, kept_ids, target_out) -> None:
        self.source.commit(kept_ids, target_out)


def _typical_verify(drafts: torch.Tensor, p: torch.Tensor, noise: torch.Tensor):
    """LOSSY (Medusa, Cai et al. 2024, Sec. 2.3.1): keep drafts while p(x) > min(eps, delta e^{-H(p)}),
    then sample the next token from p at the first unkept position. Same output layout as ``verify``."""
    num_drafts = drafts.shape[0]
    n = verify_lib.typical_acceptance(drafts, p[:num_drafts]).view(1)  # [1]
    next_token = sample_with_exponentials(p.index_select(0, n), noise)  # ~ p_{n+1}
    emitted = torch.cat([drafts, drafts.new_full((1,), verify_lib.PADDING_TOKEN_ID)])
    emitted = emitted.scatter(0, n, next_token)  # drafts beyond n are never read: the caller keeps n+1
    return emitted.view(1, -1), n


def _predicted_alpha(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor) -> torch.Tensor:
    """sum_x min(p, q) per position; for a deterministic draft (q one-hot on d) that is p(d)."""
    if q is None:
        return p.gather(1, drafts[:, None]).squeeze(1)
    return verify_lib.expected_acceptance_rate(p, q)


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
