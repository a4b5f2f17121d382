"""A saved drafter folder: config.json + model.safetensors, as every family's ``save_pretrained`` writes it
and its loader reads it, and the check that a drafter is loaded onto a target of its dimensions."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..atomic import atomic_folder, separate_tensors
from ..errors import SpecdraftError


def target_config_dict(config) -> dict:
    """The target's full HF config as plain JSON types, so exporters need no target weights."""
    return json.loads(config.to_json_string(use_diff=False))


def write_drafter_folder(path: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """config.json + model.safetensors, written to a temporary folder and renamed into place, so an
    interrupted save never leaves a half-written drafter behind. Every name is written, tied ones as
    copies (``separate_tensors``)."""
    path = Path(path)
    if path.exists() and any(path.iterdir()) and not (path / "config.json").is_file():
        raise SpecdraftError(f"{path} exists and is not a saved drafter; save to a new or empty folder")
    out = separate_tensors(tensors)
    with atomic_folder(path) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        # metadata format=pt: transformers' from_pretrained refuses safetensors files without it
        save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})


def read_drafter_folder(path: str | Path, family: str, family_key: str = "family") -> tuple[dict, dict[str, torch.Tensor]]:
    """The saved config and tensors of a ``family`` drafter (``config[family_key]`` names the family: a
    specdraft folder's "family", an HF-format folder's "model_type")."""
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise SpecdraftError(f"{path} is not a saved drafter (needs config.json and model.safetensors)")
    config = json.loads((path / "config.json").read_text())
    if config.get(family_key) != family:
        raise SpecdraftError(
            f"{path} holds a {config.get('family') or config.get('model_type')!r} drafter, not {family!r}; load it "
            "with specdraft.drafters.load_drafter, which picks the family from config.json"
        )
    return config, load_file(str(path / "model.safetensors"))


def check_same_target(saved: dict, target, path) -> None:
    """A drafter only works with the target (dimensions, vocabulary) it was trained on; the layers it
    reads are added to the target by ``FrozenTarget.require``, which refuses other taps."""
    want = saved["target_config"]
    for key, have in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        if want.get(key) is not None and want[key] != have:
            raise SpecdraftError(
                f"the drafter in {path} was trained for a target with {key}={want[key]}, but this target has "
                f"{have}; load the target the drafter was trained on ({want.get('_name_or_path') or 'see config.json'})"
            )
