"""Medusa-2: Medusa heads trained with LoRA adapters inside the target (self-distillation, two stages).

Unit tests on a 2-layer Llama; then real `specdraft train` runs: killed with kill -9 and resumed, the
heads' 4x lr, the merged export, the drift report of the end-of-training eval, and two DDP processes.
"""

import json
import warnings
from pathlib import Path

import pytest
import torch
from test_medusa import VOCAB, chat_batch, packed_batch, tiny_target
from torch.utils._python_dispatch import TorchDispatchMode

from specdraft.config import load_recipe, parse_recipe
from specdraft.contract import TrainingContext
from specdraft.data.vocab import DraftVocab
from specdraft.drafters import load_drafter, medusa2
from specdraft.drafters.medusa import MedusaDrafter
from specdraft.drafters.medusa2 import (
    DRIFT_WARNING_KL,
    MEDUSA2,
    Medusa2Config,
    drift_report,
    heads_schedule,
)
from specdraft.errors import SpecdraftError
from specdraft.export import check_exported, export, load_exported
from specdraft.losses import forward_kl
from specdraft.target import FrozenTarget


def lora(drafter, kind: str):
    return [p for n, p in drafter.trained_module().named_parameters() if f"lora_{kind}" in n]


def test_stage_1_trains_the_heads_alone_and_stage_2_starts_at_kl_0():
    target = tiny_target()
    drafter = MEDUSA2.build(target, Medusa2Config(num_heads=2, joint_from_step=3))
    for step, joint in ((0, False), (3, True)):
        example = drafter.prepare(chat_batch(), TrainingContext(target, step=step))
        out = drafter.compute_loss(example.batch, example.target)
        out.loss.backward()
        grads = [p.grad for p in lora(drafter, "B")]
        if joint:  # B = 0 at the start, so only B gets a gradient (dL/dA = B^T ... = 0)
            assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
        else:  # the adapters take no part: DDP must look for unused parameters (Optimization.unused_parameters)
            assert all(g is None for g in grads)
        assert all(p.grad is not None for p in drafter.heads.parameters())
        assert out.metrics["kl_original_adapted"] == 0  # B = 0: the adapted target is the original
        drafter.trained_module().zero_grad(set_to_none=True)


def test_the_drafter_trains_its_heads_at_their_multiplier_and_has_ddp_look_for_stage_1s_unused_adapters():
    raw = {"target": {"path": "some/model"}, "data": {"path": "d.jsonl"}, "training": {"max_steps": 10},
           "checkpoint": {"output_dir": "runs/x"}, "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
           "drafter": {"family": "medusa2", "num_heads": 2, "head_lr_multiplier": 4.0, "warmup_ratio": 0.2}}
    for joint_from_step in (3, 0):
        raw["drafter"]["joint_from_step"] = joint_from_step
        recipe = parse_recipe(raw)
        drafter = MEDUSA2.build(tiny_target(), recipe.drafter)
        optimization = drafter.configure_optimizers(recipe, 10)
        heads = {id(p) for p in drafter.heads.parameters()}
        trained = {id(p) for p in drafter.trained_module().parameters() if p.requires_grad}
        grouped = [(id(p), group["lr"]) for group in optimization.param_groups for p in group["params"]]
        assert sorted(i for i, _ in grouped) == sorted(trained)  # every trained tensor, once
        assert all(lr == pytest.approx(4e-3 if i in heads else 1e-3) for i, lr in grouped)
        assert {lr for i, lr in grouped if i not in heads} == {1e-3}  # the adapters are grouped too
        # Only a stage 1 leaves the adapters without a gradient; joint from the start, DDP need not look.
        assert optimization.unused_parameters == (joint_from_step > 0)
        optimizer = torch.optim.AdamW(optimization.param_groups)
        scheduler = optimization.schedule(optimizer)  # Medusa's: warmup = ceil(0.2 x 10) steps
        lrs = []
        for _ in range(3):
            lrs.append(scheduler.get_last_lr())
            optimizer.step()
            scheduler.step()
        assert [max(lr) for lr in lrs] == pytest.approx([0.0, 2e-3, 4e-3])


def test_lora_modules_the_target_lacks_are_refused_with_those_it_has():
    with pytest.raises(SpecdraftError, match=r"names \['wq'\].*\['down_proj', 'gate_proj', 'k_proj', 'o_proj'"):
        MEDUSA2.build(tiny_target(), Medusa2Config(lora_target_modules=["q_proj", "wq"]))


def test_heads_schedules_follow_the_runs_length():
    assert heads_schedule(Medusa2Config(), 5, 0) == 1.0
    assert heads_schedule(Medusa2Config(heads_schedule="linear"), 5, 20) == 0.25  # step / max_steps
    sine = Medusa2Config(heads_schedule="sine", heads_warmup_ratio=0.5)  # the reference's sine_0.5
    assert heads_schedule(sine, 5, 20) == pytest.approx(0.7071, abs=1e-4) and heads_schedule(sine, 15, 20) == 1.0
    with pytest.raises(SpecdraftError, match="run's length.*heads_schedule: constant"):
        heads_schedule(sine, 5, 0)


def test_data_the_target_did_not_write_gets_a_warning_naming_regenerate():
    target = tiny_target()
    drafter = MEDUSA2.build(target, Medusa2Config(num_heads=2))
    with pytest.warns(UserWarning, match="specdraft regenerate"):
        drafter.prepare(chat_batch(), TrainingContext(target))


def test_lr_multipliers_naming_no_parameter_are_refused():
    from specdraft.optim import param_groups

    module = torch.nn.ModuleDict({"heads": torch.nn.Linear(2, 2), "adapters": torch.nn.Linear(2, 2)})
    groups = param_groups(module, 0.1, 1e-3, {"heads.": 4.0})
    assert sorted((g["lr"], g["weight_decay"], len(g["params"])) for g in groups) == [
        (1e-3, 0.0, 1), (1e-3, 0.1, 1), (4e-3, 0.0, 1), (4e-3, 0.1, 1)]
    with pytest.raises(SpecdraftError, match=r"lr_multipliers name \['head\.'\]"):
        param_groups(module, 0.1, 1e-3, {"head.": 4.0})


def adapted_drafter(**cfg):
    """A Medusa-2 drafter whose adapters moved (B redrawn): the adapted target differs from the original."""
    target = tiny_target()
    vocab = DraftVocab.from_target_ids(torch.arange(200), VOCAB)  # the heads' rows: [M, 200], never [M, VOCAB]
    drafter = MEDUSA2.build(target, Medusa2Config(num_heads=2, draft_vocab_size=200, **cfg), vocab)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in lora(drafter, "B"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return target, drafter


@pytest.mark.parametrize("batch", [chat_batch(), packed_batch()], ids=["padded", "packed"])
def test_l_lm_in_chunks_of_answer_rows_is_the_kl_of_the_full_logits(batch, monkeypatch):
    """The loss and every trained tensor's gradient equal those of L_LM written over the two forwards' whole
    [B, T, V] logits (forward_kl with the answer mask), to float32 rounding, in chunks of 4 answer rows."""
    monkeypatch.setattr(medusa2, "KL_CHUNK_ROWS", 4)
    target, drafter = adapted_drafter()
    example = drafter.prepare(batch, TrainingContext(target, step=0))
    out = drafter.compute_loss(example.batch, example.target)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in drafter.trained_module().named_parameters() if p.grad is not None}
    drafter.trained_module().zero_grad(set_to_none=True)

    with torch.no_grad(), drafter.peft_model.disable_adapter():
        original = target.forward_batch(batch, "full")
    adapted = target.forward_batch(batch, "full")
    heads = MedusaDrafter.compute_loss(drafter, batch, adapted)
    attention = batch["attention_mask"].bool()
    mask = batch["loss_mask"][:, 1:].bool() & attention[:, :-1] & attention[:, 1:]
    if "seq_ids" in batch:
        mask = mask & (batch["seq_ids"][:, :-1] == batch["seq_ids"][:, 1:])
    assert mask.sum() > 8  # more answer rows than two chunks
    lm = forward_kl(adapted.logits[:, :-1], original.logits[:, :-1], mask)
    (lm + 0.2 * heads.loss).backward()
    assert lm > 1e-3  # the adapters moved: L_LM and its gradient are not 0
    torch.testing.assert_close(out.metrics["kl_original_adapted"], lm.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(out.loss.detach(), (lm + 0.2 * heads.loss).detach(), rtol=1e-5, atol=0)
    expected = {n: p.grad for n, p in drafter.trained_module().named_parameters() if p.grad is not None}
    assert sorted(grads) == sorted(expected) and any("lora_A" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


class LargestVocabularyWideOutput(TorchDispatchMode):
    """The most rows any op's output held at once over the whole vocabulary (last dim = VOCAB); views of the
    ``weights`` (the LM head transposed for its matmul) are not activations and do not count."""

    def __init__(self, weights):
        super().__init__()
        self.rows = 0
        self.weights = {w.untyped_storage().data_ptr() for w in weights}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if (isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[-1] == VOCAB
                    and tensor.untyped_storage().data_ptr() not in self.weights):
                self.rows = max(self.rows, tensor.numel() // VOCAB)
        return out


def test_a_medusa2_step_never_holds_vocabulary_wide_logits_for_more_than_a_chunk_of_rows(monkeypatch):
    """Medusa-2's peak memory was its two forwards' [B, T, V] float32 logits and L_LM's softmaxes and gradients
    of that size (16.8 GiB on SmolLM2's 49k vocabulary): prepare, loss and backward now form V-wide tensors
    of at most KL_CHUNK_ROWS rows (here 4; the batch has 40 positions)."""
    monkeypatch.setattr(medusa2, "KL_CHUNK_ROWS", 4)
    target, drafter = adapted_drafter()
    with LargestVocabularyWideOutput(target.model.parameters()) as largest:
        example = drafter.prepare(chat_batch(), TrainingContext(target, step=0))
        drafter.compute_loss(example.batch, example.target).loss.backward()
    assert 0 < largest.rows <= 4


def saved_bytes_and_grads(checkpointed: bool) -> tuple[int, torch.Tensor, dict]:
    """One joint training step of an adapted drafter in train mode (LoRA dropout on): the bytes autograd saved
    for the backward pass, the loss, and every trained tensor's gradient."""
    torch.manual_seed(0)  # the same heads, and then the same dropout masks, in both runs
    target, drafter = adapted_drafter(lora_dropout=0.1)
    if checkpointed:
        target.checkpoint_activations()
    drafter.train()
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        example = drafter.prepare(packed_batch(), TrainingContext(target, step=0))
        out = drafter.compute_loss(example.batch, example.target)
    out.loss.backward()
    grads = {n: p.grad for n, p in drafter.trained_module().named_parameters() if p.grad is not None}
    return sum(saved), out.loss.detach(), grads


def test_gradient_checkpointing_keeps_fewer_activations_for_the_same_loss_and_gradients():
    """target.gradient_checkpointing: the adapted target's layers keep their inputs only and recompute the rest
    in the backward pass (with the same dropout masks), so the step is the same and saves less."""
    plain_bytes, plain_loss, plain_grads = saved_bytes_and_grads(checkpointed=False)
    checkpointed_bytes, loss, grads = saved_bytes_and_grads(checkpointed=True)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)
    assert sorted(grads) == sorted(plain_grads) and any("lora_A" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert checkpointed_bytes < 0.6 * plain_bytes, (checkpointed_bytes, plain_bytes)


def test_gradient_checkpointing_on_a_target_that_runs_without_autograd_is_refused_naming_the_fix():
    with pytest.raises(SpecdraftError, match="Remove target.gradient_checkpointing"):
        tiny_target().checkpoint_activations()


# -- real runs ------------------------------------------------------------------------------------------------

STEPS, SAVE_EVERY, JOINT_FROM, KILL_AT_STEP = 10, 4, 3, 7


def medusa2_recipe(folder: Path, **training) -> dict:
    from spine import make_recipe

    return make_recipe(folder, folder / "target", folder / "chat.jsonl",
                       drafter={"family": "medusa2", "num_heads": 2, "joint_from_step": JOINT_FROM, "lora_r": 4,
                                "heads_schedule": "linear", "warmup_ratio": 0.2},
                       optimizer={"lr": 1e-2, "warmup_steps": 0},
                       training={"max_steps": STEPS, **training}, checkpoint={"save_every": SAVE_EVERY})


def killed_runs(folder: Path):
    from test_medusa import killed_run_of

    return killed_run_of(folder, medusa2_recipe(folder), KILL_AT_STEP, SAVE_EVERY)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from spine import built_killed_run

    return built_killed_run(tmp_path_factory, "medusa2-kill-9", killed_runs)


def test_train_and_resume_after_kill_9_restore_heads_and_adapters_exactly(runs):
    from safetensors.torch import load_file

    drafter = runs.straight / "drafter"
    assert json.loads((drafter / "adapter" / "adapter_config.json").read_text())["r"] == 4  # peft's own format
    weights = load_file(drafter / "model.safetensors")
    assert any("lora_B" in n and weights[n].abs().sum() > 0 for n in weights)  # stage 2 moved the adapters
    runs.check_resume("resumed")


def test_the_heads_train_at_four_times_the_lr_and_the_schedule_spans_the_run(runs):
    from spine import read_metrics

    from specdraft.checkpoint import checkpoint_dirs

    state = torch.load(checkpoint_dirs(runs.straight)[-1] / "scheduler.pt", weights_only=True)
    assert sorted(set(state["base_lrs"])) == pytest.approx([1e-2, 4e-2])
    logged = {m["step"]: m["train/heads_weight"] for m in read_metrics(runs.straight) if "train/heads_weight" in m}
    # lambda_heads 0.2 x a linear sched over the run's 10 steps (TrainingContext.total_steps): logged step s
    # ran with s - 1 steps done
    assert [logged[s] for s in (1, 5, 10)] == pytest.approx([0.0, 0.2 * 0.4, 0.2 * 0.9], abs=1e-6)


def test_the_merged_export_is_the_adapted_target_with_its_heads(runs, tmp_path):
    out = export(runs.straight, "merged", tmp_path / "merged")
    check_exported(out, runs.straight)
    merged = FrozenTarget.from_pretrained(out, dtype="float32")
    heads = load_drafter(out / "medusa_heads", merged)
    assert heads.family == "medusa1"
    adapted = FrozenTarget.from_pretrained(runs.tmp / "target", dtype="float32")
    medusa2 = load_drafter(runs.straight / "drafter", adapted).eval()
    ids = torch.tensor([[1, 5, 9, 12, 40, 7, 3]])
    a, b = adapted(ids), merged(ids)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-4, atol=1e-5)  # merge_and_unload: W + BA folded in
    torch.testing.assert_close(heads.head_logits(b.final_hidden), medusa2.head_logits(a.final_hidden),
                               rtol=1e-4, atol=1e-5)
    original = FrozenTarget.from_pretrained(runs.tmp / "target", dtype="float32")
    assert not torch.allclose(original(ids).logits, a.logits)  # and it is not the original target
    with pytest.raises(SpecdraftError, match="whole model.*check_exported"):
        load_exported(out, merged)


def test_a_merged_export_that_differs_from_the_adapted_target_fails_its_check(runs, tmp_path):
    from safetensors.torch import load_file, save_file

    out = export(runs.straight, "merged", tmp_path / "merged")
    heads = json.loads((out / "medusa_heads" / "config.json").read_text())
    assert heads["target_config"]["_name_or_path"] == str(out.resolve())  # the folder, not the temporary one
    tensors = load_file(out / "model.safetensors")
    name = next(n for n in tensors if n.endswith("q_proj.weight"))
    tensors[name].view(-1)[1] += 5.0  # an entry the heads' target fingerprint does not sample
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SpecdraftError, match="merged target's logits differ"):
        check_exported(out, runs.straight)


def test_drift_is_zero_before_training_and_reported_after(runs):
    target = FrozenTarget.from_pretrained(runs.tmp / "target", dtype="float32")
    drafter = load_drafter(runs.straight / "drafter", target)
    prompts = [torch.tensor([[1, 5, 9, 12, 40]]), torch.tensor([[1, 7, 3]])]
    report = drift_report(target, drafter, prompts, max_new_tokens=16)
    assert report["mean_kl_original_adapted"] > 0 and 0 <= report["greedy_agreement"] <= 1
    fresh = FrozenTarget.from_pretrained(runs.tmp / "target", dtype="float32")
    untrained = MEDUSA2.build(fresh, Medusa2Config(num_heads=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no drift, no warning
        report = drift_report(fresh, untrained, prompts, max_new_tokens=16)
    assert report["greedy_agreement"] == 1.0 and report["mean_kl_original_adapted"] == pytest.approx(0, abs=1e-7)


def test_a_drifted_target_gets_a_warning_that_names_the_adapters_lr():
    target = tiny_target()
    drafter = MEDUSA2.build(target, Medusa2Config(num_heads=2)).eval()
    prompts = [torch.tensor([[1, 5, 9, 12, 40]])]
    torch.manual_seed(0)
    for b in lora(drafter, "B"):  # adapters that moved far: W + (alpha/r) B A is another model
        b.data.normal_(0, 0.5)
    with pytest.warns(UserWarning, match=r"drifted from the original: mean KL .* lower optimizer\.lr"):
        report = drift_report(target, drafter, prompts, max_new_tokens=8)
    assert report["mean_kl_original_adapted"] > DRIFT_WARNING_KL


def test_the_end_of_training_eval_decodes_against_the_adapted_target_and_reports_its_drift(tmp_path, capsys):
    """`specdraft train` with eval on: the saved heads and adapters are loaded back on the training target
    and decode there (greedy output is the adapted target's own), and the drift report is written."""
    from spine import make_chat_data, make_recipe
    from tiny import save_tiny_target

    from specdraft.config import parse_recipe
    from specdraft.train import train

    target = save_tiny_target(tmp_path / "target")
    data = make_chat_data(tmp_path / "chat.jsonl", n=16)
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question_id": 0, "category": "a", "turns": ["Tell me a story."]}) + "\n")
    raw = make_recipe(tmp_path, target, data, drafter={"family": "medusa2", "num_heads": 2, "joint_from_step": 1,
                                                       "lora_r": 4}, training={"max_steps": 3})
    raw["eval"] = {"enabled": True, "prompts": str(questions), "num_prompts": 1, "k": 2, "temperatures": [0.0],
                   "max_new_tokens": 12, "prompt_lookup_baseline": False}
    run = train(parse_recipe(raw), show_progress=False)
    result = json.loads((run / "eval" / "temperature-0" / "result.json").read_text())
    assert result["greedy_identical"] == {"medusa2": 1.0}
    drift = json.loads((run / "eval" / "family_report.json").read_text())["medusa2"]
    assert drift["prompts"] == 1 and drift["tokens"] == 12 and drift["mean_kl_original_adapted"] >= 0
    assert "\nmedusa2: mean_kl_original_adapted" in capsys.readouterr().out


def two_process_run(tmp_path: Path, joint_from_step: int, launcher_env: tuple[list, dict]) -> tuple[dict, dict]:
    """The drafter weights of one process with accumulation 4 and of two processes with accumulation 2, on
    the same 24 training chats (3 steps an epoch either way, no padding), LoRA dropout off (it draws from
    per-rank RNG streams)."""
    from spine import drafter_weights, make_chat_data, run_cli, write_recipe
    from tiny import save_tiny_target

    from specdraft.checkpoint import checkpoint_dirs

    save_tiny_target(tmp_path / "target")
    make_chat_data(tmp_path / "chat.jsonl", n=27)

    def recipe(name, accumulation):
        raw = medusa2_recipe(tmp_path, max_steps=4, grad_accumulation=accumulation)
        raw["drafter"].update(lora_dropout=0.0, joint_from_step=joint_from_step)
        raw["checkpoint"]["output_dir"] = str(tmp_path / name / "run")
        return write_recipe(tmp_path / f"{name}.yaml", raw)

    single = run_cli(["train", str(recipe("single", 4)), "--no-progress"])
    assert single.returncode == 0, single.stderr[-5000:]
    launcher, env = launcher_env
    two = run_cli(["train", str(recipe("two", 2)), "--no-progress"], env=env, launcher=launcher, timeout=900)
    assert two.returncode == 0, two.stderr[-5000:]
    state = json.loads((checkpoint_dirs(tmp_path / "two" / "run")[-1] / "trainer_state.json").read_text())
    assert state["world_size"] == 2, "accelerate ran one process: the test would prove nothing"
    weights = drafter_weights(tmp_path / "two" / "run")
    assert any("lora_B" in n and w.abs().sum() > 0 for n, w in weights.items())  # stage 2 ran
    return weights, drafter_weights(tmp_path / "single" / "run")


def test_two_ddp_processes_train_both_stages_as_one_process_does(tmp_path):
    """Stage 1 leaves the adapters without a gradient: without find_unused_parameters
    (Family.unused_parameters) DDP's backward raises; with it, the weights are one process's."""
    from spine import DDP_ENV, assert_same_weights, ddp_launcher

    two, single = two_process_run(tmp_path, joint_from_step=2, launcher_env=(ddp_launcher(2), DDP_ENV))
    # LoRA's B starts at 0, so the first joint steps' gradients are tiny, and Adam divides each by its own
    # scale: the all-reduce's rounding comes out larger than spine's 1e-5 allows (1.1e-5 of lora_A's scale,
    # measured). A real difference is far larger: DeepSpeed's extra Adam steps in stage 1 (the ZeRO-2
    # test's docstring) move lora_A by 3.7e-2 of its scale.
    assert_same_weights(two, single, rel=1e-4)


def test_zero2_on_two_processes_trains_the_weights_of_one_process(tmp_path):
    """ZeRO-2 through the shipped accelerate config: heads, adapters and the heads' 4x lr, joint from the
    first step. (With a stage 1, DeepSpeed steps the adapters' Adam moments on zero gradients, where
    torch's AdamW skips a parameter without one: the adapters do not move in stage 1 either way, with
    weight decay 0, but their bias correction in stage 2 differs from one process's.)"""
    from spine import assert_same_weights
    from test_deepspeed import DS_ENV, deepspeed_launcher, launcher_config

    (tmp_path / "launch").mkdir()
    launcher = deepspeed_launcher(launcher_config(tmp_path / "launch", 2))
    two, single = two_process_run(tmp_path, joint_from_step=0, launcher_env=(launcher, DS_ENV))
    assert_same_weights(two, single)


RECIPES = sorted(Path(__file__).resolve().parents[1].joinpath("recipes").glob("*medusa2.yaml"))


# The heads' lr multiplier each recipe takes: the paper's 4x, except where a measurement moved it. On SmolLM2
# (eval/README.md, "Medusa-2 over 400 answers") the adapters at 2.5e-4 with the heads at 4x drifted the target
# past the drift warning; the recipe keeps the heads at 1e-3 with the adapters at 5e-5.
HEADS_LR = {"toy_medusa2.yaml": (4.0, 2.5e-4), "smollm2-135m-medusa2.yaml": (20.0, 5e-5)}


def test_the_medusa2_recipes_take_the_papers_settings_and_their_measured_heads_lr():
    assert {p.name for p in RECIPES} == set(HEADS_LR)  # a new recipe states its heads' lr here
    for path in RECIPES:
        recipe = load_recipe(path)
        cfg = recipe.drafter
        assert (cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.heads_coefficient) == (32, 16, 0.05, 0.2)
        assert (cfg.head_lr_multiplier, recipe.optimizer.lr) == HEADS_LR[path.name]
        assert cfg.head_lr_multiplier * recipe.optimizer.lr == pytest.approx(1e-3)  # Medusa-1's heads' rate
        assert 0 < cfg.joint_from_step < recipe.training.max_steps  # both stages run


def test_specdraft_eval_runs_a_medusa2_drafter_alone_and_refuses_it_beside_others(runs, tmp_path, capsys):
    """Loading Medusa-2 puts its adapters into the target that every other method would then be verified by."""
    from specdraft.cli import main
    from specdraft.drafters.medusa import MEDUSA1, MedusaConfig

    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question_id": 0, "category": "a", "turns": ["Tell me a story."]}) + "\n")
    original = FrozenTarget.from_pretrained(runs.tmp / "target", dtype="float32")
    MEDUSA1.build(original, MedusaConfig(num_heads=2)).save_pretrained(tmp_path / "medusa1")
    common = ["eval", "--target", str(runs.tmp / "target"), "--prompts", str(questions), "--max-new-tokens", "8",
              "-k", "2", "--no-progress"]
    assert main([*common, "--drafter", str(runs.straight / "drafter"), "--drafter", str(tmp_path / "medusa1")]) == 2
    assert "evaluate it in a run of its own" in capsys.readouterr().err
    assert main([*common, "--drafter", str(runs.straight / "drafter"), "--prompt-lookup",
                 "--out", str(tmp_path / "out")]) == 0
    # A run's drafter goes by its family, the run's name beside it (runs.straight is .../straight/run)
    assert "medusa2 (run): mean_kl_original_adapted" in capsys.readouterr().out
    assert (tmp_path / "out" / "medusa2-run" / "family_report.json").is_file()
