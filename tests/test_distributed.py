"""Two real CPU processes (gloo DDP through `accelerate launch -m specdraft train`) train the
same EAGLE-3 weights as one process with twice the gradient accumulation."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdraft.checkpoint import checkpoint_dirs
from spine import make_chat_data, make_recipe, write_recipe
from tiny import save_tiny_target

ACCELERATE = str(Path(sys.executable).with_name("accelerate"))  # the venv's own launcher


def eagle3_recipe(tmp_path, target, data, accumulation):
    recipe = make_recipe(tmp_path, target, data, training={"max_steps": 3, "grad_accumulation": accumulation},
                         checkpoint={"save_every": 1, "keep_last": 3})
    recipe["target"]["taps"] = "eagle3"
    recipe["drafter"] = {"family": "eagle3", "ttt_steps": 2, "draft_vocab_size": 64}
    return write_recipe(tmp_path.with_suffix(".yaml"), recipe)


def launch(args, **env):
    return subprocess.run(args, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)


def test_two_process_ddp_equals_one_process_with_double_accumulation(tmp_path):
    target = save_tiny_target(tmp_path / "target", num_hidden_layers=8)
    data = make_chat_data(tmp_path / "chat.jsonl", n=64)
    one = eagle3_recipe(tmp_path / "one", target, data, accumulation=4)
    two = eagle3_recipe(tmp_path / "two", target, data, accumulation=2)

    single = launch([sys.executable, "-m", "specdraft", "train", str(one), "--no-progress"])
    assert single.returncode == 0, single.stderr
    double = launch([ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                     "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29533",
                     "-m", "specdraft", "train", str(two), "--no-progress"], ACCELERATE_USE_CPU="1")
    assert double.returncode == 0, double.stderr

    last = checkpoint_dirs(tmp_path / "two" / "run")[-1]
    assert json.loads((last / "trainer_state.json").read_text())["world_size"] == 2, \
        "accelerate ran one process: the test would prove nothing"
    assert (last / "rng-rank1.pt").is_file()
    a = load_file(tmp_path / "one" / "run" / "drafter" / "model.safetensors")
    b = load_file(tmp_path / "two" / "run" / "drafter" / "model.safetensors")
    first = load_file(checkpoint_dirs(tmp_path / "one" / "run")[0] / "drafter" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-5, rtol=1e-4), name
    # and training moved the weights between step 1 and step 3: not a comparison of two idle copies
    moved = max((a[n] - first[n]).abs().max().item() for n in a if a[n].is_floating_point())
    assert moved > 1e-4
