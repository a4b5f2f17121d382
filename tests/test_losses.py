"""specdraft.losses: each loss against a hand computation."""

import math

import pytest
import torch
import torch.nn.functional as F

from specdraft.losses import (
    eagle1_loss,
    feature_regression_loss,
    masked_mean,
    restrict_to_draft_vocab,
    soft_cross_entropy,
    ttt_accuracy_metrics,
    ttt_step_weights,
)


def test_masked_mean_counts_only_masked_positions_and_is_zero_when_nothing_counts():
    values = torch.tensor([[1.0, 2.0, 30.0]])
    assert masked_mean(values, torch.tensor([[1, 1, 0]])).item() == pytest.approx(1.5)
    assert masked_mean(values, torch.tensor([[True, False, True]])).item() == pytest.approx(15.5)
    assert masked_mean(values, torch.zeros(1, 3)).item() == 0.0


def test_feature_regression_is_smooth_l1_averaged_over_hidden_then_positions():
    predicted = torch.tensor([[[0.0, 0.0], [0.0, 0.0], [9.0, 9.0]]])
    target = torch.tensor([[[0.5, 3.0], [1.0, -0.2], [0.0, 0.0]]])
    # Smooth L1 (beta 1): 0.5 x^2 below 1, |x| - 0.5 above.
    position0 = (0.5 * 0.25 + (3.0 - 0.5)) / 2  # 1.3125
    position1 = (0.5 * 1.0 + 0.5 * 0.04) / 2  # 0.26
    loss = feature_regression_loss(predicted, target, torch.tensor([[1, 1, 0]]))
    assert loss.item() == pytest.approx((position0 + position1) / 2)


def test_soft_cross_entropy_by_hand_and_equal_to_hard_ce_for_one_hot_targets():
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 3.0]]])
    target = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])
    log_z0 = math.log(math.exp(2) + 2)
    expected0 = -(0.5 * (2 - log_z0) + 0.5 * (0 - log_z0))
    loss = soft_cross_entropy(logits, target, torch.tensor([[1, 0]]))
    assert loss.item() == pytest.approx(expected0, rel=1e-6)

    hard = F.cross_entropy(logits[0, 1:], torch.tensor([2]))
    assert soft_cross_entropy(logits, target, torch.tensor([[0, 1]])).item() == pytest.approx(hard.item(), rel=1e-6)


def test_soft_cross_entropy_sends_no_gradient_through_masked_positions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 3, 5, generator=g).requires_grad_()
    target = torch.softmax(torch.randn(1, 3, 5, generator=g), -1)
    soft_cross_entropy(logits, target, torch.tensor([[1, 0, 1]])).backward()
    assert logits.grad[0, 1].abs().sum() == 0
    assert logits.grad[0, 0].abs().sum() > 0


def test_eagle1_loss_is_regression_plus_weighted_classification():
    g = torch.Generator().manual_seed(0)
    pred, feat = torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g)
    logits, probs = torch.randn(2, 4, 11, generator=g), torch.softmax(torch.randn(2, 4, 11, generator=g), -1)
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]])
    total, reg, cls = eagle1_loss(pred, feat, logits, probs, mask, cls_weight=0.1)
    assert reg.item() == pytest.approx(feature_regression_loss(pred, feat, mask).item())
    assert cls.item() == pytest.approx(soft_cross_entropy(logits, probs, mask).item())
    assert total.item() == pytest.approx(reg.item() + 0.1 * cls.item())


def test_restrict_to_draft_vocab_renormalises_and_counts_target_top1_in_vocab():
    # Target vocabulary of 4; the draft keeps ids 1 and 3.
    t2d = torch.tensor([False, True, False, True])
    draft_to_target = torch.tensor([1, 3])
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]]))
    probs, counted = restrict_to_draft_vocab(logits, draft_to_target, t2d)
    assert torch.allclose(probs, torch.tensor([[0.2 / 0.6, 0.4 / 0.6], [0.5, 0.5]]))
    # Row 0's top-1 (id 3) is in the draft vocabulary; row 1's (id 0) is not.
    assert counted.tolist() == [True, False]


def test_ttt_step_weights_decay_geometrically():
    assert ttt_step_weights(4, 0.8) == pytest.approx([1.0, 0.8, 0.64, 0.512])


def test_ttt_accuracy_metrics_by_hand():
    # 4 chains; step 1 has one row fewer (it ran out of sequence).
    correct = [torch.tensor([[True, True, False, True]]), torch.tensor([[True, False, True]])]
    counted = [torch.tensor([[True, True, True, False]]), torch.tensor([[True, True, True]])]
    m = ttt_accuracy_metrics(correct, counted)
    assert m["acc_0"].item() == pytest.approx(2 / 3)  # rows 0..2 counted, rows 0 and 1 right
    assert m["cond_acc_0"].item() == pytest.approx(2 / 3)
    assert m["acc_1"].item() == pytest.approx(2 / 3)
    # Given step 0 counted and right (rows 0, 1), step 1 is right on row 0 only.
    assert m["cond_acc_1"].item() == pytest.approx(1 / 2)
    assert m["sim_accept_len"].item() == pytest.approx(2 / 3 + (2 / 3) * (2 / 3))


def test_ttt_accuracy_metrics_are_zero_not_nan_when_nothing_counts():
    m = ttt_accuracy_metrics([torch.ones(1, 3, dtype=torch.bool)], [torch.zeros(1, 3, dtype=torch.bool)])
    assert m["acc_0"].item() == 0.0 and m["cond_acc_0"].item() == 0.0 and m["sim_accept_len"].item() == 0.0
