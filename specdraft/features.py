"""Offline mode: run the target once over the data and keep the features the drafter needs on disk.

``specdraft cache-features RECIPE`` writes ``training.feature_cache``, from what the recipe's
drafter family declares it needs (``TargetNeeds``):
  manifest.json               key (data + target + what is stored + max_length), shard size, dims
  train-00000.safetensors     for each sample i: "{i}.aux" [T, n_taps*H] (if it taps layers),
                              "{i}.last" [T, H] (if it reads the final hidden state or logits)
  eval-00000.safetensors      the same for the eval split

Each shard is written then renamed, so an interrupted run resumes at the first
missing shard. Logits are not stored (they are V wide); a lookup computes the ones
asked for with the target's LM head from ``last``, which gives the same numbers.
Samples are run one at a time (no padding), so a cached feature is bit-identical
to an online forward of that sample alone.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .config import Recipe
from .atomic import protected_name
from .contract import TargetNeeds, TargetOutputs
from .data.pipeline import build_datasets, data_fingerprint, tokenizer_fingerprint
from .errors import SpecdraftError
from .recipe_target import load_target, recipe_needs

SHARD_SIZE = 256


def stored(needs: TargetNeeds) -> TargetNeeds:
    """What the cache keeps for ``needs``: the taps, and the final hidden state when the drafter reads it
    or any logits (they are computed from it at lookup)."""
    return TargetNeeds(final_hidden=needs.final_hidden or needs.logits != "none", taps=needs.taps)


def cache_key(recipe: Recipe, target, kept: TargetNeeds) -> str:
    """What the cached features depend on: the data, how it is tokenized, and the target itself.

    The target counts by its weights and tokenizer, not only its path: a model replaced in place
    (retrained, another revision under the same folder) gives other features, and a cache of the
    old one must not be read as if it were the new one's. ``kept``: what the cache stores (``stored``).
    """
    parts = [recipe.data.path, recipe.data.format, recipe.data.max_length, recipe.data.eval_fraction,
             recipe.data.eval_path, recipe.data.max_samples, recipe.data.seed, recipe.data.chat_template,
             recipe.target.path, recipe.target.dtype, list(kept.taps), kept.final_hidden, target.num_layers,
             data_fingerprint(recipe.data.path, recipe.data.split),
             recipe.data.eval_path and data_fingerprint(recipe.data.eval_path, recipe.data.split),
             weights_fingerprint(target.model), tokenizer_fingerprint(target.tokenizer)]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def weights_fingerprint(model: torch.nn.Module, per_tensor: int = 64) -> str:
    """A hash of every tensor's name, shape and ``per_tensor`` evenly spaced values.

    Training changes essentially every value, so a sample identifies the weights as well as
    hashing them all would, at no cost next to one forward (hashing a whole 8B model reads 16 GB).
    """
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // per_tensor)][:per_tensor]
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(sample.float().cpu().numpy().tobytes())
    return digest.hexdigest()


def _bytes_needed(datasets: dict, target) -> int:
    width = (len(target.taps) + target.needs.final_hidden) * target.hidden_size
    itemsize = target.lm_head.weight.element_size()
    return sum(len(ids) for ds in datasets.values() for ids in ds["input_ids"]) * width * itemsize


def cache_features(recipe: Recipe, show_progress: bool = True) -> Path:
    """Write the feature cache for the recipe (resuming a partial one)."""
    if not recipe.training.feature_cache:
        raise SpecdraftError("set training.feature_cache to the folder to write (e.g. training.feature_cache=cache/feat)")
    out = Path(recipe.training.feature_cache)
    check_cache_folder(out)  # before the target loads
    device = "cuda" if torch.cuda.is_available() else "cpu"
    needs = recipe_needs(recipe)
    _check_cacheable(recipe, needs)
    kept = stored(needs)
    target = load_target(recipe, device, kept)
    train_ds, eval_ds = build_datasets(recipe.data, target.tokenizer)
    splits = {"train": train_ds, "eval": eval_ds}
    key = cache_key(recipe, target, kept)
    manifest = {"key": key, "shard_size": SHARD_SIZE, "taps": list(target.taps),
                "final_hidden": target.needs.final_hidden, "hidden_size": target.hidden_size,
                "sizes": {name: len(ds) for name, ds in splits.items()}}
    manifest_file = out / "manifest.json"
    if manifest_file.is_file() and json.loads(manifest_file.read_text())["key"] != key:
        raise SpecdraftError(f"{out} holds features of a different recipe/data/target; choose another "
                             "training.feature_cache folder or delete it")
    out.mkdir(parents=True, exist_ok=True)
    need = _bytes_needed(splits, target)
    free = shutil.disk_usage(out).free
    print(f"feature cache: {need / 2**30:.2f} GiB needed in {out} ({free / 2**30:.1f} GiB free)")
    if need > free:
        raise SpecdraftError(f"not enough disk for the feature cache: need {need / 2**30:.2f} GiB, "
                             f"{free / 2**30:.2f} GiB free in {out}; free space or use online mode "
                             "(unset training.feature_cache)")
    manifest_file.write_text(json.dumps(manifest, indent=2))
    for name, ds in splits.items():
        for start in tqdm(range(0, len(ds), SHARD_SIZE), desc=f"cache {name}", disable=not show_progress):
            shard = out / f"{name}-{start // SHARD_SIZE:05d}.safetensors"
            if shard.is_file():
                continue  # resume: finished shards are complete (written then renamed)
            tensors = {}
            for i in range(start, min(start + SHARD_SIZE, len(ds))):
                ids = torch.tensor(ds[i]["input_ids"], device=device)[None]
                t_out = target(ids, logits="none")
                if t_out.final_hidden is not None:
                    tensors[f"{i}.last"] = t_out.final_hidden[0].cpu().contiguous()
                if t_out.aux_hidden is not None:
                    tensors[f"{i}.aux"] = t_out.aux_hidden[0].cpu().contiguous()
            tmp = shard.with_suffix(".tmp")
            save_file(tensors, tmp)
            tmp.rename(shard)
    return out


def check_cache_folder(out: Path) -> None:
    """``out`` is new, empty, or a feature cache (its manifest.json is one this command wrote): never the working
    directory, ``$HOME`` or ``/``, and never a folder of the user's, whose files a cache's names could replace."""
    name = protected_name(out)
    if name:
        raise SpecdraftError(f"training.feature_cache {out} is {name} or holds it: give the cache a folder of its "
                             "own, e.g. training.feature_cache=cache/NAME")
    if not out.is_dir() or not any(out.iterdir()):
        return
    try:
        json.loads((out / "manifest.json").read_text())["key"]
    except (OSError, ValueError, KeyError, TypeError):
        raise SpecdraftError(f"training.feature_cache {out} holds files that are not a feature cache (no manifest.json "
                             "of cache-features'), so they stay: choose a new or empty folder") from None


class FeatureCache:
    """Reads cached features back into ``TargetOutputs`` for a batch (padding layout), with the
    logits asked for computed from the cached final hidden state."""

    def __init__(self, folder: Path, target, split: str = "train"):
        self.folder, self.target, self.split = Path(folder), target, split
        self.manifest = json.loads((self.folder / "manifest.json").read_text())
        self._open: dict[int, object] = {}

    def _shard(self, i: int):
        n = i // self.manifest["shard_size"]
        if n not in self._open:
            self._open[n] = safe_open(self.folder / f"{self.split}-{n:05d}.safetensors", "pt", device="cpu")
        return self._open[n]

    def lookup(self, batch: dict[str, torch.Tensor], logits: str = "none",
               rows: torch.Tensor | None = None) -> TargetOutputs:
        """What one target forward would give on ``batch`` (``FrozenTarget.forward_batch``)."""
        if "seq_ids" in batch:
            raise SpecdraftError("the feature cache works with padding only; set data.packing=false")
        B, T = batch["input_ids"].shape
        device = batch["input_ids"].device
        has_last = self.manifest["final_hidden"]
        last, aux = [], []
        for i in batch["sample_index"].tolist():
            f = self._shard(i)
            if has_last:
                last.append(f.get_tensor(f"{i}.last"))
            if self.target.taps:
                aux.append(f.get_tensor(f"{i}.aux"))

        def pad(xs):
            out = xs[0].new_zeros(B, T, xs[0].shape[-1])
            for b, x in enumerate(xs):
                out[b, : len(x)] = x
            return out.to(device)

        final = pad(last) if last else None
        # As the target's own forward: no autograd, no autocast (a mixed-precision step runs this too).
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            computed = None if logits == "none" else self.target.logits_of(final, logits, rows)
        return TargetOutputs(logits=computed, vocab_rows=rows if logits == "draft_rows" else None,
                             last_only=logits == "last",
                             final_hidden=final if self.target.needs.final_hidden else None,
                             aux_hidden=pad(aux) if aux else None, taps=self.target.taps)


def _check_cacheable(recipe: Recipe, needs: TargetNeeds) -> None:
    if needs.trains_adapters:
        raise SpecdraftError(
            f"the {recipe.drafter_family} drafter trains adapters inside the target, so the target's features change "
            "as it trains and cannot be cached: unset training.feature_cache"
        )


def check_feature_cache(recipe: Recipe, needs: TargetNeeds) -> None:
    """The cheap checks of offline mode, before anything loads: the drafter's features can be cached,
    the cache exists, and the batches are padded."""
    if not recipe.training.feature_cache:
        return
    _check_cacheable(recipe, needs)
    folder = Path(recipe.training.feature_cache)
    if not (folder / "manifest.json").is_file():
        raise SpecdraftError(f"no feature cache in {folder}; run `specdraft cache-features RECIPE` first")
    if recipe.data.packing:
        raise SpecdraftError("the feature cache works with padding only; set data.packing=false")
    missing = missing_shards(folder)
    if missing:
        raise SpecdraftError(
            f"the feature cache in {folder} is incomplete: {len(missing)} shard(s) are missing ({missing[0]} first; "
            "`specdraft cache-features` was interrupted). Run `specdraft cache-features RECIPE` again: it resumes "
            "at the first missing shard.")


def missing_shards(folder: Path) -> list[str]:
    """The shard files a cache's manifest promises that are not on disk (an interrupted cache-features)."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        sizes, shard_size = manifest["sizes"], manifest["shard_size"]
    except (ValueError, KeyError) as e:
        raise SpecdraftError(f"{folder / 'manifest.json'} is damaged ({e}); delete {folder} and run "
                             "`specdraft cache-features RECIPE` again") from e
    names = [f"{split}-{n:05d}.safetensors" for split, size in sizes.items()
             for n in range(math.ceil(size / shard_size))]
    return [name for name in names if not (folder / name).is_file()]


def open_feature_caches(recipe: Recipe, target, needs: TargetNeeds) -> dict[str, FeatureCache] | None:
    """The training loop's view of the cache per split, or None in online mode."""
    if not recipe.training.feature_cache:
        return None
    check_feature_cache(recipe, needs)
    folder = Path(recipe.training.feature_cache)
    if json.loads((folder / "manifest.json").read_text())["key"] != cache_key(recipe, target, stored(needs)):
        raise SpecdraftError(f"the feature cache in {folder} was built from a different recipe/data/target; "
                             "rebuild it with `specdraft cache-features RECIPE`")
    return {split: FeatureCache(folder, target, split) for split in ("train", "eval")}


def with_sample_index(collate):
    """Wrap a collate_fn so each batch carries its samples' dataset indices (for cache lookups)."""

    def wrapped(samples):
        index = torch.tensor([s.pop("sample_index") for s in samples])
        batch = collate(samples)
        batch["sample_index"] = index
        return batch

    return wrapped
