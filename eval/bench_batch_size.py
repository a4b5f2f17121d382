"""Benchmark: how much a drafter learns per token at each micro-batch size, at an equal token budget.

    python eval/bench_batch_size.py --recipe smollm2-135m-eagle3 --answers WORK/data/answers.jsonl \
        --heldout WORK/data/heldout_answers.jsonl --sizes 8 4 2 1 --answers-per-run 192 --warmup-answers 16 \
        --evals 2 --jobs 2 --work WORK --set target.dtype=float32 --set "training.mixed_precision='no'"
    python eval/bench_batch_size.py --recipe smollm2-135m-medusa2 --stage-field drafter.joint_from_step ...

Every run trains the recipe on the same answers (the target's own, e.g. eval/bench_families.py's WORK/data)
for the same number of answers (--answers-per-run), so it sees the same tokens in the same order: only the
micro-batch size, and so the number of optimizer steps, differs. Warmup and the held-out evals are placed at
the same answer counts in every run (--warmup-answers, --evals), so the cosine schedule is the same function
of the tokens seen. A stage boundary counted in steps (--stage-field) is placed at its share of the recipe's
run, at the same answer count in every run. Each run trains in a fresh 1-thread process (`--jobs` at a time)
into WORK/runs/mbN.

Printed (and written to WORK/report.md): held-out acc_0 (the first draft equals the target's top-1) and the
simulated acceptance length at each eval, by tokens seen, and the training throughput. `--report-only`
prints the table from WORK/runs/mb*/ without training. `--padding` prints, without training, what each size's
packed micro-batches hold over the same answers: rows, padded positions, and attention scores per token.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from bench_families import train_runs
from transformers import AutoTokenizer

from specdraft.config import load_recipe
from specdraft.data.collate import Collator, pad_token_id_of
from specdraft.data.pipeline import build_datasets
from specdraft.recipe_files import resolve_recipe
from specdraft.target import resolve_target_path


def run_overrides(args: argparse.Namespace, size: int) -> list[str]:
    """The recipe overrides of the run at micro-batch ``size``: everything placed in answers, not steps."""
    if args.answers_per_run % (size * args.evals):
        sys.exit(f"--answers-per-run {args.answers_per_run} is not a multiple of micro-batch {size} x --evals "
                 f"{args.evals}: the runs would not evaluate at the same answer counts")
    steps = args.answers_per_run // size
    every = steps // args.evals
    return [f"data.path={args.answers}", f"data.eval_path={args.heldout}", f"training.max_steps={steps}",
            f"training.micro_batch_size={size}", f"optimizer.warmup_steps={max(1, args.warmup_answers // size)}",
            f"training.eval_every={every}", f"training.log_every={every}",
            "training.eval_batches=100000",  # every held-out answer, whatever the batch size
            "eval.enabled=false", f"checkpoint.save_every={every}", "checkpoint.keep_last=1",
            *stage_overrides(args, size), *args.set]


def stage_overrides(args: argparse.Namespace, size: int) -> list[str]:
    """Each --stage-field (a recipe field counted in optimizer steps: Medusa-2's drafter.joint_from_step, the
    MLP speculator's drafter.stage2_start_step) at the share of the run it has in the recipe, rounded to the
    same answer count in every run (a multiple of every size), so each run switches stage after the same
    answers."""
    if not args.stage_field:
        return []
    recipe = yaml.safe_load(resolve_recipe(args.recipe).read_text())
    overridden = [key for key in args.stage_field for setting in args.set if setting.startswith(f"{key}=")]
    if overridden:
        sys.exit(f"{overridden[0]} is both a --stage-field and a --set: the script places it, so drop the --set")
    recipe_steps = recipe.get("training", {}).get("max_steps")
    if not isinstance(recipe_steps, int) or recipe_steps <= 0:
        sys.exit(f"--stage-field needs the recipe's training.max_steps to place a stage at its share of the run, "
                 f"and the recipe has {recipe_steps!r}")
    unit = math.lcm(*args.sizes)
    overrides = []
    for key in args.stage_field:
        section, _, field = key.partition(".")
        value = recipe.get(section, {}).get(field)
        if not isinstance(value, int) or isinstance(value, bool):
            sys.exit(f"--stage-field {key}: the recipe has {value!r} there, not a step count")
        answers = unit * round(value / recipe_steps * args.answers_per_run / unit)
        overrides.append(f"{key}={answers // size}")
    return overrides


def learning_curve(run_dir: Path) -> dict:
    """A run's held-out evals by tokens seen, and its training throughput, from its metrics.jsonl.

    Throughput: tokens over the summed log windows. A window runs from one log to the next, so every window
    after the first also holds one held-out eval and checkpoint (the same count in every run of the grid)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    tokens_at, seconds, tokens = {}, 0.0, 0.0
    evals = []
    for row in rows:
        if "train/tokens_seen" in row:
            window_tokens = row["train/tokens_seen"] - tokens
            tokens = row["train/tokens_seen"]
            seconds += window_tokens / row["train/tokens_per_s"]
            tokens_at[row["step"]] = tokens
        if "eval/acc_0" in row:
            by_position = [row[f"eval/acc_{j}"] for j in range(len(row)) if f"eval/acc_{j}" in row]
            evals.append({"step": row["step"], "tokens": tokens_at[row["step"]], "acc_0": row["eval/acc_0"],
                          "acc_by_position": by_position,
                          "sim_accept_len": row.get("eval/sim_accept_len")})  # EAGLE-1 logs no chain
    return {"micro_batch_size": recipe["training"]["micro_batch_size"], "steps": rows[-1]["step"],
            "evals": evals, "tokens": tokens, "minutes": seconds / 60, "tokens_per_s": tokens / seconds}


def three_places(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"  # None: the family logs no simulated chain (EAGLE-1)


def markdown(curves: dict[str, dict]) -> str:
    ordered = sorted(curves.values(), key=lambda c: -c["micro_batch_size"])
    points = sorted({e["tokens"] for c in ordered for e in c["evals"]})
    lines = ["| micro-batch | optimizer steps | " + " | ".join(f"acc_0 at {t / 1000:.0f}k tokens" for t in points)
             + " | simulated accepted drafts, last eval | training minutes | tokens/s |",
             "|---:|---:|" + "---:|" * len(points) + "---:|---:|---:|"]
    for c in ordered:
        by_tokens = {e["tokens"]: e for e in c["evals"]}
        cells = [f"{by_tokens[t]['acc_0']:.3f}" if t in by_tokens else "-" for t in points]
        lines.append(f"| {c['micro_batch_size']} | {c['steps']} | " + " | ".join(cells)
                     + f" | {three_places(c['evals'][-1]['sim_accept_len'])} | {c['minutes']:.1f} "
                     f"| {c['tokens_per_s']:.0f} |")
    lines += ["", "| micro-batch | tokens | held-out accuracy by draft position | simulated accepted drafts |",
              "|---:|---:|---|---:|"]
    for c in ordered:
        lines += [f"| {c['micro_batch_size']} | {e['tokens'] / 1000:.0f}k | "
                  + " ".join(f"{a:.3f}".removeprefix("0") for a in e["acc_by_position"])
                  + f" | {three_places(e['sim_accept_len'])} |"
                  for e in c["evals"]]
    return "\n".join(lines)


def packed_steps(args: argparse.Namespace) -> dict[int, dict]:
    """What each micro-batch size's steps hold over the first --answers-per-run answers, batched as training
    batches them (the recipe's collator, and accelerate's seedable sampler with the recipe's seed): totals
    over those steps of rows, positions, real tokens, answer tokens, attention scores and the causal pairs
    within documents.

    A packed step pads every row to its longest. Each layer's linear parts work on every position, padded or
    not, and the attention scores every pair of positions in a row (a dense [T, T] mask, then SDPA); a
    document needs only its own causal pairs."""
    recipe = load_recipe(resolve_recipe(args.recipe), [f"data.path={args.answers}", *args.set])
    tokenizer = AutoTokenizer.from_pretrained(resolve_target_path(recipe.target.path, recipe.target.dtype))
    answers, _ = build_datasets(recipe.data, tokenizer)
    collate = Collator(pad_token_id_of(tokenizer), recipe.data.max_length, recipe.data.packing)
    totals = {}
    for size in args.sizes:
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=recipe.training.seed))
        loader = accelerator.prepare(torch.utils.data.DataLoader(
            answers, batch_size=size, shuffle=True, collate_fn=collate,
            generator=torch.Generator().manual_seed(recipe.training.seed)))
        t = dict.fromkeys(["steps", "rows", "positions", "tokens", "answer_tokens", "scores", "causal_pairs"], 0)
        for batch in itertools.islice(loader, args.answers_per_run // size):
            mask = batch["attention_mask"].bool()
            rows, width = mask.shape
            seq_ids = batch.get("seq_ids", torch.zeros_like(batch["attention_mask"]))
            documents = (seq_ids + width * torch.arange(rows).unsqueeze(1))[mask]  # one id per row and document
            lengths = torch.unique(documents, return_counts=True)[1]
            t["steps"] += 1
            t["rows"] += rows
            t["positions"] += rows * width
            t["tokens"] += int(mask.sum())
            t["answer_tokens"] += int(batch["loss_mask"].sum())
            t["scores"] += rows * width * width
            t["causal_pairs"] += int((lengths * (lengths + 1) // 2).sum())
        totals[size] = t
    return totals


def padding_markdown(totals: dict[int, dict]) -> str:
    lines = ["| micro-batch | rows a step | row width | padded positions | positions per answer token "
             "| attention scores per token | of which a document's own causal pairs |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for size, t in totals.items():
        lines.append(f"| {size} | {t['rows'] / t['steps']:.2f} | {t['positions'] / t['rows']:.0f} "
                     f"| {1 - t['tokens'] / t['positions']:.1%} | {t['positions'] / t['answer_tokens']:.2f} "
                     f"| {t['scores'] / t['tokens']:.0f} | {t['causal_pairs'] / t['scores']:.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="smollm2-135m-eagle3", help="a shipped recipe's name, or a path")
    parser.add_argument("--answers", type=Path, help="the training answers (messages JSONL)")
    parser.add_argument("--heldout", type=Path, help="held-out answers for the runs' eval")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 4, 2, 1], help="micro-batch sizes (samples)")
    parser.add_argument("--answers-per-run", type=int, default=192, help="answers each run trains on")
    parser.add_argument("--warmup-answers", type=int, default=16, help="warmup, in answers")
    parser.add_argument("--evals", type=int, default=2, help="held-out evals per run, evenly spaced")
    parser.add_argument("--jobs", type=int, default=2, help="runs side by side, one thread each")
    parser.add_argument("--work", type=Path, default=Path("bench_batch_size"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override")
    parser.add_argument("--stage-field", action="append", default=[], metavar="KEY",
                        help="a recipe field counted in optimizer steps (drafter.joint_from_step, "
                             "drafter.stage2_start_step): placed at the recipe's share of each run")
    parser.add_argument("--report-only", action="store_true", help="tabulate WORK/runs/mb*/ without training")
    parser.add_argument("--padding", action="store_true",
                        help="tabulate what each size's packed steps hold over --answers, without training")
    args = parser.parse_args()

    if args.padding:
        if args.answers is None:
            sys.exit("--padding reads --answers")
        print(padding_markdown(packed_steps(args)))
        return

    if not args.report_only:
        if args.answers is None or args.heldout is None:
            sys.exit("--answers and --heldout are needed to train (or pass --report-only)")
        recipe = resolve_recipe(args.recipe)
        family = yaml.safe_load(recipe.read_text())["drafter"]["family"]
        runs = {f"mb{size}": (family, recipe, run_overrides(args, size)) for size in args.sizes}
        train_runs(runs, args.work, args.jobs, [args.answers, args.heldout])
    curves = {run.name: learning_curve(run) for run in sorted((args.work / "runs").glob("mb*"))
              if (run / "metrics.jsonl").is_file()}
    if not curves:
        sys.exit(f"no runs under {args.work / 'runs'}")
    table = markdown(curves)
    (args.work / "report.md").write_text(table + "\n")
    (args.work / "results.json").write_text(json.dumps(curves, indent=1))
    print(table)


if __name__ == "__main__":
    main()
