"""Benchmark: what Medusa-2's settings cost in fidelity. Trains Medusa-2 variants on the same answers and
budget, then measures each adapted target's drift from the original and the heads' acceptance on it.

    python eval/bench_medusa2_drift.py --target smollm2-135m-instruct --num-train-prompts 300 --steps 60

Medusa-2 fine-tunes the target so that its heads accept more, and the self-distillation term
KL(p_original || p_adapted) holds the target back. Under Adam the balance of the two gradients in the
adapters, not their scale, sets how far it moves: the heads' CE (about 6 nats per head, early on) dwarfs
the KL (0 at the start, where LoRA's B = 0), so the adapters follow the heads until the KL grows enough
to push back. Each variant moves one knob of that balance. The first variant never starts the joint stage
(the heads alone on the original target: Medusa-1 at the same budget, zero drift), the reference for what
the joint stage buys.

For each variant: held-out acc_0 and KL during training (the run's periodic evals), then on --per-category
Spec-Bench questions: drift on their first turns (mean KL along the original's greedy answer, greedy
agreement and common prefix over --max-new-tokens; ``medusa2.drift_report``), and tau at T=0, K=5, on the
adapted target over all their turns. Writes WORK/drift.json and WORK/drift.md and prints the Markdown.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from bench_families import prompt_sets, recipe_for, target_answers, train_runs
from transformers import AutoTokenizer

from specdraft.decoding.sampling import SamplingParams
from specdraft.drafters import load_drafter
from specdraft.drafters.medusa2 import drift_report
from specdraft.evaluation.run import EvalSettings, evaluate
from specdraft.evaluation.suites import prompt_token_ids
from specdraft.target import FrozenTarget, resolve_target_path

K = 5
# name -> recipe overrides. The adapters' lr is optimizer.lr; the heads' is lr x head_lr_multiplier (1e-3 in
# every variant but the one that moves it, so that only one thing changes at a time).
VARIANTS = {
    "heads only (no joint stage)": ["drafter.joint_from_step={steps}"],
    "recipe: adapters 2.5e-4, lambda 0.2": [],
    "adapters 5e-5": ["optimizer.lr=5e-5", "drafter.head_lr_multiplier=20"],
    "lambda_heads 0.05": ["drafter.heads_coefficient=0.05"],
}


def parse_variant(text: str) -> tuple[str, list[str]]:
    """'NAME:KEY=VALUE,KEY=VALUE' -> (NAME, [KEY=VALUE, ...])."""
    name, sep, rest = text.partition(":")
    if not sep or not name:
        sys.exit(f"--variant {text!r}: spell it NAME:KEY=VALUE[,KEY=VALUE...] (NAME:  for the recipe as it is)")
    return name, [item for item in rest.split(",") if item]


def curve(run_dir: Path) -> list[dict]:
    """The run's periodic held-out evals: step, acc_0 and KL(original || adapted) on the held-out answers."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {row["step"]: row for row in rows if "eval/acc_0" in row}
    return [{"step": step, "acc_0": row["eval/acc_0"], "kl": row.get("eval/kl_original_adapted", 0.0)}
            for step, row in evals.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct", help="a named target, 'toy', or a folder")
    parser.add_argument("--work", default="bench-medusa2-drift", help="data, runs and reports go here")
    parser.add_argument("--train-prompts", default=None, help="default: ../shared/data/train_prompts.jsonl")
    parser.add_argument("--eval-prompts", default=None, help="default: ../shared/data/spec_bench_questions.jsonl")
    parser.add_argument("--num-train-prompts", type=int, default=300)
    parser.add_argument("--heldout-answers", type=int, default=24)
    parser.add_argument("--answer-tokens", type=int, default=256)
    parser.add_argument("--answer-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--per-category", type=int, default=1, help="eval questions per Spec-Bench category")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--joint-from", type=float, default=0.3, help="the joint stage starts at this share of --steps")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--variant", action="append", default=None, metavar="NAME:KEY=VALUE,...",
                        help="replaces the default variants (repeatable)")
    parser.add_argument("--jobs", type=int, default=2, choices=(1, 2))
    args = parser.parse_args()
    torch.set_num_threads(1)

    work = Path(args.work)
    target_dir = Path(resolve_target_path(args.target, "float32"))
    recipe = recipe_for("smollm2-135m" if args.target == "smollm2-135m-instruct" else "toy", "medusa2")
    train, heldout, eval_prompts, source = prompt_sets(args)
    answers, _ = target_answers(target_dir, work, "answers", train, args.answer_tokens, args.answer_dtype)
    heldout_answers, _ = target_answers(target_dir, work, "heldout_answers", heldout, args.answer_tokens,
                                        args.answer_dtype)
    variants = dict(parse_variant(v) for v in args.variant) if args.variant else VARIANTS
    joint_from = round(args.joint_from * args.steps)
    common = [f"target.path={target_dir}", f"data.path={answers}", f"data.eval_path={heldout_answers}",
              "eval.enabled=false", f"training.max_steps={args.steps}",
              f"training.micro_batch_size={args.micro_batch_size}", f"training.eval_every={max(1, args.steps // 3)}",
              f"drafter.joint_from_step={joint_from}"]
    runs = {f"variant-{i}": ("medusa2", recipe, common + [o.format(steps=args.steps) for o in overrides])
            for i, overrides in enumerate(variants.values())}
    trained = train_runs(runs, work, args.jobs, [answers, heldout_answers])

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompt_ids = [torch.tensor([prompt_token_ids(tokenizer, p)]) for p in eval_prompts]
    rows = []
    for (name, overrides), (run_name, record) in zip(variants.items(), trained.items()):
        target = FrozenTarget.from_pretrained(target_dir, dtype="float32")  # its own: the drafter adapts it
        drafter = load_drafter(record["drafter"], target).eval()
        drift = drift_report(target, drafter, prompt_ids, args.max_new_tokens)
        result = evaluate(target, {"medusa2": drafter.draft_source(target)}, eval_prompts,
                          EvalSettings(SamplingParams(temperature=0.0), k=K, max_new_tokens=args.max_new_tokens,
                                       show_progress=False),
                          work / "eval" / run_name)
        overall = result["methods"]["medusa2"]["overall"]
        rows.append({"variant": name, "overrides": overrides, "minutes": record["seconds"] / 60,
                     "curve": curve(Path(record["drafter"]).parent), **drift,
                     "tau": overall["acceptance_length"], "alpha": overall["alpha_measured"]})
        print(f"{name}: {rows[-1]}", flush=True)
        del target, drafter

    lines = [f"## Medusa-2 variants on {args.target}: drift against acceptance ({len(eval_prompts)} prompts from "
             f"{source}, {args.steps} steps, joint from step {joint_from}, micro-batch "
             f"{args.micro_batch_size}, {args.max_new_tokens} new tokens, K={K}, T=0)", "",
             f"`python {' '.join(sys.argv)}`", "",
             "| variant | held-out acc_0 | held-out KL | drift KL | greedy agreement | common prefix | tau (T=0) "
             "| alpha | minutes |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        last = row["curve"][-1] if row["curve"] else {"acc_0": float("nan"), "kl": float("nan")}
        lines.append(f"| {row['variant']} | {last['acc_0']:.3f} | {last['kl']:.4f} | "
                     f"{row['mean_kl_original_adapted']:.4f} | {row['greedy_agreement']:.1%} | "
                     f"{row['greedy_common_prefix']:.1f} | {row['tau']:.2f} | {row['alpha']:.3f} | "
                     f"{row['minutes']:.1f} |")
    lines += [""] + [f"- {row['variant']} (step: acc_0 / KL): " + ", ".join(
        f"{c['step']}: {c['acc_0']:.3f} / {c['kl']:.4f}" for c in row["curve"]) for row in rows]
    markdown = "\n".join(lines)
    (work / "drift.md").write_text(markdown + "\n")
    (work / "drift.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    print(markdown)


if __name__ == "__main__":
    main()
