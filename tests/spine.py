"""Shared builders for the training-spine tests: a tiny target folder, chat data and a recipe."""

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from tiny import CORPUS, assert_close, save_tiny_target

TESTS = Path(__file__).resolve().parent


def make_chat_data(path: Path, n: int = 48) -> Path:
    lines = []
    for i in range(n):
        user, answer = CORPUS[i % 8], CORPUS[(i * 3 + 1) % 8] + " " + CORPUS[(i + 5) % 8]
        lines.append(json.dumps({"messages": [{"role": "user", "content": user},
                                              {"role": "assistant", "content": answer}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def make_recipe(tmp: Path, target: Path, data: Path, **sections) -> dict:
    recipe = {
        "target": {"path": str(target), "dtype": "float32", "taps": []},
        "drafter": {"family": "probe"},
        "data": {"path": str(data), "max_length": 160, "eval_fraction": 0.1},
        "optimizer": {"lr": 1e-2, "schedule": "cosine", "warmup_steps": 2},
        "training": {"max_steps": 6, "micro_batch_size": 2, "grad_accumulation": 2, "log_every": 1,
                     "eval_batches": 2},
        "checkpoint": {"output_dir": str(tmp / "run"), "save_every": 3, "keep_last": 2},
        "tracking": {"trackers": ["none"]},
        "eval": {"enabled": False},
    }
    for name, values in sections.items():
        recipe[name].update(values)
    return recipe


def write_recipe(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_cli(args: list[str], env: dict | None = None, launcher: list[str] | None = None, timeout: int = 300,
            cwd: Path | None = None):
    """Run the specdraft CLI (with the probe family) in a fresh process, one torch thread per process:
    two shared cores run several of these at once, and the tests compare runs launched alike."""
    full_env = {**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = (launcher or [sys.executable]) + [str(TESTS / "run_probe_train.py"), *args]
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def free_port() -> int:
    """A port no one listens on now, for a launch's rendezvous: a fixed one collides with a
    test running beside it (pytest -n) or anything else on the machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_launcher(num_processes: int = 2) -> list[str]:
    """`accelerate launch` for CPU DDP over gloo (run it with ACCELERATE_USE_CPU=1), on a free port."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(num_processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port())]


DDP_ENV = {"ACCELERATE_USE_CPU": "1"}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def drafter_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(Path(run_dir) / "drafter" / "model.safetensors")


# Two processes sum the same float32 gradients in another order than one process accumulating
# them (a gloo all-reduce of two halves, ZeRO's partitioned reductions): the weights differ by
# rounding, measured at up to 4e-7 of a tensor's largest value in these tests. 1e-5 of that scale
# leaves a wide margin, and a real bug (a lost micro-batch, a doubled lr) moves them far more.
SAME_WEIGHTS_REL = 1e-5


def assert_same_weights(actual: dict, expected: dict, rel: float = SAME_WEIGHTS_REL) -> None:
    """Float tensors equal to ``rel`` of each tensor's scale (tiny.assert_close), others exactly."""
    assert actual.keys() == expected.keys()
    for name in expected:
        assert actual[name].shape == expected[name].shape, name
        if expected[name].is_floating_point():
            assert_close(actual[name], expected[name], rel=rel, what=name)
        else:
            assert torch.equal(actual[name], expected[name]), name


def largest_relative_change(after: dict, before: dict) -> float:
    """How far training moved the float tensors, relative to each one's scale."""
    return max((after[n] - before[n]).abs().max().item() / max(after[n].abs().max().item(), 1e-30)
               for n in after if after[n].is_floating_point())


def warmup_cosine_lr(step: int, lr: float, warmup: int, total: int, floor_ratio: float) -> float:
    """The lr after ``step`` scheduler steps, written out from the recipe's promise (linear warmup
    from 0, then half a cosine down to ``floor_ratio * lr`` at ``total``), not from transformers."""
    if step < warmup:
        return lr * step / warmup
    progress = (step - warmup) / (total - warmup)
    return lr * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def assert_logged_lr_schedule(run_dir: Path, lr: float, warmup: int, total: int, floor_ratio: float) -> None:
    """metrics.jsonl's train/lr at every step follows ``warmup_cosine_lr``. train/lr at step s is
    the lr after s scheduler steps: the one step s + 1 will use."""
    logged = {m["step"]: m["train/lr"] for m in read_metrics(run_dir) if "train/lr" in m}
    assert sorted(logged) == list(range(1, total + 1))
    for step, value in logged.items():
        # The same float64 schedule computed two ways: equal up to rounding of the lr's scale.
        expected = warmup_cosine_lr(step, lr, warmup, total, floor_ratio)
        assert abs(value - expected) <= 1e-9 * lr, f"lr at step {step} is {value}, the schedule says {expected}"


def built_once(tmp_path_factory, name: str, build) -> Path:
    """A folder that ``build(folder)`` fills once per test session, however many pytest-xdist
    workers ask for it: the others wait for it and reuse it. Multi-process runs take most of the
    suite's time, and under `-n 2` a module's fixture would otherwise run on both workers."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # this session's folder, shared by its workers
    folder = base / name
    with FileLock(str(base / f"{name}.lock")):
        if not (folder / ".built").is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a build that failed on another worker
            folder.mkdir()
            build(folder)
            (folder / ".built").touch()
    return folder


def built_killed_run(tmp_path_factory, name: str, killed_run_in, samples: int = 27) -> "KilledRun":
    """A tiny target, ``samples`` chat samples, and the straight and killed runs that
    ``killed_run_in(folder)`` describes, built once per session (``built_once``)."""
    def build(folder):
        save_tiny_target(folder / "target")
        make_chat_data(folder / "chat.jsonl", n=samples)
        killed_run_in(folder).build()

    return killed_run_in(built_once(tmp_path_factory, name, build))


@dataclass
class KilledRun:
    """A recipe run straight through (``straight``), and killed with kill -9 mid-run (``killed``).

    Each ``resume`` works on a copy of the killed folder, so one killed run serves several
    resumes (the real one, and mutants that must be caught).
    """

    tmp: Path
    recipe: dict  # checkpoint.output_dir is set per run
    kill_at_call: int  # the probe's training micro-batch that kills the process
    checkpoint_step: int  # the step of the last checkpoint before the kill: where a resume starts
    launcher: object = None  # () -> launcher argv (a fresh port each launch), or None: one plain process
    env: dict | None = None

    @property
    def straight(self) -> Path:
        return self.tmp / "straight" / "run"

    @property
    def killed(self) -> Path:
        return self.tmp / "killed" / "run"

    def build(self) -> None:
        straight = self._train("straight", [])
        assert straight.returncode == 0, straight.stderr[-5000:]
        killed = self._train("killed", [], {"PROBE_KILL_AT_CALL": str(self.kill_at_call)})
        assert killed.returncode != 0, "the kill did not happen: nothing to resume"

    def resume(self, name: str, env: dict | None = None):
        """Resume a copy of the killed run; returns the finished process and the copy's folder."""
        shutil.copytree(self.killed, self.tmp / name / "run")
        return self._train(name, ["--resume"], env), self.tmp / name / "run"

    def check_resume(self, name: str, env: dict | None = None) -> None:
        """Resume a copy: it must say so, log the remaining steps and end at the straight run's weights."""
        out, run_dir = self.resume(name, env)
        assert out.returncode == 0, out.stderr[-5000:]
        assert_resumed_exactly(self.straight, run_dir, out.stdout + out.stderr, self.checkpoint_step,
                               self.recipe["training"]["max_steps"])

    def _train(self, name: str, flags: list[str], env: dict | None = None):
        recipe = json.loads(json.dumps(self.recipe))
        recipe["checkpoint"]["output_dir"] = str(self.tmp / name / "run")
        path = write_recipe(self.tmp / f"{name}.yaml", recipe)
        launcher = self.launcher() if self.launcher else None
        return run_cli(["train", str(path), "--no-progress", *flags], env={**(self.env or {}), **(env or {})},
                       launcher=launcher, timeout=900)


def assert_resumed_exactly(straight: Path, resumed: Path, output: str, resumed_at: int, total: int) -> None:
    """A resumed run continued the killed one from its checkpoint, said so, and ended where a
    straight run ends. Restarting from step 0 also ends with the straight run's weights (same seed,
    same data), so the log is what tells the two apart."""
    assert re.search(rf"resumed from \S+ at step {resumed_at}\b", output), \
        f"the resumed run did not print that it resumed at step {resumed_at}"
    metrics = read_metrics(resumed)
    events = [m for m in metrics if m.get("event") == "resumed"]
    assert events == [{"step": resumed_at, "event": "resumed", "checkpoint": f"step-{resumed_at:07d}"}], \
        f"metrics.jsonl does not record one resume at step {resumed_at}: {events}"
    after = metrics.index(events[0])
    logged = [m["step"] for m in metrics[after:] if "train/loss" in m]
    assert logged == list(range(resumed_at + 1, total + 1)), f"the resumed run trained steps {logged}"
    a, b = drafter_weights(straight), drafter_weights(resumed)
    assert a.keys() == b.keys()
    differ = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differ, f"resumed weights differ from the straight run's: {differ}"
