"""cuDNN's attention kept out of specdraft's work on CUDA: on shapes that change every call it costs a plan each.

torch 2.11 picks cuDNN's attention first for ``scaled_dot_product_attention`` on Hopper GPUs (the probe below saw
it on an H200; torch's ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` decides, and the environment
variable ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` moves it back). cuDNN builds an execution plan for each new shape
(batch, heads, query and key lengths, mask, strides: ``MHAParams`` in ``aten/src/ATen/native/cudnn/MHA.cpp``)
and caches it per shape. A decode step meets a new key length every step, a verify a new one every round, and a training
batch padded to its longest row a new length every batch: each of those calls builds a plan.

Measured on an H200 (torch 2.11.0+cu130, ``python eval/probe_gpu_decode.py``, eval/gpu/h200-2026-11-28.md):
a bf16 toy decode step took 6.23 ms on a prompt decoded before (its shapes planned), 47.61 ms on prompts of
new lengths, and 7.14 ms on new lengths with cuDNN's attention off. Others saw the same on B200s (a fine-tune
step 0.10 s, 1.05 s on a new batch shape: modelscope/FunASR#3704). Flash and memory-efficient attention plan
nothing, so specdraft decodes, generates and trains on CUDA with those (and math where neither applies).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Device types whose SDPA may pick cuDNN's attention: only there does anything change.
CUDNN_ATTENTION_DEVICE_TYPES = ("cuda",)


@contextmanager
def cudnn_attention_off(device: torch.device | str) -> Iterator[None]:
    """A context in which SDPA never picks cuDNN's attention when ``device`` is a CUDA device (flash,
    memory-efficient or math attention serve instead, as far as the caller allows them); on any other device
    it changes nothing. torch's backend flags are process-wide: only cuDNN's is set on entry, and the caller's
    comes back on exit."""
    if torch.device(device).type not in CUDNN_ATTENTION_DEVICE_TYPES:
        yield
        return
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
