"""Two real CPU processes (gloo DDP through `accelerate launch`) train the same weights as one
process with twice the gradient accumulation."""

import json
import sys
from pathlib import Path

from types import SimpleNamespace

import probe_family
import torch
from safetensors.torch import load_file

from specdraft.checkpoint import checkpoint_dirs
from spine import make_chat_data, make_recipe, run_cli, write_recipe
from tiny import save_tiny_target

ACCELERATE = str(Path(sys.executable).with_name("accelerate"))  # the venv's own launcher


def test_two_process_ddp_equals_one_process_with_double_accumulation(tmp_path):
    target = save_tiny_target(tmp_path / "target")
    data = make_chat_data(tmp_path / "chat.jsonl", n=64)
    # noise=0: the probe's augmentation noise draws from per-rank RNG streams, which differ by design.
    common = {"drafter": {"family": "probe", "noise": 0.0}}
    one = make_recipe(tmp_path / "one", target, data, training={"max_steps": 4, "grad_accumulation": 4})
    two = make_recipe(tmp_path / "two", target, data, training={"max_steps": 4, "grad_accumulation": 2})
    one.update(common)
    two.update(common)

    single = run_cli(["train", str(write_recipe(tmp_path / "one.yaml", one)), "--no-progress"])
    assert single.returncode == 0, single.stderr
    launcher = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29533"]
    double = run_cli(["train", str(write_recipe(tmp_path / "two.yaml", two)), "--no-progress"],
                     env={"ACCELERATE_USE_CPU": "1"}, launcher=launcher)
    assert double.returncode == 0, double.stderr

    state = json.loads((checkpoint_dirs(tmp_path / "two" / "run")[-1] / "trainer_state.json").read_text())
    assert state["world_size"] == 2, "accelerate ran one process: the test would prove nothing"
    assert (checkpoint_dirs(tmp_path / "two" / "run")[-1] / "rng-rank1.pt").is_file()
    a = load_file(tmp_path / "one" / "run" / "drafter" / "model.safetensors")
    b = load_file(tmp_path / "two" / "run" / "drafter" / "model.safetensors")
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-5, rtol=1e-4), name
    # and they moved: the comparison is not between two untouched initialisations
    initial = probe_family.build(SimpleNamespace(hidden_size=64, vocab_size=a["head.weight"].shape[0]),
                                 probe_family.ProbeConfig())
    assert (a["head.weight"] - initial.head.weight).abs().max() > 1e-3
