"""Dtypes as recipes, saved configs and exports spell them ("bfloat16"), the torch dtypes they name, and the
dtype each device computes fastest in (the one place that asks the CPU)."""

from __future__ import annotations

import platform
from pathlib import Path

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


MIXED_PRECISION_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "no": "float32"}  # accelerate's names
FLOAT32_OVERRIDES = ("target.dtype=float32", "training.mixed_precision='no'")  # a recipe in float32 throughout


def cpu_computes_natively(name: str | torch.dtype) -> bool:
    """Whether this CPU has hardware for ``name``'s matmuls, by oneDNN's own check (AVX512-BF16 or AMX on
    x86, BF16 or FP16 on Arm). Without it torch runs bf16 and fp16 matmuls in scalar fallback code: on an
    AVX2-only CPU (eval/README.md, "Half precision on a CPU without hardware for it"), SmolLM2's bf16 matmuls
    took 28x as long as float32's, its greedy generation 3.2x and its training step 18x."""
    dtype = resolve_dtype(name)
    if dtype != torch.float32 and not torch.backends.mkldnn.is_available():
        return False  # a torch built without oneDNN has only the fallback kernels
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def slow_cpu_dtype_warning(settings: dict[str, str | torch.dtype], fix: str) -> str | None:
    """A warning naming ``fix`` when some of ``settings`` (name -> dtype) ask a CPU for a half precision it
    has no hardware for (``cpu_computes_natively``), else None."""
    slow = {key: str(resolve_dtype(value)).removeprefix("torch.") for key, value in settings.items()
            if not cpu_computes_natively(value)}
    if not slow:
        return None
    asked = ", ".join(f"{key} {dtype}" for key, dtype in slow.items())
    return (f"{asked}: this CPU has no hardware for {' or '.join(sorted(set(slow.values())))} matmuls, so torch "
            f"emulates them, many times slower than float32 (a SmolLM2 training step: 18x on an AVX2 CPU). "
            f"Use float32 here: {fix}")


def default_dtype(device: str | torch.device) -> str:
    """The dtype to decode and answer in when none is asked for: bfloat16 on CUDA and on a CPU with hardware for
    it (AMX or AVX512-BF16, ``cpu_computes_natively``), where a multi-token verify costs little more than a plain
    step; float32 on a CPU that would emulate bf16 in scalar code."""
    if torch.device(device).type != "cpu" or cpu_computes_natively("bfloat16"):
        return "bfloat16"
    return "float32"


def cpu_description(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str | bool]:
    """This CPU's model and its bf16 hardware as a report names them: {"model", "amx", "avx512_bf16",
    "bf16_native"}. The flags come from ``cpuinfo`` (Linux; elsewhere False); ``bf16_native`` is oneDNN's own
    answer, the one every dtype default follows."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "amx": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "bf16_native": cpu_computes_natively("bfloat16")}


def describe_cpu(cpu: dict[str, str | bool]) -> str:
    """``cpu_description``'s record in one phrase: "Intel(R) Xeon(R) Processor (AMX, bf16 native)"."""
    hardware = "AMX" if cpu["amx"] else "AVX512-BF16" if cpu["avx512_bf16"] else "no AMX or AVX512-BF16"
    return f"{cpu['model']} ({hardware}, bf16 {'native' if cpu['bf16_native'] else 'emulated'})"
