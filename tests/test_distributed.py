"""Two real CPU processes (gloo DDP through `accelerate launch -m specdraft train`): they train the
same EAGLE-3 weights as one process with twice the gradient accumulation, and a killed two-process
run resumes exactly, every process with its own RNG, or is refused with one process."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import probe_family  # noqa: F401  (registers the "probe" family)
import pytest
import torch
from safetensors.torch import load_file

from specdraft.checkpoint import checkpoint_dirs
from specdraft.config import parse_recipe
from specdraft.errors import SpecdraftError
from specdraft.train import train
from spine import (DDP_ENV, SAME_WEIGHTS_REL, KilledRun, assert_logged_lr_schedule,
                   assert_same_weights, built_killed_run, ddp_launcher, largest_relative_change, make_chat_data,
                   make_recipe, read_metrics, write_recipe)
from tiny import save_tiny_target


def eagle3_recipe(tmp_path, target, data, accumulation):
    recipe = make_recipe(tmp_path, target, data, training={"max_steps": 3, "grad_accumulation": accumulation},
                         checkpoint={"save_every": 1, "keep_last": 3})
    recipe["target"]["taps"] = "eagle3"
    recipe["drafter"] = {"family": "eagle3", "ttt_steps": 2, "draft_vocab_size": 64}
    return write_recipe(tmp_path.with_suffix(".yaml"), recipe)


def launch(args, **env):
    return subprocess.run(args, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, capture_output=True, text=True,
                          timeout=600)


def test_two_process_ddp_equals_one_process_with_double_accumulation(tmp_path):
    target = save_tiny_target(tmp_path / "target", num_hidden_layers=8)
    data = make_chat_data(tmp_path / "chat.jsonl", n=64)
    one = eagle3_recipe(tmp_path / "one", target, data, accumulation=4)
    two = eagle3_recipe(tmp_path / "two", target, data, accumulation=2)

    single = launch([sys.executable, "-m", "specdraft", "train", str(one), "--no-progress"])
    assert single.returncode == 0, single.stderr
    double = launch([*ddp_launcher(2), "-m", "specdraft", "train", str(two), "--no-progress"], **DDP_ENV)
    assert double.returncode == 0, double.stderr

    last = checkpoint_dirs(tmp_path / "two" / "run")[-1]
    assert json.loads((last / "trainer_state.json").read_text())["world_size"] == 2, \
        "accelerate ran one process: the test would prove nothing"
    assert (last / "rng-rank1.pt").is_file()
    a = load_file(tmp_path / "one" / "run" / "drafter" / "model.safetensors")
    b = load_file(tmp_path / "two" / "run" / "drafter" / "model.safetensors")
    first = load_file(checkpoint_dirs(tmp_path / "one" / "run")[0] / "drafter" / "model.safetensors")
    assert_same_weights(b, a)
    # Training moved the weights between step 1 and step 3 by more than that tolerance: the
    # comparison above is not one of two idle copies.
    assert largest_relative_change(a, first) > SAME_WEIGHTS_REL
    # The logged training metrics are means over both processes' micro-batches, as one process
    # logs the mean over all four: process 0's own mean covers only half of them.
    logged = [{m["step"]: m for m in read_metrics(tmp_path / name / "run") if "train/loss" in m}
              for name in ("one", "two")]
    assert logged[0].keys() == logged[1].keys() == {1, 2, 3}
    for step in logged[0]:
        for key in ("train/loss", "train/loss_0", "train/acc_0"):
            assert logged[1][step][key] == pytest.approx(logged[0][step][key], rel=1e-5, abs=1e-7), \
                f"step {step}: two processes logged {key} {logged[1][step][key]}, one process {logged[0][step][key]}"


# 27 chats: 24 train, 12 micro-batches of 2, 6 per process; with grad_accumulation 2 an epoch is
# 3 steps. Killed at the first micro-batch of step 5, the newest checkpoint is step 4, inside epoch 1,
# and the resume crosses into epoch 2 (step 6 -> 7). The probe's noise (on by default) draws from
# each process's own RNG streams, which the resume must restore process by process.
DDP_STEPS, DDP_SAVE_EVERY, DDP_KILL_AT_STEP = 8, 4, 5
DDP_LR, DDP_WARMUP, DDP_FLOOR = 1e-2, 2, 0.1


def ddp_runs(folder: Path) -> KilledRun:
    recipe = make_recipe(folder, folder / "target", folder / "chat.jsonl",
                         optimizer={"lr": DDP_LR, "warmup_steps": DDP_WARMUP, "min_lr_ratio": DDP_FLOOR},
                         training={"max_steps": DDP_STEPS}, checkpoint={"save_every": DDP_SAVE_EVERY})
    accumulation = recipe["training"]["grad_accumulation"]
    return KilledRun(folder, recipe, kill_at_call=(DDP_KILL_AT_STEP - 1) * accumulation + 1,
                     checkpoint_step=DDP_KILL_AT_STEP - 1, launcher=lambda: ddp_launcher(2), env=DDP_ENV)


@pytest.fixture(scope="module")
def ddp_killed_run(tmp_path_factory) -> KilledRun:
    runs = built_killed_run(tmp_path_factory, "ddp-kill-9", ddp_runs)
    (last,) = checkpoint_dirs(runs.killed)
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["world_size"] == 2, "accelerate ran one process: the test would prove nothing"
    assert (state["run"]["epoch"], state["run"]["batches_in_epoch"]) == (1, 2), "the checkpoint is not inside epoch 1"
    return runs


def test_two_process_resume_after_kill_9_restores_every_process_rng(ddp_killed_run):
    # The two processes' streams really differ at the checkpoint, so giving both rank 0's is a bug to see.
    ckpt = checkpoint_dirs(ddp_killed_run.killed)[-1]
    rng = [torch.load(ckpt / f"rng-rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert not torch.equal(rng[0]["torch"], rng[1]["torch"])
    ddp_killed_run.check_resume("resumed")


def ddp_token_budget_runs(folder: Path) -> KilledRun:
    """``ddp_runs`` with batches filled to a token budget: accelerate shards batches of varying sample counts
    between the two processes, and the resume must hand each process the same ones again."""
    runs = ddp_runs(folder)
    runs.recipe["data"].update(packing=True, tokens_per_micro_batch=320)
    return runs


def test_two_processes_at_a_token_budget_resume_exactly_after_kill_9(tmp_path_factory):
    runs = built_killed_run(tmp_path_factory, "ddp-kill-9-token-budget", ddp_token_budget_runs)
    state = json.loads((checkpoint_dirs(runs.killed)[-1] / "trainer_state.json").read_text())
    assert state["world_size"] == 2, "accelerate ran one process: the test would prove nothing"
    assert state["run"]["epoch"] >= 1, state["run"]  # the resume starts in a later epoch's order
    runs.check_resume("resumed")


def test_two_processes_step_the_schedule_once_per_optimizer_step(ddp_killed_run):
    # accelerate's scheduler wrapper would step once per process: two processes, twice as fast.
    assert_logged_lr_schedule(ddp_killed_run.straight, DDP_LR, DDP_WARMUP, DDP_STEPS, DDP_FLOOR)


def test_resuming_a_two_process_checkpoint_with_one_process_is_refused(ddp_killed_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(ddp_killed_run.killed, run_dir)
    recipe = json.loads(json.dumps(ddp_killed_run.recipe))
    recipe["checkpoint"]["output_dir"] = str(run_dir)
    with pytest.raises(SpecdraftError, match=r"written by 2 process.*this run has 1.*--num_processes 2"):
        train(parse_recipe(recipe), resume=True, show_progress=False)
