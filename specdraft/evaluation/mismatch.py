"""Why a greedy speculative decode differed from plain decoding: a near-tie in rounding, or a defect.

Plain decoding scores each position in a 1-token forward; a verify forward scores K+1 positions at
once. Both are the same function of the same tokens, but other matmul shapes reduce in another
order and round differently. In float32 the two computations' logits differ by about 1e-6 of their
largest magnitude and greedy speculation is token-identical in practice. In bfloat16 they differ
by about 1e-2 of it, and where the target's top two logits are that close the argmax flips: the
speculative decode is still the target's greedy decode, of a slightly differently rounded target.

So every mismatch is explained here: at the first differing position, the target's top-2 logit gap
under both computations, and a verdict. A mismatch is rounding only when the gap under the 1-token
computation is at most ``ROUNDING[dtype] * max|logit|``; anything else is a defect (a wrong
position, a stale cache, a wrong mask) and is reported as one.

``ROUNDING`` is the largest relative difference between the two computations measured on
SmolLM2-135M-Instruct (30 layers, 37 positions; ``python eval/bench_rounding.py``: float32 2.6e-6,
bfloat16 2.2e-2), with a 2-4x margin; float16 has 3 more mantissa bits than bfloat16, so 1/8 of it.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

ROUNDING = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 6e-3}


def first_difference(reference: list[int], other: list[int]) -> int | None:
    """The first index where the two token lists differ (a list that stops early differs there)."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


@torch.no_grad()
def one_token_and_verify_logits(target, context: list[int], drafts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The next-token logits after ``context``, computed as plain decoding does (the last context token
    alone, on the cache of the rest) and as a verify forward does (that token followed by ``drafts``)."""
    device = target.device
    cache = DynamicCache(config=target.config)
    target(torch.tensor([context[:-1]], device=device), past_key_values=cache, use_cache=True, logits="none")
    one = target(torch.tensor([context[-1:]], device=device), past_key_values=cache, use_cache=True,
                 logits="last").logits[0, -1]
    cache.crop(-1)
    chunk = torch.tensor([context[-1:] + drafts], device=device)
    verify = target(chunk, past_key_values=cache, use_cache=True).logits[0, 0]
    return one, verify


def rounding_bound(logits: torch.Tensor, dtype: torch.dtype) -> float:
    return ROUNDING.get(dtype, ROUNDING[torch.bfloat16]) * logits.abs().max().item()


def explain(target, prompt: list[int], reference: list[int], other: list[int], k: int) -> dict | None:
    """Where ``other`` (a speculative decode) left ``reference`` (plain decoding), and why."""
    i = first_difference(reference, other)
    if i is None or i >= len(reference) or i >= len(other):
        return None if i is None else {"position": i, "verdict": "defect", "why": "one decode stopped early"}
    context = prompt + reference[:i]
    one, verify = one_token_and_verify_logits(target, context, other[i : i + k])
    dtype = next(target.parameters()).dtype
    bound = rounding_bound(one, dtype)

    def top2(logits):
        values, ids = logits.topk(2)
        return {"gap": (values[0] - values[1]).item(), "tokens": ids.tolist()}

    plain, spec = top2(one), top2(verify)
    near_tie = plain["gap"] <= bound
    return {
        "position": i,
        "plain_token": reference[i],
        "speculative_token": other[i],
        "one_token": plain,
        "verify": spec,
        "max_logit_difference": (one - verify).abs().max().item(),
        "rounding_bound": bound,
        "dtype": str(dtype).removeprefix("torch."),
        "verdict": "rounding" if near_tie else "defect",
    }
