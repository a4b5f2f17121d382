"""transformers' renamed keyword arguments, resolved once per module class.

transformers 5.24 renamed a model's ``past_key_values`` argument to ``cache``: the old name still works
but warns on every forward, and goes in 5.40. specdraft supports releases on both sides of the rename,
so it passes the cache under whichever name the module's forward declares."""

from __future__ import annotations

import functools
import inspect


@functools.lru_cache(maxsize=None)
def _cache_keyword(forward) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_kwargs(module, cache) -> dict:
    """``{name: cache}``, under the name ``module``'s forward takes its KV cache by."""
    return {_cache_keyword(type(module).forward): cache}
