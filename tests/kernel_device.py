"""Where the kernel tests run the Triton kernels: compiled on CUDA when a GPU is present, else on CPU under the
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 only then)."""

import functools

import torch

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_kernel_device(fn):
    """``fn`` (verify_triton or verify_tree_triton) with its tensor arguments moved to KERNEL_DEVICE and its
    outputs brought back to the CPU, so a test builds its inputs on the CPU either way."""

    def move(value):
        return value.to(KERNEL_DEVICE) if isinstance(value, torch.Tensor) else value

    @functools.wraps(fn)
    def run(*args, **kwargs):
        out = fn(*map(move, args), **{name: move(value) for name, value in kwargs.items()})
        return tuple(t.cpu() for t in out)

    return run
