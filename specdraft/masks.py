"""Attention masks shared by the target and every drafter, so both see the same context, and the shift
that lines a position up with the token n ahead."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def block_causal_mask(attention_mask: torch.Tensor, seq_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean ``[B, 1, T, T]`` mask, True where query t may attend to key s.

    Causal (s <= t), never onto padding, and with packing (``seq_ids`` given)
    only within the same document, so packed samples cannot see each other.
    """
    B, T = attention_mask.shape
    device = attention_mask.device
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    keep = causal[None] & attention_mask.bool()[:, None, :]
    if seq_ids is not None:
        keep = keep & (seq_ids[:, :, None] == seq_ids[:, None, :])
    # A fully padded query row would softmax over nothing (NaN); let it see itself.
    keep = keep | torch.eye(T, dtype=torch.bool, device=device)[None]
    return keep[:, None]


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, n:] padded back to length T with ``fill``: position t now holds x[:, t + n]."""
    return F.pad(x[:, n:], (0, n), value=fill)
