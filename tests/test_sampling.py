"""SamplingParams validation, the logits -> probs warping math, and the samplers.

The warping tests compare float32 softmax outputs with closed forms using torch.allclose's
defaults (rtol 1e-5, atol 1e-8): a few float32 roundings (1.2e-7 relative each) of numbers
below 1, with room to spare, and an absolute floor only for exact zeros.
"""

import math

import pytest
import torch
from test_verify_statistics import l1_check

from specdraft.decoding.sampling import (
    SamplingParams,
    draw_exponentials,
    draw_uniforms,
    logits_to_probs,
    sample,
    sample_with_exponentials,
)
from specdraft.errors import SpecdraftError


def probs_of(values, **params):
    """logits_to_probs on logits whose plain softmax is `values`."""
    return logits_to_probs(torch.tensor(values).log(), SamplingParams(**params))


# ---------------------------------------------------------------- SamplingParams


def test_defaults_are_greedy():
    assert SamplingParams().is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-0.5), "temperature must be a finite number >= 0.*use 0 for greedy"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_k=-1), "top_k must be an integer >= 0.*use 0 to turn top-k off"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\].*use 1.0 to turn nucleus sampling off"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.1), "top_p"),
    ],
)
def test_bad_params_raise_errors_naming_the_fix(kwargs, message):
    with pytest.raises(SpecdraftError, match=message):
        SamplingParams(**kwargs)


def test_edge_values_are_allowed():
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
    SamplingParams(temperature=2.0, top_k=1, top_p=1e-6)


# ---------------------------------------------------------------- logits_to_probs


def test_greedy_is_one_hot_of_first_argmax():
    logits = torch.tensor([[0.1, 2.0, 2.0, -1.0], [5.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    probs = logits_to_probs(logits, SamplingParams())
    assert probs.dtype == torch.float32
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_temperature_scales_logits():
    logits = torch.tensor([0.0, math.log(2.0), math.log(4.0)])  # softmax = [1, 2, 4] / 7
    assert torch.allclose(logits_to_probs(logits, SamplingParams(temperature=1.0)), torch.tensor([1, 2, 4]) / 7)
    # T = 2 takes square roots: [1, sqrt 2, 2] / (3 + sqrt 2)
    expected = torch.tensor([1.0, math.sqrt(2.0), 2.0]) / (3 + math.sqrt(2.0))
    assert torch.allclose(logits_to_probs(logits, SamplingParams(temperature=2.0)), expected)


def test_top_k_keeps_the_k_largest():
    probs = probs_of([0.1, 0.4, 0.2, 0.3], temperature=1.0, top_k=2)
    assert torch.allclose(probs, torch.tensor([0.0, 0.4, 0.0, 0.3]) / 0.7)
    # top_k >= vocab is a no-op.
    untouched = probs_of([0.1, 0.4, 0.2, 0.3], temperature=1.0, top_k=9)
    assert torch.allclose(untouched, torch.tensor([0.1, 0.4, 0.2, 0.3]))


def test_top_k_keeps_ties_at_the_cut():
    probs = probs_of([0.4, 0.4, 0.2], temperature=1.0, top_k=1)
    assert torch.allclose(probs, torch.tensor([0.5, 0.5, 0.0]))


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    values = [0.05, 0.5, 0.15, 0.3]
    # Sorted: 0.5, 0.3, 0.15, 0.05; mass before each: 0, 0.5, 0.8, 0.95.
    assert torch.allclose(probs_of(values, temperature=1.0, top_p=0.75), torch.tensor([0.0, 0.5, 0.0, 0.3]) / 0.8)
    assert torch.allclose(probs_of(values, temperature=1.0, top_p=0.85), torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95)
    # The most likely token always survives.
    assert torch.allclose(probs_of(values, temperature=1.0, top_p=1e-6), torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_top_k_then_top_p_in_that_order():
    # top-k=2 renormalises to [.625, .375]; then top-p=0.6 keeps only the first.
    # (top-p first would keep both: mass before the 0.3 token is only 0.5.)
    probs = probs_of([0.5, 0.3, 0.15, 0.05], temperature=1.0, top_k=2, top_p=0.6)
    assert torch.allclose(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_temperature_then_top_p():
    # T = 0.5 squares the probabilities: [.25, .09, .0225, .0025] / .365 = [.685, .247, .062, .007],
    # so top_p = 0.9 keeps two tokens (at T = 1 it would keep three).
    probs = probs_of([0.5, 0.3, 0.15, 0.05], temperature=0.5, top_p=0.9)
    assert torch.allclose(probs, torch.tensor([0.25, 0.09, 0.0, 0.0]) / 0.34)


def test_batched_shapes_and_rows_are_independent():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=g)
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    probs = logits_to_probs(logits, params)
    assert probs.shape == (2, 3, 11) and probs.dtype == torch.float32
    assert torch.allclose(probs.sum(-1), torch.ones(2, 3))
    assert torch.allclose(probs[1, 2], logits_to_probs(logits[1, 2], params))
    assert ((probs > 0).sum(-1) <= 5).all()


# ---------------------------------------------------------------- samplers


def test_exponential_race_samples_the_normalised_weights():
    weights = torch.tensor([2.0, 0.0, 1.0, 5.0, 2.0])  # unnormalised on purpose
    g = torch.Generator().manual_seed(0)
    draws = sample(weights.expand(200_000, 5), g)
    assert not (draws == 1).any()  # zero weight is never drawn
    check = l1_check("race histogram", draws, weights / weights.sum())  # derived bound: see its docstring
    assert check.passed, check


def test_sample_is_reproducible_with_a_generator():
    probs = torch.softmax(torch.randn(4, 6, 50, generator=torch.Generator().manual_seed(1)), -1)
    a = sample(probs, torch.Generator().manual_seed(7))
    b = sample(probs, torch.Generator().manual_seed(7))
    assert a.shape == (4, 6) and torch.equal(a, b)


def test_sample_with_exponentials_is_argmax_of_weight_over_noise():
    weights = torch.tensor([[0.2, 0.5, 0.3]])
    noise = torch.tensor([[0.1, 2.0, 1.0]])  # scores 2.0, 0.25, 0.3
    assert sample_with_exponentials(weights, noise).tolist() == [0]


def test_draws_have_the_right_shape_range_and_seed():
    u = draw_uniforms(1000, torch.Generator().manual_seed(3))
    assert u.shape == (1000,) and u.dtype == torch.float32 and (u >= 0).all() and (u < 1).all()
    e = draw_exponentials(4, 10_000, torch.Generator().manual_seed(3))
    assert e.shape == (4, 10_000) and (e > 0).all()
    # Exp(1) has mean 1 and standard deviation 1: the mean of n draws is within 5 standard
    # errors, 5 / sqrt(n), except with probability 6e-7 (normal limit; n = 40000).
    assert abs(float(e.mean()) - 1.0) < 5 / e.numel() ** 0.5
    assert torch.equal(e, draw_exponentials(4, 10_000, torch.Generator().manual_seed(3)))
