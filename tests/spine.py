"""Shared builders for the training-spine tests: a tiny target folder, chat data and a recipe."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tiny import CORPUS

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


def run_cli(args: list[str], env: dict | None = None, launcher: list[str] | None = None, timeout: int = 300):
    """Run the specdraft CLI (with the probe family) in a fresh process."""
    full_env = {**os.environ, "PYTHONPATH": str(TESTS), **(env or {})}
    cmd = (launcher or [sys.executable]) + [str(TESTS / "run_probe_train.py"), *args]
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
