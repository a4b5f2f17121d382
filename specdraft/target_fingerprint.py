"""Which target a drafter was trained for, beyond its shapes.

Two models of the same architecture have the same shapes, so shapes alone let a drafter be exported
with, or evaluated on, another target. The training loop records a probe of the target's token
embedding (64 values spread over the matrix) in the drafter's ``config.json`` under
``target_embedding_probe``; export and eval compare it with the target they are given, and refuse another
one unless told ``--allow-other-target``. The embedding is what an export ships and what every
drafter reads, and it can be read alone from a checkpoint without loading the model. Values are
compared to 1% (a target loaded in another dtype, bf16 for training and float32 for the eval, is
the same target); another model's embedding differs by its whole scale. A drafter saved before
targets were recorded has no probe and is not checked. (Medusa's heads also record a hash of the
whole target, which they check on load: ``specdraft.drafters.medusa.target_fingerprint``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import SpecdraftError

FINGERPRINT_KEY = "target_embedding_probe"
PROBE_VALUES = 64


def embedding_probe(weight: torch.Tensor) -> dict:
    """The fingerprint of a token embedding: its shape and ``PROBE_VALUES`` evenly spaced values."""
    flat = weight.detach().reshape(-1)
    # The positions are computed on the CPU in float32, as every probe recorded so far was, so a GPU run's probe
    # matches a CPU load; clamped, as float32 rounds past the last element from 2^24 values (SmolLM2 has 28M).
    index = torch.linspace(0, flat.numel() - 1, PROBE_VALUES).long().clamp_max(flat.numel() - 1)
    return {"shape": list(weight.shape), "values": flat[index].float().cpu().tolist()}


def same_target(recorded: dict, weight: torch.Tensor) -> bool:
    probe = embedding_probe(weight)
    if probe["shape"] != list(recorded["shape"]):
        return False
    return torch.allclose(torch.tensor(probe["values"]), torch.tensor(recorded["values"]), rtol=1e-2, atol=1e-6)


def record_target(drafter_dir: str | Path, probe: dict) -> None:
    """Add the target's fingerprint to a saved drafter's config.json (inside a folder being written)."""
    config_file = Path(drafter_dir) / "config.json"
    config = json.loads(config_file.read_text())
    config[FINGERPRINT_KEY] = probe
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def check_target(saved_config: dict, weight: torch.Tensor, drafter: str | Path, target: str,
                 allow_other_target: bool = False) -> None:
    """Raise unless ``weight`` (the target's token embedding) is the one the drafter recorded."""
    recorded = saved_config.get(FINGERPRINT_KEY)
    if recorded is None or allow_other_target or weight.device.type == "meta":
        return
    if not same_target(recorded, weight):
        trained_on = (saved_config.get("target_config") or {}).get("_name_or_path") or saved_config.get(
            "_name_or_path")
        hint = f" ({trained_on})" if trained_on else ""
        raise SpecdraftError(
            f"the drafter in {drafter} was trained for another target: the token embedding of {target} is not the "
            f"one it recorded (same shapes, other weights). Use the target it was trained on{hint}, or pass "
            "--allow-other-target if you know they are the same model."
        )
