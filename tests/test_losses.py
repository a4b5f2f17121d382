"""specdraft.losses: each loss against its formula written out directly, and the properties that
define it (KL >= 0 and 0 at equality, JSD <= log 2, TVD in [0, 1], the beta limits of JSD(beta))."""

import math

import pytest
import torch
import torch.nn.functional as F

from specdraft.losses import (
    DRAFTER_LOSSES,
    acceptance_rate,
    binary_entropy,
    distillation_view,
    dpace_position_weights,
    forward_kl,
    forward_kl_from_hidden,
    generalized_jsd,
    lk_alpha_loss,
    lk_hybrid_loss,
    masked_mean,
    overlap,
    reverse_kl,
    smooth_l1,
    soft_cross_entropy,
    total_variation,
    tv_loss,
)

DIVERGENCES = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "jsd": generalized_jsd, "tvd": total_variation}


def logits_pair(seed=0, shape=(3, 5, 11), scale=3.0):
    """Draft and target logits, peaked enough that the distributions differ a lot."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale, torch.randn(shape, generator=g) * scale


def everywhere(logits):
    return torch.ones(logits.shape[:-1], dtype=torch.bool)


# -- direct formulas, in float64 with explicit sums ------------------------------------------------


def kl_by_hand(p, q):
    """sum_x p log(p / q) per position, 0 log 0 = 0."""
    return torch.where(p > 0, p * (p.log() - q.log()), torch.zeros_like(p)).sum(-1)


def probs64(logits):
    return torch.softmax(logits.double(), -1)


def test_masked_mean_counts_only_masked_positions_and_is_zero_when_nothing_counts():
    values = torch.tensor([[1.0, 2.0, 30.0]])
    assert masked_mean(values, torch.tensor([[1, 1, 0]])).item() == pytest.approx(1.5)
    assert masked_mean(values, torch.tensor([[True, False, True]])).item() == pytest.approx(15.5)
    assert masked_mean(values, torch.zeros(1, 3)).item() == 0.0


def test_smooth_l1_is_huber_averaged_over_hidden_then_positions():
    predicted = torch.tensor([[[0.0, 0.0], [0.0, 0.0], [9.0, 9.0]]])
    target = torch.tensor([[[0.5, 3.0], [1.0, -0.2], [0.0, 0.0]]])
    # Smooth L1 (beta 1): 0.5 x^2 below 1, |x| - 0.5 above.
    position0 = (0.5 * 0.25 + (3.0 - 0.5)) / 2  # 1.3125
    position1 = (0.5 * 1.0 + 0.5 * 0.04) / 2  # 0.26
    loss = smooth_l1(predicted, target, torch.tensor([[1, 1, 0]]))
    assert loss.item() == pytest.approx((position0 + position1) / 2)
    # beta 2: 0.5 x^2 / 2 below 2, |x| - 1 above
    wide = smooth_l1(predicted, target, torch.tensor([[1, 0, 0]]), beta=2.0)
    assert wide.item() == pytest.approx((0.25 * 0.25 + (3.0 - 1.0)) / 2)


def test_soft_cross_entropy_by_hand_and_equal_to_hard_ce_for_one_hot_targets():
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 3.0]]])
    target = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])
    log_z0 = math.log(math.exp(2) + 2)
    expected0 = -(0.5 * (2 - log_z0) + 0.5 * (0 - log_z0))
    loss = soft_cross_entropy(logits, target, torch.tensor([[1, 0]]))
    assert loss.item() == pytest.approx(expected0, rel=1e-6)

    hard = F.cross_entropy(logits[0, 1:], torch.tensor([2]))
    assert soft_cross_entropy(logits, target, torch.tensor([[0, 1]])).item() == pytest.approx(hard.item(), rel=1e-6)


def test_soft_cross_entropy_is_entropy_plus_forward_kl():
    """CE(P, Q) = H(P) + KL(P || Q): the two losses EAGLE and DistillSpec train on differ by a constant."""
    draft, target = logits_pair(seed=1)
    p = torch.softmax(target, -1)
    entropy = -(p * p.log()).sum(-1).mean()
    mask = everywhere(draft)
    assert soft_cross_entropy(draft, p, mask).item() == pytest.approx(
        (entropy + forward_kl(draft, target, mask)).item(), rel=1e-5)


def test_soft_cross_entropy_sends_no_gradient_through_masked_positions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 3, 5, generator=g).requires_grad_()
    target = torch.softmax(torch.randn(1, 3, 5, generator=g), -1)
    soft_cross_entropy(logits, target, torch.tensor([[1, 0, 1]])).backward()
    assert logits.grad[0, 1].abs().sum() == 0
    assert logits.grad[0, 0].abs().sum() > 0


def test_forward_and_reverse_kl_against_the_formula():
    draft, target = logits_pair(seed=2)
    p, q = probs64(target), probs64(draft)
    mask = torch.tensor([[1, 0, 1, 1, 0]] * 3, dtype=torch.bool)
    assert forward_kl(draft, target, mask).item() == pytest.approx(kl_by_hand(p, q)[mask].mean().item(), rel=1e-5)
    assert reverse_kl(draft, target, mask).item() == pytest.approx(kl_by_hand(q, p)[mask].mean().item(), rel=1e-5)
    assert forward_kl(draft, target, mask).item() != pytest.approx(reverse_kl(draft, target, mask).item(), rel=1e-2)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_generalized_jsd_against_the_formula(beta):
    draft, target = logits_pair(seed=3)
    p, q = probs64(target), probs64(draft)
    m = beta * p + (1 - beta) * q
    expected = (beta * kl_by_hand(p, m) + (1 - beta) * kl_by_hand(q, m)).mean()
    assert generalized_jsd(draft, target, everywhere(draft), beta).item() == pytest.approx(expected.item(), rel=1e-5)


def test_total_variation_against_the_formula():
    draft, target = logits_pair(seed=4)
    expected = 0.5 * (probs64(target) - probs64(draft)).abs().sum(-1).mean()
    assert total_variation(draft, target, everywhere(draft)).item() == pytest.approx(expected.item(), rel=1e-5)


# -- properties --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DIVERGENCES))
def test_divergences_are_nonnegative_and_zero_at_equality(name):
    divergence = DIVERGENCES[name]
    for seed in range(5):
        draft, target = logits_pair(seed=seed)
        assert divergence(draft, target, everywhere(draft)).item() > 1e-3  # different distributions
        # Per position too: the mean of a negative and a positive term could hide a sign error.
        for position in range(draft.shape[1]):
            one = torch.zeros(draft.shape[:-1], dtype=torch.bool)
            one[:, position] = True
            assert divergence(draft, target, one).item() >= 0.0
        # The same distribution from shifted logits: 0 up to float32 rounding.
        assert divergence(target + 5.0, target, everywhere(draft)).item() == pytest.approx(0.0, abs=1e-6)


def test_jsd_and_tvd_are_bounded_and_reach_the_bound_on_disjoint_supports():
    # P and Q on disjoint tokens (-inf logits elsewhere): JSD = log 2, TVD = 1, KL would be infinite.
    target = torch.tensor([[[0.0, 0.0, float("-inf"), float("-inf")]]])
    draft = torch.tensor([[[float("-inf"), float("-inf"), 0.0, 0.0]]])
    mask = everywhere(draft)
    assert generalized_jsd(draft, target, mask).item() == pytest.approx(math.log(2), rel=1e-6)
    assert total_variation(draft, target, mask).item() == pytest.approx(1.0, rel=1e-6)
    for beta in (0.1, 0.3, 0.7):  # the weights' entropy bounds JSD(beta), and is reached here
        assert generalized_jsd(draft, target, mask, beta).item() == pytest.approx(binary_entropy(beta), rel=1e-5)
    for seed in range(10):
        d, t = logits_pair(seed=seed, scale=20.0)  # nearly one-hot: close to the bounds
        assert 0.0 <= total_variation(d, t, everywhere(d)).item() <= 1.0
        for beta in (0.05, 0.5, 0.95):
            value = generalized_jsd(d, t, everywhere(d), beta).item()
            assert 0.0 <= value <= binary_entropy(beta) + 1e-6 <= math.log(2) + 1e-6


def test_jsd_beta_limits_are_forward_and_reverse_kl():
    """JSD(beta) / beta -> KL(P || Q) as beta -> 0; JSD(beta) / (1 - beta) -> KL(Q || P) as beta -> 1."""
    draft, target = logits_pair(seed=6, scale=1.0)
    mask = everywhere(draft)
    fkl, rkl = forward_kl(draft, target, mask).item(), reverse_kl(draft, target, mask).item()
    for eps in (1e-2, 1e-3):
        low = generalized_jsd(draft, target, mask, eps).item() / eps
        high = generalized_jsd(draft, target, mask, 1 - eps).item() / eps
        assert low == pytest.approx(fkl, rel=20 * eps) and high == pytest.approx(rkl, rel=20 * eps)
    # At the ends the formula is 0; TRL's convention (and ours): beta = 0 is forward KL, beta = 1 reverse KL.
    assert generalized_jsd(draft, target, mask, 0.0).item() == fkl
    assert generalized_jsd(draft, target, mask, 1.0).item() == rkl
    # Swapping P and Q swaps beta and 1 - beta.
    assert generalized_jsd(draft, target, mask, 0.3).item() == pytest.approx(
        generalized_jsd(target, draft, mask, 0.7).item(), rel=1e-5)
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(draft, target, mask, 1.5)


def test_tvd_is_one_minus_the_speculative_acceptance_rate():
    """sum_x min(p, q) = 1 - TVD (Leviathan et al. 2023): the rate the decoder's verify accepts at."""
    draft, target = logits_pair(seed=7)
    p, q = torch.softmax(target, -1), torch.softmax(draft, -1)
    accept = torch.minimum(p, q).sum(-1).mean()
    assert total_variation(draft, target, everywhere(draft)).item() == pytest.approx(1 - accept.item(), rel=1e-5)


@pytest.mark.parametrize("name", sorted(DIVERGENCES))
def test_divergences_count_only_masked_positions_and_send_no_gradient_elsewhere(name):
    divergence = DIVERGENCES[name]
    draft, target = logits_pair(seed=8)
    draft.requires_grad_()
    mask = torch.zeros(draft.shape[:-1], dtype=torch.bool)
    mask[:, 1] = True
    value = divergence(draft, target, mask)
    value.backward()
    assert draft.grad[:, 0].abs().sum() == 0 and draft.grad[:, 1].abs().sum() > 0
    assert torch.isfinite(draft.grad).all()
    assert divergence(draft, target, torch.zeros_like(mask)).item() == 0.0  # nothing counted: 0, not NaN


def test_divergences_are_finite_with_masked_out_vocabulary_entries():
    """-inf logits (tokens a vocabulary map excludes) add 0 and give no NaN, value or gradient."""
    draft, target = logits_pair(seed=9)
    target[..., :3] = float("-inf")
    draft = draft.clone().requires_grad_()
    for name in ("forward_kl", "jsd", "tvd"):
        value = DIVERGENCES[name](draft, target, everywhere(draft))
        value.backward()
        assert torch.isfinite(value) and torch.isfinite(draft.grad).all(), name
        draft.grad = None


def test_acceptance_rate_is_the_sum_of_minima_by_hand():
    draft, target = logits_pair(seed=10)
    mask = torch.tensor([[1, 1, 0, 1, 0]] * 3, dtype=torch.bool)
    by_hand = torch.minimum(probs64(target), probs64(draft)).sum(-1)[mask].mean()
    assert acceptance_rate(draft, target, mask).item() == pytest.approx(by_hand.item(), rel=1e-5)


def test_distillation_view_applies_one_temperature_to_both_and_keeps_the_targets_top_k():
    draft, target = logits_pair(seed=11)
    warm_d, warm_t = distillation_view(draft, target, temperature=2.0)
    assert torch.equal(warm_d, draft / 2.0) and torch.equal(warm_t, target / 2.0)
    top_d, top_t = distillation_view(draft, target, temperature=0.5, top_k=3)
    assert top_d.shape == (*draft.shape[:-1], 3)
    # By hand, at one position: the target's three largest logits, and the draft's logits at those ids.
    ids = sorted(range(11), key=lambda i: -target[1, 2, i].item())[:3]
    assert sorted(top_t[1, 2].tolist()) == pytest.approx(sorted((target[1, 2, ids] / 0.5).tolist()))
    assert sorted(top_d[1, 2].tolist()) == pytest.approx(sorted((draft[1, 2, ids] / 0.5).tolist()))
    # Over its top-k the divergence compares renormalised distributions: P_k(x) = P(x) / P(top-k).
    p_k = probs64(target[1, 2, ids])
    q_k = probs64(draft[1, 2, ids])
    one = torch.zeros(draft.shape[:-1], dtype=torch.bool)
    one[1, 2] = True
    fkl = forward_kl(*distillation_view(draft, target, top_k=3), one)
    assert fkl.item() == pytest.approx(kl_by_hand(p_k, q_k).item(), rel=1e-5)
    assert distillation_view(draft, target, top_k=50)[1].shape[-1] == 11  # k >= V: the whole vocabulary
    with pytest.raises(ValueError, match="temperature"):
        distillation_view(draft, target, temperature=0.0)
    with pytest.raises(ValueError, match="top_k"):
        distillation_view(draft, target, top_k=0)


@pytest.mark.parametrize("name", sorted(DIVERGENCES))
def test_gradients_are_finite_where_p_or_q_is_exactly_zero(name):
    """Zero probabilities from -inf logits (a top-k or vocabulary mask): on both sides at once, and on
    one side wherever the divergence stays finite there (KL(P || Q) is infinite where Q = 0 < P)."""
    draft, target = logits_pair(seed=12)
    target[..., 9:] = draft[..., 9:] = float("-inf")  # P = Q = 0
    if name != "reverse_kl":
        target[..., :2] = float("-inf")  # P = 0 < Q
    if name != "forward_kl":
        draft[..., 2:4] = float("-inf")  # Q = 0 < P
    draft.requires_grad_()
    value = DIVERGENCES[name](draft, target, everywhere(draft))
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(draft.grad).all()
    assert draft.grad.abs().sum() > 0


# -- acceptance-aimed drafter losses (drafter.loss) -------------------------------------------------------

# One position worked by hand: P = (0.5, 0.3, 0.2), Q = (0.2, 0.5, 0.3): alpha = 0.2 + 0.3 + 0.2 = 0.7,
# TVD = (0.3 + 0.2 + 0.1) / 2 = 0.3.
HAND_P = torch.tensor([[0.5, 0.3, 0.2]])
HAND_Q = torch.tensor([[0.2, 0.5, 0.3]])
HAND_KL = 0.5 * math.log(0.5 / 0.2) + 0.3 * math.log(0.3 / 0.5) + 0.2 * math.log(0.2 / 0.3)


def test_acceptance_losses_at_a_hand_worked_position():
    logits, one = HAND_Q.log(), torch.ones(1, dtype=torch.bool)
    assert overlap(logits, HAND_P).item() == pytest.approx(0.7, abs=1e-6)
    assert tv_loss(logits, HAND_P, one).item() == pytest.approx(0.3, abs=1e-6)
    assert lk_alpha_loss(logits, HAND_P, one).item() == pytest.approx(-math.log(0.7), abs=1e-6)
    weight = math.exp(-3.0 * 0.7)
    assert lk_hybrid_loss(logits, HAND_P, one).item() == pytest.approx(weight * HAND_KL + (1 - weight) * 0.3,
                                                                      abs=1e-6)
    assert DRAFTER_LOSSES["ce"] is soft_cross_entropy  # today's loss, by its recipe name


def alpha_gradient_by_hand(p, q):
    """d alpha / d z_j for Q = softmax(z): alpha = sum_x min(p_x, q_x) moves with q_x where q_x < p_x, and
    dq_x / dz_j = q_x (delta_xj - q_j), so the gradient is [q_j < p_j] q_j - q_j sum_{x: q_x < p_x} q_x."""
    below = (q < p).double()
    return below * q - q * (below * q).sum(-1, keepdim=True)


def test_acceptance_loss_gradients_against_the_hand_derivation():
    draft, target = logits_pair(seed=5, shape=(4, 9))
    p = F.softmax(target.double(), -1)
    q = F.softmax(draft.double(), -1)
    alpha, d_alpha = torch.minimum(p, q).sum(-1, keepdim=True), alpha_gradient_by_hand(p, q)
    weight = torch.exp(-3.0 * alpha)
    expected = {
        tv_loss: -d_alpha,
        lk_alpha_loss: -d_alpha / alpha,
        # lambda is held fixed (sg[alpha]): KL's gradient q - p, plus TVD's, mixed by it
        lk_hybrid_loss: weight * (q - p) - (1 - weight) * d_alpha,
    }
    for loss, by_hand in expected.items():
        z = draft.clone().requires_grad_(True)
        loss(z, p.float(), torch.ones(4, dtype=torch.bool)).backward()
        # the masked mean over 4 positions divides each position's gradient by 4
        assert torch.allclose(z.grad.double(), by_hand / 4, atol=1e-6), loss.__name__


def test_acceptance_losses_count_only_masked_positions_and_zero_probabilities_are_finite():
    draft, target = logits_pair(seed=6, shape=(2, 3, 7))
    p = F.softmax(target, -1)
    p[0, 0] = torch.nn.functional.one_hot(torch.tensor(2), 7).float()  # a one-hot P: zeros elsewhere
    mask = torch.tensor([[True, False, True], [False, True, False]])
    for loss in (tv_loss, lk_alpha_loss, lk_hybrid_loss):
        z = draft.clone().requires_grad_(True)
        value = loss(z, p, mask)
        value.backward()
        assert torch.isfinite(value) and torch.isfinite(z.grad).all(), loss.__name__
        assert value.item() == pytest.approx(loss(draft[mask], p[mask], torch.ones(3, dtype=torch.bool)).item())
        assert (z.grad[~mask] == 0).all(), loss.__name__  # uncounted positions get no gradient
    # for a one-hot P, -log alpha is the cross-entropy -log Q(y)
    one = torch.ones(1, dtype=torch.bool)
    assert lk_alpha_loss(draft[0, :1], p[0, :1], one).item() == pytest.approx(
        F.cross_entropy(draft[0, :1], torch.tensor([2])).item(), rel=1e-5)


def test_forward_kl_from_hidden_in_chunks_is_forward_kl_of_the_whole_logits():
    """Each row's value and gradient are forward_kl's, with the LM head (soft-capped, as Gemma's) applied a chunk
    of rows at a time; the rows (7) are not a multiple of the chunk (3); without autograd it gives the value alone."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 8, generator=g)
    head = lambda h: (30.0 * torch.tanh(F.linear(h, weight) / 30.0)).float()
    draft, target = torch.randn(7, 8, generator=g) * 2, torch.randn(7, 8, generator=g) * 2
    by_chunks, whole = draft.clone().requires_grad_(), draft.clone().requires_grad_()
    value = forward_kl_from_hidden(by_chunks, target, head, head, chunk_rows=3)
    expected = forward_kl(head(whole), head(target), torch.ones(7, dtype=torch.bool))
    (3.0 * value).backward()
    (3.0 * expected).backward()
    torch.testing.assert_close(value, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(by_chunks.grad, whole.grad, rtol=1e-5, atol=1e-6)  # float32 rounding: ~1 ulp
    assert by_chunks.grad.abs().sum() > 0
    with torch.no_grad():
        assert forward_kl_from_hidden(draft, target, head, head, 3).item() == pytest.approx(expected.item(), rel=1e-6)
    empty = torch.zeros(0, 8, requires_grad=True)  # no counted row: 0, as forward_kl's masked mean gives
    assert forward_kl_from_hidden(empty, empty.detach(), head, head, 3).item() == 0.0


def test_dpace_weights_are_the_suffix_sums_of_the_smoothed_confidence_products():
    """D-PACE Eq. 7-8, by hand: q = [.2, .6, 1], alpha .5 -> q~ = [.6, .8, 1], products [.6, .48, .48],
    w = [1.56, .96, .48]. An uncounted position is 1 in the products, adds nothing and weighs 0; alpha 1 counts the
    positions left; the weights carry no gradient."""
    q = torch.tensor([[0.2, 0.6, 1.0]], requires_grad=True)
    every = torch.ones(1, 3, dtype=torch.bool)
    w = dpace_position_weights(q, every, alpha=0.5)
    torch.testing.assert_close(w, torch.tensor([[1.56, 0.96, 0.48]]))
    assert not w.requires_grad
    middle_off = torch.tensor([[True, False, True]])
    torch.testing.assert_close(dpace_position_weights(q, middle_off, alpha=0.5), torch.tensor([[1.2, 0.0, 0.6]]))
    torch.testing.assert_close(dpace_position_weights(q, every, alpha=1.0), torch.tensor([[3.0, 2.0, 1.0]]))
