"""Drafter families. The registry is a plain dict: family name -> ``Family``.

A family lives in one module of this package; adding one means writing that
module and one line here. The training loop, decoder and exporter never
branch on the family.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import SpecdraftError
from .base import Drafter, DraftSource, Family, LossOutput, Proposal, TargetOutputs

FAMILIES: dict[str, Family] = {}

from .eagle1 import EAGLE1  # noqa: E402
from .eagle3 import EAGLE3  # noqa: E402

FAMILIES[EAGLE1.name] = EAGLE1
FAMILIES[EAGLE3.name] = EAGLE3


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise SpecdraftError(f"unknown drafter family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def load_drafter(path: str | Path, target) -> Drafter:
    """Load a drafter saved with ``save_pretrained`` (a folder with config.json + model.safetensors)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise SpecdraftError(f"{path} is not a saved drafter (no config.json); point at a run's drafter folder")
    family = json.loads(config_file.read_text()).get("family")
    return get_family(family).load(path, target)


__all__ = ["FAMILIES", "Drafter", "DraftSource", "Family", "LossOutput", "Proposal", "TargetOutputs",
           "get_family", "load_drafter"]
