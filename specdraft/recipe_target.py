"""The recipe's target: what its drafter needs from it, and the target loaded to compute that.

Shared by training (``specdraft.train``) and the offline feature cache (``specdraft.features``).
"""

from __future__ import annotations

from .config import Recipe
from .contract import TargetNeeds
from .drafters import declared_needs, get_family
from .errors import SpecdraftError
from .target import FrozenTarget, check_taps, load_target_config, resolve_target_path


def recipe_needs(recipe: Recipe, target_config=None) -> TargetNeeds:
    """What the recipe's drafter needs from its target, from the target's config alone (no weights):
    the family's declaration, with ``target.taps`` in place of its default layers."""
    cfg = recipe.target
    if target_config is None:
        target_config = load_target_config(resolve_target_path(cfg.path, cfg.dtype), cfg.trust_remote_code)
    check_context(recipe.data.max_length, target_config)
    needs = declared_needs(get_family(recipe.drafter_family), recipe.drafter, target_config, cfg.taps)
    check_taps(needs.taps, target_config.num_hidden_layers)
    return needs


def check_context(max_length: int, target_config) -> None:
    """Samples are cut at ``data.max_length`` tokens; one longer than the target's context would run it at positions
    it was never trained for (past its RoPE table), so its features and logits are not the target's."""
    context = getattr(target_config, "max_position_embeddings", None)
    if context is not None and max_length > context:
        raise SpecdraftError(
            f"data.max_length is {max_length} tokens, longer than the target's context of {context} "
            f"(max_position_embeddings): samples that long would run the target past its context. Set data.max_length "
            f"to at most {context}."
        )


def load_target(recipe: Recipe, device, needs: TargetNeeds) -> FrozenTarget:
    cfg = recipe.target
    return FrozenTarget.from_pretrained(
        resolve_target_path(cfg.path, cfg.dtype), dtype=cfg.dtype, needs=needs,
        trust_remote_code=cfg.trust_remote_code, device=device, attn_implementation=cfg.attn_implementation,
    )
