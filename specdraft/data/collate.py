"""Samples to batches: right padding, or packing several samples into one row.

Batch layout (``specdraft.contract``), all ``[B, T]``: ``input_ids``,
``attention_mask``, ``loss_mask``, ``position_ids`` and, when packing,
``seq_ids``. Packing happens here, in the collate function, not as a dataset
transform: the dataset stays one sample per row (so shuffling and epochs work
as usual) and each batch of samples is packed into as few rows as fit.
"""

from __future__ import annotations

import torch

from ..errors import SpecdraftError
from ..masks import block_causal_mask


def pad_token_id_of(tokenizer) -> int:
    """The tokenizer's pad id, or its EOS id when it has none (padding is masked out anyway)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise SpecdraftError(
            "the tokenizer has neither a pad nor an EOS token; set tokenizer.pad_token before training."
        )
    return pad


def attention_mask_4d(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The ``[B, 1, T, T]`` boolean mask both target and drafter use: causal, no padding, and
    with packing (``seq_ids`` present) block-diagonal so packed samples never see each other."""
    return block_causal_mask(batch["attention_mask"], batch.get("seq_ids"))


def bucket_widths(max_length: int) -> tuple[int, ...]:
    """The 4 widths a bucketed batch may take: max_length / 8, / 4, / 2 and max_length (each at least 1)."""
    return tuple(sorted({max(1, max_length // d) for d in (8, 4, 2)} | {max_length}))


def first_fit(room: list[int], n: int) -> int | None:
    """The first row with ``n`` tokens free (``room``: each row's free tokens), or None."""
    return next((r for r, free in enumerate(room) if free >= n), None)


def pack(lengths: list[int], max_length: int) -> list[list[int]]:
    """First-fit: sample indices grouped into rows whose lengths sum to at most ``max_length``."""
    rows: list[list[int]] = []
    room: list[int] = []  # free tokens left in each row
    for i, n in enumerate(lengths):
        row = first_fit(room, n)
        if row is None:
            rows.append([])
            room.append(max_length)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= n
    return rows


class EpochOrder(torch.utils.data.Sampler):
    """Every index once, in an order drawn from ``seed`` and the epoch (``set_epoch``, which accelerate's loaders
    call): the same on every process, and again on a resume."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle, self.epoch = n, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.n))
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist())

    def __len__(self) -> int:
        return self.n


class TokenBudgetBatches(torch.utils.data.Sampler):
    """``batch_sampler`` for ``data.tokens_per_micro_batch``: consecutive samples of ``sampler``'s order, as many
    as first-fit packs into ``rows`` rows of ``max_length`` tokens (a sample that fits in none starts the next
    batch). The Collator, packing the same samples in the same order with ``rows``/``widths=(max_length,)``,
    then gives every batch one shape, ``[rows, max_length]``, whatever the samples' lengths.

    ``batch_size`` is None (the batches hold varying numbers of samples), which accelerate's sharding supports."""

    batch_size = None
    drop_last = False

    def __init__(self, lengths: list[int], rows: int, max_length: int, sampler: EpochOrder):
        self.lengths = [min(n, max_length) for n in lengths]
        self.rows, self.max_length, self.sampler = rows, max_length, sampler

    def __iter__(self):
        batch: list[int] = []
        room = [self.max_length] * self.rows
        for i in self.sampler:
            n = self.lengths[i]
            row = first_fit(room, n)  # as pack() places it: the Collator's rows are these
            if row is None:  # full: this sample opens the next batch
                yield batch
                batch, room, row = [], [self.max_length] * self.rows, 0
            batch.append(i)
            room[row] -= n
        if batch:
            yield batch

    def __len__(self) -> int:  # this epoch's count: the packing is cheap to replay
        return sum(1 for _ in self)


class Collator:
    """``collate_fn`` for a DataLoader over ``build_datasets`` output (``input_ids``, ``loss_mask``).

    ``rows`` (the micro-batch size) with ``widths`` (``bucket_widths``) gives every batch ``rows`` rows and the
    narrowest width that holds it: a run meets ``len(widths)`` shapes. The added rows and columns are padding,
    masked as all padding is."""

    def __init__(self, pad_token_id: int, max_length: int, packing: bool = False, rows: int | None = None,
                 widths: tuple[int, ...] | None = None):
        self.pad_token_id = pad_token_id
        self.max_length = max_length
        self.packing = packing
        self.rows, self.widths = rows, widths

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        docs = [(list(s["input_ids"])[: self.max_length], list(s["loss_mask"])[: self.max_length]) for s in samples]
        if self.packing:
            rows = pack([len(ids) for ids, _ in docs], self.max_length)
        else:
            rows = [[i] for i in range(len(docs))]
        width = max(sum(len(docs[i][0]) for i in row) for row in rows)  # pad to the longest row only
        if self.widths:
            width = next(w for w in self.widths if w >= width)
        if self.rows:
            rows += [[] for _ in range(self.rows - len(rows))]

        shape = (len(rows), width)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(shape, dtype=torch.long)
        loss_mask = torch.zeros(shape, dtype=torch.long)
        position_ids = torch.zeros(shape, dtype=torch.long)
        seq_ids = torch.full(shape, -1, dtype=torch.long)
        for r, row in enumerate(rows):
            start = 0
            for doc, i in enumerate(row):
                ids, mask = docs[i]
                span = slice(start, start + len(ids))
                input_ids[r, span] = torch.tensor(ids, dtype=torch.long)
                attention_mask[r, span] = 1
                loss_mask[r, span] = torch.tensor(mask, dtype=torch.long)
                position_ids[r, span] = torch.arange(len(ids))
                seq_ids[r, span] = doc
                # Position t predicts token t+1, so a document's first token would be "predicted"
                # from the previous document's last one: never put it in the loss.
                loss_mask[r, start] = 0
                start += len(ids)
            # Padding keeps counting positions: a reset to 0 would look like a new document to
            # kernels that infer packing from position_ids (flash-attention varlen).
            last = position_ids[r, start - 1] + 1 if start else 0
            position_ids[r, start:] = torch.arange(width - start) + last

        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "loss_mask": loss_mask,
            "position_ids": position_ids,
        }
        if self.packing:
            batch["seq_ids"] = seq_ids
        return batch
