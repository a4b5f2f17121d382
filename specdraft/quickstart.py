"""``specdraft quickstart``: the whole job on the shipped toy target, with no download.

  1. prompts      chat prompts from the toy target's *training* files ("Write the function f in x.py")
  2. regenerate   the target answers them itself (drafters trained on the target's own text accept more),
                  and answers prompts from its *held-out* files too: the training run's eval set
  3. train        EAGLE-3 through the same ``train`` path and recipe (recipes/toy_eagle3.yaml); its
                  ``eval:`` step runs the saved drafter in the decoder on prompts from the toy target's
                  *held-out* files, against prompt lookup and plain decoding, at temperature 0 and 1
                  (terminal table + JSON/Markdown/PNG report in RUN/eval)
  4. export       SGLang, vLLM (speculators) and specdraft's own folder
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from .errors import SpecdraftError

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
HELDOUT_ANSWERS = 48  # default: held-out prompts the target answers for the training run's eval metrics


def toy_prompts(split: str, limit: int, seed: int = 0, target_dir: Path | None = None) -> list[dict]:
    """``turns``-format prompts from a toy target's own train or held-out files (default: the shipped one)."""
    from .toy_target import definition_prompts, list_source_files, toy_target_path

    record = json.loads(((target_dir or toy_target_path()) / "build_record.json").read_text())
    heldout = set(record["heldout_files"])
    files = list_source_files()
    chosen = {rel: text for rel, text in files.items() if (rel in heldout) == (split == "heldout")}
    prompts = [p for rel, text in chosen.items() for p, _ in definition_prompts(rel, text)]
    random.Random(seed).shuffle(prompts)
    if len(prompts) < limit:
        raise SpecdraftError(f"only {len(prompts)} {split} prompts can be built from this interpreter's standard "
                             f"library; ask for at most that many")
    # Spec-Bench question format; the category is what is asked for ("Write the method ...").
    return [{"question_id": i, "category": p.split()[2], "turns": [p]} for i, p in enumerate(prompts[:limit])]


def heldout_prompt_sets(eval_prompts: int, answered: int, target_dir: Path | None = None) -> tuple[list, list]:
    """Two disjoint sets of held-out prompts: the acceptance eval's, and the ones whose answers
    are the training run's eval set (so its acc_k measure new prompts, as the decoder will)."""
    prompts = toy_prompts("heldout", eval_prompts + answered, target_dir=target_dir)
    return prompts[:eval_prompts], prompts[eval_prompts:]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def quickstart(out: Path, train_prompts: int, steps: int | None, eval_prompts: int, overwrite: bool,
               heldout_answers: int = HELDOUT_ANSWERS) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .config import load_recipe
    from .data.regenerate import regenerate
    from .export import export
    from .toy_target import toy_target_path
    from .train import train

    started = time.perf_counter()
    if not torch.cuda.is_available():
        # The toy target is tiny, and OpenMP threads that find a core busy spin: with one other
        # busy process on 2 cores, 2 threads decoded at 43 ms/token against 4.8 ms with 1.
        torch.set_num_threads(1)
    target_dir = toy_target_path()
    print(f"[1/4] toy target: {target_dir}")

    data = out / "data"
    eval_set, answered = heldout_prompt_sets(eval_prompts, heldout_answers)
    print(f"[2/4] the target answers {train_prompts} prompts from its training files -> {data / 'answers.jsonl'}, "
          f"and {len(answered)} from held-out files (training's eval set) -> {data / 'heldout_answers.jsonl'}")
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    for prompts, name in ((toy_prompts("train", train_prompts), "answers"), (answered, "heldout_answers")):
        prompts_file = write_jsonl(data / f"{name}.prompts.jsonl", prompts)
        regenerate(model, tokenizer, prompts_file, data / f"{name}.jsonl", temperature=0.0, max_new_tokens=128,
                   batch_size=64)
    del model
    eval_prompts_file = write_jsonl(data / "eval_prompts.jsonl", eval_set)

    recipe_file = RECIPES_DIR / "toy_eagle3.yaml"
    if not recipe_file.is_file():
        raise SpecdraftError(f"{recipe_file} not found: run the quickstart from a clone of the specdraft repository")
    overrides = [f"data.path={data / 'answers.jsonl'}", f"data.eval_path={data / 'heldout_answers.jsonl'}",
                 f"checkpoint.output_dir={out / 'run'}", f"eval.prompts={eval_prompts_file}",
                 f"eval.num_prompts={eval_prompts}"]
    if steps:
        overrides.append(f"training.max_steps={steps}")
    recipe = load_recipe(recipe_file, overrides)
    print(f"[3/4] training EAGLE-3 ({recipe.training.max_steps} steps), then the acceptance eval on "
          f"{eval_prompts} held-out prompts at temperature {', '.join(map(str, recipe.eval.temperatures))}")
    run_dir = train(recipe, overwrite=overwrite)

    print(f"[4/4] exporting -> {out / 'export'}")
    exported = {fmt: export(run_dir, fmt, out / "export" / fmt, overwrite=True) for fmt in ("sglang", "vllm", "hf")}

    minutes = (time.perf_counter() - started) / 60
    print(f"\ndone in {minutes:.1f} min.")
    print(f"  run:     {run_dir} (recipe.yaml, metrics.jsonl, checkpoints/, drafter/)")
    print(f"  report:  {run_dir / 'eval'} (result JSON, report.md, PNG plots per temperature)")
    for fmt, path in exported.items():
        print(f"  {fmt + ':':<8} {path}")
    return run_dir / "eval"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="quickstart", help="where data, run, exports and report go")
    parser.add_argument("--train-prompts", type=int, default=1200, help="prompts the target answers for training")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's)")
    parser.add_argument("--eval-prompts", type=int, default=24, help="held-out prompts for the acceptance eval")
    parser.add_argument("--heldout-answers", type=int, default=HELDOUT_ANSWERS,
                        help="held-out prompts the target answers for training's eval metrics")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier quickstart's run")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if (out / "run").exists() and not args.overwrite:
        raise SpecdraftError(f"{out / 'run'} exists from an earlier quickstart; pass --overwrite or --out NEW_DIR")
    quickstart(out, args.train_prompts, args.steps, args.eval_prompts, args.overwrite, args.heldout_answers)
    return 0
