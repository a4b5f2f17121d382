"""Write a folder completely, then swap it into place: a crash or a full disk never leaves half a
folder where a good one (or nothing) was."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_folder(path: str | Path):
    """Yield a temporary folder beside ``path``; when the block succeeds it replaces ``path``.

    An existing ``path`` is renamed aside first and deleted only after the swap, so at every
    instant either the old or the new folder is complete. On error the temporary folder is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old)
        else:
            tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
