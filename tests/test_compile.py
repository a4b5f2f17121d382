"""training.compile: the EAGLE families' loss at fixed shapes, torch.compiled whole, gives the eager loss and
gradients, compiles a handful of graphs a run, and the families that cannot compile are refused with the reason."""

import pytest
import torch
from spine import make_chat_data
from torch._dynamo.utils import counters

from specdraft import train as loop
from specdraft.config import load_recipe
from specdraft.drafters import FAMILIES
from specdraft.errors import SpecdraftError

COMPILED = ["dflash", "eagle1", "eagle3"]
# EAGLE-1's feature noise off, DFlash's anchors at every answer position (the eager step draws as many as the
# fullest row offers, the fixed-shape one num_anchors, the rest masked): the two forms then compare value for value.
SETTINGS = {"eagle1": ["drafter.noise=none"], "eagle3": ["drafter.ttt_steps=3"], "dflash": ["drafter.num_anchors=4096"]}
BUDGET = ["data.packing=true", "data.max_length=256", "data.tokens_per_micro_batch=512"]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return make_chat_data(tmp_path_factory.mktemp("compile") / "chat.jsonl", n=24)


def built(family, chat, folder, *overrides):
    recipe = load_recipe(f"toy_{family}", [f"data.path={chat}", f"checkpoint.output_dir={folder}",
                                           "training.max_steps=1", "eval.enabled=false", *BUDGET, *overrides])
    return loop.build_run(recipe, False, False, loop.check_before_loading(recipe, False, False))


def loss_and_gradients(run, batch):
    run.optimizer.zero_grad(set_to_none=True)
    loss, metrics, _ = run.step_module(batch, 0)
    run.accelerator.backward(loss)
    grads = {n: p.grad.clone() for n, p in run.step_module.named_parameters() if p.grad is not None}
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, grads


@pytest.mark.parametrize("family", COMPILED)
def test_the_compiled_fixed_shape_loss_gives_the_eager_loss_and_gradients(family, chat, tmp_path):
    """The same weights and batch: the eager step (counted rows gathered), then the same drafter with its loss
    switched to fixed shapes, eager and compiled. float32; the fixed-shape form sums over other rows in another
    order, and inductor fuses: losses within 1e-5 relative, gradients within 1e-4."""
    torch.manual_seed(0)
    run = built(family, chat, tmp_path / "run", *SETTINGS[family])
    batch = next(iter(run.loader))
    eager = loss_and_gradients(run, batch)
    inner = run.accelerator.unwrap_model(run.step_module)
    drafter, target, caches, _ = inner._outside
    static = FAMILIES[family].static_loss(drafter)
    assert drafter.static_shapes
    for compute_loss in (static, torch.compile(static, dynamic=False, fullgraph=True)):
        inner._outside = (drafter, target, caches, compute_loss)
        loss, metrics, grads = loss_and_gradients(run, batch)
        torch.testing.assert_close(loss, eager[0], rtol=1e-5, atol=1e-6)
        for name in {"eagle1": ("acc_0", "loss_cls"), "eagle3": ("acc_0", "loss_0"), "dflash": ("acc_0", "loss_0")}[family]:
            torch.testing.assert_close(metrics[name], eager[1][name], rtol=1e-5, atol=1e-6, msg=name)
        assert grads.keys() == eager[2].keys() and grads
        for name in grads:
            torch.testing.assert_close(grads[name], eager[2][name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_compiled_40_step_run_compiles_at_most_three_graphs_and_learns(chat, tmp_path):
    """One graph for the training step, one for the held-out loss (no gradients, eval mode); the token budget
    keeps one batch shape, so nothing recompiles after."""
    torch._dynamo.reset()
    counters.clear()
    recipe = load_recipe("toy_eagle3", [f"data.path={chat}", f"checkpoint.output_dir={tmp_path / 'run'}",
                                        "training.max_steps=40", "training.log_every=10", "training.eval_every=20",
                                        "checkpoint.save_every=1000", "eval.enabled=false", "training.compile=true",
                                        *BUDGET])  # fmt: skip
    run_dir = loop.train(recipe, show_progress=False)
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 3, dict(counters["stats"])
    assert (run_dir / "drafter" / "model.safetensors").is_file()


@pytest.mark.parametrize("family", ["distillspec", "medusa1", "medusa2", "mlp_speculator"])
def test_a_family_that_cannot_compile_is_refused_with_its_reason_before_loading(family, chat, tmp_path):
    overrides = [f"data.path={chat}", f"checkpoint.output_dir={tmp_path / 'run'}", "training.compile=true"]
    recipe = load_recipe(f"toy_{family}", overrides)
    with pytest.raises(SpecdraftError, match=f"the {family} family does not compile: .*(host read|boolean mask)"):
        loop.check_before_loading(recipe, False, False)


def test_compiling_at_batch_shapes_that_change_every_step_is_refused(chat, tmp_path):
    recipe = load_recipe("toy_eagle3", [f"data.path={chat}", f"checkpoint.output_dir={tmp_path / 'run'}",
                                        "training.max_steps=1", "training.compile=true", "data.shapes=dynamic"])
    with pytest.raises(SpecdraftError, match="training.compile needs fixed batch shapes"):
        loop.build_run(recipe, False, False, loop.check_before_loading(recipe, False, False))
