"""Training metrics of a drafter that drafts chains: how often step k's top-1 matches the target's,
and what acceptance length that predicts. Pure functions of tensors, with no host sync."""

from __future__ import annotations

import torch


def chain_accuracy_metrics(correct: list[torch.Tensor], counted: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-step accuracies of drafted chains, and the simulated acceptance length: EAGLE-3's
    training-time-test steps, or a chain of heads (an MLP speculator's, Medusa's).

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
