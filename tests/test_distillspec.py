"""DistillSpec: a small draft LM distilled from the target with FKL, RKL, JSD(beta) or TVD, on fixed or
on-policy data. Unit tests on a 2-layer Llama; then real `specdraft train` runs (killed with kill -9
and resumed), the export, and `specdraft eval --draft-model` on the same folder."""

import json
from pathlib import Path

import pytest
import torch
from test_medusa import chat_batch, tiny_target

from specdraft.contract import TrainingContext
from specdraft.decoding.sampling import SamplingParams
from specdraft.decoding.speculative import speculative_decode
from specdraft.drafters import load_drafter
from specdraft.drafters.distillspec import DISTILLSPEC, DistillSpecConfig
from specdraft.errors import SpecdraftError
from specdraft.losses import DIVERGENCES
from specdraft.target import FrozenTarget


def student_of(target, **cfg):
    return DISTILLSPEC.build(target, DistillSpecConfig(num_layers=1, **cfg))


def test_truncate_copies_the_targets_embeddings_first_layers_norm_and_head():
    target = tiny_target()
    student = student_of(target).student
    own = target.model.state_dict()
    assert student.config.num_hidden_layers == 1
    for name, tensor in student.state_dict().items():
        assert torch.equal(tensor, own[name]), name
    assert "model.layers.1.self_attn.q_proj.weight" in own and len(student.state_dict()) < len(own)


def test_config_init_is_a_fresh_model_of_the_targets_shape_and_a_wider_one_warns():
    target = tiny_target()
    student = student_of(target, init="config").student
    assert not torch.equal(student.model.embed_tokens.weight, target.model.model.embed_tokens.weight)
    with pytest.warns(UserWarning, match="wider than the target.*c > 1"):
        student_of(target, init="config", hidden_size=128, intermediate_size=256)


def test_the_ce_baseline_is_next_token_cross_entropy_on_the_answers():
    target = tiny_target()
    drafter = student_of(target, divergence="ce")
    batch = chat_batch()
    example = drafter.prepare(batch, TrainingContext(target))
    loss = drafter.compute_loss(example.batch, example.target).loss
    counted = batch["loss_mask"][:, 1:].bool() & batch["attention_mask"][:, :-1].bool()
    logits = drafter.student(batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1][counted]
    expected = torch.nn.functional.cross_entropy(logits.double(), batch["input_ids"][:, 1:][counted])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)


@pytest.mark.parametrize("divergence", sorted(DIVERGENCES))
def test_the_loss_is_the_divergence_of_the_two_models_at_the_answer_positions(divergence):
    """By brute force: both full models' logits, the positions predicting an answer token, temperature
    2 and the target's top 7, then the divergence's formula."""
    target = tiny_target()
    drafter = student_of(target, divergence=divergence, beta=0.3, temperature=2.0, top_k=7)
    batch = chat_batch()
    example = drafter.prepare(batch, TrainingContext(target))
    out = drafter.compute_loss(example.batch, example.target)

    counted = batch["loss_mask"][:, 1:].bool() & batch["attention_mask"][:, :-1].bool()
    p_logits = target.model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1][counted]
    q_logits = drafter.student(batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1][counted]
    keep = p_logits.topk(7, dim=-1).indices
    p = torch.softmax(p_logits.double().gather(-1, keep) / 2.0, -1)
    q = torch.softmax(q_logits.double().gather(-1, keep) / 2.0, -1)
    kl = lambda a, b: (a * (a / b).log()).sum(-1)
    m = 0.3 * p + 0.7 * q
    expected = {"fkl": kl(p, q), "rkl": kl(q, p), "jsd": 0.3 * kl(p, m) + 0.7 * kl(q, m),
                "tvd": 0.5 * (p - q).abs().sum(-1)}[divergence].mean()
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-4)
    # alpha is logged at T = 1 over the whole vocabulary: what the decoder's T = 1 verify accepts at
    alpha = torch.minimum(torch.softmax(p_logits.double(), -1), torch.softmax(q_logits.double(), -1)).sum(-1).mean()
    assert out.metrics["alpha"].item() == pytest.approx(alpha.item(), rel=1e-4)
    out.loss.backward()
    grads = [p.grad for p in drafter.trained_module().parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert all(p.grad is None for p in target.model.parameters())


def test_on_policy_samples_are_the_prompt_and_the_students_continuation_with_the_loss_on_it():
    target = tiny_target()
    drafter = student_of(target, on_policy_fraction=1.0, generation_max_new_tokens=6)
    batch = chat_batch()
    torch.manual_seed(0)
    example = drafter.prepare(batch, TrainingContext(target))
    torch.manual_seed(0)
    again = drafter.prepare(batch, TrainingContext(target))
    assert torch.equal(example.batch["input_ids"], again.batch["input_ids"])  # the global RNG decides it all
    for row, prompt_length in ((0, 5), (1, 3)):
        ids, mask = example.batch["input_ids"][row], example.batch["loss_mask"][row]
        length = int(example.batch["attention_mask"][row].sum())
        assert torch.equal(ids[:prompt_length], batch["input_ids"][row, :prompt_length])  # the prompt is kept
        assert mask[:prompt_length].sum() == 0 and mask[prompt_length:length].all() and mask[length:].sum() == 0
        assert 1 <= length - prompt_length <= 6
    # the student wrote them: sampled at a temperature near 0, they are its own greedy continuation
    nearly_greedy = student_of(target, on_policy_fraction=1.0, generation_max_new_tokens=6,
                               generation_temperature=1e-6)
    generated = nearly_greedy.prepare(batch, TrainingContext(target)).batch
    prompt = batch["input_ids"][:1, :5]
    greedy = nearly_greedy.student.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                            max_new_tokens=6, pad_token_id=0, eos_token_id=None)[0, 5:]
    length = int(generated["attention_mask"][0].sum())
    assert torch.equal(generated["input_ids"][0, 5:length], greedy[: length - 5])
    assert example.target.logits.shape[:2] == example.batch["input_ids"].shape  # the target scored them
    # at lambda = 0 nothing is generated, and the held-out batches are never regenerated
    fixed = student_of(target)
    assert torch.equal(fixed.prepare(batch, TrainingContext(target)).batch["input_ids"], batch["input_ids"])
    assert torch.equal(drafter.prepare(batch, TrainingContext(target, training=False)).batch["input_ids"],
                       batch["input_ids"])


def test_bad_settings_are_refused_with_what_to_do():
    with pytest.raises(SpecdraftError, match=r"beta must be in \[0, 1\]"):
        DistillSpecConfig(divergence="jsd", beta=1.5)
    with pytest.raises(SpecdraftError, match=r"on_policy_fraction.*must be in \[0, 1\]"):
        DistillSpecConfig(on_policy_fraction=-0.1)
    with pytest.raises(SpecdraftError, match="divergence must be one of fkl, rkl, jsd, tvd \\(or ce"):
        DistillSpecConfig(divergence="kl")
    target = tiny_target()  # context 256
    with pytest.raises(SpecdraftError, match="does not fit the target's context"):
        student_of(target, on_policy_fraction=0.5, generation_max_new_tokens=256)
    drafter = student_of(target, on_policy_fraction=1.0, generation_max_new_tokens=252)
    with pytest.raises(SpecdraftError, match="252 tokens after a 5-token prompt exceeds the target's context"):
        drafter.prepare(chat_batch(), TrainingContext(target))  # 252 alone fits; after the 5-token prompt, not
    with pytest.raises(SpecdraftError, match="truncate copies the target's first"):
        DISTILLSPEC.build(target, DistillSpecConfig(num_layers=3))


def test_lora_settings_and_on_policy_packing_are_refused_before_anything_loads(tmp_path):
    from spine import make_recipe, write_recipe

    from specdraft.config import load_recipe
    from specdraft.train import check_before_loading

    with pytest.raises(SpecdraftError, match=r"lora_r and drafter.lora_alpha must be >= 1, got 0"):
        DistillSpecConfig(lora_r=0)
    with pytest.raises(SpecdraftError, match=r"lora_dropout must be in \[0, 1\)"):
        DistillSpecConfig(lora_r=4, lora_dropout=1.0)
    with pytest.raises(SpecdraftError, match="random ones: use init: truncate or pretrained"):
        DistillSpecConfig(lora_r=4, init="config")
    with pytest.raises(SpecdraftError, match=r"names \['wq'\], which this student does not have.*'down_proj'"):
        student_of(tiny_target(), lora_r=4, lora_target_modules=["q_proj", "wq"])
    # the recipe check runs before the target's config is read: this target folder does not exist
    raw = make_recipe(tmp_path, tmp_path / "no-target", tmp_path / "chat.jsonl",
                      drafter={"family": "distillspec", "on_policy_fraction": 0.5})
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    raw["data"]["packing"] = True
    with pytest.raises(SpecdraftError, match="packed rows hold several: set data.packing: false"):
        check_before_loading(load_recipe(write_recipe(tmp_path / "r.yaml", raw)), resume=False, overwrite=False)


def test_a_lora_student_trains_its_adapters_only_and_saves_merged_as_a_plain_folder(tmp_path):
    """peft's LoRA on the student's projections: only lora_A / lora_B change; the saved folder is the
    merged student (transformers opens it, same logits), with peft's adapter/ and the resume tensors."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    target = tiny_target()
    torch.manual_seed(0)
    drafter = student_of(target, lora_r=4, lora_alpha=8, lora_dropout=0.0)
    trained = {n for n, p in drafter.trained_module().named_parameters() if p.requires_grad}
    assert trained and all("lora_A" in n or "lora_B" in n for n in trained)
    frozen = {n: p.detach().clone() for n, p in drafter.trained_module().named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    batch = chat_batch()
    losses = []
    for _ in range(4):
        example = drafter.prepare(batch, TrainingContext(target))
        loss = drafter.compute_loss(example.batch, example.target).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for name, p in drafter.trained_module().named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[name]), name
    drafter.save_pretrained(tmp_path / "student")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "student")
    assert not any("lora" in n for n, _ in plain.named_parameters())
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    with torch.no_grad():
        live = drafter.lm()(ids).logits
        with drafter.student.disable_adapter():
            assert (drafter.lm()(ids).logits - live).abs().max() > 1e-3  # the adapters moved the student
        merged = plain(ids).logits
    torch.testing.assert_close(merged, live, rtol=1e-5, atol=1e-5)  # W + BA folded in: float rounding only
    assert (tmp_path / "student" / "adapter" / "adapter_config.json").is_file()
    adapters = load_file(tmp_path / "student" / "adapter" / "adapter_model.safetensors")  # peft's format
    assert len(adapters) == len(trained) and all("lora_" in name for name in adapters)
    assert not (tmp_path / "student" / "trained.safetensors").exists()  # resume state lives in checkpoints
    loaded = load_drafter(tmp_path / "student", target)
    assert loaded.config.lora_r == 4 and loaded.lm() is loaded.student  # served merged: no adapters left
    torch.testing.assert_close(loaded.student(ids).logits, merged, rtol=0, atol=0)


def test_a_pretrained_student_with_another_vocabulary_or_tokenizer_is_refused(tmp_path):
    from tiny import save_tiny_target

    target_dir = save_tiny_target(tmp_path / "target")
    target = FrozenTarget.from_pretrained(target_dir, dtype="float32")
    other = save_tiny_target(tmp_path / "other", vocab_size=280)
    with pytest.raises(SpecdraftError, match="vocabulary.*must use the target's tokenizer"):
        DISTILLSPEC.build(target, DistillSpecConfig(init="pretrained", student_path=str(other)))
    # same size, other tokens: a tokenizer trained on a reversed corpus
    same_size = tmp_path / "same_size"
    save_tiny_target(same_size)
    reversed_tokens = {token: len(target.tokenizer) - 1 - i for token, i in target.tokenizer.get_vocab().items()}
    assert reversed_tokens != target.tokenizer.get_vocab()
    tokenizer_json = json.loads((same_size / "tokenizer.json").read_text())
    tokenizer_json["model"]["vocab"] = {t: i for t, i in reversed_tokens.items() if t in tokenizer_json["model"]["vocab"]}
    tokenizer_json["added_tokens"] = []
    (same_size / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    with pytest.raises(SpecdraftError, match="different tokenizer from the target"):
        DISTILLSPEC.build(target, DistillSpecConfig(init="pretrained", student_path=str(same_size)))
    good = DISTILLSPEC.build(target, DistillSpecConfig(init="pretrained", student_path=str(target_dir)))
    assert good.student.config.num_hidden_layers == 2  # the folder's own model, as it is


def test_the_logged_alpha_is_the_acceptance_the_decoder_measures():
    """The alpha training logs (``compute_loss``'s metric) on the decoder's own T = 1 outputs, against the
    decoder's measured acceptance of one draft per step: over >= 1,000 drafts, means within 0.02."""
    target = tiny_target(std=0.1)  # flatter than the default: alpha well inside (0, 1)
    drafter = student_of(target).eval()
    generator = torch.Generator().manual_seed(0)
    drafted = accepted = 0
    logged, positions = 0.0, 0
    for seed in range(12):
        prompt = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(seed))
        out = speculative_decode(target, drafter.draft_source(target), prompt, k=1,
                                 params=SamplingParams(temperature=1.0), max_new_tokens=200, generator=generator)
        drafted += sum(s.num_drafted for s in out.steps)
        accepted += sum(s.num_accepted for s in out.steps)
        ids = torch.cat([prompt, torch.tensor([out.tokens])], dim=1)
        loss_mask = torch.zeros_like(ids)
        loss_mask[:, prompt.shape[1]:] = 1
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
        with torch.no_grad():
            example = drafter.prepare(batch, TrainingContext(target, training=False))
            alpha = drafter.compute_loss(example.batch, example.target).metrics["alpha"].item()
        logged += alpha * len(out.tokens)
        positions += len(out.tokens)
    assert drafted >= 1000
    measured, logged = accepted / drafted, logged / positions
    assert 0.2 < measured < 0.9  # a test of agreement, not of two saturated rates
    assert abs(measured - logged) < 0.02, (measured, logged)


# -- real runs --------------------------------------------------------------------------------------

STEPS, SAVE_EVERY, KILL_AT_STEP = 8, 4, 6


def distillspec_recipe(folder: Path, **drafter) -> dict:
    from spine import make_recipe

    recipe = make_recipe(folder, folder / "target", folder / "chat.jsonl",
                         drafter={"family": "distillspec", "num_layers": 1, "divergence": "tvd",
                                  "on_policy_fraction": 0.5, "generation_max_new_tokens": 8, **drafter},
                         optimizer={"lr": 1e-2, "warmup_steps": 0},
                         training={"max_steps": STEPS}, checkpoint={"save_every": SAVE_EVERY})
    recipe["data"]["packing"] = False  # on-policy samples replace whole rows
    return recipe


def killed_runs(folder: Path, **drafter):
    from test_medusa import killed_run_of, killing_cli

    cli = killing_cli("specdraft.drafters.distillspec", "DistillSpecDrafter", "self.student.training")
    return killed_run_of(folder, distillspec_recipe(folder, **drafter), KILL_AT_STEP, SAVE_EVERY, cli)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from spine import built_killed_run

    return built_killed_run(tmp_path_factory, "distillspec-kill-9", killed_runs)


def test_a_lora_student_resumes_exactly_after_kill_9(tmp_path_factory):
    """The resume reads the adapters from the checkpoint's trained.safetensors (model.safetensors holds them merged);
    LoRA dropout and on-policy sampling draw from the restored RNG."""
    from spine import built_killed_run

    runs = built_killed_run(tmp_path_factory, "distillspec-lora-kill-9",
                            lambda folder: killed_runs(folder, lora_r=4, lora_target_modules=["q_proj", "v_proj"]))
    runs.check_resume("resumed")


def test_on_policy_training_resumes_exactly_after_kill_9_and_logs_alpha_and_generation(runs):
    from spine import read_metrics

    runs.check_resume("resumed")
    logged = [m for m in read_metrics(runs.straight) if "train/loss" in m]
    assert all(0 <= m["train/alpha"] <= 1 for m in logged)
    assert any(m["train/generate_s"] > 0 for m in logged)  # generation cost, reported on its own


def test_the_saved_student_is_a_transformers_folder_that_load_drafter_and_eval_both_open(runs, tmp_path, capsys):
    """One folder: load_drafter reads it, transformers reads it, `specdraft export` copies and checks it
    (printing the vLLM and SGLang flags), and `specdraft eval` takes it as --drafter and --draft-model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdraft.cli import main
    from specdraft.export import check_exported

    folder = runs.straight / "drafter"
    target = FrozenTarget.from_pretrained(runs.tmp / "target", dtype="float32")
    drafter = load_drafter(folder, target)
    plain = AutoModelForCausalLM.from_pretrained(folder)
    assert AutoTokenizer.from_pretrained(folder).get_vocab() == target.tokenizer.get_vocab()
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    assert torch.equal(plain(ids).logits, drafter.student(ids).logits)

    assert main(["export", str(runs.straight), "--format", "hf", "--out", str(tmp_path / "export")]) == 0
    hint = capsys.readouterr().out
    assert '"method": "draft_model"' in hint and "--speculative-algorithm STANDALONE" in hint
    check_exported(tmp_path / "export", folder)

    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question_id": 0, "category": "a", "turns": ["Tell me a story."]}) + "\n")
    assert main(["eval", "--target", str(runs.tmp / "target"), "--prompts", str(questions), "--max-new-tokens", "12",
                 "-k", "3", "--no-progress", "--drafter", str(folder), "--draft-model", str(tmp_path / "export"),
                 "--out", str(tmp_path / "eval")]) == 0
    result = json.loads((tmp_path / "eval" / "result.json").read_text())
    # both ways in decoded, each token-identical to plain greedy decoding
    assert len(result["greedy_identical"]) == 2 and set(result["greedy_identical"].values()) == {1.0}, result


@pytest.mark.parametrize("launch", ["ddp", "zero2-lora"])
def test_two_processes_train_the_student_of_one_process(tmp_path, launch):
    """Fixed data (lambda 0): one process with accumulation 4 and two with accumulation 2 see the same
    24 chats per step and end at the same student: the whole student under DDP, a LoRA student
    (compared merged) under DeepSpeed ZeRO-2 through the shipped accelerate config. (On-policy data and
    LoRA dropout draw from each rank's own RNG stream, so there a two-process run is a different,
    equally valid, run.)"""
    from spine import (
        DDP_ENV,
        assert_same_weights,
        ddp_launcher,
        drafter_weights,
        make_chat_data,
        run_cli,
        write_recipe,
    )
    from test_deepspeed import DS_ENV, deepspeed_launcher, launcher_config
    from tiny import save_tiny_target

    save_tiny_target(tmp_path / "target")
    make_chat_data(tmp_path / "chat.jsonl", n=27)
    lora = {"lora_r": 4, "lora_dropout": 0.0} if launch == "zero2-lora" else {}
    if launch == "zero2-lora":
        (tmp_path / "launch").mkdir()
        launcher, env = deepspeed_launcher(launcher_config(tmp_path / "launch", 2)), DS_ENV
    else:
        launcher, env = ddp_launcher(2), DDP_ENV

    def recipe(name, accumulation):
        raw = distillspec_recipe(tmp_path, **lora)
        raw["drafter"]["on_policy_fraction"] = 0.0
        raw["training"].update(max_steps=3, grad_accumulation=accumulation)
        raw["checkpoint"]["output_dir"] = str(tmp_path / name / "run")
        return write_recipe(tmp_path / f"{name}.yaml", raw)

    single = run_cli(["train", str(recipe("single", 4)), "--no-progress"])
    assert single.returncode == 0, single.stderr[-5000:]
    two = run_cli(["train", str(recipe("two", 2)), "--no-progress"], env=env, launcher=launcher, timeout=900)
    assert two.returncode == 0, two.stderr[-5000:]
    from specdraft.checkpoint import checkpoint_dirs

    state = json.loads((checkpoint_dirs(tmp_path / "two" / "run")[-1] / "trainer_state.json").read_text())
    assert state["world_size"] == 2, "accelerate ran one process: the test would prove nothing"
    # The all-reduce sums in another order; Adam divides each gradient by its own scale, and the LM
    # head's rows that see almost no gradient amplify that rounding: 1.26e-6 on lm_head.weight, 1.5e-5
    # of its scale (measured), past spine's 1e-5 and well inside 1e-4 (as Medusa-2's DDP test).
    assert_same_weights(drafter_weights(tmp_path / "two" / "run"), drafter_weights(tmp_path / "single" / "run"),
                        rel=1e-4)
    if lora:  # the adapters trained (B starts at 0), and only they did
        from safetensors.torch import load_file

        adapters = load_file(tmp_path / "two" / "run" / "drafter" / "adapter" / "adapter_model.safetensors")
        assert all("lora_" in n for n in adapters) and any(w.abs().sum() > 0 for n, w in adapters.items() if "lora_B" in n)
