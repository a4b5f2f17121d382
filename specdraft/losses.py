"""Drafter losses and training metrics: pure functions of tensors, each citing its source.

Conventions shared by every function here:
  * ``mask`` is a per-position weight (bool or 0/1 float); reductions are means over
    the counted positions, with ``clamp_min(1)`` instead of an ``if`` so nothing ever
    syncs with the host (an all-zero mask gives 0, not NaN).
  * logits and probabilities are upcast to float32 before any softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(values * mask) / max(sum(mask), 1), over all dims."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1)


def feature_regression_loss(predicted: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """EAGLE-1 (Li et al. 2024, arXiv 2401.15077, Sec. 4.2): L_reg = SmoothL1(f_{i+1}, f_hat_{i+1}).

    Smooth L1 per hidden unit, averaged over the hidden dim (as the reference code does),
    then over the counted positions. ``predicted``/``target`` are [..., H], ``mask`` [...].
    """
    per_position = F.smooth_l1_loss(predicted.float(), target.float(), reduction="none").mean(-1)
    return masked_mean(per_position, mask)


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """CE(p, p_hat) = -sum_x p(x) log p_hat(x), averaged over the counted positions.

    EAGLE-1 Sec. 4.2's L_cls with p = the target's next-token distribution; EAGLE-3
    (Li et al. 2025, arXiv 2503.01840, Sec. 3) trains each training-time-test step on it.
    ``logits`` are the draft's [..., V], ``target_probs`` the target's p [..., V].
    """
    per_position = -(target_probs.float() * F.log_softmax(logits.float(), dim=-1)).sum(-1)
    return masked_mean(per_position, mask)


def eagle1_loss(
    predicted_feature: torch.Tensor,  # [..., H] f_hat_{i+1}
    target_feature: torch.Tensor,  # [..., H] f_{i+1}
    draft_logits: torch.Tensor,  # [..., V] LM_Head(f_hat_{i+1})
    target_probs: torch.Tensor,  # [..., V] p_{i+2} = softmax(LM_Head(f_{i+1}))
    mask: torch.Tensor,  # [...]
    cls_weight: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-1 Sec. 4.2: L = L_reg + w_cls * L_cls, with w_cls = 0.1. Returns (L, L_reg, L_cls)."""
    regression = feature_regression_loss(predicted_feature, target_feature, mask)
    classification = soft_cross_entropy(draft_logits, target_probs, mask)
    return regression + cls_weight * classification, regression, classification


def restrict_to_draft_vocab(
    target_logits: torch.Tensor,  # [..., V] target logits
    draft_to_target: torch.Tensor,  # [N] long: target id of each draft id
    t2d: torch.Tensor,  # [V] bool: target id is in the draft vocabulary
) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's training target over a reduced draft vocabulary, as SpecForge computes it
    (specforge/core/eagle3.py, "handle vocab size"; the EAGLE-3 reference does the same):

      p_draft = softmax(target logits at the N draft ids)   -- renormalised over the draft vocab
      counted = t2d[argmax of the full target logits]       -- positions whose target top-1 the
                                                               draft cannot emit are not trained on

    Returns (p_draft [..., N], counted [...] bool). ``index_select`` rather than a boolean
    index, so no host sync.
    """
    logits = target_logits.float()
    draft_probs = torch.softmax(logits.index_select(-1, draft_to_target), dim=-1)
    counted = t2d[logits.argmax(dim=-1)]
    return draft_probs, counted


def ttt_step_weights(num_steps: int, decay: float = 0.8) -> list[float]:
    """EAGLE-3 reference training (eagle/traineagle3/main.py): step k's loss is weighted decay**k."""
    return [decay**k for k in range(num_steps)]


def ttt_accuracy_metrics(correct: list[torch.Tensor], counted: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-step accuracies of a training-time-test unroll, and the simulated acceptance length.

    ``correct[k]`` / ``counted[k]`` are bool [B, R_k] for step k, where row i of every step
    belongs to the same chain (the one started at position i); R_k may shrink with k
    (later steps run out of sequence), rows beyond R_k simply do not exist.

      acc_k       = P(draft top-1 == target top-1 at step k), over counted positions
      cond_acc_k  = the same, over positions where every earlier step was counted and correct
      sim_accept_len = sum_k prod_{j<=k} acc_j   -- expected accepted drafts per chain if steps
                                                  were independent (add 1 for the bonus token)
    """
    metrics: dict[str, torch.Tensor] = {}
    chain_ok = None  # [B, R] rows whose steps so far were all counted and correct
    survive = None  # prod_{j<=k} acc_j
    sim_accept_len = torch.zeros((), device=correct[0].device)
    for k, (hit, count) in enumerate(zip(correct, counted)):
        hit, count = hit.bool(), count.bool()
        rows = hit.shape[1]
        acc = (hit & count).sum() / count.sum().clamp_min(1)
        eligible = count if chain_ok is None else count & chain_ok[:, :rows]
        metrics[f"acc_{k}"] = acc
        metrics[f"cond_acc_{k}"] = (hit & eligible).sum() / eligible.sum().clamp_min(1)
        chain_ok = hit & eligible
        survive = acc if survive is None else survive * acc
        sim_accept_len = sim_accept_len + survive
    metrics["sim_accept_len"] = sim_accept_len
    return metrics
