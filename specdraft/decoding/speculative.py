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

Batch size 1: one prompt at a time (rows of a batch would accept different numbers of drafts).
"""

from __future__ import annotations

import time
from itertools import islice
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from specdraft.decoding import verify as verify_lib
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

    num_drafted: int  # K' <= K: a source may propose fewer (prompt lookup without a match: 0)
    num_accepted: int  # n: the step emitted n + 1 tokens
    draft_seconds: float  # propose + commit
    target_seconds: float  # the (K'+1)-position forward + verify + cache rollback
    # alpha predicted = sum_x min(p(x), q(x)) at each *tested* position: the n accepted drafts
    # and the rejected one. Later positions were conditioned on a rejected token: not counted.
    alpha_predicted: list[float] = field(default_factory=list)


@dataclass
class DecodeOutput:
    tokens: list[int]  # generated tokens (prompt excluded), ending with the stop token if one was hit
    steps: list[StepStats]  # empty for plain decoding
    prefill_seconds: float  # prompt forward + source.start + first token
    seconds: float  # wall clock of the whole call


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
) -> DecodeOutput:
    """Generate up to ``max_new_tokens`` tokens with drafts from ``source``, K per step."""
    budget = check_decode_args(target, prompt_ids, max_new_tokens, k=k, lenience=lenience)
    stop_ids = _stop_ids(eos_token_ids)
    device = prompt_ids.device
    sampled_row = torch.tensor([False], device=device)  # verify's per-row greedy flag: it runs when sampling
    vocab_size = target.vocab_size
    start = _clock(device)

    # Prefill: the target reads the prompt, the source sees its outputs (features at every position,
    # logits at the last only: the V-wide logits of the whole prompt are never formed), the first
    # token is drawn from p.
    cache = DynamicCache(config=target.config)
    out = target(prompt_ids, past_key_values=cache, use_cache=True, logits="last")
    source.start(prompt_ids, out)
    pending = _next_token(out.logits[:, -1], params, generator)  # [1, 1]
    tokens, steps, alphas = [pending.item()], [], []
    prefill_seconds = _clock(device) - start

    while len(tokens) < budget and tokens[-1] not in stop_ids:
        t0 = _clock(device)
        k_step = min(k, budget - len(tokens))  # never draft past the budget (or the context)
        proposal = source.propose(pending, k_step, params, generator)
        if not proposal.is_chain():
            raise SpecdraftError(
                f"{type(source).__name__}.propose returned a tree (Proposal.parents); this decoder verifies chains "
                "only. Propose a chain (parents=None) until tree verification lands."
            )
        drafts, q = proposal.tokens, proposal.probs  # [1, K'], [1, K', V] or None (one-hot q)
        num_drafts = drafts.shape[1]
        if num_drafts > k_step:
            raise SpecdraftError(
                f"{type(source).__name__}.propose returned {num_drafts} drafts, asked for at most {k_step}"
            )
        t1 = _clock(device)

        # One forward over K'+1 positions: logits[:, i] is p_{i+1}, the target's next-token
        # distribution after [.., pending, d_1..d_i], warped exactly as q was.
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
            noise = draw_exponentials(1, vocab_size, generator, device)
            if typical_acceptance:
                emitted, num_accepted = _typical_verify(drafts[0], p, noise)
            else:
                bonus = sample_with_exponentials(p[num_drafts:], noise)  # [1] ~ p_{K'+1}
                emitted, num_accepted = verify_lib.verify(
                    drafts[0], torch.full((1,), num_drafts, device=device), None if q is None else q[0],
                    p[:num_drafts], bonus, draw_uniforms(num_drafts, generator, device), noise, sampled_row,
                    max_spec_len=num_drafts, lenience=lenience,
                )  # fmt: skip
        # The one host sync a step needs: how many drafts survived, and the tokens.
        n, *row = torch.cat([num_accepted, emitted[0]]).tolist()
        new_tokens = row[: n + 1]  # d_1..d_n, then the correction or bonus token

        # Roll back: the cache holds [.., pending, d_1..d_K']; keep [.., pending, d_1..d_n].
        cache.crop(-(num_drafts - n))
        t2 = _clock(device)
        source.commit(torch.cat([pending, drafts[:, :n]], dim=1), out.slice(slice(0, n + 1)))
        t3 = _clock(device)
        tested = min(n + 1, num_drafts)  # the n accepted drafts and the rejected one
        # sum_x min(p, q) with p one-hot (greedy) is 1 where the draft is the argmax, whatever q is
        alphas.append(matches[:tested].float() if p is None else
                      _predicted_alpha(p[:tested], None if q is None else q[0, :tested], drafts[0, :tested]))
        steps.append(StepStats(num_drafts, n, (t1 - t0) + (t3 - t2), t2 - t1))
        pending = emitted[:, n : n + 1]  # the new chosen-but-unverified token, still on the device
        tokens.extend(new_tokens)
        if stop_ids.intersection(new_tokens):  # an accepted draft may be the stop token, not just the last
            break

    # alpha predicted stayed on the device during decoding; bring it to the host once.
    flat = iter(torch.cat(alphas).tolist()) if alphas else iter(())
    for step, alpha in zip(steps, alphas):
        step.alpha_predicted = list(islice(flat, alpha.numel()))
    tokens = _truncate(tokens, budget, stop_ids)
    return DecodeOutput(tokens, steps, prefill_seconds, _clock(device) - start)


@torch.no_grad()
def plain_decode(
    target,
    prompt_ids: torch.Tensor,
    *,
    params: SamplingParams = SamplingParams(),
    max_new_tokens: int = 128,
    eos_token_ids: int | list[int] | None = None,
    generator: torch.Generator | None = None,
) -> DecodeOutput:
    """The baseline: the same target and KV cache code, one token per forward."""
    budget = check_decode_args(target, prompt_ids, max_new_tokens)
    stop_ids = _stop_ids(eos_token_ids)
    device = prompt_ids.device
    start = _clock(device)
    cache = DynamicCache(config=target.config)
    out = target(prompt_ids, past_key_values=cache, use_cache=True, logits="last")
    token = _next_token(out.logits[:, -1], params, generator)
    tokens = [token.item()]
    prefill_seconds = _clock(device) - start
    while len(tokens) < budget and tokens[-1] not in stop_ids:
        out = target(token, past_key_values=cache, use_cache=True, logits="last")
        token = _next_token(out.logits[:, -1], params, generator)
        tokens.append(token.item())
    return DecodeOutput(tokens, [], prefill_seconds, _clock(device) - start)


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
