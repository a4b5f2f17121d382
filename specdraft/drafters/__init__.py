"""Drafter families. The registry is a plain dict: family name -> ``Family`` (``specdraft.contract``).

A family lives in one module of this package; adding one means writing that
module and one line here. ``folder`` is the saved-folder IO every family uses. The training loop, decoder and exporter never
branch on the family.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from safetensors import SafetensorError

from ..checkpoint import damaged_drafter_message
from ..contract import Drafter, Family, TargetNeeds
from ..errors import SpecdraftError
from ..target_fingerprint import check_target

FAMILIES: dict[str, Family] = {}

from .dflash import DFLASH  # noqa: E402
from .distillspec import DISTILLSPEC  # noqa: E402
from .eagle1 import EAGLE1  # noqa: E402
from .eagle3 import EAGLE3  # noqa: E402
from .medusa import MEDUSA1  # noqa: E402
from .medusa2 import MEDUSA2  # noqa: E402
from .mlp_speculator import MLP_SPECULATOR  # noqa: E402

FAMILIES[EAGLE1.name] = EAGLE1
FAMILIES[EAGLE3.name] = EAGLE3
FAMILIES[MEDUSA1.name] = MEDUSA1
FAMILIES[MEDUSA2.name] = MEDUSA2
FAMILIES[MLP_SPECULATOR.name] = MLP_SPECULATOR
FAMILIES[DISTILLSPEC.name] = DISTILLSPEC
FAMILIES[DFLASH.name] = DFLASH


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise SpecdraftError(f"unknown drafter family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def declared_needs(family: Family, cfg, target_config, taps: list[int] | str = "auto") -> TargetNeeds:
    """What a recipe's drafter needs from its target: the family's declaration, with the recipe's
    ``target.taps`` (a list) in place of the layers the family taps by default, one for one."""
    needs = family.needs(cfg, target_config)
    if isinstance(taps, str):  # "auto": the family's own layers
        return needs
    if len(taps) != len(needs.taps):
        reads = f"reads {len(needs.taps)} target layers" if needs.taps else "reads no tapped layers"
        raise SpecdraftError(
            f"target.taps is {taps}, but the {family.name} drafter {reads} (by default {list(needs.taps)}); "
            f"give {len(needs.taps)} layer indices, or target.taps: auto"
        )
    return replace(needs, taps=tuple(taps))


def load_drafter(path: str | Path, target, allow_other_target: bool = False) -> Drafter:
    """Load a drafter saved with ``save_pretrained`` (a folder with config.json + model.safetensors);
    the target then computes what it needs (``FrozenTarget.require``). A drafter that recorded another
    target (``specdraft.target_fingerprint``) is refused unless ``allow_other_target``."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise SpecdraftError(f"{path} is not a saved drafter (no config.json); point at a run's drafter folder")
    try:
        saved = json.loads(config_file.read_text())
    except ValueError as e:
        raise SpecdraftError(damaged_drafter_message(config_file, e)) from e
    check_target(saved, target.embed_tokens.weight, path, target.config._name_or_path or "this target",
                 allow_other_target)
    try:
        drafter = get_family(saved.get("family")).load(path, target)
    except (SafetensorError, OSError) as e:  # a truncated or unreadable weights file
        raise SpecdraftError(damaged_drafter_message(path / "model.safetensors", e)) from e
    target.require(drafter.needs)
    return drafter


__all__ = ["FAMILIES", "declared_needs", "get_family", "load_drafter"]
