"""Tests of the tests: broken samplers must fail the statistical checks, with margin.

Each mutant is one small edit to the product's source, the kind of slip a refactor makes.
``mutate`` recompiles the edited function and patches it in place (in its module or
class), so the real code path runs with the one change. Every mutant is paired with the
scenarios that should catch it, and on the mutant the named check's statistic must be at
least twice its bound. The scenarios are the very functions the statistical tests call on
the real code (tests/test_verify_statistics.py, tests/test_decode_statistics.py), where
every check must pass; the cheap verify scenarios are also rerun here on the real code.
Run with ``pytest -s`` to see each mutant's statistic and bound.
"""

import pytest
import test_batched
import test_decode_statistics as decode_stats
import test_verify
import test_verify_statistics as verify_stats
from mutation import mutate

from specdraft.decoding import sources, speculative
from specdraft.decoding import verify as verify_lib
from specdraft.drafters.eagle_common import EagleDraftSource

MARGIN = 2.0  # a mutant must push its check's statistic to at least this many times the bound

# name -> (owner of the function, function name, original source text, mutated text)
MUTANTS = {
    # After a rejection, draw from p instead of the residual norm(max(0, p - q)).
    "correction from p": (verify_lib, "recover_token", "(p - q).clamp_min(0.0) / exponentials", "p / exponentials"),
    # Accept with probability p(x) instead of min(1, p(x) / q(x)).
    "accept ignores q": (
        verify_lib, "verify_reference", "uniforms.float() * (lenience32 * q_x) < p_x", "uniforms.float() < p_x",
    ),
    # EAGLE-3 with a reduced vocabulary: q left at draft ids instead of moved to target ids by d2t.
    "q not mapped through d2t": (
        EagleDraftSource, "_to_target_vocab", "full.index_copy_(1, mapping, q)",
        "full.index_copy_(1, torch.arange(q.shape[1], device=q.device), q)",
    ),
    # ... or the drafted ids themselves left as draft ids.
    "drafts not mapped through d2t": (EagleDraftSource, "_to_target_ids", "mapping[draft_ids]", "draft_ids"),
    # The draft LM's q handed to verify unwarped (softmax of its logits), while its drafts are drawn from the
    # warped q: verify sees q without temperature, top-k or top-p.
    "verify sees q without warping": (
        sources, "draw_drafts", "return sample(q, generator), q",
        "return sample(q, generator), torch.softmax(logits.float(), -1)",
    ),
    # A batch's bonus token drawn from p at its last draft's position instead of the position after it.
    "bonus from the last draft's position": (
        speculative, "_verify_chains", "p[rows_t, torch.tensor(counts, device=device)]",
        "p[rows_t, torch.tensor(counts, device=device) - 1]",
    ),
}  # fmt: skip


def named(checks, fragment: str):
    """The checks whose name contains ``fragment`` (at least one)."""
    found = [c for c in checks if fragment in c.name]
    assert found, (fragment, [c.name for c in checks])
    return found


def assert_rejected_with_margin(monkeypatch, mutant: str, checks_of, fragment: str) -> None:
    """On the mutant, the check named ``fragment`` among ``checks_of()`` fails with
    statistic >= MARGIN * bound."""
    mutate(monkeypatch, *MUTANTS[mutant])
    broken = named(checks_of(), fragment)
    print(mutant, "|", "; ".join(map(str, broken)))  # the figures, shown with pytest -s
    assert max(c.statistic / c.bound for c in broken) >= MARGIN, [str(c) for c in broken]


# Which verify scenario and check must catch each mutant. These are cheap, so each test also
# runs the scenario on the real code first and asserts that every check passes.
VERIFY_CASES = [
    ("correction from p", verify_stats.half_mass_deterministic_draft_scenario, "emitted"),
    ("correction from p", verify_stats.sharpened_draft_scenario, "emitted"),
    ("accept ignores q", verify_stats.flattened_draft_scenario, "acceptance"),
    ("accept ignores q", verify_stats.flattened_draft_scenario, "emitted"),
]


@pytest.mark.parametrize(
    "mutant,scenario,fragment", VERIFY_CASES, ids=[f"{m}-{s.__name__}-{f}" for m, s, f in VERIFY_CASES]
)
def test_verify_mutants_are_rejected(monkeypatch, mutant, scenario, fragment):
    verify_stats.assert_all_pass(scenario())
    assert_rejected_with_margin(monkeypatch, mutant, scenario, fragment)


# Whole decodes: the scenarios of tests/test_decode_statistics.py, whose tests run the same
# calls on the real code (a decode scenario costs seconds, so it is not repeated here).
DECODE_CASES = [
    ("correction from p", "draft LM", "draft-favoured"),
    ("correction from p", "prompt lookup", "draft-favoured"),
    ("q not mapped through d2t", "eagle3", "marginal"),
    ("drafts not mapped through d2t", "eagle3", "marginal"),
    ("verify sees q without warping", "warped draft LM", "draft-favoured"),
    ("bonus from the last draft's position", "batched draft LM", "bonus"),
]
DECODE_SCENARIOS = {
    "draft LM": decode_stats.draft_lm_scenario,
    "prompt lookup": decode_stats.prompt_lookup_scenario,
    "eagle3": lambda: decode_stats.eagle_scenario("eagle3"),
    "warped draft LM": lambda: decode_stats.warped_draft_lm_scenario(),
    "batched draft LM": lambda: test_batched.bonus_token_scenario(),
}


@pytest.mark.parametrize("mutant,scenario,fragment", DECODE_CASES, ids=["-".join(case) for case in DECODE_CASES])
def test_decode_mutants_are_rejected(monkeypatch, mutant, scenario, fragment):
    assert_rejected_with_margin(monkeypatch, mutant, lambda: DECODE_SCENARIOS[scenario]()[0], fragment)


# The hand-worked verify cases that pin each mutant's mistake (tests/test_verify.py).
HAND_WORKED = [
    ("correction from p", test_verify.test_correction_is_the_residuals_winner_not_ps),
    ("accept ignores q", test_verify.test_draft_likelier_under_p_than_q_is_always_accepted),
]


@pytest.mark.parametrize("mutant,case", HAND_WORKED, ids=[m for m, _ in HAND_WORKED])
def test_hand_worked_cases_catch_the_verify_mutants(monkeypatch, mutant, case):
    case("reference")
    mutate(monkeypatch, *MUTANTS[mutant])
    # test_verify.IMPLS holds the reference function itself: point it at the mutant too.
    monkeypatch.setitem(test_verify.IMPLS, "reference", verify_lib.verify_reference)
    with pytest.raises(AssertionError):
        case("reference")
