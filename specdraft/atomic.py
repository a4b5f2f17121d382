"""Write a folder completely, then swap it into place: a crash or a full disk never leaves half a
folder where a good one (or nothing) was."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


def current_umask() -> int:
    """The process's umask (reading it means setting it: set it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def atomic_folder(path: str | Path):
    """Yield a temporary folder beside ``path``; when the block succeeds it replaces ``path``.

    An existing ``path`` is renamed aside first and deleted only after the swap, so at every
    instant either the old or the new folder is complete. On error the temporary folder is removed.
    The folder gets the permissions any tool's ``mkdir`` gives under the user's umask (``mkdtemp``
    alone makes it private, 0700).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        tmp.chmod(0o777 & ~current_umask())
        yield tmp
        move_into_place(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def move_into_place(folder: Path, path: Path) -> None:
    """Rename ``folder`` to ``path``. An existing ``path`` is renamed aside first and deleted only after the
    swap, so at every instant a complete folder is at ``path`` or beside it."""
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        path.rename(old)
        folder.rename(path)
        shutil.rmtree(old)
    else:
        folder.rename(path)


def is_disk_full(error: BaseException) -> bool:
    """Whether a write failed for want of space: an ``OSError`` with ENOSPC/EDQUOT, or a library's
    wrapper of one (torch.save's ``RuntimeError``, safetensors' ``SafetensorError``), which carry
    the message only."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error).lower()
    return "no space left" in text or "disk quota" in text or "file write failed" in text


def describe_bytes(n: int | float) -> str:
    """``1.5 GiB``, ``12.0 MiB``: sizes in messages."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def separate_tensors(tensors: dict) -> dict:
    """Detached, contiguous CPU tensors to write with safetensors, which stores no shared memory: a tensor that
    shares storage with one before it (tied weights) is written as a copy, under its own name, so every name
    a loader may look up is there (vLLM reads index 0 of a tied group and skips the rest; fms-extras'
    from_pretrained fills every name)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu()
        out[name] = tensor.clone() if tensor.data_ptr() in seen else tensor.contiguous()
        seen.add(tensor.data_ptr())
    return out
