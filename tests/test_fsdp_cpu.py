"""FSDP2 on CPU (gloo, torchrun): the drafter sharded, the frozen target whole on every rank, a sharded
checkpoint, and resumes (on 2 processes, and resharded onto 1) that end at the weights of one process.

tests/fsdp_cpu.py is the runner (see its docstring for what it drives and why accelerate does not).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from spine import TESTS, built_once, free_port, make_chat_data, make_recipe, write_recipe
from tiny import save_tiny_target

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
