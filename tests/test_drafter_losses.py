"""drafter.loss: EAGLE-1, EAGLE-3, Medusa-1 and the MLP speculator train on the loss the recipe names
(losses.DRAFTER_LOSSES), against the target's distribution at the offset each family predicts."""

import pytest
import test_eagle
import test_medusa
import test_mlp_speculator
import torch

from specdraft import losses
from specdraft.contract import TrainingContext
from specdraft.drafters import get_family
from specdraft.drafters.medusa import MedusaConfig
from specdraft.drafters.mlp_speculator import MLPSpeculatorConfig, head_masks, mlp_speculator_needs, stage2_batch
from specdraft.errors import SpecdraftError


def eagle(family):
    def make(loss):
        target = test_eagle.tiny_target()
        return target, test_eagle.build(family, target, loss=loss, **test_eagle.FAMILY_CFG[family]), \
            test_eagle.make_batch()
    return make


def medusa(loss):
    target = test_medusa.tiny_target()
    return target, test_medusa.build(target, num_heads=3, distill=True, loss=loss), test_medusa.chat_batch()


def mlp_speculator(loss):
    target = test_mlp_speculator.tiny_target()
    return target, test_mlp_speculator.speculator(target, n_predict=3, inner_dim=32, loss=loss), \
        test_mlp_speculator.make_batch(B=2, T=12)


FAMILIES = {"eagle1": eagle("eagle1"), "eagle3": eagle("eagle3"), "medusa1": medusa, "mlp_speculator": mlp_speculator}
# the losses each family adds up: EAGLE-1 w_cls L_cls (plus L_reg), EAGLE-3 its TTT steps, the heads theirs
CALLS = {"eagle1": 1, "eagle3": 3, "medusa1": 3, "mlp_speculator": 3}


@pytest.mark.parametrize("name", ["tvd", "lk_alpha", "lk_hybrid"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_trains_on_the_loss_its_recipe_names(family, name, monkeypatch):
    """The named loss is what the family adds up, each time against a distribution (rows summing to 1), and the
    family's loss moves with it: a family that kept its cross-entropy never calls it."""
    target, drafter, batch = FAMILIES[family](name)
    calls, real = [], losses.DRAFTER_LOSSES[name]

    def recording(logits, target_probs, mask):
        calls.append((target_probs, mask))
        return real(logits, target_probs, mask)

    monkeypatch.setitem(losses.DRAFTER_LOSSES, name, recording)
    example = drafter.prepare(batch, TrainingContext(target))
    out = drafter.compute_loss(example.batch, example.target)
    assert len(calls) == CALLS[family]
    for probs, mask in calls:
        counted = probs[mask.bool()]
        assert counted.numel() and torch.allclose(counted.sum(-1), torch.ones(()), atol=1e-5)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    # and a few steps at it lower it
    optimizer = torch.optim.AdamW([p for p in drafter.trained_module().parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(15):
        value = drafter.compute_loss(example.batch, example.target).loss
        first = value.item() if first is None else first
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
    assert value.item() < first


def test_the_mlp_speculators_heads_compare_with_the_targets_distribution_of_the_token_they_predict(monkeypatch):
    """Head i at t predicts token t+i+2: its P is the target's softmax at t+i+1 (a teacher-forced forward)."""
    target, drafter, batch = mlp_speculator("tvd")
    assert drafter.needs.logits == "full" and mlp_speculator_needs(MLPSpeculatorConfig(), None).logits == "none"
    calls = []
    monkeypatch.setitem(losses.DRAFTER_LOSSES, "tvd", lambda logits, p, mask: calls.append(p) or p.sum() * 0)
    drafter.compute_loss(batch, target.forward_batch(batch))
    p = torch.softmax(target(batch["input_ids"]).logits.float(), -1)
    real = batch["attention_mask"].bool()
    masks = head_masks(real, real & batch["loss_mask"].bool(), 3, batch.get("seq_ids"))
    assert len(calls) == 3
    for i, (head_p, mask) in enumerate(zip(calls, masks)):  # the counted positions t only (b-major, in order)
        where = mask.nonzero()
        assert len(where) and torch.allclose(head_p, p[where[:, 0], where[:, 1] + i + 1], atol=1e-5), f"head {i}"


def test_mlp_stage2_keeps_the_logits_the_generated_tokens_were_drawn_from():
    """With an acceptance-aimed loss, stage 2 hands the loss the target's logits at every generated position (as
    a teacher-forced forward over the sequences gives them); with ce it keeps none."""
    target = test_mlp_speculator.tiny_target()
    batch = test_mlp_speculator.make_batch(B=2, T=12)
    settings = dict(n_predict=2, inner_dim=32, stage2_start_step=0, stage2_prompt_length=5, stage2_new_tokens=6)
    torch.manual_seed(0)
    generated, out = stage2_batch(target, batch, MLPSpeculatorConfig(**settings, loss="lk_hybrid"))
    ids, P = generated["input_ids"], 5
    teacher = target(ids).logits
    assert out.logits.shape == teacher.shape
    assert torch.allclose(out.logits[:, P - 1 : -1], teacher[:, P - 1 : -1], atol=1e-4)
    torch.manual_seed(0)
    same, plain = stage2_batch(target, batch, MLPSpeculatorConfig(**settings))
    assert torch.equal(same["input_ids"], ids) and plain.logits is None


def test_bad_loss_settings_are_refused():
    for family in ("eagle1", "eagle3", "medusa1", "mlp_speculator"):
        with pytest.raises(SpecdraftError, match="drafter.loss must be one of ce, tvd, lk_alpha, lk_hybrid"):
            get_family(family).config_cls(loss="kl")
    with pytest.raises(SpecdraftError, match="loss: tvd compares each head's distribution.*distill: true"):
        MedusaConfig(loss="tvd")
