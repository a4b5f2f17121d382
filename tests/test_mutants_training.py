"""Tests of the training tests: each mutant is a bug a check claims to catch, injected on purpose.

The check must fail on it, and with the assertion that names that bug. In-process mutants are
monkeypatched here; mutants of a subprocess run are named by PROBE_MUTANT, which
tests/run_probe_train.py applies before the CLI starts. The killed runs these resume are built
once per session (spine.built_once) and shared with the tests they check.
"""

import probe_family  # noqa: F401  (registers the "probe" family)
import pytest
from mutation import mutate
from transformers import get_scheduler

from specdraft import features as features_module
from specdraft import optim as optim_module
from specdraft import train as train_module
from test_deepspeed import deepspeed_setup, zero3_runs  # noqa: F401  (fixtures)
from test_distributed import ddp_killed_run  # noqa: F401  (a fixture)
from test_features import check_a_cache_of_another_target_is_refused
from test_train import (  # noqa: F401  (data, fresh_accelerate_state, killed_run, target_dir: fixtures)
    check_bf16_mixed_precision_trains_and_resumes_exactly, check_clipping_bounds_the_gradient_the_optimizer_steps_with,
    check_end_to_end_learns_and_writes_a_self_describing_run,
    check_epochs_count_optimizer_steps_of_grad_accumulation_micro_batches,
    check_lr_warms_up_linearly_then_decays_on_a_cosine_to_the_floor,
    check_signal_saves_a_checkpoint_and_exits_with_its_code, data, fresh_accelerate_state, killed_run, target_dir)


@pytest.mark.parametrize("mutant, failure", [
    # Same seed, same data: starting over ends with the straight run's weights; only the log tells.
    ("resume_from_scratch", "did not print that it resumed at step 8"),
    ("lose_data_position", "resumed weights differ"),
    ("lose_epoch", "resumed weights differ"),
    ("skip_rng_restore", "resumed weights differ"),
    ("torch_rng_only", "resumed weights differ"),
])
def test_kill_9_resume_check_catches(killed_run, mutant, failure):
    with pytest.raises(AssertionError, match=failure):
        killed_run.check_resume(mutant, env={"PROBE_MUTANT": mutant})


def test_two_process_resume_check_catches_every_process_getting_rank_0s_rng(ddp_killed_run):
    mutant = "rank0_rng_everywhere"
    with pytest.raises(AssertionError, match="resumed weights differ"):
        ddp_killed_run.check_resume(mutant, env={"PROBE_MUTANT": mutant})


def test_zero3_resume_check_catches_a_resume_that_starts_over(zero3_runs):
    # As in one process, ZeRO-3 starting over reaches the straight run's weights: the log tells.
    mutant = "resume_from_scratch"
    with pytest.raises(AssertionError, match="did not print that it resumed at step 4"):
        zero3_runs.check_resume(mutant, env={"PROBE_MUTANT": mutant})


def test_signal_check_catches_sigint_not_handled(tmp_path, target_dir, data):
    with pytest.raises(AssertionError, match="no checkpoint at the signal's step"):
        check_signal_saves_a_checkpoint_and_exits_with_its_code(tmp_path, target_dir, data, "SIGINT",
                                                    env={"PROBE_MUTANT": "sigint_not_handled"})


def test_learning_check_catches_training_at_lr_0(tmp_path, target_dir, data, monkeypatch):
    real = optim_module.param_groups
    monkeypatch.setattr(optim_module, "param_groups",
                        lambda *args: [{**group, "lr": 0.0} for group in real(*args)])
    with pytest.raises(AssertionError, match="held-out loss did not fall"):
        check_end_to_end_learns_and_writes_a_self_describing_run(tmp_path, target_dir, data)


def no_floor(optimizer, recipe, total_steps):
    """Cosine down to 0, whatever optimizer.min_lr_ratio says."""
    return get_scheduler("cosine", optimizer, num_warmup_steps=recipe.optimizer.warmup_steps,
                         num_training_steps=total_steps)


def no_warmup(optimizer, recipe, total_steps):
    """Cosine to the floor from the first step, whatever optimizer.warmup_steps says."""
    return get_scheduler("cosine_with_min_lr", optimizer, num_warmup_steps=0, num_training_steps=total_steps,
                         scheduler_specific_kwargs={"min_lr_rate": recipe.optimizer.min_lr_ratio})


def linear_decay(optimizer, recipe, total_steps):
    """Warmup, then a straight line to 0."""
    return get_scheduler("linear", optimizer, num_warmup_steps=recipe.optimizer.warmup_steps,
                         num_training_steps=total_steps)


@pytest.mark.parametrize("mutant", [no_floor, no_warmup, linear_decay])
def test_schedule_check_catches(tmp_path, target_dir, data, monkeypatch, mutant):
    monkeypatch.setattr(optim_module, "make_scheduler", mutant)
    with pytest.raises(AssertionError, match="the schedule says"):
        check_lr_warms_up_linearly_then_decays_on_a_cosine_to_the_floor(tmp_path, target_dir, data)


def test_bf16_check_catches_mixed_precision_ignored(tmp_path, target_dir, data, monkeypatch, fresh_accelerate_state):
    real = train_module.Accelerator
    monkeypatch.setattr(train_module, "Accelerator", lambda **kwargs: real(**{**kwargs, "mixed_precision": "no"}))
    with pytest.raises(AssertionError, match="bf16 changed nothing"):
        check_bf16_mixed_precision_trains_and_resumes_exactly(tmp_path, target_dir, data, monkeypatch)


def test_feature_cache_check_catches_a_key_blind_to_the_target_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(features_module, "weights_fingerprint", lambda model: "")
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        check_a_cache_of_another_target_is_refused(tmp_path)


def test_epochs_check_catches_steps_per_epoch_blind_to_grad_accumulation(tmp_path, target_dir, monkeypatch):
    # An epoch counted as one optimizer step per micro-batch: epochs: 1 trains twice the data asked for.
    monkeypatch.setattr(probe_family.Probe, "calls", 0)
    mutate(monkeypatch, train_module, "build_run", "len(loader) // tcfg.grad_accumulation", "len(loader)")
    with pytest.raises(AssertionError, match="epochs: 1 trained 24 micro-batches, not 12"):
        check_epochs_count_optimizer_steps_of_grad_accumulation_micro_batches(tmp_path, target_dir, 1)


CLIPS = """        if accelerator.sync_gradients and tcfg.clip_grad_value:
            clip_grad_value(accelerator, run.step_module.parameters(), tcfg.clip_grad_value)
        if accelerator.sync_gradients and tcfg.max_grad_norm:
            accelerator.clip_grad_norm_(run.step_module.parameters(), tcfg.max_grad_norm)
"""
BACKWARD = "        accelerator.backward(loss)\n"


@pytest.mark.parametrize("clip", ["max_grad_norm", "clip_grad_value"])
def test_clipping_check_catches_a_clip_before_backward(tmp_path, target_dir, data, monkeypatch, clip):
    # The clip moved above the backward: it clips the first micro-batch's gradient, and the last one's adds unclipped.
    mutate(monkeypatch, train_module, "train_micro_batch", BACKWARD + CLIPS, CLIPS + BACKWARD)
    with pytest.raises(AssertionError, match=f"{clip} is 0.001, yet the optimizer stepped with gradients of size"):
        check_clipping_bounds_the_gradient_the_optimizer_steps_with(tmp_path, target_dir, data, clip)
