"""EAGLE's training objectives and metrics, composed from the pure losses of ``specdraft.losses``."""

from __future__ import annotations

import torch

from ..contract import TargetOutputs
from ..errors import SpecdraftError
from ..losses import smooth_l1, soft_cross_entropy


def eagle1_loss(
    predicted_feature: torch.Tensor,  # [..., H] f_hat_{i+1}
    target_feature: torch.Tensor,  # [..., H] f_{i+1}
    draft_logits: torch.Tensor,  # [..., V] LM_Head(f_hat_{i+1})
    target_probs: torch.Tensor,  # [..., V] p_{i+2} = softmax(LM_Head(f_{i+1}))
    mask: torch.Tensor,  # [...]
    cls_weight: float = 0.1,
    classification_loss=soft_cross_entropy,  # (draft_logits, target_probs, mask) -> scalar: losses.DRAFTER_LOSSES
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-1 (Li et al. 2024, arXiv 2401.15077) Sec. 4.2: L = L_reg + w_cls * L_cls, with
    L_reg = SmoothL1(f_{i+1}, f_hat_{i+1}) (averaged over the hidden dim, as the reference code does),
    L_cls = CE(p_{i+2}, p_hat_{i+2}) and w_cls = 0.1; ``classification_loss`` may replace the CE by an
    acceptance-aimed loss (``drafter.loss``). Returns (L, L_reg, L_cls)."""
    regression = smooth_l1(predicted_feature, target_feature, mask)
    classification = classification_loss(draft_logits, target_probs, mask)
    return regression + cls_weight * classification, regression, classification


def draft_vocab_probs(target_out: TargetOutputs, draft_ids: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's training target over a reduced draft vocabulary, as SpecForge computes it
    (specforge/core/eagle3.py, "handle vocab size"; the EAGLE-3 reference does the same):
    p_draft = softmax of the target's logits at the N draft ids, renormalised over the draft vocabulary.

    The target computed only those rows when asked for "draft_rows" (``vocab_rows``); from
    full-vocabulary logits they are picked here (``index_select``: no host sync). [B, T, N].
    """
    logits = target_out.logits
    if logits is None:
        raise SpecdraftError("EAGLE-3 trains on the target's logits; the target computed none (logits='none')")
    if target_out.vocab_rows is None:
        logits = logits.index_select(-1, draft_ids)
    elif target_out.vocab_rows.shape != draft_ids.shape:
        raise SpecdraftError(
            f"the target's logits cover {target_out.vocab_rows.numel()} vocabulary rows, but this drafter's draft "
            f"vocabulary has {draft_ids.numel()}; ask the target for the drafter's own rows (drafter.prepare does)"
        )
    return torch.softmax(logits.float(), dim=-1)


def label_in_draft_vocab(input_ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: whether each token of the data is in the draft vocabulary.

    Which positions EAGLE-3 trains on: those whose next token the draft can emit. SpecForge counts a
    position when the target's *top-1* is in the draft vocabulary, which needs the V-wide logits
    this loop no longer computes (only the draft rows). The data's next token stands in for it: the
    data is usually the target's own answers (``specdraft regenerate``), where that token is what the
    target chose, and a position whose next token the draft cannot emit is one it can never get
    accepted, whatever it learns there. With a full draft vocabulary both rules count every position.
    """
    return t2d[input_ids]


def ttt_step_weights(num_steps: int, decay: float = 0.8) -> list[float]:
    """EAGLE-3 reference training (eagle/traineagle3/main.py): step k's loss is weighted decay**k."""
    return [decay**k for k in range(num_steps)]
