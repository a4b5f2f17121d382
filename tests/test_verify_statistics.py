"""Statistical tests of verify: emitted tokens follow p (not q), acceptance = sum min(p, q).

Each scenario runs many independent one-row verify steps as one big batch through the
reference (the kernel is checked equal to it on the same inputs at the end of this file,
and in test_verify.py). A scenario returns ``Check``s: a statistic and the bound a correct
sampler stays under except with probability ``DELTA``. The bounds are derived, not tuned:

* emitted histogram, L1 distance from the expected distribution (``l1_check``): the mean
  is at most sum_x sqrt(P(x)(1 - P(x)) / n) (Jensen, bin by bin), and changing one of n
  samples moves the L1 by at most 2 / n, so McDiarmid's inequality bounds the excess.
* acceptance rate (``rate_check``): Hoeffding's inequality for n independent coin flips.
* acceptance counted over decodes (``martingale_check``): Freedman's inequality.

Seeds are fixed, so the tests are deterministic; DELTA is the chance that a seed would
have failed. tests/test_mutants_sampling.py runs the same scenarios on broken samplers and
asserts that they are rejected with margin (statistic at least twice the bound).
"""

import math
from dataclasses import dataclass

import torch

from specdraft.decoding import verify as verify_lib
from specdraft.decoding.sampling import draw_exponentials, draw_uniforms, sample
from specdraft.decoding.verify import VerifyInputs, expected_acceptance_rate

VOCAB = 8
NUM_STEPS = 40_000
DELTA = 1e-6  # chance that a correct sampler fails one check, for a random seed


# ---------------------------------------------------------------- checks with derived bounds


@dataclass
class Check:
    name: str
    statistic: float
    bound: float

    @property
    def passed(self) -> bool:
        return self.statistic < self.bound

    def __str__(self) -> str:
        return f"{self.name}: {self.statistic:.4f} (bound {self.bound:.4f})"


def l1_check(name: str, tokens: torch.Tensor, expected: torch.Tensor, delta: float = DELTA) -> Check:
    """L1 distance between the histogram of ``tokens`` (n independent draws) and ``expected``.

    E[L1] <= sum_x sqrt(P(x)(1 - P(x)) / n), and P(L1 - E[L1] >= t) <= exp(-n t^2 / 2)
    (McDiarmid, bounded differences 2 / n), so the bound is exceeded with probability <= delta.
    """
    n = len(tokens)
    expected = expected.double()
    histogram = torch.bincount(tokens, minlength=len(expected)).double() / n
    mean_bound = float(torch.sqrt(expected * (1 - expected) / n).sum())
    return Check(name, float((histogram - expected).abs().sum()), mean_bound + math.sqrt(2 * math.log(1 / delta) / n))


def rate_check(name: str, outcomes: torch.Tensor, expected: float, delta: float = DELTA) -> Check:
    """|mean - expected| of n independent 0/1 outcomes; Hoeffding: exceeded with probability <= delta."""
    n = len(outcomes)
    statistic = abs(float(outcomes.double().mean()) - float(expected))
    return Check(name, statistic, math.sqrt(math.log(2 / delta) / (2 * n)))


def martingale_check(name: str, outcomes: torch.Tensor, probabilities: torch.Tensor, delta: float = DELTA) -> Check:
    """|sum(outcome_i - P_i)| for 0/1 outcomes, each with probability P_i given everything before it.

    The sum is a martingale with increments in [-1, 1] and summed conditional variance
    w = sum P_i (1 - P_i). Freedman's inequality, P(|S| >= a) <= 2 exp(-a^2 / (2 (w + a / 3))),
    solved for a at probability delta (w taken as observed).
    """
    log_term = math.log(2 / delta)
    w = float((probabilities * (1 - probabilities)).sum())
    bound = log_term / 3 + math.sqrt((log_term / 3) ** 2 + 2 * w * log_term)
    return Check(name, abs(float(outcomes.double().sum() - probabilities.double().sum())), bound)


def assert_all_pass(checks: list[Check]) -> None:
    failed = [str(c) for c in checks if not c.passed]
    assert not failed, failed


def l1(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().sum())


# ---------------------------------------------------------------- running many verify steps


def verify_inputs(ps, qs, num_steps, g, deterministic_draft=None):
    """Inputs for num_steps independent verify steps, each one row drafting len(qs) tokens.

    Position j has target p_j = ps[j] and draft q_j = qs[j]; the bonus is drawn from ps[-1]
    (so ps has one more entry than qs). ``deterministic_draft``: every draft is that token,
    with q one-hot on it (draft_probs=None), as prompt lookup proposes.
    """
    k = len(qs)
    if deterministic_draft is None:
        draft_probs = torch.stack(qs).repeat(num_steps, 1)  # [N * K, V], row-major by step
        drafts = sample(draft_probs, g)
    else:
        drafts, draft_probs = torch.full((num_steps * k,), deterministic_draft), None
    target_probs = torch.stack(ps[:k]).repeat(num_steps, 1)
    bonus = sample(ps[-1].expand(num_steps, VOCAB), g)
    cu = torch.arange(1, num_steps + 1) * k
    uniforms, exponentials = draw_uniforms(num_steps * k, g), draw_exponentials(num_steps, VOCAB, g)
    greedy = torch.zeros(num_steps, dtype=torch.bool)
    return drafts, cu, draft_probs, target_probs, bonus, uniforms, exponentials, greedy


def run_steps(ps, qs, num_steps, g, lenience=1.0, deterministic_draft=None):
    """(output [N, K+1], num_accepted [N]) from the reference sampler, looked up at call time
    so that tests/test_mutants_sampling.py can swap in a broken one."""
    inputs = verify_inputs(ps, qs, num_steps, g, deterministic_draft)
    return verify_lib.verify_reference(VerifyInputs(*inputs, len(qs), lenience))


def one_position_checks(name, p, q, g, deterministic_draft=None, num_steps=NUM_STEPS):
    """One draft position: the emitted token follows p, and the draft is accepted with
    probability sum min(p, q) (for a deterministic draft d: p(d))."""
    output, num_accepted = run_steps([p, p], [q], num_steps, g, deterministic_draft=deterministic_draft)
    alpha = p[deterministic_draft] if deterministic_draft is not None else expected_acceptance_rate(p, q)
    return [
        l1_check(f"{name}: emitted vs p", output[:, 0], p),
        rate_check(f"{name}: acceptance vs sum min(p, q)", num_accepted, alpha),
    ]


# ---------------------------------------------------------------- scenarios


MIN_PAIR_DISTANCE = 0.4


def random_pair(g):
    """A target p and a draft q that disagree a lot (L1 distance >= MIN_PAIR_DISTANCE)."""
    while True:
        p = (torch.randn(VOCAB, generator=g) * 1.5).softmax(-1)
        q = (torch.randn(VOCAB, generator=g) * 1.5).softmax(-1)
        if l1(p, q) >= MIN_PAIR_DISTANCE:
            return p, q


def tempered_pair(g, power):
    """A target p and a draft q ~ p^power: the same ranking, a different sharpness.

    power > 1 (sharpened): q over-proposes p's mode, so the residual max(0, p - q) is zero
    there and its mode is another token; drawing the correction from p instead of the
    residual re-emits the mode too often.
    power < 1 (flattened): q under-proposes the mode and the residual sits on it; every token
    has p(x) < min(1, p(x) / q(x)), so accepting with p(x) rejects far too often.
    """
    logits = torch.randn(VOCAB, generator=g)
    return logits.softmax(-1), (power * logits).softmax(-1)


def half_mass_draft(g):
    """p with exactly half its mass on one token d, the deterministic draft: accepted half the
    time, so the correction after a rejection (which must never be d) carries half the output."""
    draft = int(torch.randint(VOCAB, (1,), generator=g))
    rest = torch.rand(VOCAB, generator=g)
    rest[draft] = 0
    p = 0.5 * rest / rest.sum()
    p[draft] = 0.5
    return p, draft


def random_pairs_scenario(seed=0):
    g = torch.Generator().manual_seed(seed)
    checks = []
    for i in range(6):
        p, q = random_pair(g)
        checks += one_position_checks(f"random pair {i}", p, q, g)
    return checks


def sharpened_draft_scenario(seed=5):
    g = torch.Generator().manual_seed(seed)
    p, q = tempered_pair(g, power=3.0)
    return one_position_checks("sharpened draft", p, q, g)


def flattened_draft_scenario(seed=8):
    g = torch.Generator().manual_seed(seed)
    p, q = tempered_pair(g, power=1 / 3)
    return one_position_checks("flattened draft", p, q, g)


def half_mass_deterministic_draft_scenario(seed=6):
    g = torch.Generator().manual_seed(seed)
    p, draft = half_mass_draft(g)
    return one_position_checks("deterministic draft with p = 0.5", p, None, g, deterministic_draft=draft)


def unlikely_deterministic_draft_scenario(seed=3):
    """A bad guess (the least likely token): rarely accepted, so the residual does the work."""
    g = torch.Generator().manual_seed(seed)
    p, _ = random_pair(g)
    return one_position_checks("deterministic draft = argmin p", p, None, g, deterministic_draft=int(p.argmin()))


def multi_token_scenario(seed=2, num_steps=60_000):
    """K = 3 drafts with different (p_j, q_j) per position, plus the bonus from p_4: the j-th
    emitted token of the rows that reach it follows p_j, and position j is accepted, given it
    is reached, with probability sum min(p_j, q_j)."""
    g = torch.Generator().manual_seed(seed)
    pairs = [random_pair(g) for _ in range(3)]
    ps = [p for p, _ in pairs] + [random_pair(g)[0]]
    qs = [q for _, q in pairs]
    output, num_accepted = run_steps(ps, qs, num_steps, g)
    checks = []
    for j in range(4):
        reached = num_accepted >= j  # rows whose first j drafts were all accepted
        checks.append(l1_check(f"position {j}: emitted vs p_{j}", output[reached, j], ps[j]))
        if j < 3:
            alpha = expected_acceptance_rate(ps[j], qs[j])
            checks.append(rate_check(f"position {j}: acceptance", num_accepted[reached] > j, alpha))
    return checks, ps


# ---------------------------------------------------------------- tests


def test_random_pairs_emit_p_and_accept_the_overlap_mass():
    checks = random_pairs_scenario()
    assert_all_pass(checks)
    # Each check could tell p's output from q's: their distance is over twice its bound.
    assert all(MIN_PAIR_DISTANCE > 2 * c.bound for c in checks if "emitted" in c.name)


def test_drafts_sharper_or_flatter_than_p_emit_p():
    p, q = tempered_pair(torch.Generator().manual_seed(5), power=3.0)
    residual = (p - q).clamp_min(0)
    assert residual.argmax() != p.argmax()  # the case that tells the residual from p
    assert_all_pass(sharpened_draft_scenario())
    assert_all_pass(flattened_draft_scenario())


def test_deterministic_drafts_also_emit_p():
    assert_all_pass(half_mass_deterministic_draft_scenario())
    assert_all_pass(unlikely_deterministic_draft_scenario())


def test_every_position_follows_its_target_through_a_multi_token_step():
    checks, ps = multi_token_scenario()
    assert_all_pass(checks)
    # Enough rows reached the bonus position to notice it drawn from p_3's neighbour p_2.
    assert l1(ps[3], ps[2]) > 2 * checks[-1].bound


def test_lenience_is_lossy_in_the_predicted_way():
    """With l < 1 a draft is accepted with min(1, p / (l q)); the output is then
    min(q, p / l) + (1 - sum min(q, p / l)) * norm(max(0, p - q)), not p."""
    g = torch.Generator().manual_seed(4)
    lenience = 0.5
    for p, q in [random_pair(g) for _ in range(3)]:
        output, num_accepted = run_steps([p, p], [q], NUM_STEPS, g, lenience=lenience)
        accepted_mass = torch.minimum(q, p / lenience)
        residual = (p - q).clamp_min(0)
        predicted = accepted_mass + (1 - accepted_mass.sum()) * residual / residual.sum()
        assert_all_pass([
            rate_check("acceptance vs sum min(q, p / l)", num_accepted, accepted_mass.sum()),
            l1_check("emitted vs predicted", output[:, 0], predicted),
        ])  # fmt: skip
        # It does accept more, and what comes out is not p: both gaps exceed twice the bounds.
        exact_check = rate_check("", num_accepted, expected_acceptance_rate(p, q))
        assert float(accepted_mass.sum() - expected_acceptance_rate(p, q)) > 2 * exact_check.bound
        assert l1(predicted, p) > 2 * l1_check("", output[:, 0], predicted).bound


def test_kernel_agrees_with_the_reference_on_these_scenarios():
    """The Triton kernel (interpreted on CPU) emits the reference's tokens on a small batch of
    each design above. 64 rows per design keep the interpreter's cost (a program per row) small."""
    from kernel_device import on_kernel_device

    from specdraft.decoding.verify import verify_triton

    verify_triton = on_kernel_device(verify_triton)

    g = torch.Generator().manual_seed(7)
    sharp_p, sharp_q = tempered_pair(g, power=3.0)
    flat_p, flat_q = tempered_pair(g, power=1 / 3)
    half_p, half_draft = half_mass_draft(g)
    pairs = [random_pair(g) for _ in range(4)]
    scenarios = [
        ([sharp_p, sharp_p], [sharp_q], None),
        ([flat_p, flat_p], [flat_q], None),
        ([half_p, half_p], [None], half_draft),
        ([p for p, _ in pairs], [q for _, q in pairs[:3]], None),
    ]
    for ps, qs, draft in scenarios:
        inputs = verify_inputs(ps, qs, 64, g, deterministic_draft=draft)
        ref_out, ref_n = verify_lib.verify_reference(VerifyInputs(*inputs, len(qs)))
        out, n = verify_triton(VerifyInputs(*inputs, len(qs)))
        assert torch.equal(out, ref_out) and torch.equal(n, ref_n)
        assert 0 < int(ref_n.sum()) and int((ref_n < len(qs)).sum()) > 0  # accepts and rejections both ran
