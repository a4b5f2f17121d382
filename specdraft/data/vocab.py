"""Reduced draft vocabulary (EAGLE-3): the N most frequent assistant tokens.

Conventions shared with vLLM and SGLang checkpoints:
  d2t [N] long  offsets, target_id = draft_id + d2t[draft_id]
  t2d [V] bool  True where the target token is in the draft vocabulary
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..atomic import current_umask
from ..errors import SpecdraftError
from .records import Records


@dataclass
class DraftVocab:
    d2t: torch.Tensor  # [N] long offsets
    t2d: torch.Tensor  # [V] bool

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[N] long: the target id of each draft id."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    @property
    def size(self) -> int:
        return len(self.d2t)

    @classmethod
    def from_target_ids(cls, target_ids: torch.Tensor, target_vocab_size: int) -> "DraftVocab":
        """From the sorted target ids kept in the draft vocabulary."""
        target_ids = torch.sort(target_ids.long()).values
        t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
        t2d[target_ids] = True
        return cls(d2t=target_ids - torch.arange(len(target_ids)), t2d=t2d)


# -- building the map from data (EAGLE-3) --------------------------------------------------------


def count_assistant_tokens(train_dataset, target_vocab_size: int) -> torch.Tensor:
    """[V] long: how often each token id appears where ``loss_mask`` is 1."""
    counts = np.zeros(target_vocab_size, dtype=np.int64)
    for ids, mask in _token_batches(train_dataset):
        ids = ids[mask.astype(bool)]
        if ids.size and (ids.min() < 0 or ids.max() >= target_vocab_size):
            raise SpecdraftError(
                f"the data holds token id {int(ids.max())}, outside the target's vocabulary of {target_vocab_size}. "
                "Tokenize with the target's own tokenizer."
            )
        counts += np.bincount(ids, minlength=target_vocab_size)
    return torch.from_numpy(counts)


def _token_batches(train_dataset):
    """(input_ids, loss_mask) flattened, 4096 samples at a time: from arrow for a ``datasets.Dataset``, from
    the lists of ``Records`` (the reader used without ``datasets``)."""
    if isinstance(train_dataset, Records):
        yield train_dataset.token_arrays("input_ids"), train_dataset.token_arrays("loss_mask")
        return
    import pyarrow.compute as pc  # optional: pyarrow (with datasets), for Arrow-backed data only

    batches = train_dataset.with_format("arrow").iter(batch_size=4096)
    for table in tqdm(batches, total=-(-len(train_dataset) // 4096), desc="counting assistant tokens", leave=False):
        yield pc.list_flatten(table["input_ids"]).to_numpy(), pc.list_flatten(table["loss_mask"]).to_numpy()


def top_tokens(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """The ``draft_vocab_size`` most frequent ids, ties (including never-seen ids) broken by lower id."""
    # A stable sort of -counts keeps equal counts in id order, so if fewer than N distinct
    # tokens were seen the rest are filled with unseen ids in id order.
    order = torch.sort(-counts, stable=True).indices
    return order[:draft_vocab_size]


def build_draft_vocab(
    train_dataset,
    target_vocab_size: int,
    draft_vocab_size: int,
    cache_dir: str | Path | None,
    cache_key_parts: list[str],
) -> DraftVocab:
    """The N most frequent assistant tokens of ``train_dataset`` (columns ``input_ids``, ``loss_mask``).

    Cached as safetensors under ``cache_dir``, keyed by a hash of ``cache_key_parts``
    (what the data depends on: ``specdraft.data.pipeline.vocab_cache_key_parts``) + V + N,
    so a map built from other data or another tokenizer is never reused.
    """
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise SpecdraftError(
            f"draft vocabulary size {draft_vocab_size} must be between 1 and the target vocabulary size "
            f"{target_vocab_size}. Lower the drafter's draft_vocab_size (or leave it unset for the full vocabulary)."
        )
    key = hashlib.sha256(json.dumps([list(cache_key_parts), target_vocab_size, draft_vocab_size]).encode()).hexdigest()
    path = Path(cache_dir) / f"draft_vocab_{key[:24]}.safetensors" if cache_dir is not None else None
    if path is not None and path.exists():
        return load_draft_vocab(path)

    counts = count_assistant_tokens(train_dataset, target_vocab_size)
    if counts.sum() == 0:
        raise SpecdraftError("the training data has no assistant (loss-masked) token to build a draft vocabulary from.")
    vocab = DraftVocab.from_target_ids(top_tokens(counts, draft_vocab_size), target_vocab_size)
    if path is not None:
        save_draft_vocab(vocab, path)
    return vocab


def save_draft_vocab(vocab: DraftVocab, path: str | Path) -> None:
    """``d2t`` / ``t2d`` as safetensors, written to a temporary name first so a crash leaves no half file. The
    name is this writer's own: the processes of one node build the same cache at once, and with one shared
    name a writer's file could be moved away, or replaced half-written, under another."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        save_file({"d2t": vocab.d2t.contiguous(), "t2d": vocab.t2d.contiguous()}, tmp)
        os.chmod(tmp, 0o666 & ~current_umask())  # what open() would give it (mkstemp makes it private, 0600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_draft_vocab(path: str | Path) -> DraftVocab:
    tensors = load_file(str(path))
    return DraftVocab(d2t=tensors["d2t"].long(), t2d=tensors["t2d"].bool())
