"""A SIGTERM or Ctrl-C ends the whole command that trains inside (the self-test, the quickstart), with the shell's
code for the signal, after a checkpoint that resumes; training's own stop is tested in test_train.py."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdraft.checkpoint import checkpoint_dirs
from specdraft.config import load_recipe
from specdraft.train import train

# The CLI, with a real signal sent to itself at the 3rd training micro-batch: through every handler a user's
# `kill` or Ctrl-C meets, at a known step.
SIGNAL_AT_THIRD_BATCH = """
import os, signal, sys
from specdraft import train as loop
real, calls = loop.train_micro_batch, [0]
def signalled(run, batch):
    calls[0] += 1
    if calls[0] == 3:
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    return real(run, batch)
loop.train_micro_batch = signalled
from specdraft.cli import main
sys.exit(main(sys.argv[2:]))
"""


def specdraft(tmp_path: Path, signal_name: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    script = tmp_path / "signalled_cli.py"
    script.write_text(SIGNAL_AT_THIRD_BATCH)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(script), signal_name, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path, env=env)


def assert_stopped_after_a_checkpoint(out: subprocess.CompletedProcess, signal_name: str, run_dir: Path) -> None:
    code = 128 + getattr(signal, signal_name)
    assert out.returncode == code, f"exit {out.returncode}, not {code}: {out.stderr[-3000:]}"
    assert f"{signal_name}: stopped at step 3, after its checkpoint in" in out.stderr
    assert "Traceback" not in out.stderr
    state = json.loads((checkpoint_dirs(run_dir)[-1] / "trainer_state.json").read_text())
    assert state["reason"] == "signal" and state["run"]["step"] == 3
    assert not (run_dir / "drafter").exists()  # it stopped: no final drafter, nothing after training ran


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_a_signal_ends_the_selftest_after_a_checkpoint_with_a_report_of_the_checks_done(tmp_path, signal_name):
    out = specdraft(tmp_path, signal_name, "selftest", "--quick", "--families", "eagle3", "--out", "st")
    [run_dir] = (tmp_path / "st").glob("work-*/runs/eagle3")
    assert_stopped_after_a_checkpoint(out, signal_name, run_dir)
    report = json.loads((tmp_path / "st" / "selftest.json").read_text())
    assert [c["name"] for c in report["checks"]] == ["verify: chains", "verify: trees", "verify: exactness"]
    assert "train: eagle3: " + signal_name in out.stdout and "the self-test stops here" in out.stdout


def test_a_sigterm_ends_the_quickstart_after_a_checkpoint_that_resumes(tmp_path, monkeypatch):
    out = specdraft(tmp_path, "SIGTERM", "quickstart", "--out", "qs", "--train-prompts", "8", "--steps", "6",
                    "--eval-prompts", "2", "--heldout-answers", "2")
    run_dir = tmp_path / "qs" / "run"
    assert_stopped_after_a_checkpoint(out, "SIGTERM", run_dir)
    assert not (tmp_path / "qs" / "export").exists()  # the quickstart went no further
    monkeypatch.chdir(tmp_path)  # where the quickstart ran: its recipe's paths are relative to it
    recipe = load_recipe(run_dir / "recipe.yaml", ["eval.enabled=false"])
    assert train(recipe, resume=True, show_progress=False).resolve() == run_dir
    state = json.loads((checkpoint_dirs(run_dir)[-1] / "trainer_state.json").read_text())
    assert state["run"]["step"] == 6 and (run_dir / "drafter" / "config.json").is_file()


def test_a_sigterm_outside_training_ends_the_command_at_once_with_143(tmp_path):
    """Between checks (verifying, decoding), where nothing is saved: the command still ends, 143, in seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    selftest = subprocess.Popen([sys.executable, "-m", "specdraft", "selftest", "--quick", "--out", "st"],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while "verify: chains" not in selftest.stdout.readline():  # the first check's line: between checks now
        assert selftest.poll() is None, selftest.stderr.read()
    selftest.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert selftest.wait(timeout=60) == 143
    assert time.monotonic() - sent < 30
    assert "specdraft selftest: SIGTERM: stopped before it finished" in selftest.stderr.read()
