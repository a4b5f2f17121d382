"""The recipe's target: what its drafter needs from it, and the target loaded to compute that.

Shared by training (``specdraft.train``) and the offline feature cache (``specdraft.features``).
"""

from __future__ import annotations

from .config import Recipe
from .contract import TargetNeeds
from .drafters import declared_needs, get_family
from .target import FrozenTarget, check_taps, load_target_config, resolve_target_path


def recipe_needs(recipe: Recipe, target_config=None) -> TargetNeeds:
    """What the recipe's drafter needs from its target, from the target's config alone (no weights):
    the family's declaration, with ``target.taps`` in place of its default layers."""
    cfg = recipe.target
    if target_config is None:
        target_config = load_target_config(resolve_target_path(cfg.path, cfg.dtype), cfg.trust_remote_code)
    needs = declared_needs(get_family(recipe.drafter_family), recipe.drafter, target_config, cfg.taps)
    check_taps(needs.taps, target_config.num_hidden_layers)
    return needs


def load_target(recipe: Recipe, device, needs: TargetNeeds) -> FrozenTarget:
    cfg = recipe.target
    return FrozenTarget.from_pretrained(
        resolve_target_path(cfg.path, cfg.dtype), dtype=cfg.dtype, needs=needs,
        trust_remote_code=cfg.trust_remote_code, device=device, attn_implementation=cfg.attn_implementation,
    )
