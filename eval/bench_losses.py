"""Benchmark: which drafter.loss wins tau, per family, on one target at one step budget.

    python eval/bench_losses.py --target toy --families eagle3 eagle1 --steps 150 --train-jobs 2

  1. data      as eval/bench_families.py: the target's own answers to the training prompts (cached), and to a
               held-out slice (the runs' held-out loss); eval prompts from Spec-Bench's questions.
  2. train     recipes/<target>-<family>.yaml once per loss (--losses, default every one of
               losses.DRAFTER_LOSSES: ce, tvd, lk_alpha, lk_hybrid), the same init, data and steps, each in
               a fresh 1-thread process. Medusa-1 trains on soft labels (drafter.distill=true) in every
               cell, ce included, so only the loss differs.
  3. evaluate  one `evaluate` per temperature (0 and 1; --eval-jobs 2 runs the two side by side, a process
               each), every run plus prompt lookup, chain K=5: tau and alpha measured; the winner per
               family and temperature is printed.

Writes WORK/results.json and WORK/report.md, and prints the Markdown.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from bench_eagle import K, evaluate_at_temperatures, evaluate_temperatures_side_by_side, markdown_table
from bench_families import (RECIPE_PREFIX, add_grid_arguments, fitting_prompts, grid_data, overrides_for,
                            recipe_for, train_runs)

from specdraft.drafters import load_drafter
from specdraft.losses import DRAFTER_LOSSES
from specdraft.target import FrozenTarget, resolve_target_path

FAMILIES = ("eagle3", "eagle1", "medusa1", "mlp_speculator")
FAMILY_OVERRIDES = {"medusa1": ["drafter.distill=true"]}


def grid_runs(recipes: dict[str, Path], losses: list[str], overrides: list[str]) -> dict[str, tuple]:
    """FAMILY-LOSS -> (family, recipe, overrides): the overrides for every run and those for the family
    (``--set FAMILY:KEY=VALUE``), the family's own (Medusa-1's soft labels), then the loss."""
    return {f"{family}-{loss}": (family, recipe, [*overrides_for(family, overrides), *FAMILY_OVERRIDES.get(family, []),
                                                  f"drafter.loss={loss}"])
            for family, recipe in recipes.items() for loss in losses}


def grid_table(results: dict, families: list[str], losses: list[str]) -> str:
    """family x loss: tau (alpha measured) per temperature."""
    lines = ["| family | loss | " + " | ".join(f"T={t:g}" for t in results) + " |",
             "|---|---" + "|---:" * len(results) + "|"]
    for family in families:
        for loss in losses:
            cells = []
            for result in results.values():
                overall = result["methods"].get(f"{family}-{loss}", {}).get("overall")
                cells.append("-" if not overall or overall["acceptance_length"] is None else
                             f"{overall['acceptance_length']:.3f} ({overall['alpha_measured']:.3f})")
            lines.append(f"| {family} | {loss} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_grid_arguments(parser, work="bench-losses", steps=150)
    parser.add_argument("--families", nargs="+", default=["eagle3", "eagle1"], choices=FAMILIES)
    parser.add_argument("--losses", nargs="+", default=list(DRAFTER_LOSSES), choices=list(DRAFTER_LOSSES),
                        help="the drafter.loss values to train (default: every one)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    work = Path(args.work)
    target_dir = Path(resolve_target_path(args.target, "float32"))
    prefix = RECIPE_PREFIX.get(args.target, target_dir.name)
    data = grid_data(args, target_dir, work)
    recipes = {family: recipe_for(prefix, family) for family in args.families}
    for family, recipe in recipes.items():
        if recipe is None:
            sys.exit(f"no recipe for {family} on {args.target}: add recipes/{prefix}-{family}.yaml")
    runs = grid_runs(recipes, args.losses, data.overrides)
    trained = train_runs(runs, work, args.train_jobs, [data.answers, data.heldout_answers])

    target = FrozenTarget.from_pretrained(target_dir, dtype="float32")
    fits = fitting_prompts(target, data.eval_prompts, args.max_new_tokens)
    folders = {name: Path(run["drafter"]) for name, run in trained.items()}
    if args.eval_jobs == 2:
        results = evaluate_temperatures_side_by_side(target_dir, folders, fits, args.max_new_tokens, work / "eval")
    else:
        drafters = {name: load_drafter(folder, target).eval() for name, folder in folders.items()}
        results = evaluate_at_temperatures(target, drafters, fits, args.max_new_tokens, work / "eval")

    lines = [(f"## drafter.loss on {args.target} ({len(fits)} prompts from {data.source}, K={K}, {args.steps} "
              f"steps per run, max {args.max_new_tokens} new tokens, float32, 1 thread)"), "",
             f"`python {' '.join(sys.argv)}`", "", f"answers: {data.answer_record}", "",
             "### tau (alpha measured)", "", grid_table(results, args.families, args.losses), ""]
    winners = {}
    for temperature, result in results.items():
        for family in args.families:
            taus = {loss: result["methods"][f"{family}-{loss}"]["overall"]["acceptance_length"] or 0
                    for loss in args.losses}
            best = max(taus, key=taus.get)
            winners[f"{family} T={temperature:g}"] = best
            lines.append(f"**{family}, T={temperature:g}: {best}** (tau {taus[best]:.3f}; "
                         + ", ".join(f"{loss} {tau:.3f}" for loss, tau in taus.items()) + ")")
        lines += ["", f"### temperature {temperature:g}", "", markdown_table(result), ""]
    lines += ["### training", "", "| run | minutes | tokens | final held-out acc_0 |", "|---|---:|---:|---:|"]
    for name, run in trained.items():
        held_out = run["final_metrics"].get("eval/acc_0")  # step-1 accuracy: comparable across losses
        lines.append(f"| {name} | {run['seconds'] / 60:.1f} | {run['tokens']} | "
                     f"{'-' if held_out is None else format(held_out, '.4f')} |")
    markdown = "\n".join(lines)
    (work / "report.md").write_text(markdown + "\n")
    (work / "results.json").write_text(json.dumps({"args": vars(args), "training": trained, "winners": winners,
                                                   "eval": {str(t): r for t, r in results.items()}}, indent=1))
    print("\n" + markdown)


if __name__ == "__main__":
    main()
