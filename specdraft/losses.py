"""Drafter losses: pure functions of tensors, each citing its equation. Families compose them.

Conventions shared by every function here:
  * P is the target's (teacher's) next-token distribution, Q the draft's (student's); both are
    given as logits ``[..., V]`` over the same vocabulary, except ``soft_cross_entropy``, whose
    P is given as probabilities.
  * ``mask`` is a per-position weight (bool or 0/1 float) of the leading dims; the result is the
    mean over the counted positions, with ``clamp_min(1)`` instead of an ``if`` so nothing syncs
    with the host (an all-zero mask gives 0, not NaN).
  * logits and probabilities are upcast to float32 before any softmax.
  * A vocabulary entry with P(x) = 0 adds 0 to a divergence (0 log 0 = 0), also where a logit is -inf.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .errors import SpecdraftError


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(values * mask) / max(sum(mask), 1), over all dims."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1)


def smooth_l1(predicted: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """Smooth L1 (Huber with slope 1; Girshick 2015, Fast R-CNN Eq. 3), per element

        l(x) = 0.5 x^2 / beta   if |x| < beta,   |x| - 0.5 beta   otherwise,   x = predicted - target,

    averaged over the last (hidden) dim, then over the counted positions. EAGLE-1's feature
    regression (Li et al. 2024, arXiv 2401.15077, Sec. 4.2) is this with beta = 1.
    """
    per_position = F.smooth_l1_loss(predicted.float(), target.float(), reduction="none", beta=beta).mean(-1)
    return masked_mean(per_position, mask)


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """CE(P, Q) = -sum_x P(x) log Q(x), Q = softmax(logits), averaged over the counted positions.

    EAGLE-1 Sec. 4.2's L_cls with P the target's next-token distribution; EAGLE-3
    (Li et al. 2025, arXiv 2503.01840, Sec. 3) trains each training-time-test step on it.
    """
    per_position = -(target_probs.float() * F.log_softmax(logits.float(), dim=-1)).sum(-1)
    return masked_mean(per_position, mask)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) = sum_x P(x) (log P(x) - log Q(x)) per position, with 0 log 0 = 0."""
    p = log_p.exp()
    # The difference is masked *before* the product: where P = Q = 0 it is (-inf) - (-inf) = NaN, and
    # a product with it would send NaN back to P even from a branch torch.where leaves out.
    log_ratio = torch.where(p > 0, log_p - log_q, torch.zeros_like(p))
    return (p * log_ratio).sum(-1)


def forward_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) = sum_x P(x) log(P(x) / Q(x)): mode-covering, the divergence of supervised KD
    (Hinton et al. 2015); DistillSpec's "FKL" (Zhou et al. 2023, arXiv 2310.08461)."""
    log_p, log_q = F.log_softmax(target_logits.float(), -1), F.log_softmax(draft_logits.float(), -1)
    return masked_mean(_kl(log_p, log_q), mask)


def forward_kl_from_hidden(draft_hidden: torch.Tensor, target_hidden: torch.Tensor, draft_logits_of,
                           target_logits_of, chunk_rows: int = 512) -> torch.Tensor:
    """``forward_kl`` over all rows of ``[M, H]`` hidden states whose logits are ``draft_logits_of(draft_hidden)``
    and ``target_logits_of(target_hidden)`` (an LM head: ``[C, H] -> [C, V]``), without ever holding ``[M, V]``.

    A vocabulary-wide KL (Medusa-2's L_LM over a 49k vocabulary) otherwise keeps several ``[M, V]`` float32
    tensors alive for backward: both sets of logits, both log-softmaxes, P, the log-ratio and their gradients.
    Here ``chunk_rows`` rows at a time go through the same ops as ``forward_kl``, and each chunk's gradient
    with respect to its hidden states (``[C, H]``) is taken at once, so only one chunk's ``[C, V]`` tensors
    exist at a time (the fused-linear losses of Liger-Kernel do the same for cross-entropy). Each row's value
    and gradient are those of ``forward_kl``; only the sum over rows runs in another order.

    The callables' own parameters get no gradient (the frozen target's LM head); ``target_logits_of`` runs
    without autograd. The draft's logits run under the caller's autocast, as ``forward_kl``'s inputs would.
    """
    return _ForwardKLFromHidden.apply(draft_hidden, target_hidden, draft_logits_of, target_logits_of, chunk_rows)


class _ForwardKLFromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, draft_hidden, target_hidden, draft_logits_of, target_logits_of, chunk_rows):
        rows = draft_hidden.shape[0]
        # masked_mean's weight of each counted row, as forward_kl's backward applies it (before the LM head's)
        weight = torch.ones((), dtype=torch.float32, device=draft_hidden.device) / max(rows, 1)
        total = torch.zeros((), dtype=torch.float32, device=draft_hidden.device)
        grad = torch.zeros_like(draft_hidden) if ctx.needs_input_grad[0] else None
        for start in range(0, rows, chunk_rows):
            chunk = slice(start, start + chunk_rows)
            with torch.no_grad():
                log_p = F.log_softmax(target_logits_of(target_hidden[chunk]).float(), -1)
            with torch.enable_grad():
                hidden = draft_hidden[chunk].detach().requires_grad_(grad is not None)
                per_row = _kl(log_p, F.log_softmax(draft_logits_of(hidden).float(), -1))
                if grad is not None:
                    (grad[chunk],) = torch.autograd.grad(per_row, hidden, weight.expand_as(per_row))
            total += per_row.detach().sum()
        ctx.save_for_backward(grad)
        return total / max(rows, 1)

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad * grad_output.to(grad.dtype), None, None, None, None


def reverse_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(Q || P) = sum_x Q(x) log(Q(x) / P(x)): mode-seeking; DistillSpec's "RKL" (MiniLLM, Gu et al. 2024,
    trains on it too)."""
    log_p, log_q = F.log_softmax(target_logits.float(), -1), F.log_softmax(draft_logits.float(), -1)
    return masked_mean(_kl(log_q, log_p), mask)


def generalized_jsd(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor,
                    beta: float = 0.5) -> torch.Tensor:
    """The generalized Jensen-Shannon divergence of GKD (Agarwal et al. 2024, arXiv 2306.13649, Sec. 2):

        JSD(beta)(P || Q) = beta KL(P || M) + (1 - beta) KL(Q || M),   M = beta P + (1 - beta) Q

    beta = 0.5 is the Jensen-Shannon divergence (<= log 2). For 0 < beta < 1 it is at most the
    entropy of (beta, 1 - beta), hence <= log 2. As beta -> 0, JSD(beta) / beta -> KL(P || Q)
    (forward KL), and as beta -> 1, JSD(beta) / (1 - beta) -> KL(Q || P) (reverse KL). The formula
    itself is 0 at both ends, so, as TRL's ``GKDTrainer`` does, beta = 0 *is* forward KL and
    beta = 1 *is* reverse KL (P the teacher, Q the student). DistillSpec uses it as "JSD[beta]".
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if beta == 0.0:
        return forward_kl(draft_logits, target_logits, mask)
    if beta == 1.0:
        return reverse_kl(draft_logits, target_logits, mask)
    log_p, log_q = F.log_softmax(target_logits.float(), -1), F.log_softmax(draft_logits.float(), -1)
    # log M by logsumexp of the weighted logs: no underflow where P and Q are tiny
    weights = torch.tensor([beta, 1.0 - beta], device=log_p.device).log().view(2, *[1] * log_p.dim())
    # (floored at -1e30 first: where P = Q = 0 a logsumexp of -infs has a NaN gradient; exp(-1e30) is 0 too)
    log_m = torch.logsumexp(torch.stack([log_p, log_q]).clamp_min(-1e30) + weights, dim=0)
    per_position = beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)
    return masked_mean(per_position, mask)


def total_variation(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TVD(P, Q) = 1/2 sum_x |P(x) - Q(x)|, in [0, 1]. Speculative sampling accepts a draft with
    probability 1 - TVD(P, Q) (Leviathan et al. 2023, arXiv 2211.17192, Cor. 3.6), which DistillSpec
    therefore trains on."""
    p, q = F.softmax(target_logits.float(), -1), F.softmax(draft_logits.float(), -1)
    return masked_mean(0.5 * (p - q).abs().sum(-1), mask)


def binary_entropy(beta: float) -> float:
    """H(beta) = -beta log beta - (1 - beta) log(1 - beta): the bound of JSD(beta), at most log 2."""
    return -sum(w * math.log(w) for w in (beta, 1.0 - beta) if w > 0)


def overlap(draft_logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(P(x), Q(x)) per position ``[...]``, Q = softmax(draft_logits): the probability that
    speculative sampling accepts a draft drawn from Q (Leviathan et al. 2023, arXiv 2211.17192, Cor. 3.6;
    DistillSpec Eq. 2). With both summing to 1 it is 1 - TVD(P, Q)."""
    return torch.minimum(target_probs.float(), F.softmax(draft_logits.float(), -1)).sum(-1)


def acceptance_rate(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(P(x), Q(x)) = 1 - TVD(P, Q) (``overlap``), averaged over the counted positions. A
    training metric, so a divergence's curve reads directly as predicted acceptance."""
    return masked_mean(overlap(draft_logits, F.softmax(target_logits.float(), -1)), mask)


# -- acceptance-aimed drafter losses ----------------------------------------------------------------------
# Each is (draft_logits [..., V], target_probs [..., V], mask [...]) -> the mean over the counted positions,
# P given as probabilities (as ``soft_cross_entropy`` takes it): EAGLE's P over a reduced draft vocabulary
# is the target's renormalised there. Speculative sampling accepts with probability alpha = 1 - TVD(P, Q)
# (``overlap``); CE and KL only bound it (Pinsker), these aim at it. Both anchors ship them: vLLM's
# speculators (``--loss-fn tv | nla | lk_hybrid``, src/speculators/losses) and SpecForge (lk_loss_type
# alpha | lambda, specforge/core/lk_loss.py), after Samarin et al., "LK Losses: Direct Acceptance Rate
# Optimization for Speculative Decoding" (2026, arXiv 2602.23881).


def tv_loss(draft_logits: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - alpha = TVD(P, Q): the expected rejection rate itself (speculators' ``tv``). Its gradient vanishes
    where Q puts almost no mass on P's support, so it trains slowly from a cold start."""
    return masked_mean(1.0 - overlap(draft_logits, target_probs), mask)


def lk_alpha_loss(draft_logits: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor,
                  floor: float = 1e-5) -> torch.Tensor:
    """-log alpha per position (Samarin et al. 2026, LK_alpha; speculators' ``nla``, SpecForge's lk_loss_type
    ``alpha``): TVD's target with its gradient scaled by 1 / alpha, so it trains from a cold start; for a
    one-hot P it is the cross-entropy. alpha is floored at ``floor`` (speculators' 1e-5)."""
    return masked_mean(-overlap(draft_logits, target_probs).clamp_min(floor).log(), mask)


def lk_hybrid_loss(draft_logits: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor,
                   eta: float = 3.0) -> torch.Tensor:
    """lambda KL(P || Q) + (1 - lambda) (1 - alpha) per position, lambda = exp(-eta sg[alpha]) (Samarin et al.
    2026, the hybrid LK loss; speculators' ``lk_hybrid`` with its eta = 3, "the paper's best hybrid setting"):
    KL's strong gradient while the draft is far from P, the acceptance rate itself as it gets close. (SpecForge's
    ``lambda`` variant takes alpha averaged over the batch, with eta 1.)"""
    p, log_q = target_probs.float(), F.log_softmax(draft_logits.float(), -1)
    alpha = torch.minimum(p, log_q.exp()).sum(-1)
    weight = torch.exp(-eta * alpha.detach())
    kl = _kl(p.log(), log_q)
    return masked_mean(weight * kl + (1.0 - weight) * (1.0 - alpha), mask)


def dpace_position_weights(confidence: torch.Tensor, counted: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE's weights of a block's draft positions (Dynamic Position-Aware Cross-Entropy for parallel
    drafting, arXiv 2605.18810, Eq. 7-8; SpecForge ``--loss-type dpace``, speculators ``--per-position-loss-weight
    dpace``, Model-Optimizer's ``dflash_loss_objective``), detached: the expected accepted length still to gain
    at each position,

        q~_i = (1 - alpha) q_i + alpha                  (Eq. 7, smoothed confidence; alpha = 1: all weights equal
                                                         the positions left, 0: the bare prefix products)
        w_j  = sum_{m >= j} counted_m prod_{i <= m} q~_i     (Eq. 8)

    ``confidence`` [..., L] is the draft's probability of position i's label, exp(-CE_i); ``counted`` [..., L] is
    bool. An uncounted position is 1 in the products, adds nothing to the sums and weighs 0 (SpecForge's
    convention). A fixed decay weighs a far position the same however the earlier ones do; these weights shrink
    every position behind one the draft still gets wrong, since a rejection there discards it."""
    with torch.no_grad():
        smooth = torch.where(counted, (1.0 - alpha) * confidence.float() + alpha, torch.ones_like(confidence.float()))
        reached = torch.cumprod(smooth, dim=-1) * counted
        return reached.flip(-1).cumsum(-1).flip(-1) * counted


# The recipe's ``drafter.loss`` for EAGLE-1/3, Medusa and the MLP speculator: "ce" is each family's own
# (the soft cross-entropy -sum P log Q = KL(P || Q) + H(P), KL's gradient), the others aim at acceptance.
DRAFTER_LOSSES = {"ce": soft_cross_entropy, "tvd": tv_loss, "lk_alpha": lk_alpha_loss, "lk_hybrid": lk_hybrid_loss}


def check_drafter_loss(name: str) -> None:
    if name not in DRAFTER_LOSSES:
        raise SpecdraftError(f"drafter.loss must be one of {', '.join(DRAFTER_LOSSES)} (ce: the family's own; tvd, "
                             f"lk_alpha, lk_hybrid aim at the acceptance rate), got {name!r}")


def distillation_view(draft_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float = 1.0,
                      top_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both logits as a divergence should compare them: divided by the same ``temperature`` (the
    decoding temperature the drafter is distilled for: DistillSpec Sec. 5.2 matches them), and
    with ``top_k``, only the target's k most likely tokens, both sides renormalised over them (the
    mass a sampler with top-k would ever see). Returns float32 logits, ``[..., V]`` or ``[..., k]``."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    draft, target = draft_logits.float() / temperature, target_logits.float() / temperature
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1 (or None for the whole vocabulary), got {top_k}")
        if top_k < target.shape[-1]:
            keep = target.topk(top_k, dim=-1).indices
            draft, target = draft.gather(-1, keep), target.gather(-1, keep)
    return draft, target


# DistillSpec's four divergences by their recipe names (drafter.divergence), each (draft, target, mask[, beta]).
DIVERGENCES = {"fkl": forward_kl, "rkl": reverse_kl, "jsd": generalized_jsd, "tvd": total_variation}
