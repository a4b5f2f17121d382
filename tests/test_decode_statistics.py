"""Speculative sampling through the whole decoder emits the target's distribution.

Two tiny random Llamas over a 12-token vocabulary are the target (p) and draft (q).
From a fixed prompt we decode three tokens many times with different seeds. The
first token comes from the prefill; the second and third come out of verify
steps (accepted drafts, recovered tokens, bonus tokens). Their marginal
frequencies must converge to the target's exact marginals, computed by brute
force over every possible earlier token, and stay far from the draft's (the
control). Seeds are fixed, so the tests are deterministic; the bounds are a few
standard errors: an N-sample histogram's L1 error is about sum_x sqrt(2 P(x) / (pi N)).
"""

import math

import pytest
import torch
from tiny import tiny_llama

from specdraft.decoding.sampling import SamplingParams, logits_to_probs
from specdraft.decoding.sources import DraftLMSource, PromptLookupSource
from specdraft.decoding.speculative import speculative_decode
from specdraft.target import FrozenTarget

VOCAB = 12
PROMPT = torch.tensor([[1, 5, 9, 3, 5, 9, 7]])


def peaked_llama(seed, logit_scale):
    """A random tiny Llama whose next-token distributions are far from uniform."""
    model = tiny_llama(VOCAB, seed=seed, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


@pytest.fixture(scope="module")
def models():
    return peaked_llama(seed=0, logit_scale=15.0), peaked_llama(seed=1, logit_scale=15.0)


@pytest.fixture(scope="module")
def exact_runs(models):
    """Temperature-1 decodes with the draft LM, shared by the exactness and lenience tests."""
    target, draft = models
    return decode_many(target, lambda: DraftLMSource(draft), SamplingParams(temperature=1.0), 1000)


def exact_marginals(model, params):
    """P(x1), P(x2), P(x3) of the model's own sampling from PROMPT, by enumerating x1 and (x1, x2)."""
    L = PROMPT.shape[1]
    p1 = logits_to_probs(model(PROMPT).logits[0, -1], params)  # [V]
    x1 = torch.arange(VOCAB)
    seqs1 = torch.cat([PROMPT.expand(VOCAB, L), x1[:, None]], dim=1)
    p2_given_1 = logits_to_probs(model(seqs1).logits[:, -1], params)  # [V(x1), V(x2)]
    seqs2 = torch.cat([seqs1.repeat_interleave(VOCAB, 0), x1.repeat(VOCAB)[:, None]], dim=1)
    p3_given_12 = logits_to_probs(model(seqs2).logits[:, -1], params).view(VOCAB, VOCAB, VOCAB)
    joint12 = p1[:, None] * p2_given_1
    return p1, joint12.sum(0), (joint12[..., None] * p3_given_12).sum((0, 1))


def draft_marginals(target, draft, params):
    """The control: x1 ~ p, then the draft's own x2 ~ q(. | x1) and x3 ~ q(. | x1, x2)."""
    p1, _, _ = exact_marginals(target, params)
    L = PROMPT.shape[1]
    x1 = torch.arange(VOCAB)
    seqs1 = torch.cat([PROMPT.expand(VOCAB, L), x1[:, None]], dim=1)
    q2_given_1 = logits_to_probs(draft(seqs1).logits[:, -1], params)
    seqs2 = torch.cat([seqs1.repeat_interleave(VOCAB, 0), x1.repeat(VOCAB)[:, None]], dim=1)
    q3_given_12 = logits_to_probs(draft(seqs2).logits[:, -1], params).view(VOCAB, VOCAB, VOCAB)
    joint12 = p1[:, None] * q2_given_1
    return joint12.sum(0), (joint12[..., None] * q3_given_12).sum((0, 1))


def decode_many(target_model, make_source, params, num_runs, k=2, lenience=1.0):
    target = FrozenTarget(target_model)
    tokens, steps = [], []
    for seed in range(num_runs):
        g = torch.Generator().manual_seed(seed)
        out = speculative_decode(
            target, make_source(), PROMPT, k=k, params=params, max_new_tokens=3, generator=g, lenience=lenience
        )
        tokens.append(out.tokens)
        steps.extend(out.steps)
    return torch.tensor(tokens), steps


def l1(a, b):
    return float((a - b).abs().sum())


def expected_l1(probs, n):
    """Mean L1 error of an n-sample histogram of probs (normal approximation per bin)."""
    return float(torch.sqrt(2 * probs * (1 - probs) / (math.pi * n)).sum())


def histogram(tokens):
    return torch.bincount(tokens, minlength=VOCAB).float() / len(tokens)


def check_marginals(tokens, p2, p3, q2=None, q3=None):
    """Positions 1 and 2 (the 2nd and 3rd tokens) both come out of verify steps."""
    num_runs = len(tokens)
    for position, p, q in ((1, p2, q2), (2, p3, q3)):
        few, many = histogram(tokens[: num_runs // 6, position]), histogram(tokens[:, position])
        assert l1(many, p) < 2.0 * expected_l1(p, num_runs)
        assert l1(many, p) < l1(few, p)  # converging
        if q is not None:  # and not to the draft's distribution
            assert l1(many, q) > l1(p, q) - 2.0 * expected_l1(p, num_runs)


def check_acceptance_matches_theory(steps):
    """Each tested draft is accepted with probability alpha = sum_x min(p, q) given its context,
    so (accepted - sum alpha) is a zero-mean martingale with variance sum alpha (1 - alpha)."""
    alphas = torch.tensor([a for s in steps for a in s.alpha_predicted])
    accepted = sum(s.num_accepted for s in steps)
    assert len(alphas) == sum(min(s.num_accepted + 1, s.num_drafted) for s in steps)
    assert 0.15 < float(alphas.mean()) < 0.85  # acceptance is neither trivial nor impossible
    spread = math.sqrt(float((alphas * (1 - alphas)).sum()))
    assert abs(accepted - float(alphas.sum())) < 4 * spread


def test_draft_lm_decoding_emits_target_marginals(models, exact_runs):
    target, draft = models
    params = SamplingParams(temperature=1.0)
    with torch.no_grad():
        _, p2, p3 = exact_marginals(target, params)
        q2, q3 = draft_marginals(target, draft, params)
    assert l1(p2, q2) > 0.5 and l1(p3, q3) > 0.5  # the control is really different
    tokens, steps = exact_runs
    check_marginals(tokens, p2, p3, q2, q3)
    check_acceptance_matches_theory(steps)


def test_warped_sampling_emits_warped_target_marginals(models):
    """Temperature, top-k and top-p apply to p and q alike, and the output follows the warped p."""
    target, draft = models
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.9)
    with torch.no_grad():
        _, p2, p3 = exact_marginals(target, params)
        q2, q3 = draft_marginals(target, draft, params)
    tokens, steps = decode_many(target, lambda: DraftLMSource(draft), params, 500)
    check_marginals(tokens, p2, p3, q2, q3)
    check_acceptance_matches_theory(steps)


def test_prompt_lookup_sampling_emits_target_marginals(models):
    """Deterministic drafts (q one-hot, probs=None) go through the same exact test."""
    target, _ = models
    params = SamplingParams(temperature=1.0)
    with torch.no_grad():
        _, p2, p3 = exact_marginals(target, params)
    tokens, steps = decode_many(target, lambda: PromptLookupSource(max_ngram=2), params, 500)
    assert sum(s.num_drafted for s in steps) > 500  # the repetitive prompt gives drafts
    assert sum(s.num_accepted for s in steps) > 15  # so both accepted and recovered tokens are tested
    check_marginals(tokens, p2, p3)


def test_lenience_is_lossy_and_accepts_more(models, exact_runs):
    """lenience < 1 (off by default) trades exactness for acceptance: more accepted, output drifts off p."""
    target, draft = models
    params = SamplingParams(temperature=1.0)
    with torch.no_grad():
        _, p2, _ = exact_marginals(target, params)
    num_runs = 300
    tokens, steps = decode_many(target, lambda: DraftLMSource(draft), params, num_runs, lenience=0.2)
    exact_steps = exact_runs[1]
    rate = lambda steps: sum(s.num_accepted for s in steps) / sum(s.num_drafted for s in steps)  # noqa: E731
    assert rate(steps) > rate(exact_steps) + 0.1
    assert l1(histogram(tokens[:, 1]), p2) > 3.0 * expected_l1(p2, num_runs)  # exact runs stay under 2x
