"""The speedup predicted from the forwards a run made, priced on the device's verify-cost curve (issue 31, item 6)."""

import pytest
import torch
from tiny import tiny_llama

from specdraft.decoding.sources import PromptLookupSource
from specdraft.decoding.speculative import (
    DecodeOutput,
    Forward,
    TreeDrafting,
    plain_decode,
    speculative_decode,
    speculative_decode_batch,
)
from specdraft.evaluation.metrics import summarize
from specdraft.evaluation.verify_cost import (
    ForwardCosts,
    FixedProposal,
    flat_tree,
    forward_keys,
    measure_forward_costs,
    plain_step_seconds,
    predicted_seconds,
    predicted_speedup_from_forwards,
    sampled_keys,
)
from specdraft.target import FrozenTarget

VOCAB = 300


@pytest.fixture(scope="module")
def target():
    return FrozenTarget(tiny_llama(VOCAB, seed=0))


def prompt(length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.tensor([1]), torch.randint(3, VOCAB, (length - 1,), generator=g)])[None]


# ---------------------------------------------------------------- the formula, on figures written out by hand

COSTS = ForwardCosts({("plain", 1, 1): 0.010, ("chain", 1, 1): 0.011, ("chain", 6, 1): 0.020,
                      ("plain", 1, 4): 0.012, ("chain", 6, 4): 0.040, ("chain", 2, 4): 0.016})


def test_a_decode_is_priced_forward_by_forward_at_its_own_width_in_plain_steps_of_the_same_run():
    # 3 steps of 5 drafts (width 6: v = 2.0) and 2 steps where the source found nothing (width 1: v = 1.1),
    # as prompt lookup does
    forwards = [Forward("chain", 6, 0.002)] * 3 + [Forward("chain", 1, 0.0005)] * 2
    out = DecodeOutput(list(range(12)), [], prefill_seconds=0.05, seconds=0.2, forwards=forwards)
    plain = DecodeOutput(list(range(12)), [], prefill_seconds=0.04, seconds=0.2, forwards=[Forward("plain", 1, 0)] * 11)
    step = (0.2 - 0.04) / 11  # this run's plain step, the unit the curve's relative costs are priced in
    assert plain_step_seconds([plain]) == {1: pytest.approx(step)}
    expected = 0.05 + 3 * (2.0 * step + 0.002) + 2 * (1.1 * step + 0.0005)
    assert predicted_seconds(out, COSTS, {1: step}) == pytest.approx(expected)
    assert predicted_speedup_from_forwards([out], [plain], COSTS) == pytest.approx((12 / expected) / (12 / 0.2))


def test_the_rows_of_a_batch_are_each_charged_their_calls_forwards_at_that_batch_size():
    call = [Forward("chain", 6, 0.003), Forward("chain", 2, 0.001)]  # the widest row's drafts + 1, per step
    rows = [DecodeOutput([1, 2, 3], [], 0.1, 0.5, batch_rows=4, forwards=call) for _ in range(4)]
    plain_call = [Forward("plain", 1, 0.0)] * 2
    plain = [DecodeOutput([1, 2, 3], [], 0.1, 0.4, batch_rows=4, forwards=plain_call) for _ in range(4)]
    step = 0.15  # (0.4 - 0.1) / 2 forwards, per call
    call_seconds = 0.1 + (0.040 / 0.012 * step + 0.003) + (0.016 / 0.012 * step + 0.001)  # v at batch 4
    assert all(predicted_seconds(row, COSTS, {4: step}) == pytest.approx(call_seconds) for row in rows)
    assert predicted_speedup_from_forwards(rows, plain, COSTS) == pytest.approx(0.4 / call_seconds)
    assert predicted_speedup_from_forwards(rows, plain[:0], COSTS) is None  # no plain decoding at that batch


def test_widths_not_measured_are_read_off_the_line_between_the_nearest_two():
    costs = ForwardCosts({("tree", 5, 1): 0.010, ("tree", 9, 1): 0.018, ("tree", 17, 1): 0.026})
    assert costs("tree", 7, 1) == pytest.approx(0.014)
    assert costs("tree", 13, 1) == pytest.approx(0.022)
    assert costs("tree", 21, 1) == pytest.approx(0.030)  # beyond the widest: the last segment's line
    assert costs("tree", 3, 1) == pytest.approx(0.006)
    with pytest.raises(KeyError, match="no chain step at batch 1"):
        costs("chain", 3, 1)


def test_a_kind_with_many_widths_is_sampled_from_narrowest_to_widest():
    keys = {("tree", w, 1) for w in range(2, 40)} | {("chain", 6, 4)}
    kept = sampled_keys(keys)
    trees = [w for k, w, _ in kept if k == "tree"]
    assert trees[0] == 2 and trees[-1] == 39 and len(trees) == 8
    assert ("plain", 1, 1) in kept and ("plain", 1, 4) in kept and ("chain", 6, 4) in kept


def test_summarize_reports_the_prediction_only_with_a_curve():
    forwards = [Forward("chain", 6, 0.002)] * 3
    out = DecodeOutput(list(range(10)), [], 0.05, 0.2, forwards=forwards)
    plain = DecodeOutput(list(range(10)), [], 0.05, 0.3, forwards=[Forward("plain", 1, 0)] * 9)
    assert summarize([out], 5, [plain])["predicted_speedup_from_proposals"] is None
    assert summarize([out], 5, [plain], COSTS)["predicted_speedup_from_proposals"] == pytest.approx(
        predicted_speedup_from_forwards([out], [plain], COSTS))


# ---------------------------------------------------------------- what the decoders record


def test_plain_and_single_prompt_decodes_record_each_forward(target):
    ids = prompt()
    plain = plain_decode(target, ids, max_new_tokens=9)
    assert plain.forwards == [Forward("plain", 1, 0.0)] * 8
    for drafts in (0, 3):  # near the budget's end a step drafts fewer
        out = speculative_decode(target, FixedProposal(drafts), ids, k=3, max_new_tokens=9)
        assert [(f.kind, f.width) for f in out.forwards] == [("chain", s.num_drafted + 1) for s in out.steps]
        assert out.forwards[0].width == drafts + 1
        assert [f.draft_seconds for f in out.forwards] == [s.draft_seconds for s in out.steps]
    lookup = speculative_decode(target, PromptLookupSource(), ids, k=4, max_new_tokens=16)
    assert [f.width for f in lookup.forwards] == [s.num_drafted + 1 for s in lookup.steps]
    tree = speculative_decode(target, TreeDrafting(FixedProposal(0), flat_tree(4)), ids, k=3, max_new_tokens=9)
    assert {(f.kind, f.width) for f in tree.forwards} == {("tree", 5)}


def test_a_compiled_verify_is_recorded_at_its_padded_width(target):
    out = speculative_decode(target, FixedProposal(0), prompt(), k=3, max_new_tokens=6, compile_target=True)
    assert {(f.kind, f.width) for f in out.forwards} == {("chain", 4)}  # K + 1, whatever was proposed


def test_a_batch_records_its_calls_forwards_once_for_all_rows(target):
    ids = [prompt(12, seed=s)[0] for s in range(3)]
    sources = [FixedProposal(n) for n in (1, 3, 2)]
    outs = speculative_decode_batch(target, sources, ids, k=3, max_new_tokens=7)
    assert all(o.forwards is outs[0].forwards and o.batch_rows == 3 for o in outs)
    # each step as wide as its widest row's drafts + 1 (rows that stopped draft nothing)
    widest = [1 + max(o.steps[j].num_drafted for o in outs if j < len(o.steps)) for j in range(len(outs[0].forwards))]
    assert [(f.kind, f.width) for f in outs[0].forwards] == [("chain", w) for w in widest]
    assert widest[0] == 4
    plain = speculative_decode_batch(target, None, ids, max_new_tokens=7)
    assert plain[0].forwards == [Forward("plain", 1, 0.0)] * 6
    assert forward_keys(outs + plain) == {("chain", w, 3) for w in widest} | {("plain", 1, 3)}


def test_measured_curve_prices_every_key(target):
    keys = {("chain", 1, 1), ("chain", 4, 1), ("tree", 5, 1), ("chain", 3, 2)}
    costs = measure_forward_costs(target, prompt(), keys, steps=4, rounds=1)
    assert set(costs.seconds) == keys | {("plain", 1, 1), ("plain", 1, 2)}
    assert all(s > 0 for s in costs.seconds.values())
    assert ForwardCosts.from_json(costs.to_json()).seconds == costs.seconds


def test_precompile_makes_every_first_turn_cache_size_before_anything_is_timed(target, monkeypatch):
    """evaluate(compile_target=...) compiles a graph per (cache size, step width, tree) up front: here the calls
    it makes, recorded instead of compiled (a prompt near the context end gets the budget that is left)."""
    from specdraft.evaluation import run as eval_run_module
    from specdraft.evaluation.run import precompile

    calls = []

    class Recording:
        def new_cache(self, positions, width, tree=False):
            calls.append((positions, width, tree))

    monkeypatch.setattr(eval_run_module, "compiled_verify", lambda target, mode: Recording())
    widths = {(1, False), (6, False), (9, True)}
    precompile(target, True, [10, 40, 10, 500], 20, widths)
    context = target.config.max_position_embeddings  # 512: the 500-token prompt has 12 tokens of budget left
    assert sorted(calls) == sorted((min(length + 20, context), w, t) for length in (10, 40, 500) for w, t in widths)


def test_a_sampled_curve_verifies_as_a_drafter_does(target):
    """At T > 0 the fixed source gives V-wide draft distributions, so the measured step runs the exact verify a
    drafter's step runs (greedy steps compare tokens and need none)."""
    from specdraft.decoding.sampling import SamplingParams

    source = FixedProposal(3, VOCAB)
    pending = torch.tensor([[5]])
    assert source.propose(pending, 3, SamplingParams(), None).probs is None
    sampled = source.propose(pending, 3, SamplingParams(temperature=1.0), None)
    assert sampled.probs.shape == (1, 3, VOCAB) and sampled.probs.sum(-1).eq(1).all()
    costs = measure_forward_costs(target, prompt(), {("chain", 4, 1)}, steps=4, rounds=1,
                                  params=SamplingParams(temperature=1.0))
    assert set(costs.seconds) == {("chain", 4, 1), ("plain", 1, 1)}
