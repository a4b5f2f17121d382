"""Statistical tests of verify: emitted tokens follow p (not q), acceptance = sum min(p, q).

Each test runs many independent one-row verify steps as one big batch through
the reference (the kernel is tested equal to it in test_verify.py). Seeds are
fixed, so the tests are deterministic; the bounds are a few standard errors
(L1 error of an N-sample histogram over V tokens is about sqrt(2 V / (pi N))).
"""

import torch

from specdraft.decoding.sampling import draw_exponentials, draw_uniforms, sample
from specdraft.decoding.verify import expected_acceptance_rate, verify_reference

VOCAB = 8


def random_pair(g):
    """A target p and a draft q that disagree a lot (L1 distance >= 0.4)."""
    while True:
        p = (torch.randn(VOCAB, generator=g) * 1.5).softmax(-1)
        q = (torch.randn(VOCAB, generator=g) * 1.5).softmax(-1)
        if (p - q).abs().sum() >= 0.4:
            return p, q


def run_steps(ps, qs, num_steps, g, lenience=1.0, deterministic_draft=None):
    """num_steps independent verify steps, each one row drafting len(ps) tokens.

    Position j has target p_j = ps[j] and draft q_j = qs[j]; the bonus is drawn from ps[-1]
    (so ps has one more entry than qs). Returns (output [N, K+1], num_accepted [N]).
    """
    k = len(qs)
    q_flat = torch.stack(qs).repeat(num_steps, 1)  # [N * K, V], row-major by step
    if deterministic_draft is None:
        drafts = sample(q_flat, g)
        draft_probs = q_flat
    else:
        drafts = torch.full((num_steps * k,), deterministic_draft)
        draft_probs = None
    target_probs = torch.stack(ps[:k]).repeat(num_steps, 1)
    bonus = sample(ps[-1].expand(num_steps, VOCAB), g)
    cu = torch.arange(1, num_steps + 1) * k
    return verify_reference(
        drafts, cu, draft_probs, target_probs, bonus,
        draw_uniforms(num_steps * k, g), draw_exponentials(num_steps, VOCAB, g),
        torch.zeros(num_steps, dtype=torch.bool), k, lenience,
    )


def histogram(tokens):
    return torch.bincount(tokens, minlength=VOCAB).float() / len(tokens)


def l1(a, b):
    return float((a - b).abs().sum())


def test_first_token_converges_to_p_not_q():
    g = torch.Generator().manual_seed(0)
    errors_small, errors_large = [], []
    for _ in range(6):
        p, q = random_pair(g)
        small, _ = run_steps([p, p], [q], 500, g)
        large, _ = run_steps([p, p], [q], 40_000, g)
        errors_small.append(l1(histogram(small[:, 0]), p))
        errors_large.append(l1(histogram(large[:, 0]), p))
        assert errors_large[-1] < 0.03  # expected ~0.01 at N = 40k
        # Control: the draft distribution is nowhere near what comes out.
        assert l1(histogram(large[:, 0]), q) > 0.5 * l1(p, q)
    # More samples, closer to p (expected ratio sqrt(80) ~ 9).
    assert sum(errors_large) < sum(errors_small) / 3


def test_acceptance_rate_matches_overlap_mass():
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        p, q = random_pair(g)
        _, num_accepted = run_steps([p, p], [q], 40_000, g)
        measured = num_accepted.float().mean()
        # Standard error sqrt(a (1 - a) / N) <= 0.0025.
        assert abs(measured - expected_acceptance_rate(p, q)) < 0.01


def test_every_position_follows_its_target_through_a_multi_token_step():
    """K = 3 drafts with different (p_j, q_j) per position, plus the bonus from p_4:
    the j-th emitted token of the rows that reach it is distributed as p_j, and
    position j's acceptance, given it is reached, is sum min(p_j, q_j)."""
    g = torch.Generator().manual_seed(2)
    pairs = [random_pair(g) for _ in range(3)]
    ps = [p for p, _ in pairs] + [random_pair(g)[0]]
    qs = [q for _, q in pairs]
    output, num_accepted = run_steps(ps, qs, 60_000, g)
    for j in range(4):
        reached = num_accepted >= j  # rows whose first j drafts were all accepted
        assert l1(histogram(output[reached, j]), ps[j]) < 0.06
        if j < 3:
            accepted_here = (num_accepted[reached] > j).float().mean()
            assert abs(accepted_here - expected_acceptance_rate(ps[j], qs[j])) < 0.015
    assert int((num_accepted == 3).sum()) > 500  # the bonus position was really exercised


def test_deterministic_drafts_also_emit_p():
    g = torch.Generator().manual_seed(3)
    p, _ = random_pair(g)
    draft = int(p.argmin())  # a bad guess: rarely accepted, so the residual does the work
    output, num_accepted = run_steps([p, p], [p], 40_000, g, deterministic_draft=draft)
    assert l1(histogram(output[:, 0]), p) < 0.03
    assert abs(num_accepted.float().mean() - p[draft]) < 0.01  # accept with probability p(x)


def test_lenience_is_lossy_in_the_predicted_way():
    """With l < 1 a draft is accepted with min(1, p / (l q)); the output is then
    min(q, p / l) + (1 - sum min(q, p / l)) * norm(max(0, p - q)), not p."""
    g = torch.Generator().manual_seed(4)
    lenience = 0.5
    for p, q in [random_pair(g) for _ in range(3)]:
        output, num_accepted = run_steps([p, p], [q], 40_000, g, lenience=lenience)
        accepted_mass = torch.minimum(q, p / lenience)
        residual = (p - q).clamp_min(0)
        predicted = accepted_mass + (1 - accepted_mass.sum()) * residual / residual.sum()
        assert abs(num_accepted.float().mean() - accepted_mass.sum()) < 0.01
        assert l1(histogram(output[:, 0]), predicted) < 0.03
        assert num_accepted.float().mean() > expected_acceptance_rate(p, q) + 0.02  # it does accept more
        assert l1(histogram(output[:, 0]), p) > 0.1  # and what comes out is not p (predicted L1 >= 0.148)
