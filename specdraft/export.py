"""``specdraft export``: a trained drafter as a folder that vLLM or SGLang serves without edits.

    specdraft export RUN --format sglang --out DIR     (RUN: a run folder or a drafter folder)

This is the generic driver: the formats belong to the drafter families (``Family.exporters``, each an
``Exporter`` with its function, its inverse and its serve hint; EAGLE's are in
``specdraft/drafters/eagle_export.py``). ``hf`` is specdraft's own folder, a copy that ``specdraft eval``
and the decoder load, for every family that does not define its own.

An export is config.json + model.safetensors; other formats than the copy also carry specdraft.json
(the drafter they came from, so ``load_exported`` can read them back; engines ignore it). Each is
written to a temporary folder, then renamed into place.

An exporter may ship the target's token embedding (``Exporter.target_embedding``): the driver reads
only that tensor from the target's safetensors, sharded or not, in the export dtype. The target is
the run recipe's ``target.path``, with specdraft's shortcuts (``toy``, named targets) resolved to the
folder training actually loaded (``specdraft.target.resolve_target_path``), or ``--target``.
"""

from __future__ import annotations

import argparse
import errno
import json
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
import yaml
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .atomic import atomic_folder, check_replaceable_output, describe_bytes, disk_full_reason
from .checkpoint import damaged_drafter_message, find_drafter_dir
from .contract import Exporter, ExportOptions, FolderExporter
from .drafters import FAMILIES, load_drafter
from .dtypes import export_dtype
from .errors import SpecdraftError
from .target import resolve_target_path
from .target_fingerprint import check_target

SIDE_FILE = "specdraft.json"  # where an export came from; engines never read it
EXPORT_OWNER = "specdraft export"  # atomic.mark_owner's record: --overwrite replaces only what export wrote
TARGET_EMBED = "model.embed_tokens.weight"  # the token embedding's name in the target's own checkpoint


def _copy(saved: dict, tensors: dict, opts: ExportOptions) -> tuple[dict, dict]:
    """specdraft's own folder, unchanged (no embedding: specdraft binds the target's)."""
    return saved, tensors


# The "hf" format of every family that does not define its own: a drafter folder, which
# `specdraft eval` loads (so it carries no specdraft.json).
DRAFTER_FOLDER = Exporter(write=_copy, read_back=lambda saved, tensors: tensors)


def exporters_of(family: str) -> dict[str, Exporter]:
    """A family's formats: its own exporters, and the copy as "hf" unless it has its own."""
    own = FAMILIES[family].exporters if family in FAMILIES else {}
    return {"hf": DRAFTER_FOLDER, **own}


def all_formats() -> list[str]:
    return sorted({"hf", *(fmt for family in FAMILIES.values() for fmt in family.exporters)})


def exporter_for(family: str, fmt: str) -> Exporter:
    if fmt not in all_formats():
        raise SpecdraftError(f"unknown export format {fmt!r}; choose one of {', '.join(all_formats())}")
    formats = exporters_of(family)
    if fmt not in formats:
        raise SpecdraftError(
            f"the {family} drafter cannot be exported as {fmt}: specdraft knows no {fmt} model that loads it. "
            f"Formats for {family}: {', '.join(sorted(formats))} (e.g. --format hf, which specdraft eval loads)."
        )
    return formats[fmt]


# -- the target's side: its name and its embedding ------------------------------------------------


def name_target(name: str | None) -> str | None:
    """The folder or hub id an engine opens for the target ``name``.

    specdraft's shortcuts (``toy``, named targets) become the folder training loaded, through the
    same ``resolve_target_path`` call as ``train``; an existing folder becomes an absolute path, so
    the export names it from any working directory; anything else is a hub id, kept as given.
    """
    if not name:
        return None
    resolved = resolve_target_path(str(name))
    return str(Path(resolved).resolve()) if Path(resolved).is_dir() else resolved


def _target_file(target: str, filename: str) -> Path | None:
    """``filename`` of the target: from its folder, else through the hub cache; None if it has none."""
    if Path(target).is_dir():
        path = Path(target) / filename
        return path if path.is_file() else None

    try:
        return Path(hf_hub_download(target, filename))
    except EntryNotFoundError:  # not in the repo, or offline and not cached
        return None
    except Exception as e:  # not a valid hub id, unreachable, gated: the user's to fix
        raise SpecdraftError(
            f"the target {target!r} is neither a local folder nor a hub model that can be read "
            f"({type(e).__name__}: {e}). Pass --target with the target's folder or hub id."
        ) from e


def read_target_embedding(target: str) -> torch.Tensor:
    """The target's ``model.embed_tokens.weight`` alone, as stored, without loading the model.

    A sharded checkpoint's ``model.safetensors.index.json`` names the shard that holds it; else it is
    in ``model.safetensors``. Only that tensor is read (safetensors reads by offset).
    """
    index = _target_file(target, "model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        if TARGET_EMBED not in weight_map:
            raise SpecdraftError(
                f"{index} maps no {TARGET_EMBED}: the export needs the target's token embedding under that name "
                "(a Llama/Qwen-style checkpoint). Export --format hf instead."
            )
        shard = weight_map[TARGET_EMBED]
        file = _target_file(target, shard)
    else:
        shard, file = "model.safetensors", _target_file(target, "model.safetensors")
    if file is None:
        raise SpecdraftError(
            f"the target {target!r} has no {shard} (or it could not be fetched): the export ships the target's "
            "token embedding and reads it from the target's safetensors. Pass --target with the folder or hub id "
            "of the target this drafter was trained on."
        )
    with safe_open(str(file), framework="pt") as f:
        if TARGET_EMBED not in f.keys():
            raise SpecdraftError(f"{file} holds no {TARGET_EMBED}; pass --target with the target's own checkpoint")
        return f.get_tensor(TARGET_EMBED)


def _target_embedding(saved: dict, tensors: dict, target: str) -> torch.Tensor:
    """The embedding an export ships: the target's, checked against the drafter's target, in the export dtype."""
    tc = saved["target_config"]
    embed = read_target_embedding(target)
    want = (tc["vocab_size"], tc["hidden_size"])
    if tuple(embed.shape) != want:
        raise SpecdraftError(
            f"the target {target!r} has a {tuple(embed.shape)} token embedding, but this drafter was trained on a "
            f"target with vocab_size x hidden_size {want}. Pass --target with the target the drafter was trained on."
        )
    dtype = getattr(torch, export_dtype(saved, tensors), None)
    if not isinstance(dtype, torch.dtype):
        raise SpecdraftError(f"the target's config names dtype {export_dtype(saved, tensors)!r}, not a torch dtype")
    return embed.to(dtype)


# -- writing and reading folders -----------------------------------------------------------------


def _write_folder(path: Path, config: dict, tensors: dict, side: dict | None,
                  weights_file: str = "model.safetensors") -> None:
    """config.json + the tensors (+ specdraft.json), written to a temporary folder then renamed."""
    with writing_export(path, sum(t.numel() * t.element_size() for t in tensors.values())) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        # metadata format=pt: transformers' from_pretrained refuses safetensors files without it
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / weights_file),
                  metadata={"format": "pt"})
        if side is not None:
            (tmp / SIDE_FILE).write_text(json.dumps(side, indent=2) + "\n")


@contextmanager
def writing_export(path: Path, need: int):
    """``atomic_folder`` for an export of about ``need`` bytes: refused up front when the disk has less
    free, and any failure (a full disk) reported with what it needs and what is left as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path.parent).free
    kept = f"an existing {path} is left as it was" if path.exists() else f"nothing was written to {path}"
    if free < need:
        raise SpecdraftError(f"not enough disk for the export: it needs about {describe_bytes(need)} and "
                             f"{describe_bytes(free)} is free in {path.parent}; {kept}. Free space or choose "
                             "another --out.")
    try:
        with atomic_folder(path, owner=EXPORT_OWNER) as tmp:
            yield tmp
    except SpecdraftError:
        raise
    except Exception as e:  # safetensors reports a full disk as a SafetensorError, shutil as an OSError
        reason = disk_full_reason(e)
        if reason:
            raise SpecdraftError(f"could not write the export {path} ({reason}): {getattr(e, 'strerror', None) or e}. "
                                 f"It needs about {describe_bytes(need)}; {kept}.") from e
        code = f" ({errno.errorcode[e.errno]})" if isinstance(e, OSError) and e.errno in errno.errorcode else ""
        raise SpecdraftError(f"could not write the export {path}: {getattr(e, 'strerror', None) or e}{code}; "
                             f"{kept}.") from e


def _find_recipe(given: Path, drafter_dir: Path) -> dict:
    """RUN/recipe.yaml for RUN, RUN/drafter or RUN/checkpoints/step-N/drafter; {} if there is none."""
    folders = [given, drafter_dir.parent]
    if drafter_dir.parent.parent.name == "checkpoints":
        folders.append(drafter_dir.parent.parent.parent)
    for folder in folders:
        if (folder / "recipe.yaml").is_file():
            return yaml.safe_load((folder / "recipe.yaml").read_text()) or {}
    return {}


def export(run_or_drafter_dir: str | Path, fmt: str, out_dir: str | Path, overwrite: bool = False,
           verifier: str | None = None, num_speculative_tokens: int | None = None,
           allow_other_target: bool = False) -> Path:
    """Write the drafter of a run (its final drafter, else its newest checkpoint) in format ``fmt``.

    ``verifier`` is the target (a folder, hub id or specdraft shortcut such as ``toy``); by default the
    run recipe's ``target.path``. Exports that ship the target's token embedding read it there, and
    formats that name the target write it. ``num_speculative_tokens`` goes where a format records a
    proposal length (vLLM's EAGLE-3 config); by default the recipe's ``eval.k``. A target other than
    the one the drafter recorded (``specdraft.target_fingerprint``) is refused unless ``allow_other_target``.
    """
    given, out_dir = Path(run_or_drafter_dir).expanduser(), Path(out_dir).expanduser()
    if num_speculative_tokens is not None and num_speculative_tokens < 1:
        raise SpecdraftError(f"--num-speculative-tokens must be >= 1, got {num_speculative_tokens}")
    source = find_drafter_dir(given)
    saved = read_saved_config(source)
    family = saved.get("family")
    if family is None:
        raise SpecdraftError(f"{source}/config.json names no drafter family; point at a folder save_pretrained wrote")
    exporter = exporter_for(family, fmt)
    if out_dir.exists() and not out_dir.is_dir():
        raise SpecdraftError(f"--out {out_dir} is a file; give a folder path")
    if out_dir.exists() and not overwrite:
        raise SpecdraftError(f"{out_dir} already exists; pass --overwrite to replace it, or choose another --out")
    if out_dir.resolve() == source.resolve() or out_dir.resolve() in source.resolve().parents:
        raise SpecdraftError(f"--out {out_dir} holds the drafter being exported ({source}); choose another --out")
    if out_dir.exists():  # --overwrite replaces an earlier export, never a folder of the user's
        check_replaceable_output(out_dir, EXPORT_OWNER, "--out")

    recipe = _find_recipe(given, source)
    opts = ExportOptions(
        verifier=name_target(verifier or (recipe.get("target") or {}).get("path")
                             or (saved.get("target_config") or {}).get("_name_or_path")),
        num_speculative_tokens=num_speculative_tokens or (recipe.get("eval") or {}).get("k") or 3,
    )
    side = {"format": fmt, "options": asdict(opts), "drafter_config": saved}
    if opts.verifier and Path(opts.verifier).is_dir() and _target_file(opts.verifier, "config.json"):
        # A local target is cheap to check: its embedding alone is read (by offset)
        check_target(saved, read_target_embedding(opts.verifier), source, opts.verifier, allow_other_target)
    if isinstance(exporter, FolderExporter):  # a whole folder (a merged model): the exporter writes it
        need = sum(f.stat().st_size for f in source.iterdir() if f.is_file())
        with writing_export(out_dir, need) as tmp:
            exporter.write(source, tmp, out_dir.resolve(), opts)
            (tmp / SIDE_FILE).write_text(json.dumps(side, indent=2) + "\n")
        return out_dir
    try:
        tensors = load_file(str(source / "model.safetensors"))
    except (SafetensorError, OSError) as e:
        raise SpecdraftError(damaged_drafter_message(source / "model.safetensors", e)) from e
    if exporter.target_embedding:
        if not opts.verifier:
            raise SpecdraftError(
                f"the {fmt} export ships the target's token embedding, and no recipe with target.path was found "
                "next to the drafter: pass --target with the target's folder or hub id."
            )
        tensors[exporter.target_embedding] = _target_embedding(saved, tensors, opts.verifier)
        check_target(saved, tensors[exporter.target_embedding], source, opts.verifier, allow_other_target)
    config, tensors = exporter.write(saved, tensors, opts)
    _write_folder(out_dir, config, tensors, None if exporter is DRAFTER_FOLDER else side, exporter.weights_file)
    return out_dir


def read_saved_config(drafter_dir: Path) -> dict:
    """A saved drafter's config.json; a damaged one is named, with the checkpoint that still holds weights."""
    try:
        return json.loads((drafter_dir / "config.json").read_text())
    except (ValueError, OSError) as e:
        raise SpecdraftError(damaged_drafter_message(drafter_dir / "config.json", e)) from e


def load_exported(path: str | Path, target):
    """Read an exported folder back into a specdraft drafter bound to ``target``.

    The weights are the exported tensors, renamed back (``Exporter.read_back``). The folder must hold
    exactly what ``export`` writes for its drafter (config and tensors), so what an engine reads is
    what was trained, and a shipped embedding must be ``target``'s.
    """
    path = Path(path)
    if not (path / SIDE_FILE).is_file():  # a copy ("hf" of most families) is a drafter folder
        return load_drafter(path, target)
    side = json.loads((path / SIDE_FILE).read_text())
    saved, fmt = side["drafter_config"], side["format"]
    exporter = exporter_for(saved["family"], fmt)
    if isinstance(exporter, FolderExporter):
        raise SpecdraftError(
            f"{path} is a {fmt} export, a whole model rather than a drafter folder: check it with "
            "specdraft.export.check_exported, and load what it holds as its serve hint says."
        )
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(str(path / exporter.weights_file))
    embed = exporter.target_embedding
    if embed and embed not in tensors:
        raise SpecdraftError(f"{path} was changed after export ({embed} is missing). Export it again.")
    weights = exporter.read_back(saved, {k: t for k, t in tensors.items() if k != embed})
    embedding = {embed: tensors[embed]} if embed else {}
    want_config, want_tensors = exporter.write(saved, {**weights, **embedding}, ExportOptions(**side["options"]))
    changed = sorted(k for k in set(config) | set(want_config) if config.get(k) != want_config.get(k))
    changed += sorted(k for k in set(tensors) | set(want_tensors)
                      if k not in tensors or k not in want_tensors or not torch.equal(tensors[k], want_tensors[k]))
    if changed:
        raise SpecdraftError(
            f"{path} was changed after export ({', '.join(changed)} differ from what specdraft writes for its "
            "drafter), so an engine would not run the trained drafter. Export it again."
        )
    # Compared in the export's dtype: a bf16 export of a target read back in fp32 ships the same
    # embedding rounded to bf16, not another target's.
    shipped = tensors.get(embed) if embed else None
    if shipped is not None and not torch.equal(shipped, target.embed_tokens.weight.detach().to("cpu", shipped.dtype)):
        raise SpecdraftError(
            f"{path} ships a token embedding that is not this target's: it was exported for another target. "
            "Load it with the target named at export, or export again with --target."
        )
    with tempfile.TemporaryDirectory() as tmp:
        _write_folder(Path(tmp) / "drafter", saved, weights, None)
        return load_drafter(Path(tmp) / "drafter", target)


def check_exported(path: str | Path, drafter_dir: str | Path) -> None:
    """Raise unless the export at ``path`` is what ``export`` writes for the drafter in ``drafter_dir``
    (a FolderExporter's own check; other formats are read back by ``load_exported``)."""
    path = Path(path)
    side = json.loads((path / SIDE_FILE).read_text())
    exporter = exporter_for(side["drafter_config"]["family"], side["format"])
    if not isinstance(exporter, FolderExporter):
        raise SpecdraftError(f"{path} is a {side['format']} export: read it back with load_exported")
    exporter.check(path, find_drafter_dir(Path(drafter_dir)), ExportOptions(**side["options"]))


# -- the command ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN",
                        help="a run folder (final drafter, else newest checkpoint) or a drafter folder")
    parser.add_argument("--format", required=True, help=f"one of {', '.join(all_formats())}")
    parser.add_argument("--out", required=True, help="the folder to write (must not exist, unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out if an earlier export wrote it (a folder holding anything else is kept)")
    parser.add_argument("--target", "--verifier", dest="verifier",
                        help="the target's folder or hub id (default: the recipe's target.path): exports that "
                             "ship its token embedding read it there, and formats that name the target write it")
    parser.add_argument("--num-speculative-tokens", type=int,
                        help="where a format records a draft length (vLLM EAGLE-3): the value (default: eval.k)")
    parser.add_argument("--allow-other-target", action="store_true",
                        help="export with a target other than the one the drafter was trained for (same shapes, "
                             "other weights), which is refused otherwise")


def run(args: argparse.Namespace) -> int:
    out = export(args.run, args.format, args.out, overwrite=args.overwrite, verifier=args.verifier,
                 num_speculative_tokens=args.num_speculative_tokens, allow_other_target=args.allow_other_target)
    saved = read_saved_config(find_drafter_dir(Path(args.run)))
    print(f"wrote {out}")
    hint = serve_hint(exporter_for(saved["family"], args.format), Path(out), saved)
    if hint:
        print("serve with:\n  " + hint)
    return 0


def serve_hint(exporter, out: Path, saved: dict) -> str | None:
    """The exporter's serve hint for the export at ``out``, with its folder, its target and the drafts per step
    it serves with (``Exporter.draft_length``, else the K the export recorded) filled in."""
    if not exporter.serve_hint:
        return None
    side = json.loads((out / SIDE_FILE).read_text()) if (out / SIDE_FILE).is_file() else {}
    opts = ExportOptions(**side.get("options", {}))
    k = exporter.draft_length(saved, opts) if exporter.draft_length else opts.num_speculative_tokens
    return (exporter.serve_hint.replace("{out}", str(out)).replace("TARGET", opts.verifier or "TARGET")
            .replace("{k+1}", str(k + 1)).replace("{k}", str(k)))
