"""Benchmark: chain against tree drafting, for every drafter family that drafts trees, on one target.

    python eval/bench_trees.py --target toy --train-prompts /nonexistent --num-train-prompts 400 --steps 300

  1. drafters  trained exactly as eval/bench_families.py trains them (same data, recipes and cache: a
               WORK folder that bench_families filled is reused as it is).
  2. evaluate  one `evaluate(...)` per temperature (0 and 1) over the same prompts: plain decoding, each
               family as a chain (K=5), and as trees: Medusa's static trees (8, 16 and 63 nodes) for
               every family, and EAGLE-2 dynamic trees of several sizes for the EAGLE families.
  3. report    tau and speedup per method and temperature; WORK/tree_size_vs_tau.png plots tau (and the
               speedup) against the number of nodes a step verifies.

`--compile-target` compiles the target's forwards (plain steps, chain and tree verifies alike; an untimed
pass over the same prompts compiles every shape first) and writes WORK/trees-compiled.*; `--temperatures 0`
evaluates greedy only.

Writes WORK/trees.md, WORK/trees.json and the PNG, and prints the Markdown.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

import torch
from bench_eagle import K, TEMPERATURES
from bench_families import (
    RECIPE_PREFIX,
    _interrupt,
    prompt_sets,
    recipe_for,
    target_answers,
    train_all,
)

from specdraft.decoding.sampling import SamplingParams
from specdraft.decoding.trees import DynamicTree, parse_tree
from specdraft.drafters import load_drafter
from specdraft.evaluation.run import EvalSettings, evaluate, tree_methods
from specdraft.evaluation.suites import prompt_token_ids
from specdraft.target import FrozenTarget, resolve_target_path

FAMILIES = ("eagle3", "eagle1", "medusa1", "mlp_speculator")
STATIC_TREES = ("medusa-8", "medusa-16", "medusa-63")
DYNAMIC_TREES = ("eagle2:total_tokens=8,depth=5,top_k=4", "eagle2:total_tokens=16,depth=5,top_k=4",
                 "eagle2:total_tokens=32,depth=6,top_k=8", "eagle2")  # the last: EAGLE-3's 60 / 6 / 10


def methods_of(target, drafters: dict, trees: list[str]) -> dict:
    """name -> source: each family as a chain, and as each tree it can draft."""
    sources = {}
    for family, drafter in drafters.items():
        sources[family] = drafter.draft_source(target)
        sources.update(tree_methods(family, drafter, target, trees))
    return sources


def nodes_of(method: str) -> int:
    """Nodes a step verifies: K for a chain, the tree's (most) nodes otherwise."""
    if " tree:" not in method:
        return K
    return parse_tree(method.split(" tree:")[1]).num_nodes


def table(result: dict) -> list[str]:
    lines = ["| method | nodes | depth | tau | speedup | tokens/s | c |", "|---|---:|---:|---:|---:|---:|---:|"]
    for method, groups in result["methods"].items():
        s = groups["overall"]
        tree = parse_tree(method.split(" tree:")[1]) if " tree:" in method else None
        depth = "-" if method == "plain" else (tree.depth if tree else K)
        speedup = "-" if s["speedup"] is None else f"{s['speedup']:.2f}x"
        c = "-" if s["draft_cost_ratio"] is None else f"{s['draft_cost_ratio']:.3f}"
        nodes = "-" if method == "plain" else nodes_of(method)
        lines.append(f"| {method} | {nodes} | {depth} | {s['acceptance_length']:.2f} | {speedup} | "
                     f"{s['tokens_per_second']:.1f} | {c} |")
    return lines


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(11, 4 * len(results)), squeeze=False)
    for row, (temperature, result) in enumerate(results.items()):
        for family in FAMILIES:
            for kind, marker in (("tree:medusa", "o"), ("tree:eagle2", "s")):
                points = sorted((nodes_of(m), g["overall"]) for m, g in result["methods"].items()
                                if m.startswith(family + " ") and kind in m)
                chain = result["methods"].get(family, {}).get("overall")
                if not points or chain is None:
                    continue
                points = [(K, chain)] + points  # the chain is the K-node tree
                label = f"{family} ({'static' if 'medusa' in kind else 'EAGLE-2'})"
                for col, key in enumerate(("acceptance_length", "speedup")):
                    axes[row][col].plot([n for n, _ in points], [s[key] for _, s in points], marker=marker,
                                        label=label)
        for col, name in enumerate(("tau (tokens per target forward)", "speedup over plain decoding")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("nodes verified per step (chain = K = 5)")
            ax.set_ylabel(name)
            ax.set_title(f"T={temperature:g}")
            ax.grid(alpha=0.3)
        axes[row][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="toy", help="a named target, 'toy', or a folder")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--work", default="bench-trees", help="data, runs and reports (a bench_families WORK works)")
    parser.add_argument("--train-prompts", default=None)
    parser.add_argument("--eval-prompts", default=None)
    parser.add_argument("--num-train-prompts", type=int, default=400)
    parser.add_argument("--heldout-answers", type=int, default=48)
    parser.add_argument("--answer-tokens", type=int, default=256)
    parser.add_argument("--answer-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--per-category", type=int, default=2, help="eval prompts per category")
    parser.add_argument("--steps", type=int, default=None, help="every family's step budget (default: its recipe's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--train-jobs", type=int, default=2, choices=(1, 2))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--trees", nargs="+", default=list(STATIC_TREES + DYNAMIC_TREES))
    parser.add_argument("--temperatures", type=float, nargs="+", default=list(TEMPERATURES))
    parser.add_argument("--compile-target", action="store_true",
                        help="compile the target's decode forwards (plain decoding's too, so speedups stay like for like)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    signal.signal(signal.SIGTERM, _interrupt)

    work = Path(args.work)
    target_dir = Path(resolve_target_path(args.target, "float32"))
    prefix = RECIPE_PREFIX.get(args.target, target_dir.name)
    families = [f for f in args.families if recipe_for(prefix, f)]
    train, heldout, eval_prompts, source = prompt_sets(args)
    answers, _ = target_answers(target_dir, work, "answers", train, args.answer_tokens, args.answer_dtype)
    heldout_answers, _ = target_answers(target_dir, work, "heldout_answers", heldout, args.answer_tokens,
                                        args.answer_dtype)
    overrides = [f"target.path={target_dir}", f"data.path={answers}", f"data.eval_path={heldout_answers}",
                 "eval.enabled=false"] + ([f"training.max_steps={args.steps}"] if args.steps else []) + args.set
    trained = train_all(families, prefix, overrides, work, args.train_jobs, [answers, heldout_answers])

    target = FrozenTarget.from_pretrained(target_dir, dtype="float32")
    eval_prompts = [p for p in eval_prompts if len(prompt_token_ids(target.tokenizer, p)) + 2 * args.max_new_tokens
                    < target.config.max_position_embeddings]
    drafters = {family: load_drafter(run["drafter"], target).eval() for family, run in trained.items()}
    for spec in args.trees:
        parse_tree(spec)  # a typo fails before the eval starts
    results, name = {}, "trees-compiled" if args.compile_target else "trees"
    for temperature in args.temperatures:
        if args.compile_target:  # each new (cache size, step width) compiles on first use: an untimed pass first
            evaluate(target, methods_of(target, drafters, args.trees), eval_prompts,
                     EvalSettings(SamplingParams(temperature=temperature), k=K, max_new_tokens=args.max_new_tokens,
                                  compile_target=True, show_progress=False))  # fmt: skip
        results[temperature] = evaluate(target, methods_of(target, drafters, args.trees), eval_prompts,
                                        EvalSettings(SamplingParams(temperature=temperature), k=K,
                                                     max_new_tokens=args.max_new_tokens,
                                                     compile_target=args.compile_target),
                                        work / name / f"temperature-{temperature:g}")
    plot(results, work / f"{name.replace('trees', 'tree_size')}_vs_tau.png")

    lines = [f"## Chains and trees on {args.target} ({len(eval_prompts)} prompts from {source}, chain K={K}, "
             f"max {args.max_new_tokens} new tokens, float32, {args.threads} thread(s)"
             f"{', target compiled' if args.compile_target else ''})", "",
             f"`python {' '.join(sys.argv)}`", ""]
    for temperature, result in results.items():
        lines += [f"### T={temperature:g}", ""] + table(result) + [""]
        if "greedy_identical" in result:
            lines += [f"greedy output identical to plain decoding: {result['greedy_identical']}", ""]
    lines.append(f"dynamic trees at EAGLE-3's defaults: {DynamicTree()}")
    markdown = "\n".join(lines)
    (work / f"{name}.md").write_text(markdown + "\n")
    (work / f"{name}.json").write_text(json.dumps({"args": vars(args), "training": trained,
                                                   "eval": {str(t): r for t, r in results.items()}}, indent=1))
    print("\n" + markdown)
    print(f"\nwrote {work / f'{name}.md'}, {work / f'{name}.json'}, "
          f"{work / (name.replace('trees', 'tree_size') + '_vs_tau.png')}")


if __name__ == "__main__":
    main()
