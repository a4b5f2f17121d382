"""eval/gpu_check.sh's launcher check: toy EAGLE-3 trained under `accelerate launch` with a launcher config
(recipes/accelerate/fsdp.yaml, 1 process), saved at half its steps; a copy resumed from that checkpoint must
end with the straight run's weights, bit for bit.

    python eval/fsdp_resume.py --work W                                  # on a GPU: bf16, FSDP
    python eval/fsdp_resume.py --work W --cpu                            # a CPU dry run (float32)

Prints a one-row Markdown table (launcher, steps, seconds, loss, resume verdict) and exits 1 if a run fails
or the weights differ.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from specdraft.selftest import TRAIN_FILES, TRAIN_STEPS as STEPS, Setup, family_recipe, toy_chat_data

REPO = Path(__file__).resolve().parents[1]


# What accelerate makes of the launcher config: printed by a process launched like the training runs.
PROBE = """from accelerate import Accelerator
accelerator = Accelerator()
plugin = getattr(accelerator.state, "fsdp_plugin", None) if accelerator.distributed_type.value == "FSDP" else None
print("DISTRIBUTED", accelerator.distributed_type.value, f"(FSDP version {plugin.fsdp_version})" if plugin else "")
"""


def launch(config: Path, cpu: bool, *program: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
               "1", *(["--cpu"] if cpu else []), *program]  # fmt: skip
    print("+ " + " ".join(command), flush=True)
    env = {**os.environ, **({"ACCELERATE_USE_CPU": "1"} if cpu else {})}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    print(done.stdout[-3000:], done.stderr[-6000:], sep="\n", flush=True)
    return done


def train_run(config: Path, recipe: Path, cpu: bool, resume: bool) -> subprocess.CompletedProcess:
    return launch(config, cpu, "-m", "specdraft", "train", str(recipe), "--no-progress",
                  *(["--resume"] if resume else []))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True)
    parser.add_argument("--config", default=str(REPO / "recipes" / "accelerate" / "fsdp.yaml"))
    parser.add_argument("--cpu", action="store_true", help="a dry run on the CPU, in float32")
    args = parser.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    gpu = not args.cpu
    setup = Setup(torch.device("cuda" if gpu else "cpu"), False, work, "bfloat16" if gpu else "float32",
                  "bf16" if gpu else "no")
    (work / "probe.py").write_text(PROBE)
    probe = launch(Path(args.config), args.cpu, str(work / "probe.py"))
    distributed = next((line.split(" ", 1)[1] for line in probe.stdout.splitlines() if line.startswith("DISTRIBUTED")),
                       "unknown (the probe failed)")
    data = toy_chat_data(work / "chat.jsonl", TRAIN_FILES, 20)
    raw = family_recipe(setup, "eagle3", data, work / "straight", STEPS)
    recipe = work / "straight.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    started = time.perf_counter()
    straight = train_run(Path(args.config), recipe, args.cpu, resume=False)
    seconds = time.perf_counter() - started
    verdict = "the straight run failed"
    if straight.returncode == 0:
        resumed = work / "resumed"
        shutil.copytree(work / "straight", resumed)
        shutil.rmtree(resumed / "drafter")
        shutil.rmtree(resumed / "checkpoints" / f"step-{STEPS:07d}")
        raw["checkpoint"]["output_dir"] = str(resumed)
        (work / "resumed.yaml").write_text(yaml.safe_dump(raw))
        again = train_run(Path(args.config), work / "resumed.yaml", args.cpu, resume=True)
        verdict = "the resumed run failed"
        if again.returncode == 0:
            a = load_file(work / "straight" / "drafter" / "model.safetensors")
            b = load_file(resumed / "drafter" / "model.safetensors")
            differ = [name for name in a if name not in b or not torch.equal(a[name], b[name])]
            verdict = (f"identical ({len(a)} tensors)" if not differ and a.keys() == b.keys()
                       else f"DIFFERENT: {len(differ)} of {len(a)} tensors, e.g. {differ[:3]}")
    config = Path(args.config).resolve()
    shown = config.relative_to(REPO) if config.is_relative_to(REPO) else config
    print(f"\n| launcher | accelerate's distributed type | steps | seconds | resume from step {STEPS // 2} |\n"
          f"|---|---|---:|---:|---|\n| accelerate launch --config_file {shown} --num_processes 1"
          f"{' --cpu' if args.cpu else ''} | {distributed} | {STEPS} | {seconds:.0f} | {verdict} |")
    return 0 if verdict.startswith("identical") else 1


if __name__ == "__main__":
    sys.exit(main())
