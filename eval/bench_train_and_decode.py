"""Benchmark on one device (a GPU): the target answers prompts, drafters train for a time budget, and the
built-in decoder measures them, eager and with the target's verify compiled (CUDA graphs on CUDA).

    # issue 31, item 5 (a real target on a GPU; eval/gpu_real_target.sh runs it):
    python eval/bench_train_and_decode.py --target smollm2-135m-instruct --device cuda --work W \\
        --train-prompts-file P.jsonl --eval-prompts-file Q.jsonl --num-train-prompts 3000 --train-minutes 2 \\
        --families eagle3 dflash -k 7 --tree eagle2 --temperatures 0 1
    # eval/gpu_check.sh's decode speedups (the toy target, its own prompts):
    python eval/bench_train_and_decode.py --target toy --device cuda --work W --num-train-prompts 600 \\
        --train-minutes 1 --families eagle3 medusa1 mlp_speculator -k 5 --temperatures 0
    # a CPU dry run of either (minutes): --device cpu --num-train-prompts 16 --train-steps 4 --per-category 1

  1. answers   the target answers the training prompts (greedy, batched, on the device; bench_families'
               target_answers, cached in WORK/data) and a held-out slice (training's eval set)
  2. train     each family with recipes/<target>-<family>.yaml (the target and the drafter in bf16 on a
               GPU), for --train-minutes: a 10-step probe run times a step, then the real run is given
               the steps that fit (or --train-steps); the cosine schedule spans exactly those steps
  3. decode    one `evaluate` per temperature and compile mode: every drafter as a chain of -k drafts and
               (--tree) as a tree, prompt lookup, and plain decoding of the same target; tau, speedups and
               the predictions (specdraft/evaluation/verify_cost.py) per method; greedy outputs checked
               against plain decoding
Prompts: --train-prompts-file / --eval-prompts-file (a copy of the shared training prompts and
Spec-Bench questions), else the toy target's own prompt source (definitions in the standard library).
Writes WORK/report.md and WORK/results.json and prints the Markdown.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from bench_families import overrides_for, recipe_for, target_answers

from specdraft.config import load_recipe
from specdraft.decoding.sampling import SamplingParams
from specdraft.decoding.sources import PromptLookupSource
from specdraft.decoding.speculative import TreeDrafting
from specdraft.decoding.trees import parse_tree
from specdraft.drafters import load_drafter
from specdraft.evaluation.run import EvalSettings, evaluate
from specdraft.evaluation.suites import Prompt, load_suite, prompt_token_ids
from specdraft.target import FrozenTarget, resolve_target_path
from specdraft.train import train

RECIPE_PREFIX = {"smollm2-135m-instruct": "smollm2-135m", "toy": "toy"}
COLUMNS = (("tau", "acceptance_length", ".2f"), ("alpha", "alpha_measured", ".3f"),
           ("tok/s", "tokens_per_second", ".1f"), ("speedup", "speedup", ".2f"),
           ("pred @ proposals", "predicted_speedup_from_proposals", ".2f"))


def prompt_sets(args) -> tuple[list[dict], list[dict], list[Prompt]]:
    """(training prompts, held-out prompts whose answers are training's eval set, decoding prompts)."""
    if args.train_prompts_file and args.eval_prompts_file:
        text = Path(args.train_prompts_file).read_text(encoding="utf-8")
        records = [json.loads(line) for line in text.split("\n") if line.strip()]
        random.Random(0).shuffle(records)  # the file is grouped by source
        wanted = args.num_train_prompts + args.heldout_answers
        if len(records) < wanted:
            sys.exit(f"{args.train_prompts_file} has {len(records)} prompts; {wanted} are asked for")
        per_category: dict[str, list[Prompt]] = {}
        for prompt in load_suite(args.eval_prompts_file):
            per_category.setdefault(prompt.category, []).append(prompt)
        evals = [p for group in per_category.values() for p in group[: args.per_category]]
        return records[: args.num_train_prompts], records[len(records) - args.heldout_answers :], evals
    train = toy_definitions("train", args.num_train_prompts)
    heldout = toy_definitions("heldout", args.heldout_answers + 4 * args.per_category)
    prompts = [Prompt(str(p["question_id"]), "stdlib", p["category"], "question", p["turns"])
               for p in heldout[args.heldout_answers :]]
    return train, heldout[: args.heldout_answers], prompts


def toy_definitions(split: str, count: int) -> list[dict]:
    """``count`` prompts asking for definitions in the toy target's ``split`` files (as its quickstart asks), read
    file by file until there are enough: the quickstart's ``toy_prompts`` parses the whole standard library."""
    from specdraft.toy_target import definition_prompts, list_source_files, toy_target_path

    heldout = set(json.loads((toy_target_path() / "build_record.json").read_text())["heldout_files"])
    prompts = []
    for rel, text in sorted(list_source_files().items()):
        if (rel in heldout) == (split == "heldout"):
            prompts += [p for p, _ in definition_prompts(rel, text)]
        if len(prompts) >= 2 * count:
            break
    random.Random(0).shuffle(prompts)
    return [{"question_id": f"{split}-{i}", "category": p.split()[2], "turns": [p]}
            for i, p in enumerate(prompts[:count])]


def train_for(family: str, recipe_path: Path, overrides: list[str], run_dir: Path, minutes: float,
              steps: int | None) -> dict:
    """Train ``family``: ``steps`` steps, or as many as ``minutes`` allow at the step time of a 20-step probe run's
    last 10 steps (its first steps pay the loading, the data and the device's warm-up: on an H200 the first
    10 steps of EAGLE-3 on SmolLM2, loading included, took 22.6 s against 0.5 s a step after them)."""
    probe_step_seconds = None
    if steps is None:
        probe = run_dir.with_name(run_dir.name + "-probe")
        train(load_recipe(recipe_path, overrides + ["training.max_steps=20", "training.log_every=10",
                                                    "training.eval_every=0",  # no eval inside the timed window
                                                    f"checkpoint.output_dir={probe}", "checkpoint.save_every=20"]),
              overwrite=True, show_progress=False)
        logs = [json.loads(line) for line in (probe / "metrics.jsonl").read_text().splitlines()]
        windows = {e["step"]: e for e in logs if "train/tokens_per_s" in e}
        seconds_10_to_20 = (windows[20]["train/tokens_seen"] - windows[10]["train/tokens_seen"]) \
            / windows[20]["train/tokens_per_s"]
        probe_step_seconds = seconds_10_to_20 / 10
        steps = max(20, math.floor(minutes * 60 / probe_step_seconds))
    overrides = overrides + [f"training.max_steps={steps}", f"checkpoint.output_dir={run_dir}",
                             f"checkpoint.save_every={steps}", f"training.eval_every={steps}"]
    started = time.perf_counter()
    train(load_recipe(recipe_path, overrides), overwrite=True, show_progress=False)
    seconds = time.perf_counter() - started
    logs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = {k: v for entry in logs for k, v in entry.items() if k.startswith("eval/")}
    return {"family": family, "steps": steps, "seconds": round(seconds, 1), "probe_step_seconds": probe_step_seconds,
            "tokens_per_s": [e["train/tokens_per_s"] for e in logs if "train/tokens_per_s" in e][-1],
            "tokens": [e["train/tokens_seen"] for e in logs if "train/tokens_seen" in e][-1],
            "eval": final, "peak_cuda_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available()
            else None}  # fmt: skip


def methods_of(drafters: dict, target, trees: list[str]) -> dict:
    sources = {}
    for family, drafter in drafters.items():
        sources[family] = drafter.draft_source(target)
        for spec in trees:
            tree, source = parse_tree(spec), drafter.draft_source(target)
            if tree.kind in source.capabilities.tree_kinds:
                sources[f"{family} tree:{spec}"] = TreeDrafting(source, tree)
    sources["prompt-lookup"] = PromptLookupSource()
    return sources


def table(runs: dict) -> str:
    lines = ["| compile_target | T | method | " + " | ".join(name for name, _, _ in COLUMNS) + " | greedy identical |",
             "|---|---:|---|" + "---:|" * len(COLUMNS) + "---|"]
    for (mode, temperature), result in runs.items():
        for method, groups in result["methods"].items():
            s = groups["overall"]
            cells = ["-" if s[key] is None else format(s[key], spec) for _, key, spec in COLUMNS]
            same = result.get("greedy_identical", {}).get(method)
            lines.append(f"| {mode} | {temperature:g} | {method} | " + " | ".join(cells) + " | "
                         + ("-" if same is None else f"{same:.0%}") + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="toy", choices=sorted(RECIPE_PREFIX))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--work", required=True)
    parser.add_argument("--train-prompts-file", default=None)
    parser.add_argument("--eval-prompts-file", default=None)
    parser.add_argument("--num-train-prompts", type=int, default=3000)
    parser.add_argument("--heldout-answers", type=int, default=48)
    parser.add_argument("--answer-tokens", type=int, default=256)
    parser.add_argument("--answer-batch", type=int, default=128)
    parser.add_argument("--per-category", type=int, default=3, help="decoding prompts per category")
    parser.add_argument("--families", nargs="+", default=["eagle3"])
    parser.add_argument("--train-minutes", type=float, default=4.0, help="per family")
    parser.add_argument("--train-steps", type=int, default=None, help="instead of --train-minutes")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for every family, or for one: eagle3:drafter.draft_vocab_size=2048")
    parser.add_argument("-k", type=int, default=7)
    parser.add_argument("--tree", action="append", default=[], help="also decode each drafter with this tree")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--compile-modes", nargs="+", default=["off", "reduce-overhead"],
                        help="off, and torch.compile modes for the target's verify (reduce-overhead: CUDA graphs)")
    args = parser.parse_args()
    work = Path(args.work)
    gpu = args.device.startswith("cuda")
    dtype = "bfloat16" if gpu else "float32"
    target_dir = Path(resolve_target_path(args.target, dtype))
    train_set, heldout, eval_prompts = prompt_sets(args)
    started = time.perf_counter()
    answers, record = target_answers(target_dir, work, "answers", train_set, args.answer_tokens, dtype,
                                     args.answer_batch, args.device)
    heldout_answers, _ = target_answers(target_dir, work, "heldout_answers", heldout, args.answer_tokens, dtype,
                                        args.answer_batch, args.device)
    answer_seconds = time.perf_counter() - started

    precision = "bf16" if gpu else "'no'"  # quoted: YAML reads a bare no as False
    overrides = [f"target.path={target_dir}", f"data.path={answers}", f"data.eval_path={heldout_answers}",
                 "eval.enabled=false", f"target.dtype={dtype}", f"training.mixed_precision={precision}", *args.set]
    trained = {}
    for family in args.families:
        recipe = recipe_for(RECIPE_PREFIX[args.target], family)
        family_overrides = overrides_for(family, overrides) + ([f"drafter.ttt_steps={args.k}"] if family == "eagle3"
                                                               else [])
        trained[family] = train_for(family, recipe, family_overrides, work / "runs" / family, args.train_minutes,
                                    args.train_steps)
        print(f"{family}: {trained[family]}", flush=True)

    target = FrozenTarget.from_pretrained(target_dir, dtype=dtype, device=args.device)
    fits = [p for p in eval_prompts if len(prompt_token_ids(target.tokenizer, p)) + 2 * args.max_new_tokens
            < target.config.max_position_embeddings]
    drafters = {family: load_drafter(work / "runs" / family / "drafter", target).eval() for family in trained}
    runs = {}
    for temperature in args.temperatures:  # T=0 eager and compiled first: what a call cut at its limit keeps
        for mode in args.compile_modes:
            compile_target = False if mode == "off" else mode
            runs[(mode, temperature)] = evaluate(
                target, methods_of(drafters, target, args.tree), fits,
                EvalSettings(SamplingParams(temperature=temperature), k=args.k, max_new_tokens=args.max_new_tokens,
                             compile_target=compile_target, show_progress=False),
                work / "eval" / f"{mode}-T{temperature:g}")
    device_name = torch.cuda.get_device_name() if gpu else "CPU"
    lines = [f"## {args.target} on {device_name}: drafters trained here, decoded by specdraft (K={args.k}, "
             f"{len(fits)} prompts, max {args.max_new_tokens} new tokens, {dtype})", "",
             f"`python eval/bench_train_and_decode.py {' '.join(sys.argv[1:])}`", "",
             f"answers: {len(train_set)} prompts in {answer_seconds:.0f} s ({record})", "",
             "| family | steps | train s | tokens | tokens/s | peak GPU GiB | eval acc_0 / sim_accept_len |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for family, run in trained.items():
        peak = "-" if run["peak_cuda_gib"] is None else f"{run['peak_cuda_gib']:.1f}"
        lines.append(f"| {family} | {run['steps']} | {run['seconds']:.0f} | {run['tokens']:,.0f} | "
                     f"{run['tokens_per_s']:.0f} | {peak} | "
                     f"{run['eval'].get('eval/acc_0', float('nan')):.3f} / "
                     f"{run['eval'].get('eval/sim_accept_len', float('nan')):.2f} |")
    lines += ["", table(runs)]
    markdown = "\n".join(lines)
    (work / "report.md").write_text(markdown + "\n")
    (work / "results.json").write_text(json.dumps({"args": vars(args), "training": trained,
                                                    "eval": {f"{m} T={t:g}": r for (m, t), r in runs.items()}},
                                                   indent=1, default=str))
    print("\n" + markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
