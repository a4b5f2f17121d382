"""DeepSpeed ZeRO-2 and ZeRO-3 through the shipped accelerate configs, on two CPU processes.

The launch is the GPU user's command (`accelerate launch --config_file
recipes/accelerate/deepspeed_zero{2,3}.yaml`) with `--num_processes 2` and DS_ACCELERATOR=cpu,
so DeepSpeed runs over gloo. ZeRO only splits where state lives, not the math: two processes with
accumulation 2 must train the weights one plain process trains with accumulation 4.

The first launch on a machine JIT-compiles DeepSpeed's CPU shared-memory comm op (cached in
~/.cache/torch_extensions; a few minutes on 2 cores).
"""

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from specdraft.checkpoint import _zero_state_classes, checkpoint_dirs
from spine import (KilledRun, assert_same_weights, built_once, drafter_weights, free_port,
                   make_chat_data, make_recipe, run_cli, write_recipe)
from tiny import save_tiny_target

ACCELERATE_CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "accelerate"
LAUNCH_TIMEOUT = 900  # includes the one-time op compile on a fresh machine
# 27 chats: 24 train, 12 micro-batches of 2. One process with accumulation 4 and two with 2 both
# make 3 steps an epoch from the same batches (no padding), so the runs stay equal across epoch
# boundaries. The kill falls in step 5, after the step-4 checkpoint inside epoch 1, and the resume
# crosses into epoch 2 (step 6 -> 7).
STEPS, SAVE_EVERY, KILL_AT_STEP = 8, 4, 5


def launcher_config(tmp: Path, stage: int, **zero_overrides) -> Path:
    """The shipped YAML and JSON, with the JSON path made absolute (the YAML's is repo-relative)."""
    ds_config = json.loads((ACCELERATE_CONFIGS / f"zero{stage}.json").read_text())
    ds_config["zero_optimization"].update(zero_overrides)
    (tmp / f"zero{stage}.json").write_text(json.dumps(ds_config))
    launch = yaml.safe_load((ACCELERATE_CONFIGS / f"deepspeed_zero{stage}.yaml").read_text())
    launch["deepspeed_config"]["deepspeed_config_file"] = str(tmp / f"zero{stage}.json")
    path = tmp / f"deepspeed_zero{stage}.yaml"
    path.write_text(yaml.safe_dump(launch))
    return path


def deepspeed_launcher(config: Path) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
            "--num_processes", "2", "--main_process_port", str(free_port())]


DS_ENV = {"DS_ACCELERATOR": "cpu"}


def probe_recipe(folder: Path, name: str, grad_accumulation: int) -> dict:
    """The probe on the target and data under ``folder``, run in ``folder/name``."""
    raw = make_recipe(folder / name, folder / "target", folder / "chat.jsonl",
                      training={"max_steps": STEPS, "grad_accumulation": grad_accumulation},
                      checkpoint={"save_every": SAVE_EVERY})
    # noise=0: the probe's augmentation noise draws from per-rank RNG streams, which differ by design.
    raw["drafter"] = {"family": "probe", "noise": 0.0}
    return raw


@pytest.fixture(scope="module")
def deepspeed_setup(tmp_path_factory):
    """Target, data, and the 1-process reference run (accumulation 4)."""
    def build(folder):
        save_tiny_target(folder / "target")
        make_chat_data(folder / "chat.jsonl", n=27)
        single = run_cli(["train", str(write_recipe(folder / "single.yaml", probe_recipe(folder, "single", 4))),
                          "--no-progress"])
        assert single.returncode == 0, single.stderr

    folder = built_once(tmp_path_factory, "deepspeed", build)
    return {"tmp": folder, "reference": drafter_weights(folder / "single" / "run")}


def zero3_killed_run(deepspeed_setup, folder: Path) -> KilledRun:
    config = folder / "deepspeed_zero3.yaml"  # written by launcher_config when the runs are built
    return KilledRun(folder, probe_recipe(deepspeed_setup["tmp"], "zero3", 2), kill_at_call=(KILL_AT_STEP - 1) * 2 + 1,
                     checkpoint_step=KILL_AT_STEP - 1, launcher=lambda: deepspeed_launcher(config), env=DS_ENV)


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory, deepspeed_setup) -> KilledRun:
    """A straight ZeRO-3 run with every parameter sharded (persistence threshold 0; DeepSpeed's
    default 1e5 would keep the probe's whole 16k-element head on every process), and the same run
    killed in step 5 (accumulation 2: each process's call 9), after the step-4 checkpoint."""
    def build(folder):
        launcher_config(folder, 3, stage3_param_persistence_threshold=0)
        zero3_killed_run(deepspeed_setup, folder).build()

    runs = zero3_killed_run(deepspeed_setup, built_once(tmp_path_factory, "zero3", build))
    (last,) = checkpoint_dirs(runs.killed)
    position = json.loads((last / "trainer_state.json").read_text())["run"]
    assert (position["step"], position["epoch"], position["batches_in_epoch"]) == (4, 1, 2)
    return runs


def assert_two_process_run_matches_reference(run_dir: Path, reference: dict[str, torch.Tensor]) -> None:
    last = checkpoint_dirs(run_dir)[-1]
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["world_size"] == 2, "one process ran: the comparison would prove nothing"
    assert state["run"]["step"] == STEPS
    # ZeRO checkpoints: one optimizer shard per process, no single optimizer.pt
    assert sorted(p.name for p in last.glob("optimizer*.pt")) == ["optimizer-rank0.pt", "optimizer-rank1.pt"]
    # Both the final drafter and the last checkpoint's (saved right after an optimizer step, when
    # ZeRO-3 has the parameters split; the final one is written after eval, when they may be whole).
    for weights in (drafter_weights(run_dir), drafter_weights(last)):
        assert_same_weights(weights, reference)


def test_zero2_two_processes_match_one_process_with_double_accumulation(deepspeed_setup):
    config = launcher_config(deepspeed_setup["tmp"], 2)
    recipe = write_recipe(deepspeed_setup["tmp"] / "zero2.yaml", probe_recipe(deepspeed_setup["tmp"], "zero2", 2))
    out = run_cli(["train", str(recipe), "--no-progress"], launcher=deepspeed_launcher(config), env=DS_ENV,
                  timeout=LAUNCH_TIMEOUT)
    assert out.returncode == 0, out.stderr[-5000:]
    assert_two_process_run_matches_reference(deepspeed_setup["tmp"] / "zero2" / "run", deepspeed_setup["reference"])


def test_zero3_two_processes_match_one_process_with_double_accumulation(deepspeed_setup, zero3_runs):
    run_dir = zero3_runs.straight
    assert_two_process_run_matches_reference(run_dir, deepspeed_setup["reference"])
    # The optimizer state really is split: each process holds about half of the fp32 master weights.
    total = sum(t.numel() for t in deepspeed_setup["reference"].values())
    with _zero_state_classes():
        shards = [torch.load(checkpoint_dirs(run_dir)[-1] / f"optimizer-rank{r}.pt", weights_only=True)
                  for r in (0, 1)]
    held = [sum(t.numel() for t in shard["fp32_flat_groups"]) for shard in shards]
    assert all(0 < h < total for h in held) and sum(held) >= total, (held, total)


def test_zero3_resume_after_kill_9_gives_the_same_weights(zero3_runs):
    zero3_runs.check_resume("resumed")
