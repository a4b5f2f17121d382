"""transformers' renamed keyword arguments and methods, resolved once per module class.

transformers 5.24 renamed a model's ``past_key_values`` argument to ``cache``: the old name still works
but warns on every forward, and goes in 5.40. specdraft supports releases on both sides of the rename,
so it passes the cache under whichever name the module's forward declares. Gradient checkpointing was
renamed activation checkpointing in the same way (the old method warns, and goes in v6)."""

from __future__ import annotations

import functools
import inspect


@functools.lru_cache(maxsize=None)
def _cache_keyword(forward) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_kwargs(module, cache) -> dict:
    """``{name: cache}``, under the name ``module``'s forward takes its KV cache by."""
    return {_cache_keyword(type(module).forward): cache}


def enable_activation_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing of every decoder layer, by the method ``model``'s release has:
    ``activation_checkpointing_enable`` (newer releases, 5.24 among them), else ``gradient_checkpointing_enable``
    (5.17, for one)."""
    enable = getattr(type(model), "activation_checkpointing_enable", None)
    if enable is not None:
        enable(model, activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
