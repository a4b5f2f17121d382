"""The one entry point the training loop calls: recipe ``data:`` section -> tokenized train/eval.

load -> normalise the format -> tokenize with the chat template (loss on assistant
tokens) -> drop what cannot be trained on, say how much -> deterministic split.
Batches are made by ``specdraft.data.collate.Collator``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections import Counter
from pathlib import Path

import numpy as np

from ..config import DataConfig
from ..errors import SpecdraftError
from .chat import resolve_chat_template, tokenize_dialogue, tokenize_text
from .formats import FILE_BUILDERS, datasets, load_raw, normalize, resolve_format
from .records import Records

logger = logging.getLogger(__name__)

# Why a sample was dropped ("" = kept).
NO_ASSISTANT = "no assistant turn"
TEMPLATE_ERROR = "chat template failed"
NOTHING_LEFT = "no assistant token within max_length"
ANSWER_FIRST = "an assistant message before any user message (an answer to no question)"

# Declared, not inferred: a first batch of dropped (empty) samples would otherwise type the column as null.
# (None without datasets: Records keep the Python ints the tokenizer returns.)
TOKENIZED_FEATURES = None if datasets is None else datasets.Features({
    "input_ids": datasets.List(datasets.Value("int32")),
    "loss_mask": datasets.List(datasets.Value("int8")),
    "length": datasets.Value("int64"),
    "dropped": datasets.Value("string"),
})


def build_datasets(cfg: "DataConfig", tokenizer) -> tuple[datasets.Dataset | Records, datasets.Dataset | Records]:
    """Tokenized ``(train, eval)``, columns ``input_ids`` and ``loss_mask`` (1 = assistant token).
    The eval set is ``cfg.eval_path`` when given, else a random ``eval_fraction`` of ``cfg.path``."""
    tokenized = tokenize_file(cfg, cfg.path, tokenizer)
    if cfg.eval_path:
        return tokenized, tokenize_file(cfg, cfg.eval_path, tokenizer)
    return train_eval_split(tokenized, cfg.eval_fraction, cfg.seed)


def tokenize_file(cfg: "DataConfig", path: str, tokenizer) -> datasets.Dataset | Records:
    """One data source -> the trainable samples, tokenized as the ``data:`` section says."""
    raw = load_raw(path, cfg.split)
    if cfg.max_samples:
        raw = raw.select(range(min(cfg.max_samples, len(raw))))
    fmt = resolve_format(cfg.format, raw.column_names, cfg.text_field)
    records = normalize(raw, fmt, cfg.text_field, cfg.num_proc)
    template = None if fmt == "text" else resolve_chat_template(tokenizer, cfg.chat_template)
    max_length = cfg.max_length

    def tokenize(record):
        if template is None:
            input_ids, loss_mask = tokenize_text(record["text"], tokenizer)
        elif not any(m["role"] == "assistant" for m in record["messages"]):
            return {"input_ids": [], "loss_mask": [], "length": 0, "dropped": NO_ASSISTANT}
        elif next(m["role"] for m in record["messages"] if m["role"] != "system") == "assistant":
            return {"input_ids": [], "loss_mask": [], "length": 0, "dropped": ANSWER_FIRST}
        else:
            try:
                input_ids, loss_mask = tokenize_dialogue(record["messages"], tokenizer, template)
            except SpecdraftError:
                raise
            except Exception:  # e.g. a template's raise_exception("roles must alternate")
                return {"input_ids": [], "loss_mask": [], "length": 0, "dropped": TEMPLATE_ERROR}
        length = len(input_ids)
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
        dropped = "" if any(loss_mask) else NOTHING_LEFT
        return {"input_ids": input_ids, "loss_mask": loss_mask, "length": length, "dropped": dropped}

    tokenized = records.map(
        tokenize,
        remove_columns=records.column_names,
        features=TOKENIZED_FEATURES,
        num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
        desc="tokenizing",
    )
    return _drop_untrainable(tokenized, path, cfg.max_length)


def _drop_untrainable(tokenized: datasets.Dataset | Records, path: str, max_length: int) -> datasets.Dataset | Records:
    """Filter out dropped samples, warn with counts, and fail if nothing (useful) is left."""
    total = len(tokenized)
    reasons = list(tokenized["dropped"])
    dropped = Counter(reason for reason in reasons if reason)
    # Lengths of the samples that tokenized; the others have no length to speak of.
    lengths = [n for n, reason in zip(tokenized["length"], reasons) if reason not in (NO_ASSISTANT, TEMPLATE_ERROR)]
    if dropped[NO_ASSISTANT] == total:
        raise SpecdraftError(
            f"none of the {total} dialogues in {path!r} has an assistant turn, so there is nothing to learn. "
            "Prompt-only data (e.g. Spec-Bench 'turns') needs answers first: run `specdraft regenerate`."
        )
    if lengths and min(lengths) > max_length:
        raise SpecdraftError(
            f"every sample in {path!r} is longer than data.max_length={max_length} tokens "
            f"(the shortest has {min(lengths)}). Raise data.max_length."
        )
    for reason, count in dropped.items():
        first = [str(i) for i, r in enumerate(reasons) if r == reason][:3]
        logger.warning("skipped %d of %d samples of %s: %s (records %s%s, counting from 0)", count, total, path,
                       reason, ", ".join(first), " ..." if count > len(first) else "")
    truncated = sum(n > max_length for n in lengths)
    if truncated:
        logger.warning("truncated %d of %d samples to data.max_length=%d tokens", truncated, total, max_length)
    if sum(dropped.values()) == total:
        raise SpecdraftError(
            f"no usable sample in {path!r}: {dict(dropped)}. Check data.chat_template and data.max_length."
        )
    kept = [i for i, reason in enumerate(reasons) if not reason]
    return tokenized.select(kept).remove_columns(["length", "dropped"])


def train_eval_split(
    dataset: datasets.Dataset | Records, eval_fraction: float, seed: int
) -> tuple[datasets.Dataset | Records, datasets.Dataset | Records]:
    """A random ``eval_fraction`` (rounded up) held out, the same for the same seed; both keep data order."""
    if not 0 <= eval_fraction < 1:
        raise SpecdraftError(f"data.eval_fraction must be in [0, 1), got {eval_fraction}.")
    n = len(dataset)
    n_eval = math.ceil(n * eval_fraction)
    if n - n_eval < 1:
        raise SpecdraftError(
            f"only {n} usable samples: none would be left to train on. Lower data.eval_fraction or add data."
        )
    order = np.random.default_rng(seed).permutation(n)
    return dataset.select(np.sort(order[n_eval:])), dataset.select(np.sort(order[:n_eval]))


def vocab_cache_key_parts(cfg: "DataConfig", tokenizer) -> list[str]:
    """What the draft vocabulary depends on, for ``build_draft_vocab``'s cache key.

    The data by content (a hash of local files, else the hub dataset's fingerprint),
    every data setting that changes the train split, and the tokenizer's vocabulary
    and chat template: change any and the cached map is not reused.
    """
    # eval_path too: with it set, the whole of path is the train split.
    fields = ("path", "format", "split", "text_field", "max_length", "eval_fraction", "eval_path", "max_samples",
              "seed")
    settings = {k: getattr(cfg, k) for k in fields}
    # The override's text, not its file name: editing the .jinja file must invalidate the map.
    settings["chat_template"] = resolve_chat_template(tokenizer, cfg.chat_template) if cfg.chat_template else None
    return [data_fingerprint(cfg.path, cfg.split), json.dumps(settings, sort_keys=True), tokenizer_fingerprint(tokenizer)]


def data_fingerprint(path: str, split: str = "train") -> str:
    local = Path(path).expanduser()
    if local.is_file() or local.is_dir():
        files = [local] if local.is_file() else sorted(
            f for f in local.rglob("*") if f.is_file() and f.suffix.lower() in FILE_BUILDERS
        )
        digest = hashlib.sha256()
        for f in files:
            digest.update(str(f.relative_to(local) if local.is_dir() else f.name).encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(chunk)
        return digest.hexdigest()
    return load_raw(path, split)._fingerprint  # hub: datasets fingerprints the downloaded files


def tokenizer_fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps([vocab, tokenizer.chat_template]).encode()).hexdigest()
