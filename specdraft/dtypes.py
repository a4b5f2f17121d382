"""Dtypes as recipes, saved configs and exports spell them ("bfloat16"), and the torch dtypes they name."""

from __future__ import annotations

import torch

from .errors import SpecdraftError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise SpecdraftError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def export_dtype(saved: dict, tensors: dict) -> str:
    """The dtype the engines run the draft in: the target's, else that of the trained weights."""
    tc = saved.get("target_config") or {}
    floating = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    return tc.get("dtype") or tc.get("torch_dtype") or str(floating).removeprefix("torch.")
