"""Sampling parameters, logits -> probabilities, and the random draws verify needs.

Speculative sampling is only lossless if the target p and the draft q are warped
the same way, so both sides go through the one function ``logits_to_probs``.
Every random number is drawn up front (uniforms, Exp(1) noise) and handed to
the sampler, so the pure-torch reference and the Triton kernel can be compared
bit for bit on the same draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdraft.errors import SpecdraftError

# Smallest positive float32: Exp(1) draws are clamped to it so x / e never divides by zero.
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a next-token distribution.

    temperature 0 means greedy. top_k 0 and top_p 1.0 mean "off".
    The order is temperature, then top-k, then top-p (as in HF and vLLM).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        # `not (x >= 0)` also catches NaN.
        if not (self.temperature >= 0) or math.isinf(self.temperature):
            raise SpecdraftError(
                f"temperature must be a finite number >= 0, got {self.temperature}; "
                "use 0 for greedy decoding or e.g. 0.7 / 1.0 for sampling."
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SpecdraftError(
                f"top_k must be an integer >= 0, got {self.top_k!r}; use 0 to turn top-k off."
            )
        if not (0.0 < self.top_p <= 1.0):
            raise SpecdraftError(
                f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to turn nucleus sampling off."
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Warped float32 probabilities over the last dim (the vocabulary).

    Greedy returns the one-hot of the argmax (first one on ties), so greedy is
    just sampling from a point mass and the same verify code handles it.
    """
    logits = logits.float()
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()

    logits = logits / params.temperature
    vocab_size = logits.shape[-1]
    if 0 < params.top_k < vocab_size:
        # Keep every token at least as large as the k-th largest (ties at the cut are kept).
        kth_largest = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        logits = _top_p_filter(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus sampling (Holtzman et al. 2020): keep the smallest set of most likely
    tokens whose mass reaches top_p; the most likely token is always kept."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Mass strictly before each token: drop the token if that already reaches top_p.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def draw_uniforms(
    num_tokens: int, generator: torch.Generator | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """U[0, 1) per draft position: the coin for each accept/reject test."""
    return torch.rand(num_tokens, generator=generator, device=device, dtype=torch.float32)


def draw_exponentials(
    batch: int, vocab_size: int, generator: torch.Generator | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Exp(1) noise per row and token for the exponential race (see ``sample``)."""
    noise = torch.empty(batch, vocab_size, device=device, dtype=torch.float32)
    return noise.exponential_(generator=generator).clamp_min_(_TINY)


def sample_with_exponentials(weights: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """argmax_x w(x) / e_x with e ~ Exp(1) draws x with probability w(x) / sum(w).

    The "exponential race": e_x / w(x) ~ Exp(w(x)), and the smallest of independent
    exponentials is x with probability w(x) / sum(w). So unnormalised weights
    (e.g. a residual max(0, p - q)) can be sampled without dividing by their sum.
    """
    return (weights.float() / exponentials).argmax(dim=-1)


def draw_drafts(logits: torch.Tensor, params: SamplingParams, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A drafter's tokens from its logits [..., V]: (ids [...], q [..., V] or None). At temperature 0 the
    argmax, whose q is one-hot: no V-wide q is formed (``Proposal.probs`` None); else a draw from q, the
    logits warped exactly as the target's p will be (verification compares the two)."""
    if params.is_greedy:
        return logits.argmax(-1), None
    q = logits_to_probs(logits, params)
    return sample(q, generator), q


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs`` [..., V] (any non-negative weights work)."""
    flat = probs.reshape(-1, probs.shape[-1])
    noise = draw_exponentials(flat.shape[0], flat.shape[1], generator, flat.device)
    return sample_with_exponentials(flat, noise).reshape(probs.shape[:-1])
