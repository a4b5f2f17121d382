"""Write a folder completely, then swap it into place: a crash or a full disk never leaves half a
folder where a good one (or nothing) was; and replace a folder only where the command wrote all of it."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .errors import SpecdraftError

OWNER_FILE = ".specdraft-owner.json"  # which command wrote a folder, and every entry it wrote there


def protected_name(path: Path) -> str | None:
    """What ``path`` is if no command may replace it: the working directory, ``$HOME``, the root, or a folder
    above one of them; else None."""
    where = path.expanduser().resolve()
    protected = {"the working directory": Path.cwd().resolve(), "your home folder": Path.home().resolve(),
                 "the root": Path("/")}
    return next((name for name, folder in protected.items() if folder == where or where in folder.parents), None)


def mark_owner(folder: Path, owner: str, will_write: tuple[str, ...] = ()) -> None:
    """Record in ``folder`` that ``owner`` (a command, "specdraft export") wrote it and every entry it holds now,
    and the entries it ``will_write`` (marked before writing them, a half-written one stays its own), added to
    what ``owner`` recorded there before: ``check_replaceable_output`` then lets ``owner`` replace it, and only it."""
    entries = {p.name for p in folder.iterdir() if p.name != OWNER_FILE and not p.name.startswith(".owner")}
    try:
        earlier = json.loads((folder / OWNER_FILE).read_text())
    except (OSError, ValueError):
        earlier = {}
    if earlier.get("written_by") == owner:
        entries |= set(earlier.get("entries", []))
    tmp = folder / f".owner-{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps({"written_by": owner, "entries": sorted(entries | set(will_write))}, indent=1) + "\n")
        tmp.replace(folder / OWNER_FILE)
    finally:
        tmp.unlink(missing_ok=True)


def check_replaceable_output(path: Path, owner: str, flag: str) -> None:
    """Raise unless ``owner`` may replace (``--overwrite``) or write into the existing folder ``path``: never the
    working directory, ``$HOME``, the root or a folder above them; else an empty folder, or one ``owner`` wrote
    (``mark_owner``) that holds nothing it did not write. Each refusal names the fix."""
    name = protected_name(path)
    if name:
        raise SpecdraftError(f"{flag} {path} is {name} or holds it: {owner} will not write over it. Give a folder "
                             f"of its own, e.g. {flag} reports/NAME.")
    if not path.is_dir() or not any(path.iterdir()):
        return
    try:
        record = json.loads((path / OWNER_FILE).read_text())
    except (OSError, ValueError):
        record = {}
    if record.get("written_by") != owner:
        raise SpecdraftError(f"{flag} {path} holds files that {owner} did not write (it has no {OWNER_FILE} of "
                             f"{owner}'s), so they stay: choose a new or empty {flag}, or move them out.")
    own = set(record.get("entries", [])) | {OWNER_FILE}
    foreign = sorted(p.name for p in path.iterdir() if p.name not in own and not p.name.startswith(".owner-"))
    if foreign:
        listed = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise SpecdraftError(f"{flag} {path} holds files that {owner} did not write ({listed}), so they stay: "
                             f"move them out, or choose a new or empty {flag}.")


def current_umask() -> int:
    """The process's umask (reading it means setting it: set it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def atomic_folder(path: str | Path, owner: str | None = None):
    """Yield a temporary folder beside ``path``; when the block succeeds it replaces ``path``.

    An existing ``path`` is renamed aside first and deleted only after the swap, so at every
    instant either the old or the new folder is complete. On error the temporary folder is removed.
    The folder gets the permissions any tool's ``mkdir`` gives under the user's umask (``mkdtemp``
    alone makes it private, 0700). ``owner`` (a command) is recorded in it (``mark_owner``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        tmp.chmod(0o777 & ~current_umask())
        yield tmp
        if owner:
            mark_owner(tmp, owner)
        move_into_place(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def move_into_place(folder: Path, path: Path) -> None:
    """Rename ``folder`` to ``path``. An existing ``path`` is renamed aside first and deleted only after the
    swap, so at every instant a complete folder is at ``path`` or beside it; if the swap itself fails, the old
    folder is renamed back."""
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        path.rename(old)
        try:
            folder.rename(path)
        except BaseException:
            old.rename(path)
            raise
        shutil.rmtree(old)
    else:
        folder.rename(path)


def disk_full_reason(error: BaseException) -> str | None:
    """Why a write failed for want of room, or None: the disk or a quota is full (ENOSPC, EDQUOT), or a file size
    limit was reached (EFBIG: ``ulimit -f``). Libraries wrap these and keep only the message: torch.save's
    RuntimeError ("unexpected pos": fewer bytes written than asked), safetensors' ("os error 28" / "27")."""
    codes = {errno.ENOSPC: "the disk is full (ENOSPC)", errno.EDQUOT: "the disk quota is full (EDQUOT)",
             errno.EFBIG: "a file size limit was reached (EFBIG; see `ulimit -f`)"}
    if isinstance(error, OSError) and error.errno in codes:
        return codes[error.errno]
    text = str(error).lower()
    if "file write failed" in text or "unexpected pos" in text:  # torch.save's words for either: which applies?
        limited = resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY
        return codes[errno.EFBIG if limited else errno.ENOSPC]
    if "no space left" in text or "os error 28" in text:
        return codes[errno.ENOSPC]
    if "disk quota" in text:
        return codes[errno.EDQUOT]
    if "file too large" in text or "os error 27" in text:
        return codes[errno.EFBIG]
    return None


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
