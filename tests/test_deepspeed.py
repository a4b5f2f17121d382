"""DeepSpeed ZeRO-2 and ZeRO-3 through the shipped accelerate configs, on two CPU processes.

The launch is the GPU user's command (`accelerate launch --config_file
recipes/accelerate/deepspeed_zero{2,3}.yaml`) with `--num_processes 2` and DS_ACCELERATOR=cpu,
so DeepSpeed runs over gloo. ZeRO only splits where state lives, not the math: two processes with
accumulation 2 must train the weights one plain process trains with accumulation 4.

The first launch on a machine JIT-compiles DeepSpeed's CPU shared-memory comm op (cached in
~/.cache/torch_extensions; a few minutes on 2 cores).
"""

import json
import socket
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from specdraft.checkpoint import _zero_state_classes, checkpoint_dirs
from spine import make_chat_data, make_recipe, run_cli, write_recipe
from tiny import save_tiny_target

ACCELERATE_CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "accelerate"
LAUNCH_TIMEOUT = 900  # includes the one-time op compile on a fresh machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def launch(config: Path, recipe: Path, *flags: str, env: dict | None = None):
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                "--num_processes", "2", "--main_process_port", str(free_port())]
    return run_cli(["train", str(recipe), "--no-progress", *flags], launcher=launcher,
                   env={"DS_ACCELERATOR": "cpu", **(env or {})}, timeout=LAUNCH_TIMEOUT)


def drafter_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "drafter" / "model.safetensors")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Target, data, and the 1-process reference run (accumulation 4)."""
    tmp = tmp_path_factory.mktemp("ds")
    target = save_tiny_target(tmp / "target")
    data = make_chat_data(tmp / "chat.jsonl", n=64)

    def recipe(name: str, grad_accumulation: int) -> Path:
        # noise=0: the probe's augmentation noise draws from per-rank RNG streams, which differ by design.
        raw = make_recipe(tmp / name, target, data, training={"max_steps": 6, "grad_accumulation": grad_accumulation})
        raw["drafter"] = {"family": "probe", "noise": 0.0}
        return write_recipe(tmp / f"{name}.yaml", raw)

    single = run_cli(["train", str(recipe("single", 4)), "--no-progress"])
    assert single.returncode == 0, single.stderr
    return {"tmp": tmp, "recipe": recipe, "reference": drafter_weights(tmp / "single" / "run")}


@pytest.fixture(scope="module")
def zero3_run(setup):
    """A straight ZeRO-3 run with every parameter sharded (persistence threshold 0; DeepSpeed's
    default 1e5 would keep the probe's whole 16k-element head on every process)."""
    tmp = setup["tmp"]
    config = launcher_config(tmp, 3, stage3_param_persistence_threshold=0)
    out = launch(config, setup["recipe"]("zero3", 2))
    assert out.returncode == 0, out.stderr[-5000:]
    return config, tmp / "zero3" / "run"


def assert_two_process_run_matches_reference(run_dir: Path, reference: dict[str, torch.Tensor]) -> None:
    last = checkpoint_dirs(run_dir)[-1]
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["world_size"] == 2, "one process ran: the comparison would prove nothing"
    assert state["run"]["step"] == 6
    # ZeRO checkpoints: one optimizer shard per process, no single optimizer.pt
    assert sorted(p.name for p in last.glob("optimizer*.pt")) == ["optimizer-rank0.pt", "optimizer-rank1.pt"]
    # Both the final drafter and the step-6 checkpoint's (saved right after an optimizer step, when
    # ZeRO-3 has the parameters split; the final one is written after eval, when they may be whole).
    for weights in (drafter_weights(run_dir), drafter_weights(last)):
        assert weights.keys() == reference.keys()
        for name in reference:
            assert weights[name].shape == reference[name].shape, name
            assert torch.allclose(weights[name], reference[name], atol=1e-5, rtol=1e-4), name


def test_zero2_two_processes_match_one_process_with_double_accumulation(setup):
    config = launcher_config(setup["tmp"], 2)
    out = launch(config, setup["recipe"]("zero2", 2))
    assert out.returncode == 0, out.stderr[-5000:]
    assert_two_process_run_matches_reference(setup["tmp"] / "zero2" / "run", setup["reference"])


def test_zero3_two_processes_match_one_process_with_double_accumulation(setup, zero3_run):
    _, run_dir = zero3_run
    assert_two_process_run_matches_reference(run_dir, setup["reference"])
    # The optimizer state really is split: each process holds about half of the fp32 master weights.
    total = sum(t.numel() for t in setup["reference"].values())
    with _zero_state_classes():
        shards = [torch.load(checkpoint_dirs(run_dir)[-1] / f"optimizer-rank{r}.pt", weights_only=True)
                  for r in (0, 1)]
    held = [sum(t.numel() for t in shard["fp32_flat_groups"]) for shard in shards]
    assert all(0 < h < total for h in held) and sum(held) >= total, (held, total)


def test_zero3_resume_after_kill_9_gives_the_same_weights(setup, zero3_run):
    config, straight = zero3_run
    recipe = setup["recipe"]("zero3_killed", 2)
    # Accumulation 2: each process's call 7 is its first micro-batch after the step-3 checkpoint.
    killed = launch(config, recipe, env={"PROBE_KILL_AT_CALL": "7"})
    assert killed.returncode != 0
    run_dir = setup["tmp"] / "zero3_killed" / "run"
    assert [p.name for p in checkpoint_dirs(run_dir)] == ["step-0000003"]
    resumed = launch(config, recipe, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert "resumed from" in resumed.stdout + resumed.stderr

    a, b = drafter_weights(straight), drafter_weights(run_dir)
    for name in a:
        assert torch.equal(a[name], b[name]), name
