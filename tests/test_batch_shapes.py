"""Fixed batch shapes (``data.shapes: buckets``): micro_batch_size rows of one of 4 widths, so a run meets a handful
of shapes; the padding they add changes no loss and no gradient."""

import collections
import json

import pytest
import torch
from spine import make_chat_data

from specdraft import train as loop
from specdraft.config import load_recipe
from specdraft.data.collate import Collator, EpochOrder, TokenBudgetBatches, bucket_widths, pack, pad_token_id_of

# What makes a family's step random, switched off so the two layouts can be compared value for value: EAGLE-1's
# feature noise, DFlash's anchor sampling (all positions are anchors), DistillSpec's on-policy samples.
DETERMINISTIC = {"eagle1": ["drafter.noise=none"], "dflash": ["drafter.num_anchors=4096"],
                 "distillspec": ["drafter.on_policy_fraction=0"]}
FAMILIES = ["dflash", "distillspec", "eagle1", "eagle3", "medusa1", "medusa2", "mlp_speculator"]


def test_bucket_widths_are_four_fractions_of_max_length():
    assert bucket_widths(1024) == (128, 256, 512, 1024)
    assert bucket_widths(4) == (1, 2, 4)


def test_a_bucketed_batch_has_its_rows_and_the_narrowest_width_that_holds_it_and_masks_what_it_adds():
    samples = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8, 9], "loss_mask": [0, 1]}]
    dynamic = Collator(0, max_length=16)(samples)
    fixed = Collator(0, max_length=16, rows=4, widths=bucket_widths(16))(samples)
    assert dynamic["input_ids"].shape == (2, 3) and fixed["input_ids"].shape == (4, 4)
    for key in ("input_ids", "attention_mask", "loss_mask", "position_ids"):
        assert torch.equal(fixed[key][:2, :3], dynamic[key]), key
    assert not fixed["attention_mask"][2:].any() and not fixed["attention_mask"][:, 3:].any()
    assert not fixed["loss_mask"][2:].any() and not fixed["loss_mask"][:, 3:].any()


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return make_chat_data(tmp_path_factory.mktemp("shapes") / "chat.jsonl", n=24)


def one_step(run, batch):
    """The batch's shape, the step's loss and token count, and the gradients it leaves, from zeroed gradients."""
    run.optimizer.zero_grad(set_to_none=True)
    loss, _, tokens = run.step_module(batch, 0)
    run.accelerator.backward(loss)
    grads = {n: p.grad.clone() for n, p in run.step_module.named_parameters() if p.grad is not None}
    return batch["input_ids"].shape, loss.detach(), int(tokens), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_the_padding_of_a_bucketed_batch_changes_no_loss_and_no_gradient(family, chat, tmp_path):
    recipe = load_recipe(f"toy_{family}", [f"data.path={chat}", f"checkpoint.output_dir={tmp_path / 'run'}",
                                           "training.max_steps=1", "training.micro_batch_size=3", "eval.enabled=false",
                                           *DETERMINISTIC.get(family, [])])  # fmt: skip
    run = loop.build_run(recipe, False, False, loop.check_before_loading(recipe, False, False))
    samples = [dict(run.loader.dataset[i]) for i in range(3)]
    pad = pad_token_id_of(run.target.tokenizer)
    seen = {}
    for name, shapes in (("dynamic", {}), ("buckets", {"rows": 4, "widths": bucket_widths(recipe.data.max_length)})):
        batch = Collator(pad, recipe.data.max_length, recipe.data.packing, **shapes)([dict(s) for s in samples])
        seen[name] = one_step(run, batch)
    (shape, loss, tokens, grads), (fixed_shape, fixed_loss, fixed_tokens, fixed_grads) = seen["dynamic"], seen["buckets"]
    assert fixed_shape[0] == 4 and fixed_shape[1] in bucket_widths(recipe.data.max_length) and fixed_shape != shape
    assert fixed_tokens == tokens
    torch.testing.assert_close(fixed_loss, loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == fixed_grads.keys() and grads
    for name in grads:  # float32: the added rows and columns only change the order of some sums
        torch.testing.assert_close(fixed_grads[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_bucketed_run_meets_at_most_four_batch_shapes(chat, tmp_path, monkeypatch):
    """200 steps of the toy EAGLE-3 recipe with data.shapes: buckets: the drafter sees at most 4 shapes, where the
    dynamic layout of the same run meets a new one at almost every step."""
    shapes = collections.Counter()
    real = loop.TrainStep.forward
    monkeypatch.setattr(loop.TrainStep, "forward", lambda self, batch, step, split="train": (
        shapes.update([(split, tuple(batch["input_ids"].shape))]), real(self, batch, step, split))[1])
    met = {}
    for layout in ("buckets", "dynamic"):
        shapes.clear()
        recipe = load_recipe("toy_eagle3", [f"data.path={chat}", f"checkpoint.output_dir={tmp_path / layout}",
                                            "training.max_steps=200", "training.micro_batch_size=2",
                                            "training.log_every=50", "checkpoint.save_every=1000",
                                            "training.eval_every=0", "eval.enabled=false",
                                            f"data.shapes={layout}", "data.packing=false"])  # fmt: skip
        loop.train(recipe, show_progress=False)
        met[layout] = {shape for split, shape in shapes if split == "train"}
    assert len(met["buckets"]) <= 4, met["buckets"]
    assert len(met["dynamic"]) > 4  # the check can fail: without buckets, these answers' lengths vary


# -- a token budget per micro-batch (data.tokens_per_micro_batch) ----------------------------------------------


def test_token_budget_batches_fill_their_rows_and_hold_every_sample_once_an_epoch():
    lengths = [7, 3, 9, 2, 5, 8, 1, 6, 4, 10, 3, 3] * 5
    order = EpochOrder(len(lengths), seed=3)
    sampler = TokenBudgetBatches(lengths, rows=2, max_length=10, sampler=order)
    epochs = []
    for epoch in (0, 1, 0):
        order.set_epoch(epoch)
        batches = list(sampler)
        assert len(sampler) == len(batches)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for b in batches:  # each fits in 2 rows of 10 as the Collator packs it, and the next sample did not
            assert len(pack([lengths[i] for i in b], 10)) <= 2
        for b, after in zip(batches, batches[1:]):
            assert len(pack([lengths[i] for i in b + after[:1]], 10)) > 2
        epochs.append(batches)
    assert epochs[0] == epochs[2] and epochs[0] != epochs[1]  # the epoch's order, drawn again the same


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "distillspec"])  # DistillSpec does not pack
def test_a_token_budget_batch_gives_the_unpacked_samples_loss_and_gradients(family, chat, tmp_path):
    """The samples of one budget batch, packed into [rows, max_length], against the same samples one to a row."""
    recipe = load_recipe(f"toy_{family}", [f"data.path={chat}", f"checkpoint.output_dir={tmp_path / 'run'}",
                                           "training.max_steps=1", "eval.enabled=false", "data.packing=true",
                                           "data.max_length=256", "data.tokens_per_micro_batch=512",
                                           *DETERMINISTIC.get(family, [])])  # fmt: skip
    run = loop.build_run(recipe, False, False, loop.check_before_loading(recipe, False, False))
    indices = next(iter(run.loader.batch_sampler))
    samples = [dict(run.loader.dataset[i]) for i in indices]
    assert len(samples) > 2  # several answers share each row
    pad = pad_token_id_of(run.target.tokenizer)
    seen = {}
    for name, collate in (("unpacked", Collator(pad, 256)),
                          ("budget", Collator(pad, 256, True, **loop.batch_shapes(recipe, torch.device("cpu"))))):
        seen[name] = one_step(run, collate([dict(s) for s in samples]))
    (_, loss, tokens, grads), (shape, budget_loss, budget_tokens, budget_grads) = seen["unpacked"], seen["budget"]
    assert shape == (2, 256) and budget_tokens == tokens
    torch.testing.assert_close(budget_loss, loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == budget_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(budget_grads[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_token_budget_run_meets_one_batch_shape_and_counts_its_tokens(chat, tmp_path, monkeypatch):
    shapes = collections.Counter()
    real = loop.TrainStep.forward
    monkeypatch.setattr(loop.TrainStep, "forward", lambda self, batch, step, split="train": (
        shapes.update([(split, tuple(batch["input_ids"].shape))]), real(self, batch, step, split))[1])
    recipe = load_recipe("toy_eagle3", [f"data.path={chat}", f"checkpoint.output_dir={tmp_path / 'run'}",
                                        "training.max_steps=40", "training.log_every=10", "checkpoint.save_every=1000",
                                        "training.eval_every=20", "eval.enabled=false", "data.packing=true",
                                        "data.max_length=128", "data.tokens_per_micro_batch=256"])  # fmt: skip
    run_dir = loop.train(recipe, show_progress=False)
    assert {shape for _, shape in shapes} == {(2, 128)}, shapes
    assert shapes[("train", (2, 128))] == 40 and shapes[("eval", (2, 128))] > 0
    metrics = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "step" in m]
    seen = [m["train/tokens_seen"] for m in metrics if "train/tokens_seen" in m]
    assert seen[-1] > 40 * 128  # over half the budget filled with real tokens on average
