"""What a run folder is, and the rules that keep ``--overwrite`` and ``--resume`` from losing anything.

A run folder holds what ``specdraft train`` writes (``RUN_ENTRIES``, a tracker's folder, and the hidden
temporary folders of atomic writes), with ``recipe.yaml`` naming a drafter family. The rules:

- A folder that exists and is not empty needs ``--resume`` (it must hold a checkpoint) or ``--overwrite``.
- ``--overwrite`` replaces only a run folder, and never the working directory, ``$HOME``, the
  filesystem root, a folder above any of them, or a folder holding the run's own inputs (data, eval
  prompts, feature cache, target): each is refused before anything loads.
- The old run is not deleted up front. Once the new run has loaded everything (target, data, drafter),
  the old folder is renamed aside, to ``.NAME.replaced`` beside it, and the new run starts in its place.
  The old one is deleted when the new run's first checkpoint lands, and renamed back if the new run fails
  before that. A run killed in between (kill -9) leaves both: the next ``specdraft train`` on that folder
  puts the old run back (or, if the new one had reached a checkpoint, finishes the swap), under a lock,
  so processes of one launch cannot race on it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import yaml

from .atomic import move_into_place, protected_name
from .checkpoint import STATE_FILE, checkpoint_dirs
from .config import flatten
from .errors import SpecdraftError

# What the loop writes in a run folder (besides the trackers' folders, see run_entries).
RUN_ENTRIES = frozenset({"recipe.yaml", "metrics.jsonl", "checkpoints", "drafter", "eval", "wandb"})


def aside_path(run_dir: Path) -> Path:
    """Where ``--overwrite`` keeps the old run until the new one's first checkpoint."""
    return run_dir.parent / f".{run_dir.name}.replaced"


def saved_recipe(run_dir: Path) -> dict | None:
    """The recipe a run folder records (``recipe.yaml``), or None if it has none that names a drafter."""
    try:
        recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(recipe, dict) or not isinstance(recipe.get("drafter"), dict) \
            or "family" not in recipe["drafter"]:
        return None
    return recipe


def foreign_entries(run_dir: Path) -> list[str] | None:
    """The entries of ``run_dir`` that ``specdraft train`` did not write; None if it is not a run folder."""
    recipe = saved_recipe(run_dir)
    if recipe is None:
        return None
    tracker_folder = (recipe.get("tracking") or {}).get("project")  # tensorboard logs under project_dir/project
    allowed = RUN_ENTRIES | ({str(tracker_folder)} if tracker_folder else set())
    # atomic_folder's temporary and replaced folders (".drafter.tmp-x", ".drafter.old-pid") after a kill
    hidden = tuple(f".{name}." for name in RUN_ENTRIES)
    return sorted(p.name for p in run_dir.iterdir() if p.name not in allowed and not p.name.startswith(hidden))


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _input_paths(recipe) -> dict[str, Path]:
    """The recipe's inputs that are local paths (a hub id is not a folder on this disk)."""
    inputs = {"data.path": recipe.data.path, "data.eval_path": recipe.data.eval_path,
              "training.feature_cache": recipe.training.feature_cache, "eval.prompts": recipe.eval.prompts,
              "target.path": recipe.target.path, "data.chat_template": recipe.data.chat_template}
    return {key: Path(value).expanduser().resolve() for key, value in inputs.items()
            if value and Path(value).expanduser().exists()}


def check_replaceable(run_dir: Path, recipe) -> None:
    """Raise unless ``--overwrite`` may replace ``run_dir`` (see the module docstring)."""
    where = run_dir.expanduser().resolve()
    name = protected_name(run_dir)
    if name:
        raise SpecdraftError(
            f"--overwrite would replace {run_dir}, which is {name} or holds it: refused. Set "
            "checkpoint.output_dir to a folder of its own (e.g. runs/NAME).")
    for key, path in _input_paths(recipe).items():
        if _inside(path, where):
            raise SpecdraftError(
                f"--overwrite would replace {run_dir}, which holds this run's own input {key} ({path}): refused. "
                "Move the input out of that folder, or set checkpoint.output_dir to another folder.")
    foreign = foreign_entries(run_dir)
    if foreign is None:
        raise SpecdraftError(
            f"{run_dir} is not a specdraft run folder (no recipe.yaml naming a drafter), so --overwrite will not "
            "replace it. Set checkpoint.output_dir to a new folder, or empty that one yourself.")
    if foreign:
        listed = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise SpecdraftError(
            f"{run_dir} holds files specdraft did not write ({listed}), so --overwrite will not replace it. "
            "Move them out, or set checkpoint.output_dir to a new folder.")


@contextmanager
def _locked(run_dir: Path):
    """An exclusive lock on the folder that holds the run folder: the processes of one launch take turns
    (a lock on the folder itself leaves no lock file behind)."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def finish_interrupted_replacement(run_dir: Path) -> str | None:
    """After a kill between ``--overwrite``'s rename aside and the new run's first checkpoint: put the old
    run back (the new one had nothing worth keeping), or, if the new run reached a checkpoint, delete the
    old one as the swap would have. Returns what it did, or None if there was nothing to do."""
    aside = aside_path(run_dir)
    if not aside.is_dir():  # nothing to finish, and no folder made for the lock: a refused run creates nothing
        return None
    with _locked(run_dir):
        if not aside.is_dir():  # another process of the launch finished it
            return None
        if checkpoint_dirs(run_dir):
            shutil.rmtree(aside)
            return (f"removed {aside}: an earlier --overwrite of {run_dir} was interrupted after its new run's first "
                    "checkpoint, so the old run it replaced is no longer needed")
        if run_dir.exists():
            if foreign_entries(run_dir) != []:
                raise SpecdraftError(
                    f"an earlier --overwrite of {run_dir} was interrupted: the run it replaced is in {aside}, and "
                    f"{run_dir} now holds other files. Move them, then `mv {aside} {run_dir}` to get the old run back.")
        move_into_place(aside, run_dir)
        return (f"restored {run_dir}: an earlier --overwrite was interrupted before its new run's first checkpoint, "
                "so the run it was replacing is back in place")


def check_run_dir(recipe, resume: bool, overwrite: bool) -> None:
    """Never clobber a run: an existing non-empty folder needs --resume or --overwrite, and --overwrite
    replaces only what ``check_replaceable`` allows. Runs before anything loads."""
    run_dir = Path(recipe.checkpoint.output_dir)
    if resume and overwrite:
        raise SpecdraftError("--resume and --overwrite contradict each other: pass one of them")
    done = finish_interrupted_replacement(run_dir)
    if done:
        print(done)
    if run_dir.exists() and not run_dir.is_dir():
        raise SpecdraftError(f"checkpoint.output_dir {run_dir} is a file; give a folder path")
    if resume:
        if not checkpoint_dirs(run_dir):
            raise SpecdraftError(f"--resume: no checkpoint in {run_dir}/checkpoints; start without --resume")
        return
    if not (run_dir.is_dir() and any(run_dir.iterdir())):
        return
    if not overwrite:
        if not checkpoint_dirs(run_dir) and saved_recipe(run_dir) is not None:
            raise SpecdraftError(
                f"run folder {run_dir} already exists (the run there stopped before its first checkpoint, so there "
                "is nothing to resume); pass --overwrite to start it again, or set checkpoint.output_dir to a new "
                "folder"
            )
        raise SpecdraftError(
            f"run folder {run_dir} already exists; pass --resume to continue it, --overwrite to replace it, "
            "or set checkpoint.output_dir to a new folder"
        )
    check_replaceable(run_dir, recipe)


class Replacement:
    """``--overwrite``'s swap (main process only): ``begin`` renames the old run aside once everything has
    loaded, ``commit`` deletes it once the new run has a checkpoint, ``undo`` puts it back after a failure."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.aside = Path(run_dir), aside_path(Path(run_dir))
        self.pending = False

    def begin(self) -> None:
        if not (self.run_dir.is_dir() and any(self.run_dir.iterdir())):
            return
        if self.aside.exists():
            raise SpecdraftError(f"{self.aside} exists: an earlier --overwrite kept the old run there; move it away")
        self.run_dir.rename(self.aside)
        self.pending = True

    def commit(self) -> None:
        if self.pending:
            shutil.rmtree(self.aside)
            self.pending = False

    def undo(self) -> None:
        if self.pending:
            if self.run_dir.exists():
                shutil.rmtree(self.run_dir)
            self.aside.rename(self.run_dir)
            self.pending = False


# -- what --resume may change -------------------------------------------------------------------------

# Fields a resumed run may change: they decide what is logged, evaluated and kept, and where, not what is trained.
# training.max_steps may grow (the schedule then decays to the new end); everything else must match the
# checkpoint's recipe, or the resumed run would not be the run its checkpoints describe.
RESUME_MAY_CHANGE = ("training.log_every", "training.eval_every", "training.eval_batches", "training.num_workers",
                     "checkpoint.save_every", "checkpoint.keep_last", "tracking.", "eval.")


def checkpoint_recipe(run_dir: Path, ckpt: Path) -> dict | None:
    """The recipe a checkpoint was trained with: its own record (trainer_state.json), else, for a
    checkpoint written before checkpoints recorded it, the run's recipe.yaml."""
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise SpecdraftError(f"checkpoint {ckpt} is corrupt or incomplete ({STATE_FILE}: {e}). Delete that folder "
                             "to resume from the one before it, or start again with --overwrite.") from e
    return state.get("recipe") or saved_recipe(run_dir)


def resume_changes(recipe, run_dir: Path) -> list[tuple[str, object, object]]:
    """The fields this recipe changes against the newest checkpoint's, as (key, was, now); raises,
    naming them, if any would make the resumed run differ from the one the checkpoint belongs to."""
    ckpt = checkpoint_dirs(run_dir)[-1]
    saved = checkpoint_recipe(run_dir, ckpt)
    if saved is None:
        return []
    # Compared as YAML writes them, so 1e-3 and 0.001, or a tuple and a list, are the same value.
    was = flatten(yaml.safe_load(yaml.safe_dump(saved, sort_keys=False)))
    now = flatten(yaml.safe_load(yaml.safe_dump(recipe.to_dict(), sort_keys=False)))
    # checkpoint.output_dir is not compared: a run folder may be moved or copied, and resumed where it is.
    changes = [(key, was.get(key), now.get(key)) for key in dict.fromkeys([*was, *now])
               if was.get(key) != now.get(key) and key != "checkpoint.output_dir"]
    refused = []
    for key, old, new in changes:
        if key == "training.max_steps":  # may grow: the schedule then decays to the new end
            if not (isinstance(old, int) and isinstance(new, int) and new > old):
                refused.append((key, old, new))
        elif not key.startswith(RESUME_MAY_CHANGE):
            refused.append((key, old, new))
    if refused:
        listed = "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in refused)
        raise SpecdraftError(
            f"--resume: the recipe differs from the one checkpoint {ckpt.name} was trained with, in fields that change "
            f"what is trained ({listed}). Resume with the checkpoint's values, or start a new run (another "
            "checkpoint.output_dir, or --overwrite). A resume may change logging, evaluation, checkpointing and "
            "tracking, and raise training.max_steps.")
    return changes

