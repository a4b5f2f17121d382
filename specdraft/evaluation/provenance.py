"""What a measurement ran on, as every eval report names it: the device and dtype, the CPU (its model and whether
it has AMX), specdraft's commit and the date. A speedup means nothing without them: the same eval on one CPU
differs between a dtype the CPU computes natively and one it emulates, and between CPUs."""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

import torch

import specdraft
from specdraft.dtypes import cpu_description, describe_cpu


def source_commit() -> str:
    """specdraft's git commit (with "-dirty" when tracked files differ from it) where it runs from a checkout, else
    its version ("specdraft 0.1.0, not a git checkout")."""
    root = Path(specdraft.__file__).resolve().parent.parent
    if (root / ".git").exists():
        try:
            def git(*args: str) -> str:
                return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True,
                                      timeout=10).stdout.strip()

            commit = git("rev-parse", "--short=12", "HEAD")
            return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
        except (OSError, subprocess.SubprocessError):
            pass
    return f"specdraft {specdraft.__version__}, not a git checkout"


def measured_on(device: torch.device | str, dtype: torch.dtype | str) -> dict:
    """The record every report carries: device, dtype, CPU, GPU (on CUDA), commit, date (UTC) and torch."""
    device = torch.device(device)
    record = {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "cpu": cpu_description(),
        "commit": source_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
    }
    if device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(device)
    return record


def describe_machine(record: dict) -> str:
    """``measured_on``'s record in one line, for the terminal and report.md."""
    where = record.get("gpu") or describe_cpu(record["cpu"])
    return (f"measured on {record['device']} in {record['dtype']}: {where}; commit {record['commit']}; "
            f"{record['date']}; torch {record['torch']}")
