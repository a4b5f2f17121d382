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


def document_lengths(attention_mask: torch.Tensor, seq_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T]``: at each position, the number of real tokens of its document (with packing, ``seq_ids``
    names the documents, -1 on padding, whose count is 0); without packing a row is one document."""
    real = attention_mask.long()
    if seq_ids is None:
        return real.sum(1, keepdim=True).expand_as(real)
    docs = seq_ids + 1  # padding -> 0: a bucket no real token adds to
    # A row holds at most T documents: T + 1 buckets, a fixed shape and no host read of the largest id.
    per_doc = torch.zeros(docs.shape[0], docs.shape[1] + 1, dtype=torch.long, device=docs.device)
    return per_doc.scatter_add_(1, docs, real * (docs > 0)).gather(1, docs)


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, n:] padded back to length T with ``fill``: position t now holds x[:, t + n]."""
    return F.pad(x[:, n:], (0, n), value=fill)


def counted_rows(weights: list[torch.Tensor], row_length: int) -> list[torch.Tensor]:
    """For each bool loss weight ``[B, R_k]`` (R_k <= ``row_length``), the flat indices ``b * row_length + i``
    of its True entries, found in one host sync for all of them.

    A loss that reads only these rows (``rows_at``) runs the LM head and the vocabulary-wide passes over the
    positions it counts: a packed row's padding and the prompts' tokens are skipped, and a masked mean over
    them is the same mean."""
    stacked = torch.stack([F.pad(w.bool(), (0, row_length - w.shape[1])) for w in weights])  # [K, B, L]
    where = stacked.nonzero()  # [n, 3], ordered by step: the one host sync
    flat = where[:, 1] * row_length + where[:, 2]
    return list(flat.split(stacked.sum((1, 2)).tolist()))


def every_row(weights: list[torch.Tensor], row_length: int) -> list[torch.Tensor]:
    """``counted_rows`` at fixed shapes: for each weight ``[B, R_k]``, the flat indices ``b * row_length + i`` of all
    its entries, counted or not, with no host read. A loss over them masks with ``weights_at``; it computes the
    rows it does not count, and a compiled step keeps one shape."""
    rows = torch.arange(weights[0].shape[0], device=weights[0].device)[:, None] * row_length
    return [(rows + torch.arange(w.shape[1], device=w.device)).reshape(-1) for w in weights]


def weights_at(weight: torch.Tensor, index: torch.Tensor, row_length: int) -> torch.Tensor:
    """The bool ``weight`` ``[B, R]`` at the flat indices ``index`` (from ``counted_rows``: all True, or
    ``every_row``): the mask of a loss over those rows."""
    return F.pad(weight.bool(), (0, row_length - weight.shape[1])).reshape(-1).index_select(0, index)


def rows_at(x: torch.Tensor, index: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """``x`` [B, L, ...] at the flat indices ``index`` (from ``counted_rows``) moved ``shift`` positions right
    within their rows: [n, ...]."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, index + shift)


def gathered_rows(select: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a bool ``select`` [B, T]: ``rows`` [B, n], each row's selected positions in order, n the most any row
    selects (one host sync; a row with fewer is filled with unselected positions, computed and never read), and
    ``rank`` [B, T], a selected position's column in ``rows``."""
    n = int(select.sum(1).max()) if select.numel() else 0  # the host sync
    order = torch.argsort((~select).long(), dim=1, stable=True)  # the selected positions first, in order
    return order[:, :n], select.long().cumsum(1) - 1


def gathered_index(index: torch.Tensor, rank: torch.Tensor, n: int) -> torch.Tensor:
    """Flat indices ``b * T + t`` (from ``counted_rows``) of selected positions -> their flat indices
    ``b * n + rank[b, t]`` in the [B, n] layout of ``gathered_rows``."""
    return index // rank.shape[1] * n + rank.reshape(-1)[index]
