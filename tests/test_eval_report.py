"""Eval metrics (pure functions, hand-computed values) and the report writers."""

import copy
import json

import pytest

from specdraft.decoding.speculative import DecodeOutput, StepStats
from specdraft.evaluation import metrics, report


def step(drafted, accepted, draft_s=0.0, target_s=0.0, alphas=None):
    if alphas is None:
        alphas = [1.0] * accepted + [0.0] * (accepted < drafted)
    return StepStats(drafted, accepted, draft_s, target_s, alphas)


# Three steps with K = 4: all accepted; two accepted then a rejection; an immediate rejection.
STEPS = [
    step(4, 4, 0.4, 1.0, [0.9, 0.8, 0.9, 0.8]),
    step(4, 2, 0.4, 1.0, [0.7, 0.6, 0.1]),
    step(4, 0, 0.4, 1.0, [0.2]),
]


def test_acceptance_length_counts_the_bonus_token():
    assert metrics.acceptance_length(STEPS) == (5 + 3 + 1) / 3
    assert metrics.acceptance_length([]) == 1.0


def test_position_acceptance_is_conditional_on_reaching_the_position():
    # Position 1 tested 3 times (accepted twice), 2: twice (2), 3: twice (1), 4: once (1).
    assert metrics.position_acceptance(STEPS, 4) == [2 / 3, 1.0, 0.5, 1.0]
    assert metrics.position_acceptance([step(2, 2)], 4) == [1.0, 1.0, None, None]


def test_alpha_measured_and_predicted_cover_the_same_positions():
    # Tested = 4 + 3 + 1 = 8 positions, 6 of them accepted.
    assert metrics.measured_alpha(STEPS) == 6 / 8
    assert metrics.predicted_alpha(STEPS) == pytest.approx((0.9 + 0.8 + 0.9 + 0.8 + 0.7 + 0.6 + 0.1 + 0.2) / 8)
    assert metrics.measured_alpha([step(0, 0)]) is None  # prompt lookup without a match tests nothing


def test_draft_cost_ratio_is_per_token_over_per_forward():
    # 1.2 s for 12 drafted tokens = 0.1 s/token; 3 s for 3 target forwards = 1 s/forward.
    assert metrics.draft_cost_ratio(STEPS) == pytest.approx(0.1)
    assert metrics.draft_cost_ratio([step(0, 0, 0.0, 1.0)]) is None


def test_predicted_speedup_formula():
    # Leviathan et al. 2023 Thm. 3.8: (1 - a^(K+1)) / ((1 - a)(1 + K c)).
    assert metrics.predicted_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))
    assert metrics.predicted_speedup(0.8, 4, 0.1) == pytest.approx(2.40114, abs=1e-5)
    assert metrics.predicted_speedup(1.0, 4, 0.0) == 5.0
    assert metrics.predicted_speedup(0.0, 3, 0.0) == 1.0
    assert metrics.predicted_speedup(0.0, 3, 0.5) == pytest.approx(1 / 2.5)
    # a verify forward costing 2 plain steps halves it
    assert metrics.predicted_speedup(0.8, 4, 0.1, verify_cost=2.0) == pytest.approx(2.40114 / 2, abs=1e-5)


def test_recommended_k_is_the_argmax():
    for alpha, c in ((0.8, 0.1), (0.5, 0.3), (0.95, 0.01)):
        best = metrics.recommended_k(alpha, c)
        assert all(metrics.predicted_speedup(alpha, best, c) >= metrics.predicted_speedup(alpha, k, c)
                   for k in range(1, 17))  # fmt: skip
    assert metrics.recommended_k(0.99, 0.0) == 16  # free drafts: as many as allowed
    assert metrics.recommended_k(0.3, 0.5) == 1


def decode_output(steps, num_tokens, seconds):
    return DecodeOutput(tokens=list(range(num_tokens)), steps=steps, prefill_seconds=0.1, seconds=seconds)


def test_summarize_speedup_against_plain():
    spec = [decode_output(STEPS, 10, 2.0)]
    plain = [decode_output([], 10, 5.0)]
    summary = metrics.summarize(spec, 4, plain)
    assert summary["tokens_per_second"] == 5.0
    assert summary["decode_tokens_per_second"] == pytest.approx(9 / 1.9)  # the first token is the prefill's
    batch = [DecodeOutput(list(range(10)), [], 0.4, 2.0, batch_rows=2) for _ in range(2)]  # one clock, two rows
    assert metrics.decode_tokens_per_second(batch) == pytest.approx(18 / 1.6)
    assert summary["speedup"] == pytest.approx(2.5)
    assert summary["alpha_measured"] == 0.75 and summary["draft_cost_ratio"] == pytest.approx(0.1)
    assert summary["predicted_speedup"] == pytest.approx(metrics.predicted_speedup(0.75, 4, 0.1))
    assert summary["recommended_k"] == metrics.recommended_k(0.75, 0.1)
    # verify cost: 1.0 s per verify forward (3 s / 3 steps) over 0.5 s per plain token (5 s / 10 tokens)
    assert summary["verify_cost"] == pytest.approx(2.0)
    assert summary["predicted_speedup_measured_verify"] == pytest.approx(summary["predicted_speedup"] / 2.0)
    plain_summary = metrics.summarize(plain, 4, plain)
    assert plain_summary["speedup"] == 1.0 and plain_summary["alpha_measured"] is None
    assert plain_summary["acceptance_length"] == 1.0


def make_result():
    spec = [decode_output(STEPS, 10, 2.0)]
    plain = [decode_output([], 10, 5.0)]
    groups = lambda outs: {"overall": metrics.summarize(outs, 4, plain),  # noqa: E731
                           "by_suite": {"bench": metrics.summarize(outs, 4, plain)},
                           "by_category": {"qa": metrics.summarize(outs, 4, plain),
                                           "code": metrics.summarize(outs, 4, plain)}}  # fmt: skip
    return {
        "config": {"k": 4, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": 10, "num_prompts": 1,
                   "device": "cpu", "lenience": 1.0, "typical_acceptance": False},
        "methods": {"plain": groups(plain), "eagle3": groups(spec)},
        "greedy_identical": {"eagle3": 1.0},
    }  # fmt: skip


def test_tables():
    result = make_result()
    rows = report.table_rows(result)
    # Per method: overall and two categories; a single suite adds no row.
    assert [r[:2] for r in rows] == [["plain", "all"], ["plain", "category: qa"], ["plain", "category: code"],
                                     ["eagle3", "all"], ["eagle3", "category: qa"], ["eagle3", "category: code"]]
    eagle = dict(zip(report.headers(), rows[3]))
    assert eagle["tau"] == "3.00" and eagle["alpha"] == "0.750" and eagle["speedup"] == "2.50x"
    assert dict(zip(report.headers(), rows[0]))["alpha"] == "-"
    text = report.format_table(result)
    assert text.splitlines()[0] == "== temperature 0 (greedy), K=4, 1 prompt, 10 new tokens, batch 1 =="
    assert text.splitlines()[1].split()[:3] == ["method", "group", "decodes"]
    assert "identical to plain decoding: eagle3 100%" in text and "tau = tokens per target forward" in text
    alone = report.format_table(result, legend=False)  # under several tables the legend is printed once
    assert "tau = tokens per target forward" not in alone and "identical to plain decoding: eagle3 100%" in alone
    sampled = {**result, "config": {**result["config"], "temperature": 1.0, "top_p": 0.9, "batch_size": 4}}
    assert report.heading(sampled) == "temperature 1 (sampled, top-p 0.9), K=4, 1 prompt, 10 new tokens, batch 4"
    markdown = report.format_markdown(result)
    assert markdown.splitlines()[1].startswith("|---|---|---:|")
    assert all(line.count("|") == len(report.headers()) + 1 for line in markdown.splitlines()[:8])
    result["config"]["lenience"] = 0.5
    assert "LOSSY" in report.format_table(result)


def test_write_report_files(tmp_path):
    paths = report.write_report(make_result(), tmp_path / "out")
    assert json.loads(paths["json"].read_text())["methods"]["eagle3"]["overall"]["speedup"] == pytest.approx(2.5)
    assert paths["markdown"].read_text().startswith("# specdraft eval: temperature 0 (greedy), K=4")
    for key in ("acceptance_plot", "speedup_heatmap"):
        assert paths[key].read_bytes()[:4] == b"\x89PNG"


def test_the_plots_say_their_temperature_and_k_and_share_one_colour_scale(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    result = make_result()
    cheap = copy.deepcopy(result["methods"]["eagle3"])
    cheap["overall"]["draft_cost_ratio"] = 0.01  # a second drafter whose predicted speedups reach higher
    result["methods"]["cheap"] = cheap
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figures open to read them
    report.plot_speedup_heatmap(result, tmp_path / "h.png")
    report.plot_acceptance_by_position(result, tmp_path / "a.png")
    heatmap, acceptance = figures
    panels = [ax for ax in heatmap.axes if ax.images]
    assert len(panels) == 2 and len({ax.images[0].get_clim() for ax in panels}) == 1
    assert all("T=0, K=4" in ax.get_title() for ax in panels)
    assert "temperature 0 (greedy), K=4" in acceptance.axes[0].get_title()


def test_wandb_table_offline(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run = wandb.init(project="specdraft-test", dir=str(tmp_path))
    try:
        report.log_wandb(make_result(), run)
        assert run.summary["eval/eagle3/speedup"] == pytest.approx(2.5)
    finally:
        run.finish()
