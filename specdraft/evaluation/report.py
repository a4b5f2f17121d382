"""Eval results as a terminal table, JSON, Markdown, PNG plots and (optionally) a wandb.Table.

``result`` is what ``specdraft.evaluation.run.evaluate`` returns:
  {"config": {...}, "methods": {name: {"overall": summary, "by_suite": {..}, "by_category": {..}}},
   "greedy_identical": {name: fraction of decodes identical to plain decoding} (greedy runs only),
   "greedy_mismatches": {name: [where each differing decode left plain decoding, and why]} (greedy only)}
with each summary from ``specdraft.evaluation.metrics.summarize``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from specdraft.evaluation.metrics import MAX_RECOMMENDED_K, predicted_speedup
from specdraft.evaluation.provenance import describe_machine
from specdraft.evaluation.verify_cost import ForwardCosts, format_curve

# (header, summary key, format); None values print as "-".
COLUMNS = [
    ("decodes", "num_decodes", "{:d}"),
    ("tokens", "num_tokens", "{:d}"),
    ("tau", "acceptance_length", "{:.2f}"),
    ("alpha", "alpha_measured", "{:.3f}"),
    ("alpha pred", "alpha_predicted", "{:.3f}"),
    ("c", "draft_cost_ratio", "{:.3f}"),
    ("tok/s", "tokens_per_second", "{:.1f}"),
    ("total tok/s", "total_tokens_per_second", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("pred speedup", "predicted_speedup", "{:.2f}x"),
    ("verify cost", "verify_cost", "{:.2f}"),
    ("pred @ verify cost", "predicted_speedup_measured_verify", "{:.2f}x"),
    ("pred @ proposals", "predicted_speedup_from_proposals", "{:.2f}x"),
    ("best K", "recommended_k", "{:d}"),
    ("pred @ best K", "predicted_speedup_at_recommended_k", "{:.2f}x"),
]

# What the columns mean: printed once under the tables of one command.
LEGEND = [
    "tau = tokens per target forward (bonus included); alpha = accepted / tested drafts; alpha pred = mean "
    "sum_x min(p, q); c = draft time per token / target time per forward; speedup = tok/s over plain decoding "
    "in the same run; tok/s is per request and total tok/s the throughput (they differ with --batch-size > 1); "
    "pred speedup = (1 - alpha^(K+1)) / ((1 - alpha)(1 + K c)), which assumes a verify "
    "forward costs one plain step; verify cost v = seconds per verify forward / seconds per plain token, "
    "measured; pred @ verify cost = pred speedup / v; pred @ proposals = each step priced at its own width "
    "and batch size on this device's measured verify-cost curve, plus its measured drafting."
]


def table_rows(result: dict) -> list[list[str]]:
    """One row per method and group: overall, then per suite and per category when there are several."""
    rows = []
    for method, groups in result["methods"].items():
        rows.append([method, "all", *_cells(groups["overall"])])
        for key, label in (("by_suite", "suite"), ("by_category", "category")):
            if len(groups[key]) > 1:
                rows += [[method, f"{label}: {name}", *_cells(summary)] for name, summary in groups[key].items()]
    return rows


def headers() -> list[str]:
    return ["method", "group", *[header for header, _, _ in COLUMNS]]


def heading(result: dict) -> str:
    """What one table measured: temperature, drafts per step, prompts, new tokens and batch size."""
    cfg = result["config"]
    temperature = cfg.get("temperature", 0.0)
    sampling = "greedy" if temperature == 0 else "sampled" + "".join(
        f", {key.replace('_', '-')} {cfg[key]}" for key, off in (("top_k", 0), ("top_p", 1.0)) if cfg.get(key, off) != off)
    prompts = cfg["num_prompts"]
    return (f"temperature {temperature:g} ({sampling}), K={cfg['k']}, {prompts} prompt{'s' * (prompts != 1)}, "
            f"{cfg['max_new_tokens']} new tokens, batch {cfg.get('batch_size', 1)}")


def format_table(result: dict, legend: bool = True) -> str:
    """A plain-text table with aligned columns, for the terminal: a heading (temperature, K), the machine, the
    rows and this run's notes; ``legend=False`` leaves out what the columns mean (printed once under several)."""
    rows = [headers(), *table_rows(result)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i > 1 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([f"== {heading(result)} =="] + _machine_lines(result) + lines + _notes(result)
                     + (LEGEND if legend else []))


def format_markdown(result: dict) -> str:
    rows = [headers(), *table_rows(result)]
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + "|".join(["---"] * 2 + ["---:"] * len(COLUMNS)) + "|")
    return "\n".join(lines + [""] + _notes(result) + LEGEND) + "\n"


REPORT_FILES = {"json": "result.json", "markdown": "report.md", "acceptance_plot": "acceptance_by_position.png",
                "speedup_heatmap": "speedup_heatmap.png"}


def write_report(result: dict, out_dir: str | Path) -> dict[str, Path]:
    """result.json, report.md, acceptance_by_position.png, speedup_heatmap.png in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {key: out_dir / name for key, name in REPORT_FILES.items()}
    paths["json"].write_text(json.dumps(result, indent=2, default=_json_default) + "\n")
    curve = ""
    if result.get("forward_costs"):
        curve = "\n## verify-cost curve on this device (ms per decode step, and v = step / plain step)\n\n" + \
            format_curve(ForwardCosts.from_json(result["forward_costs"])) + "\n"
    machine = "".join(line + "\n\n" for line in _machine_lines(result))
    paths["markdown"].write_text(f"# specdraft eval: {heading(result)}\n\n{machine}{_config_line(result)}\n\n{format_markdown(result)}"
                                 f"{curve}")
    plot_acceptance_by_position(result, paths["acceptance_plot"])
    plot_speedup_heatmap(result, paths["speedup_heatmap"])
    return paths


def plot_acceptance_by_position(result: dict, path: Path) -> None:
    """Conditional acceptance rate of draft position i (given 1..i-1 accepted), one line per method."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, groups in result["methods"].items():
        rates = groups["overall"]["position_acceptance"]
        points = [(i + 1, r) for i, r in enumerate(rates) if r is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=method)
    ax.set(xlabel="draft position", ylabel="acceptance rate (given earlier drafts accepted)", ylim=(0, 1.02))
    ax.set_title(f"acceptance by draft position\n{heading(result)}", fontsize=8)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_speedup_heatmap(result: dict, path: Path) -> None:
    """Predicted speedup over alpha x K at each method's measured c, with the measured (alpha, K) marked."""
    plt = _pyplot()
    summaries = [(method, groups["overall"]) for method, groups in result["methods"].items()]
    # Chains only: a tree method has no predicted speedup (metrics.summarize), so no best K to mark.
    measured = [(m, s) for m, s in summaries if s["alpha_measured"] is not None and s["draft_cost_ratio"] is not None
                and s["recommended_k"] is not None]
    k = result["config"]["k"]
    fig, axes = plt.subplots(1, max(1, len(measured)), figsize=(5 * max(1, len(measured)), 4), squeeze=False)
    alphas = [i / 50 for i in range(50)]  # 0 .. 0.98
    ks = list(range(1, MAX_RECOMMENDED_K + 1))
    grids = [[[predicted_speedup(a, kk, s["draft_cost_ratio"]) for a in alphas] for kk in ks] for _, s in measured]
    scale = {"vmin": min((min(map(min, g)) for g in grids), default=0.0),
             "vmax": max((max(map(max, g)) for g in grids), default=1.0)}  # one colour scale for every panel
    for ax, (method, summary), grid in zip(axes[0], measured, grids):
        c = summary["draft_cost_ratio"]
        image = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis",
                          extent=(0, 1, ks[0] - 0.5, ks[-1] + 0.5), **scale)  # fmt: skip
        ax.contour([a + 0.01 for a in alphas], ks, grid, levels=[1.0], colors="white", linewidths=1)
        v = summary.get("verify_cost")
        if v:  # break-even once a verify forward costs v plain steps, as measured (a CPU: v > 1)
            ax.contour([a + 0.01 for a in alphas], ks, [[x / v for x in row] for row in grid], levels=[1.0],
                       colors="red", linewidths=1, linestyles="dashed")
        ax.plot(summary["alpha_measured"], k, marker="*", markersize=16, color="red", label=f"measured (K={k})")
        ax.plot(summary["alpha_measured"], summary["recommended_k"], marker="o", color="orange", label="best K")
        temperature = result["config"].get("temperature", 0.0)
        title = f"{method}: predicted speedup, T={temperature:g}, K={k}\nc={c:.3f}; white: 1x"
        title += f"; red dashed: 1x at verify cost {v:.2f}" if v else ""
        ax.set(xlabel="alpha", ylabel="K")
        ax.set_title(title, fontsize=9)
        ax.legend(loc="upper left", fontsize=8)
        fig.colorbar(image, ax=ax)
    if not measured:
        axes[0][0].text(0.5, 0.5, "no drafting method measured", ha="center", va="center")
        axes[0][0].set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def log_wandb(result: dict, run) -> None:
    """Log the table (and the config) to an open wandb run; WANDB_MODE=offline works."""
    import wandb  # optional at run time: only with --wandb (GPU images often lack it)

    run.log({"eval/table": wandb.Table(columns=headers(), data=table_rows(result))})
    for method, groups in result["methods"].items():
        run.summary[f"eval/{method}/acceptance_length"] = groups["overall"]["acceptance_length"]
        run.summary[f"eval/{method}/speedup"] = groups["overall"]["speedup"]


def _cells(summary: dict) -> list[str]:
    return [_fmt(summary.get(key), fmt) for _, key, fmt in COLUMNS]


def _fmt(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def _config_line(result: dict) -> str:
    cfg = result["config"]
    keys = ["k", "temperature", "top_k", "top_p", "max_new_tokens", "num_prompts", "batch_size", "device"]
    return ", ".join(f"{key}={cfg[key]}" for key in keys if key in cfg)


def _machine_lines(result: dict) -> list[str]:
    return [describe_machine(result["measured_on"])] if "measured_on" in result else []


def _notes(result: dict) -> list[str]:
    """This run's own notes: lossy verification, greedy identity and each mismatch's verdict."""
    notes = []
    cfg = result["config"]
    if cfg.get("lenience", 1.0) < 1.0 or cfg.get("typical_acceptance"):
        notes.append("LOSSY verification (lenience < 1 or typical acceptance): output differs from the target's.")
    identical = result.get("greedy_identical")
    if identical:
        notes.append("greedy outputs identical to plain decoding: "
                     + ", ".join(f"{m} {v:.0%}" for m, v in identical.items()))  # fmt: skip
    for method, found in result.get("greedy_mismatches", {}).items():
        notes.extend(_mismatch_notes(method, found))
    return notes


def _mismatch_notes(method: str, found: list[dict]) -> list[str]:
    """One line per method with mismatches, and one per defect: where, and the top-2 gaps."""
    if not found:
        return []
    counts = {}
    for m in found:
        counts[m["verdict"]] = counts.get(m["verdict"], 0) + 1
    notes = [f"{method}: {len(found)} greedy decode(s) differ from plain decoding ("
             + ", ".join(f"{n} {verdict}" for verdict, n in counts.items()) + "); rounding = the target's "
             "top-2 logits were within its dtype's rounding there (see specdraft/evaluation/mismatch.py)"]
    for m in found:
        if m["verdict"] != "defect":
            continue
        detail = m.get("why")
        if "one_token" in m:
            detail = (f"top-2 gap {m['one_token']['gap']:.3g} (1-token forward) / {m['verify']['gap']:.3g} "
                      f"(verify forward) > rounding bound {m['rounding_bound']:.3g} ({m['dtype']})")
        notes.append(f"DEFECT: {method} on {m['prompt']} differs at token {m['position']}: {detail}")
    return notes


def _json_default(value):
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _pyplot():
    import matplotlib  # optional at run time: plots only

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt  # optional at run time: plots only

    return plt
