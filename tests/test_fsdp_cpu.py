"""FSDP2 on CPU (gloo, torchrun): the drafter sharded, the frozen target whole on every rank, a sharded
checkpoint, and resumes (on 2 processes, and resharded onto 1) that end at the weights of one process.

tests/fsdp_cpu.py is the runner (see its docstring for what it drives and why accelerate does not).

The second half runs `specdraft train` itself under accelerate's FSDP2 plugin (tests/accelerate_fsdp_cpu.py: the
one field accelerate checks for a GPU set, see its docstring): two processes train the weights of one, checkpoint,
resume exactly, and the FSDP launches specdraft cannot train are refused before training starts.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import probe_family  # noqa: F401  (registers the "probe" family)
import pytest
import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file
from spine import (DDP_ENV, SAME_WEIGHTS_REL, TESTS, assert_same_weights, built_once, ddp_launcher, drafter_weights,
                   free_port, largest_relative_change, make_chat_data, make_recipe, write_recipe)
from tiny import save_tiny_target

import specdraft.train as train_module
from specdraft.checkpoint import checkpoint_dirs
from specdraft.config import load_recipe
from specdraft.errors import SpecdraftError
from specdraft.train import train
from specdraft.train_parts import check_fsdp

STEPS, SAVE_AT = 4, 2


def torchrun(processes: int, recipe: Path, out: Path, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
           str(free_port()), str(TESTS / "fsdp_cpu.py"), str(recipe), str(out), "--steps", str(STEPS), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def build_runs(folder: Path) -> None:
    target = save_tiny_target(folder / "target", num_hidden_layers=4)
    recipe = make_recipe(folder, target, make_chat_data(folder / "chat.jsonl", n=24))
    recipe["drafter"] = {"family": "eagle3", "ttt_steps": 2, "draft_vocab_size": None}
    recipe["target"]["taps"] = [1, 2, 3]
    path = write_recipe(folder / "recipe.yaml", recipe)
    torchrun(2, path, folder / "two", "--save-at", str(SAVE_AT))
    torchrun(1, path, folder / "one")
    torchrun(2, path, folder / "two-resumed", "--resume", str(folder / "two" / f"step-{SAVE_AT}"))
    torchrun(1, path, folder / "one-from-two", "--resume", str(folder / "two" / f"step-{SAVE_AT}"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return built_once(tmp_path_factory, "fsdp-cpu", build_runs)


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "final.safetensors")


def test_the_drafter_is_sharded_and_the_target_stays_whole_on_every_rank(runs):
    report = json.loads((runs / "two" / "report.json").read_text())
    assert report["world"] == 2 and report["drafter_sharded"] and report["target_whole"]
    assert report["drafter_local_numel"] * 2 == report["drafter_numel"]  # each rank holds half the drafter
    # the gathered weights are the drafter's, and nothing of the target
    assert all(name.startswith("trained.") for name in weights(runs / "two"))
    assert report["target_numel"] > 0


def test_the_checkpoint_is_written_in_one_shard_per_process(runs):
    ckpt = runs / "two" / f"step-{SAVE_AT}"
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.parametrize("run", ["one", "two-resumed", "one-from-two"])
def test_two_processes_resumed_and_resharded_end_at_the_weights_of_one(runs, run):
    """Two processes average two half-batches' gradients where one process accumulates them: the same sums,
    here bit for bit; a resume from the step-2 sharded checkpoint, on 2 processes or resharded onto 1, too."""
    expected, actual = weights(runs / "two"), weights(runs / run)
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


def test_training_moved_the_weights(runs):
    """The comparisons above are of trained weights, not of the initial ones."""
    trained, initial = weights(runs / "one"), load_file(runs / "one" / "initial.safetensors")
    assert all(not torch.equal(trained[n], initial[n]) for n in trained if trained[n].is_floating_point())


# -- `specdraft train` under accelerate's FSDP2 plugin ------------------------------------------------------------

ACCEL_STEPS, ACCEL_SAVE_EVERY = 4, 2


def fsdp_train(processes: int, recipe: Path, *arguments: str, env: dict | None = None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
           str(free_port()), str(TESTS / "accelerate_fsdp_cpu.py"), "train", str(recipe), *arguments, "--no-progress"]
    return subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True, timeout=300)


def accelerate_recipe(folder: Path, name: str, accumulation: int, **drafter) -> Path:
    recipe = make_recipe(folder / name, folder / "target", folder / "chat.jsonl",
                         training={"max_steps": ACCEL_STEPS, "grad_accumulation": accumulation,
                                   # element-wise clipping that binds, which accelerate refuses under FSDP
                                   "clip_grad_value": 2e-3, "max_grad_norm": 0.5},
                         checkpoint={"save_every": ACCEL_SAVE_EVERY, "keep_last": 2})
    recipe["drafter"] = {"family": "eagle3", "ttt_steps": 2, "draft_vocab_size": None, **drafter}
    recipe["target"]["taps"] = [1, 2, 3]
    return write_recipe(folder / f"{name}.yaml", recipe)


def build_accelerate_runs(folder: Path) -> None:
    save_tiny_target(folder / "target", num_hidden_layers=4)
    make_chat_data(folder / "chat.jsonl", n=24)
    two = accelerate_recipe(folder, "fsdp", accumulation=1)
    done = fsdp_train(2, two)
    assert done.returncode == 0, done.stderr[-3000:]
    train(load_recipe(accelerate_recipe(folder, "one", accumulation=2)), show_progress=False)
    # The same FSDP run resumed from its step-2 checkpoint, on 2 processes.
    shutil.copytree(folder / "fsdp" / "run", folder / "resumed" / "run")
    resumed = folder / "resumed" / "run"
    shutil.rmtree(resumed / "drafter")
    shutil.rmtree(checkpoint_dirs(resumed)[-1])
    done = fsdp_train(2, two, f"checkpoint.output_dir={resumed}", "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    (folder / "resumed.log").write_text(done.stdout)


@pytest.fixture(scope="module")
def accelerate_runs(tmp_path_factory):
    return built_once(tmp_path_factory, "accelerate-fsdp-cpu", build_accelerate_runs)


def test_accelerate_fsdp_two_processes_train_the_weights_of_one(accelerate_runs):
    """accelerate's FSDP2 on 2 processes, one micro-batch each per step, against 1 process accumulating both:
    the same weights (gradient clipping by value and by norm both in play)."""
    last = checkpoint_dirs(accelerate_runs / "fsdp" / "run")[-1]
    state = json.loads((last / "trainer_state.json").read_text())
    assert (state["world_size"], state["distributed_type"]) == (2, "FSDP"), "the run was not FSDP on 2 processes"
    fsdp, one = drafter_weights(accelerate_runs / "fsdp" / "run"), drafter_weights(accelerate_runs / "one" / "run")
    assert_same_weights(fsdp, one)
    first = load_file(checkpoint_dirs(accelerate_runs / "one" / "run")[0] / "drafter" / "model.safetensors")
    assert largest_relative_change(one, first) > SAME_WEIGHTS_REL  # training moved them: not two idle copies


def test_accelerate_fsdp_checkpoint_is_whole_and_resumes_exactly(accelerate_runs):
    """The checkpoint holds whole tensors (the drafter's and the trained module's) and the optimizer's whole state;
    a 2-process resume from step 2 ends at the straight run's weights, bit for bit."""
    ckpt = checkpoint_dirs(accelerate_runs / "fsdp" / "run")[-1]
    one_ckpt = checkpoint_dirs(accelerate_runs / "one" / "run")[-1]
    whole, reference = load_file(ckpt / "trained.safetensors"), load_file(one_ckpt / "trained.safetensors")
    assert {n: t.shape for n, t in whole.items()} == {n: t.shape for n, t in reference.items()}
    optimizer = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert all(state["exp_avg"].shape == whole[name.removeprefix("trained.")].shape
               for name, state in optimizer["state"].items())
    assert "resumed from" in (accelerate_runs / "resumed.log").read_text()
    straight = drafter_weights(accelerate_runs / "fsdp" / "run")
    resumed = drafter_weights(accelerate_runs / "resumed" / "run")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)


def test_resuming_an_fsdp_checkpoint_with_another_process_count_is_refused_before_loading(accelerate_runs,
                                                                                          tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    shutil.copytree(accelerate_runs / "fsdp" / "run", run_dir)
    recipe = load_recipe(accelerate_runs / "fsdp.yaml", [f"checkpoint.output_dir={run_dir}"])

    def no_load(*args, **kwargs):
        raise AssertionError("the target loaded before the refusal")

    monkeypatch.setattr(train_module, "load_target", no_load)
    with pytest.raises(SpecdraftError, match=r"written by 2 process.*this run has 1.*--num_processes 2"):
        train(recipe, resume=True, show_progress=False)


def test_an_fsdp_checkpoint_resumes_under_ddp_on_as_many_processes(accelerate_runs, tmp_path):
    """Its files are those of a DDP run (whole tensors; the optimizer's state by name, which a plain optimizer
    reads by position): DDP on 2 processes resumes it from step 2 and ends at the FSDP run's weights."""
    run_dir = tmp_path / "run"
    shutil.copytree(accelerate_runs / "fsdp" / "run", run_dir)
    shutil.rmtree(run_dir / "drafter")
    shutil.rmtree(checkpoint_dirs(run_dir)[-1])
    cmd = [*ddp_launcher(2), "-m", "specdraft", "train", str(accelerate_runs / "fsdp.yaml"),
           f"checkpoint.output_dir={run_dir}", "--resume", "--no-progress"]
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **DDP_ENV}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout
    assert_same_weights(drafter_weights(run_dir), drafter_weights(accelerate_runs / "fsdp" / "run"))


def test_a_checkpoint_written_without_fsdp_resumed_under_fsdp_is_refused(accelerate_runs, tmp_path):
    """The other way fails inside torch (a KeyError 'state.0.step' from set_optimizer_state_dict) without the
    check: FSDP loads the optimizer's state by parameter name, which a one-process checkpoint does not save."""
    run_dir = tmp_path / "run"
    shutil.copytree(accelerate_runs / "one" / "run", run_dir)
    done = fsdp_train(1, accelerate_runs / "one.yaml", f"checkpoint.output_dir={run_dir}", "--resume")
    assert done.returncode != 0
    assert "without FSDP, and this run is FSDP" in done.stderr, done.stderr[-3000:]


REFUSED_FSDP_LAUNCHES = {
    # accelerate's size-based policy wraps submodules as FSDP units of their own, gathered only by their own
    # forward: the drafter's methods would meet them sharded (a "mixed torch.Tensor and DTensor" error mid-step)
    "auto_wrap": ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_MIN_NUM_PARAMS": "1000"}, {},
                  "Set fsdp_auto_wrap_policy: NO_WRAP"),
    # transformers would load the target with placeholder weights on every process but the first of a node
    "cpu_ram_efficient_loading": ({"FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}, {},
                                  "Set fsdp_cpu_ram_efficient_loading: false"),
    # Medusa-2's adapters sit inside the target: FSDP would shard the frozen target with them, and the
    # acceptance eval at the end (the main process alone) would meet the target's slices
    "medusa2": ({}, {"family": "medusa2", "num_heads": 2, "num_layers": 1, "draft_vocab_size": None},
                "FSDP would shard the frozen target.*Train it with DDP or DeepSpeed"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_FSDP_LAUNCHES))
def test_fsdp_launches_the_loop_cannot_train_are_refused_before_training(accelerate_runs, tmp_path, case):
    env, drafter, message = REFUSED_FSDP_LAUNCHES[case]
    recipe = make_recipe(tmp_path, accelerate_runs / "target", accelerate_runs / "chat.jsonl",
                         training={"max_steps": 2})
    recipe["drafter"] = drafter or {"family": "eagle3", "ttt_steps": 2, "draft_vocab_size": None}
    recipe["target"]["taps"] = [] if drafter else [1, 2, 3]
    done = fsdp_train(1, write_recipe(tmp_path / "recipe.yaml", recipe), env=env)
    assert done.returncode != 0
    assert re.search(message, done.stderr), done.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before the first step


def test_the_shipped_fsdp_config_on_cpu_processes_is_refused(accelerate_runs, tmp_path):
    """accelerate takes FSDP only for accelerators: on CPU processes it would silently train DDP instead."""
    recipe = make_recipe(tmp_path, accelerate_runs / "target", accelerate_runs / "chat.jsonl")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(TESTS.parent / "recipes" / "accelerate" / "fsdp.yaml"), "--num_processes", "2", "--mixed_precision",
           "no", "--main_process_port", str(free_port()), str(TESTS / "run_probe_train.py"), "train",
           str(write_recipe(tmp_path / "recipe.yaml", recipe)), "--no-progress"]
    done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1", **DDP_ENV},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "accelerate runs FSDP only on GPUs" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_fsdp1_is_refused(monkeypatch):
    """FSDP1 (accelerate's default fsdp_version): its plugin cannot be built on CPU (accelerate asks for a GPU), so
    the check is given what accelerate builds on GPUs, an FSDP state with a version-1 plugin."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    plugin = SimpleNamespace(fsdp_version=1, cpu_ram_efficient_loading=False, auto_wrap_policy=None)
    accelerator = SimpleNamespace(distributed_type=DistributedType.FSDP, state=SimpleNamespace(fsdp_plugin=plugin))
    with pytest.raises(SpecdraftError, match="Set fsdp_version: 2"):
        check_fsdp(accelerator)
    plugin.fsdp_version = 2
    check_fsdp(accelerator)  # the shipped settings pass
