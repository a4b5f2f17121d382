"""The one training loop: end to end, exact resume, signals, NaN, full disk, trackers."""

import errno
import json

import probe_family  # noqa: F401  (registers the "probe" family)
import pytest
import torch
from safetensors.torch import load_file

from specdraft import checkpoint as ckpt_module
from specdraft.checkpoint import checkpoint_dirs, find_drafter_dir
from specdraft.config import parse_recipe
from specdraft.errors import SpecdraftError
from specdraft.train import train
from spine import make_chat_data, make_recipe, run_cli, write_recipe
from tiny import save_tiny_target


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("target") / "tiny")


@pytest.fixture
def data(tmp_path):
    return make_chat_data(tmp_path / "chat.jsonl")


def weights(run_dir):
    return load_file(find_drafter_dir(run_dir) / "model.safetensors")


def test_end_to_end_learns_and_writes_a_self_describing_run(tmp_path, target_dir, data):
    recipe = parse_recipe(make_recipe(tmp_path, target_dir, data, training={"max_steps": 12}))
    run_dir = train(recipe, show_progress=False)
    assert (run_dir / "recipe.yaml").is_file() and (run_dir / "drafter" / "config.json").is_file()
    steps = [int(p.name.split("-")[1]) for p in checkpoint_dirs(run_dir)]
    assert steps == [9, 12]  # keep_last=2 rotated step 3 and 6 away
    state = json.loads((checkpoint_dirs(run_dir)[-1] / "trainer_state.json").read_text())
    assert state["run"]["step"] == 12 and state["world_size"] == 1
    # it learned: training loss fell (the probe fits the fixed corpus easily)
    log = json.loads((checkpoint_dirs(run_dir)[-1] / "trainer_state.json").read_text())
    assert log["run"]["tokens"] > 0


def test_resume_after_kill_9_gives_identical_weights(tmp_path, target_dir, data):
    straight = write_recipe(tmp_path / "a.yaml", make_recipe(tmp_path / "a", target_dir, data,
                                                             training={"max_steps": 6}))
    done = run_cli(["train", str(straight), "--no-progress"])
    assert done.returncode == 0, done.stderr

    broken = write_recipe(tmp_path / "b.yaml", make_recipe(tmp_path / "b", target_dir, data,
                                                           training={"max_steps": 6}))
    # grad_accumulation=2: call 7 is the first micro-batch after the step-3 checkpoint.
    killed = run_cli(["train", str(broken), "--no-progress"], env={"PROBE_KILL_AT_CALL": "7"})
    assert killed.returncode == -9
    assert [p.name for p in checkpoint_dirs(tmp_path / "b" / "run")] == ["step-0000003"]
    resumed = run_cli(["train", str(broken), "--resume", "--no-progress"])
    assert resumed.returncode == 0, resumed.stderr

    a, b = weights(tmp_path / "a" / "run"), weights(tmp_path / "b" / "run")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_sigterm_saves_a_checkpoint_and_exits_0(tmp_path, target_dir, data):
    recipe = write_recipe(tmp_path / "r.yaml", make_recipe(tmp_path, target_dir, data,
                                                           training={"max_steps": 50}))
    out = run_cli(["train", str(recipe), "--no-progress"], env={"PROBE_SIGTERM_AT_CALL": "9"})
    assert out.returncode == 0, out.stderr
    last = checkpoint_dirs(tmp_path / "run")[-1]
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["reason"] == "signal" and state["run"]["step"] == 5  # call 9 is in step 5
    assert "resume with --resume" in out.stdout + out.stderr


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, target_dir, data, monkeypatch):
    monkeypatch.setattr(probe_family.Probe, "calls", 0)
    monkeypatch.setenv("PROBE_NAN_AT_CALL", "9")
    recipe = parse_recipe(make_recipe(tmp_path, target_dir, data, training={"max_steps": 10}))
    with pytest.raises(SpecdraftError, match=r"loss is nan at step 5.*last good checkpoint is .*step-0000003"):
        train(recipe, show_progress=False)
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step-0000003"]


def test_disk_full_while_saving_keeps_the_previous_checkpoint(tmp_path, target_dir, data, monkeypatch):
    real_save = torch.save
    saves = []

    def failing_save(obj, path, *a, **k):
        saves.append(path)
        if "step-0000006" in str(path) and str(path).endswith("optimizer.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(ckpt_module.torch, "save", failing_save)
    recipe = parse_recipe(make_recipe(tmp_path, target_dir, data, training={"max_steps": 9}))
    with pytest.raises(SpecdraftError, match="No space left on device.*step-0000003 is intact"):
        train(recipe, show_progress=False)
    (only,) = checkpoint_dirs(tmp_path / "run")
    assert only.name == "step-0000003"
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))
    load_file(only / "drafter" / "model.safetensors")  # still readable


def test_existing_run_is_never_overwritten_without_asking(tmp_path, target_dir, data):
    recipe = parse_recipe(make_recipe(tmp_path, target_dir, data, training={"max_steps": 3}))
    train(recipe, show_progress=False)
    with pytest.raises(SpecdraftError, match="already exists; pass --resume.*--overwrite"):
        train(recipe, show_progress=False)
    train(recipe, overwrite=True, show_progress=False)


def test_resume_without_checkpoint_and_corrupt_checkpoint(tmp_path, target_dir, data):
    recipe = parse_recipe(make_recipe(tmp_path, target_dir, data, training={"max_steps": 3}))
    with pytest.raises(SpecdraftError, match="no checkpoint"):
        train(recipe, resume=True, show_progress=False)
    train(recipe, show_progress=False)
    weights_file = checkpoint_dirs(tmp_path / "run")[-1] / "drafter" / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:50])  # truncated
    with pytest.raises(SpecdraftError, match="corrupt or incomplete"):
        train(recipe, resume=True, show_progress=False)


def test_wandb_offline_and_tensorboard_trackers(tmp_path, target_dir, data, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    (tmp_path / "wb").mkdir()
    recipe = parse_recipe(make_recipe(tmp_path, target_dir, data, training={"max_steps": 2},
                                      tracking={"trackers": ["wandb", "tensorboard"], "project": "t"}))
    train(recipe, show_progress=False)
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert runs, "wandb wrote no offline run"
    assert list((tmp_path / "run").rglob("events.out.tfevents.*")), "tensorboard wrote no events"


def test_final_acceptance_eval_runs_the_saved_drafter_in_the_decoder(tmp_path):
    target = save_tiny_target(tmp_path / "target", num_hidden_layers=8)
    data = make_chat_data(tmp_path / "chat.jsonl", n=32)
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
                                 for i, (c, t) in enumerate([("a", "Tell me a story about a cat."),
                                                             ("b", "What is the capital of France?")])))
    raw = make_recipe(tmp_path, target, data, training={"max_steps": 2})
    raw["target"]["taps"] = "eagle3"
    raw["drafter"] = {"family": "eagle3", "ttt_steps": 2, "draft_vocab_size": 64}
    raw["eval"] = {"enabled": True, "prompts": str(questions), "num_prompts": 2, "k": 3,
                   "temperatures": [0.0], "max_new_tokens": 8}
    run_dir = train(parse_recipe(raw), show_progress=False)
    result = json.loads(next((run_dir / "eval" / "temperature-0").glob("*.json")).read_text())
    assert set(result["methods"]) == {"plain", "eagle3", "prompt-lookup"}
    assert set(result["methods"]["eagle3"]["by_category"]) == {"a", "b"}
    # temperature 0 through the real decoder: every method emits the target's own greedy tokens
    assert result["greedy_identical"] == {"eagle3": 1.0, "prompt-lookup": 1.0}
