"""The one training loop: end to end, exact resume, signals, NaN, full disk, trackers."""

import errno
import json
import shutil
import signal
import sys
import warnings
from pathlib import Path

import probe_family  # noqa: F401  (registers the "probe" family)
import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook

from specdraft import checkpoint as ckpt_module
from specdraft import dtypes
from specdraft import train as train_module
from specdraft.checkpoint import checkpoint_dirs, find_drafter_dir
from specdraft.config import parse_recipe
from specdraft.errors import SpecdraftError, StoppedBySignal
from specdraft.optim import make_scheduler
from specdraft.train import train
from spine import (KilledRun, assert_logged_lr_schedule, built_killed_run, make_chat_data,
                   make_recipe, read_metrics, run_cli, write_recipe)
from tiny import save_tiny_target


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("target") / "tiny")


@pytest.fixture
def data(tmp_path):
    return make_chat_data(tmp_path / "chat.jsonl")


def weights(run_dir):
    return load_file(find_drafter_dir(run_dir) / "model.safetensors")


def check_end_to_end_learns_and_writes_a_self_describing_run(tmp_path, target_dir, data):
    # eval_every=1: the held-out loss after every step, on the same batches each time.
    recipe = parse_recipe(make_recipe(tmp_path, target_dir, data, training={"max_steps": 12, "eval_every": 1}))
    run_dir = train(recipe, show_progress=False)
    assert (run_dir / "recipe.yaml").is_file() and (run_dir / "drafter" / "config.json").is_file()
    steps = [int(p.name.split("-")[1]) for p in checkpoint_dirs(run_dir)]
    assert steps == [9, 12]  # keep_last=2 rotated step 3 and 6 away
    state = json.loads((checkpoint_dirs(run_dir)[-1] / "trainer_state.json").read_text())
    assert state["run"]["step"] == 12 and state["world_size"] == 1 and state["run"]["tokens"] > 0
    # It learned: the held-out loss fell between the first and the last step. The probe's noise is
    # off in eval, so weights that never moved (lr 0) give the same loss to the last bit.
    evals = [m["eval/loss"] for m in read_metrics(run_dir) if "eval/loss" in m]
    assert len(evals) == 12
    assert evals[-1] < evals[0], f"the held-out loss did not fall: {evals[0]:.4f} -> {evals[-1]:.4f}"


def test_end_to_end_learns_and_writes_a_self_describing_run(tmp_path, target_dir, data):
    check_end_to_end_learns_and_writes_a_self_describing_run(tmp_path, target_dir, data)


def check_lr_warms_up_linearly_then_decays_on_a_cosine_to_the_floor(tmp_path, target_dir, data):
    lr, warmup, total, floor = 1e-2, 3, 10, 0.1
    raw = make_recipe(tmp_path, target_dir, data, training={"max_steps": total},
                      optimizer={"lr": lr, "warmup_steps": warmup, "min_lr_ratio": floor})
    assert_logged_lr_schedule(train(parse_recipe(raw), show_progress=False), lr, warmup, total, floor)
    # The first step, before any scheduler step, trains at lr 0: the warmup starts from 0.
    scheduler = make_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr), parse_recipe(raw), total)
    assert scheduler.get_last_lr() == [0.0]


def test_lr_warms_up_linearly_then_decays_on_a_cosine_to_the_floor(tmp_path, target_dir, data):
    check_lr_warms_up_linearly_then_decays_on_a_cosine_to_the_floor(tmp_path, target_dir, data)


@pytest.mark.parametrize("max_steps, eval_steps", [(7, [3, 6, 7]), (6, [3, 6])])
def test_eval_runs_every_eval_every_steps_and_once_at_the_end(tmp_path, target_dir, data, max_steps, eval_steps):
    raw = make_recipe(tmp_path, target_dir, data, training={"max_steps": max_steps, "eval_every": 3})
    run_dir = train(parse_recipe(raw), show_progress=False)
    # max_steps=6: the periodic eval at step 6 is the final one; it is not run twice.
    assert [m["step"] for m in read_metrics(run_dir) if "eval/loss" in m] == eval_steps


def check_epochs_count_optimizer_steps_of_grad_accumulation_micro_batches(tmp_path, target_dir, epochs):
    """``training.epochs`` passes over the data, whatever ``grad_accumulation`` is: 27 chats give 24 training rows,
    12 micro-batches of 2 per epoch, so with grad_accumulation 2 one epoch is 6 optimizer steps."""
    data = make_chat_data(tmp_path / "chat.jsonl", n=27)
    raw = make_recipe(tmp_path, target_dir, data, training={"max_steps": None, "epochs": epochs})
    assert raw["training"]["grad_accumulation"] == 2
    probe_family.Probe.calls = 0  # counts training micro-batches
    run_dir = train(parse_recipe(raw), show_progress=False)
    state = json.loads((checkpoint_dirs(run_dir)[-1] / "trainer_state.json").read_text())["run"]
    micro_batches = round(12 * epochs)
    assert probe_family.Probe.calls == micro_batches, \
        f"epochs: {epochs} trained {probe_family.Probe.calls} micro-batches, not {micro_batches}"
    assert state["step"] == micro_batches // 2


@pytest.mark.parametrize("epochs", [1, 1.5])
def test_epochs_count_optimizer_steps_of_grad_accumulation_micro_batches(tmp_path, target_dir, monkeypatch, epochs):
    monkeypatch.setattr(probe_family.Probe, "calls", 0)
    check_epochs_count_optimizer_steps_of_grad_accumulation_micro_batches(tmp_path, target_dir, epochs)


def check_clipping_bounds_the_gradient_the_optimizer_steps_with(tmp_path, target_dir, data, clip):
    """At every optimizer step (after grad_accumulation 2 micro-batches), the gradient is within the limit: its
    norm at most max_grad_norm, or each element at most clip_grad_value. The limits are far below the probe's
    gradients, so they bind on every step; a clip made before the last backward would leave that micro-batch's
    gradient unclipped."""
    limit = 1e-3
    training = {"max_steps": 4, "max_grad_norm": limit if clip == "max_grad_norm" else 0,
                "clip_grad_value": limit if clip == "clip_grad_value" else None}
    seen = []

    def record(optimizer, args, kwargs):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        size = (torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
                if clip == "max_grad_norm" else max(g.abs().max() for g in grads))
        seen.append(size.item())

    hook = register_optimizer_step_pre_hook(record)
    try:
        train(parse_recipe(make_recipe(tmp_path, target_dir, data, training=training)), show_progress=False)
    finally:
        hook.remove()
    assert len(seen) == 4
    # torch's clip_grad_norm_ scales by limit / (norm + 1e-6): a clipped norm is a hair under the limit.
    over = [size for size in seen if size > limit * (1 + 1e-5)]
    assert not over, f"{clip} is {limit}, yet the optimizer stepped with gradients of size {over}"
    assert min(seen) > 0.9 * limit, f"the limit did not bind: {seen}"  # it clipped, so the test can fail


@pytest.mark.parametrize("clip", ["max_grad_norm", "clip_grad_value"])
def test_clipping_bounds_the_gradient_the_optimizer_steps_with(tmp_path, target_dir, data, clip):
    check_clipping_bounds_the_gradient_the_optimizer_steps_with(tmp_path, target_dir, data, clip)


# 27 chats: 24 train (and 3 eval), 12 micro-batches of 2, so with grad_accumulation 2 an epoch is
# 6 steps. The run is killed at the first micro-batch of step 9, so its newest checkpoint is step 8,
# inside epoch 1 (2 steps into it), and the resume carries on across the next epoch boundary (step
# 12 -> 13). Restoring the wrong epoch, data position or RNG then ends with other weights.
KILL_STEPS, KILL_SAVE_EVERY, KILL_AT_STEP = 14, 4, 9


def kill_9_runs(folder: Path) -> KilledRun:
    recipe = make_recipe(folder, folder / "target", folder / "chat.jsonl",
                         training={"max_steps": KILL_STEPS}, checkpoint={"save_every": KILL_SAVE_EVERY})
    accumulation = recipe["training"]["grad_accumulation"]
    return KilledRun(folder, recipe, kill_at_call=(KILL_AT_STEP - 1) * accumulation + 1,
                     checkpoint_step=KILL_AT_STEP - 1)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> KilledRun:
    runs = built_killed_run(tmp_path_factory, "kill-9", kill_9_runs)
    assert [p.name for p in checkpoint_dirs(runs.killed)] == ["step-0000004", "step-0000008"]
    position = json.loads((checkpoint_dirs(runs.killed)[-1] / "trainer_state.json").read_text())["run"]
    assert (position["epoch"], position["batches_in_epoch"]) == (1, 4), "the checkpoint is not inside epoch 1"
    return runs


def test_resume_after_kill_9_gives_identical_weights(killed_run):
    killed_run.check_resume("resumed")


def token_budget_kill_9_runs(folder: Path) -> KilledRun:
    """As ``kill_9_runs``, with batches filled to a token budget: several answers a batch, several epochs
    before the kill, so the resume must draw the same epoch's order and skip the same batches."""
    recipe = make_recipe(folder, folder / "target", folder / "chat.jsonl", training={"max_steps": KILL_STEPS},
                         checkpoint={"save_every": KILL_SAVE_EVERY})
    recipe["data"].update(packing=True, tokens_per_micro_batch=320)
    accumulation = recipe["training"]["grad_accumulation"]
    return KilledRun(folder, recipe, kill_at_call=(KILL_AT_STEP - 1) * accumulation + 1,
                     checkpoint_step=KILL_AT_STEP - 1)


def test_a_token_budget_run_resumes_exactly_after_kill_9_in_a_later_epoch(tmp_path_factory):
    runs = built_killed_run(tmp_path_factory, "kill-9-token-budget", token_budget_kill_9_runs)
    position = json.loads((checkpoint_dirs(runs.killed)[-1] / "trainer_state.json").read_text())["run"]
    assert position["epoch"] >= 1 and position["batches_in_epoch"] > 0, position  # inside a later epoch
    runs.check_resume("resumed")


def check_signal_saves_a_checkpoint_and_exits_with_its_code(tmp_path, target_dir, data, signal_name, env=None):
    """The shell's code for the signal (130 SIGINT, 143 SIGTERM), after a checkpoint at the step it came in."""
    recipe = write_recipe(tmp_path / "r.yaml", make_recipe(tmp_path, target_dir, data,
                                                           training={"max_steps": 50}))
    out = run_cli(["train", str(recipe), "--no-progress"], env={f"PROBE_{signal_name}_AT_CALL": "9", **(env or {})})
    code = 128 + getattr(signal, signal_name)
    assert out.returncode == code, f"{signal_name} did not exit {code}: {out.stderr[-3000:]}"
    last = checkpoint_dirs(tmp_path / "run")[-1]
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["reason"] == "signal" and state["run"]["step"] == 5, "no checkpoint at the signal's step"
    assert f"{signal_name}: stopped at step 5" in out.stderr and "--resume" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_signal_saves_a_checkpoint_and_exits_with_its_code(tmp_path, target_dir, data, signal_name):
    check_signal_saves_a_checkpoint_and_exits_with_its_code(tmp_path, target_dir, data, signal_name)


def reset_accelerate_state():
    """accelerate keeps one state per process, and its mixed precision cannot change once set."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def fresh_accelerate_state():
    """A bf16 run in this process: reset before it, and after it for the next test's fp32 runs."""
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def check_bf16_mixed_precision_trains_and_resumes_exactly(tmp_path, target_dir, data, monkeypatch):
    def run(name, precision, **flags):
        raw = make_recipe(tmp_path / name, target_dir, data, training={"max_steps": 6, "mixed_precision": precision})
        return train(parse_recipe(raw), show_progress=False, **flags)

    straight = weights(run("straight", "bf16"))
    monkeypatch.setattr(probe_family.Probe, "calls", 0)
    monkeypatch.setenv("PROBE_SIGTERM_AT_CALL", "7")  # in step 4: it saves there and raises
    with pytest.raises(StoppedBySignal) as stop:
        run("stopped", "bf16")
    assert stop.value.code == 128 + signal.SIGTERM
    stopped = tmp_path / "stopped" / "run"
    assert [p.name for p in checkpoint_dirs(stopped)] == ["step-0000003", "step-0000004"]
    monkeypatch.delenv("PROBE_SIGTERM_AT_CALL")
    resumed = weights(run("stopped", "bf16", resume=True))
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    # and bf16 was really on: the same run in float32 ends elsewhere
    reset_accelerate_state()
    full = weights(run("fp32", "no"))
    assert any(not torch.equal(straight[name], full[name]) for name in straight), "bf16 changed nothing"


def test_bf16_mixed_precision_trains_and_resumes_exactly(tmp_path, target_dir, data, monkeypatch,
                                                         fresh_accelerate_state):
    check_bf16_mixed_precision_trains_and_resumes_exactly(tmp_path, target_dir, data, monkeypatch)


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


def truncate(path):
    path.write_bytes(path.read_bytes()[:50])


@pytest.mark.parametrize("damage", [
    lambda ckpt: truncate(ckpt / "trained.safetensors"),  # what a resume reads: the trained module's tensors
    # without it the process would resume with the fresh RNG: not an exact resume, so refused
    lambda ckpt: (ckpt / "rng-rank0.pt").unlink(),
], ids=["truncated-weights", "missing-rng"])
def test_resume_without_checkpoint_and_corrupt_checkpoint(tmp_path, target_dir, data, damage):
    recipe = parse_recipe(make_recipe(tmp_path, target_dir, data, training={"max_steps": 3}))
    with pytest.raises(SpecdraftError, match="no checkpoint"):
        train(recipe, resume=True, show_progress=False)
    train(recipe, show_progress=False)
    damage(checkpoint_dirs(tmp_path / "run")[-1])
    with pytest.raises(SpecdraftError, match="corrupt or incomplete"):
        train(recipe, resume=True, show_progress=False)


def test_a_checkpoint_in_the_older_layout_resumes_exactly(tmp_path, target_dir, data):
    """Checkpoints written before the trained tensors had their own file kept them as drafter/model.safetensors
    (or drafter/trained.safetensors): a resume from one reads them there and ends where a straight run does."""
    straight = train(parse_recipe(make_recipe(tmp_path / "straight", target_dir, data)), show_progress=False)
    old = tmp_path / "old" / "run"
    shutil.copytree(straight, old)
    first, *later = checkpoint_dirs(old)
    assert first.name == "step-0000003" and later
    for folder in (*later, old / "drafter"):
        shutil.rmtree(folder)
    (first / "trained.safetensors").unlink()  # the older layout
    published = first / "drafter" / "model.safetensors"
    truncate(published)  # it is what the resume now reads:
    with pytest.raises(SpecdraftError, match="corrupt or incomplete"):
        train(parse_recipe(make_recipe(tmp_path / "old", target_dir, data)), resume=True, show_progress=False)
    shutil.copy2(straight / "checkpoints" / first.name / "drafter" / "model.safetensors", published)
    resumed = train(parse_recipe(make_recipe(tmp_path / "old", target_dir, data)), resume=True, show_progress=False)
    after, before = weights(resumed), weights(straight)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


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


def test_final_acceptance_eval_runs_the_saved_drafter_in_the_decoder(tmp_path, monkeypatch):
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
                   "temperatures": [0.0], "max_new_tokens": 8, "verify_backend": "reference"}
    backends, real_evaluate = [], train_module.evaluate
    monkeypatch.setattr(train_module, "evaluate", lambda *a, **k: backends.append(a[3].verify_backend) or
                        real_evaluate(*a, **k))  # fmt: skip
    run_dir = train(parse_recipe(raw), show_progress=False)
    assert backends == ["reference"]  # eval.verify_backend reached the decoder's evaluate
    result = json.loads(next((run_dir / "eval" / "temperature-0").glob("*.json")).read_text())
    assert set(result["methods"]) == {"plain", "eagle3", "prompt-lookup"}
    assert set(result["methods"]["eagle3"]["by_category"]) == {"a", "b"}
    # temperature 0 through the real decoder: every method emits the target's own greedy tokens
    assert result["greedy_identical"] == {"eagle3": 1.0, "prompt-lookup": 1.0}


def test_without_eval_prompts_the_acceptance_eval_decodes_held_out_samples_up_to_their_answers(tmp_path, capsys):
    """eval.prompts unset: the eval decodes eval.num_prompts held-out samples, each cut before its first answer
    token (what recipes/README.md and config.py promise); with nothing held out it says why it skips."""
    from specdraft.evaluation.suites import heldout_prompts

    target = save_tiny_target(tmp_path / "target", num_hidden_layers=8)
    data = make_chat_data(tmp_path / "chat.jsonl", n=40)
    raw = make_recipe(tmp_path, target, data, training={"max_steps": 2})
    raw["drafter"] = {"family": "medusa1", "num_heads": 2}
    raw["eval"] = {"enabled": True, "num_prompts": 3, "k": 2, "temperatures": [0.0], "max_new_tokens": 6}
    run_dir = train(parse_recipe(raw), show_progress=False)
    assert "acceptance eval: 3 held-out samples of the data" in capsys.readouterr().out
    result = json.loads((run_dir / "eval" / "temperature-0" / "result.json").read_text())
    assert result["config"]["suites"] == ["heldout"] and result["config"]["num_prompts"] == 3
    assert result["greedy_identical"] == {"medusa1": 1.0, "prompt-lookup": 1.0}

    samples = [{"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 0, 1, 1]}, {"input_ids": [1, 2], "loss_mask": [1, 1]}]
    assert [p.ids for p in heldout_prompts(samples, 5)] == [[5, 6, 7], [1]]  # up to the answer; plain text: half
    assert [p.id for p in heldout_prompts(samples * 5, 2)] == ["heldout-0", "heldout-5"]  # spread evenly

    raw["data"]["eval_fraction"] = 0.0
    raw["checkpoint"]["output_dir"] = str(tmp_path / "none-held-out")
    train(parse_recipe(raw), show_progress=False)
    assert "acceptance eval skipped: no held-out samples" in capsys.readouterr().out


@pytest.mark.parametrize("eval_dtype, native, expected", [
    ("auto", True, torch.bfloat16), ("auto", False, torch.float32), ("bfloat16", False, torch.bfloat16)])
def test_the_acceptance_eval_runs_the_target_in_eval_dtype(tmp_path, monkeypatch, eval_dtype, native, expected):
    """A bf16-trained drafter is evaluated in bf16 by default where the CPU computes bf16 natively (AMX,
    AVX512-BF16), in float32 on a CPU that would emulate it, and in the dtype eval.dtype names if it names one."""
    import specdraft.train as train_module

    monkeypatch.setattr(train_module, "cpu_computes_natively", lambda name: native or name in ("float32", torch.float32))

    target = save_tiny_target(tmp_path / "target", num_hidden_layers=8)
    data = make_chat_data(tmp_path / "chat.jsonl", n=16)
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question_id": 0, "category": "a", "turns": ["Tell me a story."]}) + "\n")
    raw = make_recipe(tmp_path, target, data, training={"max_steps": 1})
    raw["target"].update(dtype="bfloat16", taps="auto")
    raw["drafter"] = {"family": "eagle3", "ttt_steps": 2, "draft_vocab_size": 64}
    raw["eval"] = {"enabled": True, "prompts": str(questions), "num_prompts": 1, "k": 2, "temperatures": [0.0],
                   "max_new_tokens": 4, "dtype": eval_dtype}
    seen = []
    real_eval = train_module.acceptance_eval
    monkeypatch.setattr(train_module, "acceptance_eval", lambda recipe, target, drafter, *args, **kwargs: (
        seen.append(target.lm_head.weight.dtype), real_eval(recipe, target, drafter, *args, **kwargs))[1])
    train(parse_recipe(raw), show_progress=False)
    assert seen == [expected]


def no_target_load(*args, **kwargs):
    raise AssertionError("the target's weights were loaded before a cheap check failed")


@pytest.mark.parametrize("edit, message", [
    (lambda raw, tmp: raw["data"].update(path=str(tmp / "missing.jsonl")), r"data file .*missing.jsonl.* does not exist"),
    (lambda raw, tmp: raw["data"].update(eval_path=str(tmp / "held_out.jsonl")),
     r"data file .*held_out.jsonl.* does not exist"),
    (lambda raw, tmp: raw["eval"].update(enabled=True, prompts=str(tmp / "questions.jsonl")),
     r"prompt suite .*questions.jsonl does not exist"),
    (lambda raw, tmp: raw["training"].update(feature_cache=str(tmp / "features")), "no feature cache in"),
    (lambda raw, tmp: raw["target"].update(taps=[1, 2]), r"target.taps is \[1, 2\].*reads no tapped layers"),
    (lambda raw, tmp: raw.update(drafter={"family": "eagle3"}, target={**raw["target"], "taps": [0, 1, 9]}),
     "tap layer 9 is out of range"),
    (lambda raw, tmp: (tmp / "run" / "old").mkdir(parents=True), "already exists; pass --resume"),
    (lambda raw, tmp: (tmp / "run").mkdir() or (tmp / "run" / "recipe.yaml").write_text(yaml.safe_dump(raw)),
     r"before its first checkpoint, so there is nothing to resume\); pass --overwrite"),
], ids=["data", "eval-data", "eval-prompts", "feature-cache", "taps-count", "taps-range", "run-folder",
        "run-folder-without-checkpoint"])
def test_cheap_mistakes_are_reported_before_the_target_loads(tmp_path, target_dir, data, monkeypatch, edit, message):
    monkeypatch.setattr(train_module, "load_target", no_target_load)
    monkeypatch.setattr(train_module.FrozenTarget, "from_pretrained", no_target_load)
    raw = make_recipe(tmp_path, target_dir, data)
    edit(raw, tmp_path)
    with pytest.raises(SpecdraftError, match=message):
        train(parse_recipe(raw), show_progress=False)


def test_the_acceptance_eval_runs_on_the_main_process_alone_after_the_last_barrier(tmp_path, target_dir, data,
                                                                                   monkeypatch):
    """The other processes end while the main one decodes: no barrier (or other collective) waits for it."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    calls = []

    class Accelerator:
        distributed_type = DistributedType.MULTI_CPU

        def __init__(self, main):
            self.is_main_process = main

        def wait_for_everyone(self):
            calls.append("barrier")

        def end_training(self):
            calls.append("end")

        def unwrap_model(self, module):
            return module

    monkeypatch.setattr(train_module, "save", lambda run, reason: calls.append("save"))
    monkeypatch.setattr(train_module, "heldout_loss", lambda run: calls.append("eval loss") or {})
    monkeypatch.setattr(train_module, "load_drafter", lambda *args: None)
    monkeypatch.setattr(train_module, "eval_target", lambda recipe, target: target)
    monkeypatch.setattr(train_module, "acceptance_eval", lambda *args, **kwargs: calls.append("acceptance eval"))
    raw = make_recipe(tmp_path, target_dir, data)
    raw["eval"] = {"enabled": True, "prompts": str(data)}
    for main in (True, False):
        calls.clear()
        run = SimpleNamespace(accelerator=Accelerator(main), recipe=parse_recipe(raw), run_dir=tmp_path / str(main),
                              state=train_module.RunState(step=3), evaluated_at=2, trackers=[], target=None, heldout=None,
                              step_module=SimpleNamespace(save_pretrained=lambda path: None))
        train_module.finish(run, show_progress=False)
        expected = ["save", "eval loss", "barrier"] + (["acceptance eval"] if main else []) + ["end"]
        assert calls == expected, f"main={main}: {calls}"


def test_a_family_that_trains_adapters_in_the_target_cannot_read_cached_features(tmp_path, target_dir, data,
                                                                                 monkeypatch):
    import dataclasses

    from specdraft.contract import TargetNeeds
    from specdraft.drafters import FAMILIES

    adapters = TargetNeeds(final_hidden=True, trains_adapters=True)  # as Medusa-2 will declare
    monkeypatch.setitem(FAMILIES, "probe", dataclasses.replace(FAMILIES["probe"], needs=lambda cfg, config: adapters))
    monkeypatch.setattr(train_module, "load_target", no_target_load)
    raw = make_recipe(tmp_path, target_dir, data, training={"feature_cache": str(tmp_path / "features")})
    with pytest.raises(SpecdraftError, match="trains adapters inside the target.*unset training.feature_cache"):
        train(parse_recipe(raw), show_progress=False)


@pytest.mark.parametrize("argv", [
    ["train", "r.yaml", "--overwrite", "training.max_steps=3", "--no-progress", "data.path=a.jsonl"],
    ["train", "--overwrite", "--no-progress", "r.yaml", "training.max_steps=3", "data.path=a.jsonl"],
])
def test_train_options_may_come_before_or_after_the_recipe_and_its_overrides(monkeypatch, argv):
    # `specdraft train RECIPE --overwrite KEY=VALUE` used to stop with "unrecognized arguments" for every override
    # after the option (argparse's plain parsing ends the positional list at the first option).
    import specdraft.cli_train
    from specdraft.cli import main

    seen = []
    monkeypatch.setattr(specdraft.cli_train, "run", lambda args: seen.append(args) or 0)
    assert main(argv) == 0
    (args,) = seen
    assert (args.recipe, args.overrides) == ("r.yaml", ["training.max_steps=3", "data.path=a.jsonl"])
    assert args.overwrite and args.no_progress and not args.resume


def test_gradient_checkpointing_a_target_the_drafter_runs_without_autograd_is_refused_before_training(
        tmp_path, target_dir, data):
    raw = make_recipe(tmp_path, target_dir, data)
    raw["target"]["gradient_checkpointing"] = True
    recipe = parse_recipe(raw)
    with pytest.raises(SpecdraftError, match="runs the target without autograd.*Remove target.gradient_checkpointing"):
        train(recipe, show_progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_every_log_line_counts_the_tokens_seen_so_far(tmp_path, target_dir, data):
    recipe = parse_recipe(make_recipe(tmp_path, target_dir, data, training={"max_steps": 4, "grad_accumulation": 1}))
    train(recipe, show_progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    seen = [row["train/tokens_seen"] for row in rows if "train/tokens_seen" in row]
    assert len(seen) == 4 and all(a < b for a, b in zip(seen, seen[1:]))
    state = json.loads((checkpoint_dirs(tmp_path / "run")[-1] / "trainer_state.json").read_text())
    assert seen[-1] == state["run"]["tokens"] > 0


class TargetLoadReached(Exception):
    pass


def stop_at_target_load(*args, **kwargs):
    raise TargetLoadReached


@pytest.mark.parametrize("native", [False, True], ids=["emulated", "native"])
def test_half_precision_a_cpu_would_emulate_is_warned_about_with_the_fix(tmp_path, target_dir, data, monkeypatch,
                                                                         fresh_accelerate_state, native):
    # An AVX2-only CPU (no AVX512-BF16 or AMX) runs bf16 matmuls about 60x slower than float32.
    monkeypatch.setattr(dtypes, "cpu_computes_natively", lambda name: native or name in ("float32", torch.float32))
    monkeypatch.setattr(train_module, "load_target", stop_at_target_load)  # the warning comes before the target
    raw = make_recipe(tmp_path, target_dir, data, training={"mixed_precision": "bf16"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TargetLoadReached):
            train(parse_recipe(raw), show_progress=False)
    about = [str(w.message) for w in caught if "no hardware" in str(w.message)]
    if native:
        assert about == []
    else:
        assert len(about) == 1 and about[0].startswith("training.mixed_precision bfloat16: this CPU has no hardware")
        assert "target.dtype=float32 training.mixed_precision='no'" in about[0]


def test_the_loop_reads_nothing_back_from_the_device_between_log_lines(tmp_path, target_dir, data, monkeypatch):
    """A host read (``.item()``, ``bool()``, ``int()``, ``.tolist()``: on CUDA each waits for the device) made by the
    loop itself (specdraft/train.py) happens at log lines and checkpoints, never in every step: a run of 16 steps
    makes exactly as many as a run of 4 with the same log lines (the last step's only)."""
    reads = []

    def counted(name):
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller == train_module.__file__:
                reads.append(name)
            return real(self, *args, **kwargs)
        return read

    for name in ("item", "__bool__", "__int__", "__float__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    made = {}
    for steps in (4, 16):
        reads.clear()
        raw = make_recipe(tmp_path / str(steps), target_dir, data, training={"max_steps": steps, "log_every": 1000},
                          checkpoint={"save_every": 1000})
        train(parse_recipe(raw), show_progress=False)
        made[steps] = list(reads)
    assert made[16] == made[4], made
    assert len(made[4]) <= 4, made  # the last step's log line: losses finite, tokens counted (and the final save)
