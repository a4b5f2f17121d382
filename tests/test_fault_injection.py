"""Faults in every command that writes: a failed rename, a full disk and a kill at a random point.

Each command in WRITERS runs in a working folder that holds the user's files (sentinels, and a folder of
theirs beside the command's output), in a fresh process (tests/fault_launch.py injects the fault). After
each fault the user's files are there byte for byte, the command failed cleanly or finished, and running
it again (resuming where it can) finishes. A new command that writes joins WRITERS:
``test_every_command_that_writes_is_listed`` fails until it does.
"""

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from specdraft.cli import COMMANDS
from spine import make_chat_data, make_recipe, write_recipe
from tiny import save_tiny_target

TESTS = Path(__file__).parent


@dataclass(frozen=True)
class Writer:
    argv: Callable[[dict], list[str]]  # the command line, from the world's paths
    output: str  # what it writes, in the working folder


WRITERS = {
    "export": Writer(lambda w: ["export", w["run"], "--format", "hf", "--out", "exported"], "exported"),
    "eval": Writer(lambda w: ["eval", "--target", w["target"], "--prompt-lookup", "--prompts", w["questions"],
                              "--num-prompts", "1", "--max-new-tokens", "4", "--dtype", "float32", "--no-progress",
                              "--out", "report"], "report"),
    "recipes": Writer(lambda w: ["recipes", "copy", "toy_eagle3", "mine.yaml"], "mine.yaml"),
    "data": Writer(lambda w: ["data", "sample", "--prompts", "6"], "quickstart"),
    "regenerate": Writer(lambda w: ["regenerate", "--target", w["target"], "--data", w["questions"], "--out",
                                    "answers.jsonl", "--max-new-tokens", "4", "--batch-size", "2"], "answers.jsonl"),
    "train": Writer(lambda w: ["train", w["recipe"], "--no-progress"], "run"),
    "cache-features": Writer(lambda w: ["cache-features", w["eagle3_recipe"]], "features"),
}
# Commands that write and run too long to repeat here: their faults are tested where they live.
ELSEWHERE = {
    "quickstart": "tests/test_signals.py (SIGTERM, resume), tests/test_nothing_lost.py (its prompts files)",
    "selftest": "tests/test_signals.py (SIGTERM, SIGINT), tests/test_selftest.py (its --out)",
    "toy-target": "tests/test_toy_target.py (--overwrite), its one atomic_folder (the swap's faults)",
}
READ_ONLY = set()  # every command writes something


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target, chat data, questions, a finished probe run and the recipes the commands read."""
    root = tmp_path_factory.mktemp("faults")
    target = save_tiny_target(root / "target", num_hidden_layers=8)
    data = make_chat_data(root / "chat.jsonl", n=12)
    questions = root / "questions.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [f"Say {i}."]}) + "\n"
                                 for i in range(3)))
    raw = make_recipe(root, target, data, training={"max_steps": 3})
    finished = launch(["train", str(write_recipe(root / "finished.yaml", raw)), "--no-progress"], root)
    assert finished.returncode == 0, finished.stderr[-3000:]
    raw["checkpoint"]["output_dir"] = "run"  # relative: each test's working folder
    eagle3 = make_recipe(root, target, data)
    eagle3["target"]["taps"] = "eagle3"
    eagle3["drafter"] = {"family": "eagle3", "ttt_steps": 2, "draft_vocab_size": 64}
    eagle3["training"]["feature_cache"] = "features"
    return {"target": str(target), "questions": str(questions), "run": str(root / "run"),
            "recipe": str(write_recipe(root / "recipe.yaml", raw)),
            "eagle3_recipe": str(write_recipe(root / "eagle3.yaml", eagle3))}


def launch(argv: list[str], cwd: Path, fault: str = "", kill_after_first_write: random.Random | None = None):
    """The CLI in a fresh process (one torch thread), with FAULT; or killed (-9) at a random point after its
    first write into ``cwd``."""
    env = {**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1", "FAULT": fault,
           "HF_DATASETS_CACHE": str(cwd.parent / "hf-cache")}
    cmd = [sys.executable, str(TESTS / "fault_launch.py"), *argv]
    if kill_after_first_write is None:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    before = set(os.listdir(cwd))
    process = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while process.poll() is None and set(os.listdir(cwd)) == before:
        time.sleep(0.01)
    time.sleep(kill_after_first_write.uniform(0.0, 1.5))
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
    _, stderr = process.communicate(timeout=600)
    return subprocess.CompletedProcess(cmd, process.returncode, "", stderr)


def rerun_as_told(argv: list[str], work: Path):
    """The command again, as a user would run it: and if it is refused naming --resume or --overwrite (a run
    or an output that the fault left behind), with that flag, resume first."""
    done = launch(argv, work)
    for flag in ("--resume", "--overwrite"):
        if done.returncode == 2 and flag in done.stderr:
            return launch([*argv, flag], work)
    return done


def users_files(work: Path) -> dict[str, bytes]:
    """The sentinels: files of the user's in the working folder and in a folder of theirs beside the output."""
    return {str(p.relative_to(work)): p.read_bytes() for p in sorted(work.rglob("*"))
            if p.is_file() and (p.name.startswith("users-") or p.parent.name == "users-folder")}


def workspace(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    (work / "users-folder").mkdir(parents=True)
    (work / "users-notes.md").write_text("my notes\n")
    (work / "users-folder" / "thesis.tex").write_text("\\section{mine}\n")
    (work / "users-folder" / ".bashrc").write_text("export MINE=1\n")
    return work


FAULTS = {
    "failed-rename": {"fault": "rename:1"},
    "full-disk": {"fault": "fsize:4096"},
    "killed": {},
}


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("command", WRITERS)
def test_a_fault_loses_nothing_of_the_users_and_a_rerun_finishes(world, tmp_path, command, fault):
    writer = WRITERS[command]
    work = workspace(tmp_path)
    before = users_files(work)
    argv = writer.argv(world)
    rng = random.Random(f"{command}-{fault}") if fault == "killed" else None
    done = launch(argv, work, FAULTS[fault].get("fault", ""), kill_after_first_write=rng)
    assert users_files(work) == before, f"{command} under {fault} changed the user's files"
    if fault == "full-disk" and done.returncode != 0:  # a full disk is named as one, without a traceback
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        assert any(word in done.stderr for word in ("disk is full", "EFBIG", "File too large")), done.stderr[-3000:]
    if fault == "failed-rename" and done.returncode != 0:  # the device's error, named in one line
        assert "Traceback" not in done.stderr and "(EIO)" in done.stderr, done.stderr[-3000:]
        assert "disk" not in done.stderr.split("(EIO)")[0], done.stderr[-3000:]  # not taken for a full disk
    again = rerun_as_told(argv, work)
    assert again.returncode == 0, f"{command} after {fault}: {again.stderr[-3000:]}"
    assert (work / writer.output).exists()
    assert users_files(work) == before
    assert not [p for p in work.rglob("*.tmp") if p.is_file()], "a temporary file outlived the rerun"


def test_every_command_that_writes_is_listed():
    assert set(COMMANDS) == set(WRITERS) | set(ELSEWHERE) | READ_ONLY


@pytest.mark.parametrize("code", [errno.EIO, errno.EROFS, errno.EACCES])
def test_a_filesystem_that_refuses_a_write_is_named_in_one_line_and_a_bug_keeps_its_traceback(monkeypatch, capsys,
                                                                                                code):
    from specdraft import cli, recipe_files

    def refused(args):
        raise OSError(code, os.strerror(code), "out/model.safetensors")

    monkeypatch.setattr(recipe_files, "run", refused)
    assert cli.main(["recipes"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the filesystem refused at out/model.safetensors" in err
    assert f"({errno.errorcode[code]})" in err and "what it finished is kept" in err

    def bug(args):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "a/path/specdraft/built/wrong")

    monkeypatch.setattr(recipe_files, "run", bug)
    with pytest.raises(FileNotFoundError):
        cli.main(["recipes"])
