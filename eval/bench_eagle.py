"""Benchmark (issue 3): EAGLE-1 vs EAGLE-3 vs prompt lookup on the toy target.

One run, one target, one set of held-out prompts:
  1. data      the toy target answers chat prompts from its *training* files, and (the training
               runs' eval set) other prompts from its held-out files, as `specdraft quickstart`
               does (cached in --work, so reruns skip it)
  2. train     EAGLE-1 and EAGLE-3 through `specdraft.train.train` with the shipped toy recipes
               (recipes/toy_eagle{1,3}.yaml), same data; wall-clock time and steps are recorded
  3. evaluate  ONE `evaluate(...)` call per temperature (0 and 1) with sources
               {eagle1, eagle3, prompt-lookup} plus plain decoding of the same target,
               on prompts from the toy target's *held-out* files, chain K=5
and prints one Markdown table per temperature: tau (tokens per target forward, bonus included),
the acceptance rate of draft positions 1..5 (given the earlier ones were accepted), alpha,
the draft cost c, tokens/s and the measured speedup over plain decoding.

  python eval/bench_eagle.py                                  # the shipped toy target
  python eval/bench_eagle.py --target /tmp/toy-quick --train-prompts 200 --eval-prompts 8
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import signal
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from specdraft.config import load_recipe
from specdraft.decoding.sampling import SamplingParams
from specdraft.decoding.sources import PromptLookupSource
from specdraft.drafters import load_drafter
from specdraft.evaluation.run import EvalSettings, evaluate
from specdraft.evaluation.suites import Prompt
from specdraft.quickstart import HELDOUT_ANSWERS, RECIPES_DIR, write_jsonl
from specdraft.target import FrozenTarget, resolve_target_path
from specdraft.toy_target import (
    definition_prompts,
    heldout_prompt_sets,
    list_source_files,
    toy_prompts,
)

K = 5
TEMPERATURES = (0.0, 1.0)
DRAFTERS = ("eagle1", "eagle3")
REGENERATE_TOKENS = 160  # the quickstart's answer length


def target_answers(target_dir: Path, work: Path, name: str, prompts: list[dict]) -> Path:
    """The target's own greedy answers to ``prompts`` (the quickstart's step 2), cached per target."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdraft.data.regenerate import regenerate

    answers = work / "data" / f"{name}.jsonl"
    stamp = {"target": str(target_dir.resolve()), "target_mtime": (target_dir / "model.safetensors").stat().st_mtime,
             "prompts": prompts, "max_new_tokens": REGENERATE_TOKENS}
    stamp_file = answers.with_suffix(".stamp.json")
    if answers.is_file() and stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        print(f"reusing {answers} ({len(prompts)} answers by {target_dir})")
        return answers
    answers.unlink(missing_ok=True)  # regenerate appends: never mix answers of two targets
    prompts_file = write_jsonl(work / "data" / f"{name}.prompts.jsonl", prompts)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    started = time.perf_counter()
    regenerate(model, tokenizer, prompts_file, answers, temperature=0.0, max_new_tokens=REGENERATE_TOKENS,
               batch_size=32)
    print(f"the target answered {len(prompts)} prompts in {time.perf_counter() - started:.0f} s -> {answers}")
    stamp_file.write_text(json.dumps(stamp))
    return answers


def train_drafter(family: str, target_dir: Path, data: list[str], work: Path, steps: int | None, reuse: bool,
                  show_progress: bool = True) -> dict:
    """Train one drafter with its shipped toy recipe; returns where it is and what it cost."""
    from specdraft.train import train

    run_dir = work / "runs" / family
    record_file = run_dir / "bench_record.json"
    if reuse and record_file.is_file():
        print(f"reusing {run_dir / 'drafter'} (--reuse-drafters)")
        return json.loads(record_file.read_text())
    overrides = [f"target.path={target_dir}", *data, f"checkpoint.output_dir={run_dir}",
                 "eval.enabled=false"]  # the acceptance eval is ours, below: one call for all methods
    if steps:
        overrides.append(f"training.max_steps={steps}")
    recipe = load_recipe(RECIPES_DIR / f"toy_{family}.yaml", overrides)
    print(f"training {family}: {recipe.training.max_steps} steps x {recipe.training.micro_batch_size} samples, "
          f"lr {recipe.optimizer.lr}")
    started = time.perf_counter()  # everything a user waits for: loading, data, draft vocab, loop, save
    train(recipe, overwrite=True, show_progress=show_progress)
    # The last line of metrics.jsonl is the held-out batches' loss and accuracies after training.
    final = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    record = {"drafter": str(run_dir / "drafter"), "seconds": time.perf_counter() - started,
              "steps": recipe.training.max_steps, "threads": torch.get_num_threads(),
              "final_metrics": {k: v for k, v in final.items() if k.startswith("eval/")}}
    record_file.write_text(json.dumps(record, indent=1))
    return record


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


@contextmanager
def spawned_workers(max_workers: int, **pool_options):
    """A pool of fresh (spawned) processes that ends with this script: Ctrl-C, or a SIGTERM (`kill`,
    `pkill`) of this process alone, terminates the workers too, which would otherwise go on unseen. A
    training worker's SIGTERM saves a checkpoint at its next step and exits (the loop's StopRequested);
    the pool's shutdown waits for that."""
    context = multiprocessing.get_context("spawn")  # a forked child would inherit the parent's torch threads
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # SIGTERM's default exits without unwinding
    try:
        with ProcessPoolExecutor(max_workers=max_workers, mp_context=context, **pool_options) as pool:
            try:
                yield pool
            except BaseException:
                for worker in multiprocessing.active_children():
                    worker.terminate()
                raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _train_one_thread(family: str, *args) -> dict:
    """A --train-jobs worker: one torch thread, no progress bar (two bars would interleave)."""
    torch.set_num_threads(1)
    return train_drafter(family, *args, show_progress=False)


def train_all(target_dir: Path, data: list[str], work: Path, steps: dict, reuse: bool, jobs: int) -> dict:
    """Train every drafter, one after another or (jobs=2) side by side in two 1-thread processes,
    which uses both cores of a 2-core machine; each drafter's recorded time is its own wall clock."""
    if jobs <= 1:
        return {family: train_drafter(family, target_dir, data, work, steps[family], reuse) for family in DRAFTERS}
    print(f"training {', '.join(DRAFTERS)} side by side (no progress bars; this takes minutes)")
    with spawned_workers(jobs) as pool:
        futures = {family: pool.submit(_train_one_thread, family, target_dir, data, work, steps[family], reuse)
                   for family in DRAFTERS}
        return {family: future.result() for family, future in futures.items()}


def eval_history(run_dir: Path) -> str:
    """Every periodic eval of a run, from its metrics.jsonl: how fast each drafter learns."""
    evals = eval_rows(run_dir)
    return ", ".join(f"{step}: {row['eval/acc_0']:.3f}" + (f" / {row['eval/sim_accept_len']:.2f}"
                     if "eval/sim_accept_len" in row else "")
                     # Medusa-2: how far the adapted target has moved from the original on the held-out answers
                     + (f" / KL {row['eval/kl_original_adapted']:.3f}" if "eval/kl_original_adapted" in row else "")
                     for step, row in evals.items())


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def evals_in(rows: list[dict]) -> dict[int, dict]:
    """The periodic held-out evals among metrics.jsonl's rows, by step (the final eval repeats the last step)."""
    return {row["step"]: row for row in rows if "eval/acc_0" in row}


def eval_rows(run_dir: Path) -> dict[int, dict]:
    return evals_in(metric_rows(run_dir))


def plot_learning_curves(runs: dict[str, Path], path: Path) -> None:
    """Each run's held-out first-draft accuracy, and where it logs one its simulated acceptance length,
    against the tokens it had trained on (``train/tokens_seen``; the optimizer step for a run that did not
    log them): one line per run, one panel per metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves, seen = {}, {}
    for name, run_dir in runs.items():
        rows = metric_rows(run_dir)
        curves[name] = evals_in(rows)
        seen[name] = {row["step"]: row["train/tokens_seen"] for row in rows if "train/tokens_seen" in row}
    by_tokens = all(set(curves[name]) <= set(seen[name]) for name in runs)
    panels = [(key, label) for key, label in (("eval/acc_0", "held-out acc_0 (first draft = target's top-1)"),
                                              ("eval/sim_accept_len", "held-out simulated acceptance length"))
              if any(key in row for rows in curves.values() for row in rows.values())]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        for name, rows in curves.items():
            points = [(seen[name][step] / 1e3 if by_tokens else step, row[key])
                      for step, row in rows.items() if key in row]
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        ax.set(xlabel="thousands of tokens trained on" if by_tokens else "optimizer step", ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draft_vocab_coverage(drafter, target_dir: Path, tokenizer) -> float:
    """Share of the tokens of the held-out definitions (what the eval asks for) inside EAGLE-3's
    reduced draft vocabulary: a token outside it can never be drafted, so it caps acceptance."""
    record = json.loads((target_dir / "build_record.json").read_text())
    files = list_source_files()
    sources = [src for rel in record["heldout_files"] if rel in files for _, src in definition_prompts(rel, files[rel])]
    ids = torch.tensor([t for src in sources for t in tokenizer(src, add_special_tokens=False)["input_ids"]])
    return drafter.t2d[ids].float().mean().item()


def evaluate_at_temperature(target, drafters: dict, prompts: list[Prompt], max_new_tokens: int, out: Path,
                            temperature: float, batch_size: int = 1) -> dict:
    """One `evaluate`: every drafter, prompt lookup and plain decoding, chain K, ``batch_size`` prompts at a time."""
    sources = {family: drafter.draft_source(target) for family, drafter in drafters.items()}
    sources["prompt-lookup"] = PromptLookupSource()
    return evaluate(target, sources, prompts,
                    EvalSettings(SamplingParams(temperature=temperature), k=K, max_new_tokens=max_new_tokens,
                                 batch_size=batch_size),
                    out / f"temperature-{temperature:g}")


def evaluate_at_temperatures(target, drafters: dict, prompts: list[Prompt], max_new_tokens: int, out: Path,
                             batch_size: int = 1) -> dict:
    """One `evaluate` per temperature, one after the other."""
    return {t: evaluate_at_temperature(target, drafters, prompts, max_new_tokens, out, t, batch_size)
            for t in TEMPERATURES}


def evaluate_folders_at_temperature(target_dir: Path, drafter_dirs: dict, prompts: list[Prompt], max_new_tokens: int,
                                    out: Path, temperature: float) -> dict:
    """``evaluate_at_temperature`` in this (fresh, one-thread) process, the models loaded from their folders."""
    torch.set_num_threads(1)
    target = FrozenTarget.from_pretrained(target_dir, dtype="float32")
    drafters = {name: load_drafter(folder, target).eval() for name, folder in drafter_dirs.items()}
    return evaluate_at_temperature(target, drafters, prompts, max_new_tokens, out, temperature)


def evaluate_temperatures_side_by_side(target_dir: Path, drafter_dirs: dict, prompts: list[Prompt],
                                       max_new_tokens: int, out: Path) -> dict:
    """``evaluate_at_temperatures`` with each temperature in its own process, a core each: half the wall clock
    of many drafters on a real target. Speedups stay like for like: within a temperature every method runs
    in the same process, beside the same neighbour."""
    with spawned_workers(len(TEMPERATURES)) as pool:
        futures = {t: pool.submit(evaluate_folders_at_temperature, target_dir, drafter_dirs, prompts, max_new_tokens,
                                  out, t) for t in TEMPERATURES}  # fmt: skip
        return {t: future.result() for t, future in futures.items()}


def markdown_table(result: dict) -> str:
    """method | tau | acceptance at draft positions 1..K | alpha measured, predicted | c | tok/s | speedup; with a
    K column where the methods drafted chains of different lengths (``result["chain_k"]``, bench_families)."""
    chain_k = result.get("chain_k")
    most = max([k for k in (chain_k or {}).values() if k] + [K])
    header = ["method", *(["K"] if chain_k else []), "tau", *[f"pos {i}" for i in range(1, most + 1)], "alpha",
              "alpha pred", "c", "tok/s", "speedup"]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    for method, groups in result["methods"].items():
        s = groups["overall"]
        positions = (s["position_acceptance"] or []) + [None] * most
        cells = [method, *([fmt(chain_k.get(method), "d")] if chain_k else []), fmt(s["acceptance_length"], ".2f"),
                 *[fmt(p, ".3f") for p in positions[:most]],
                 fmt(s["alpha_measured"], ".3f"), fmt(s["alpha_predicted"], ".3f"), fmt(s["draft_cost_ratio"], ".3f"),
                 fmt(s["tokens_per_second"], ".1f"), fmt(s["speedup"], ".2f") + ("x" if s["speedup"] else "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="toy", help="toy-target folder (default: the shipped toy target)")
    parser.add_argument("--work", default="bench-eagle", help="data, runs and eval reports go here")
    parser.add_argument("--train-prompts", type=int, default=800, help="training-file prompts the target answers")
    parser.add_argument("--eval-prompts", type=int, default=24, help="held-out prompts per temperature")
    parser.add_argument("--steps-eagle1", type=int, default=None, help="default: recipes/toy_eagle1.yaml's")
    parser.add_argument("--steps-eagle3", type=int, default=None, help="default: recipes/toy_eagle3.yaml's")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    # 1, not 2: on a 2-core machine shared with other jobs, torch's OpenMP threads spin-wait on each
    # other and the toy target's plain decoding fell from 264 to 3 tokens/s (EAGLE-3 training: 0.8 -> 7.9 s/step).
    parser.add_argument("--threads", type=int, default=1, help="torch threads (2 only on an otherwise idle machine)")
    parser.add_argument("--reuse-drafters", action="store_true",
                        help="skip training when --work already holds both drafters (their recorded times are printed)")
    parser.add_argument("--train-jobs", type=int, default=1, choices=(1, 2),
                        help="2: train both drafters at once, one thread each (an otherwise idle 2-core machine)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    target_dir, work = Path(resolve_target_path(args.target)), Path(args.work)
    eval_set, answered = heldout_prompt_sets(args.eval_prompts, HELDOUT_ANSWERS, target_dir)
    train_set = toy_prompts("train", args.train_prompts, target_dir=target_dir)
    data = [f"data.path={target_answers(target_dir, work, 'answers', train_set)}",
            f"data.eval_path={target_answers(target_dir, work, 'heldout_answers', answered)}"]
    steps = {"eagle1": args.steps_eagle1, "eagle3": args.steps_eagle3}
    trained = train_all(target_dir, data, work, steps, args.reuse_drafters, args.train_jobs)

    # Both drafters read one target: loading each makes it compute what that drafter reads.
    target = FrozenTarget.from_pretrained(target_dir, dtype="float32")
    drafters = {family: load_drafter(run["drafter"], target).eval() for family, run in trained.items()}
    prompts = [Prompt(id=str(p["question_id"]), suite="toy-heldout", category=p["category"], kind="question",
                      turns=p["turns"]) for p in eval_set]
    results = evaluate_at_temperatures(target, drafters, prompts, args.max_new_tokens, work / "eval")

    print(f"\n## EAGLE-1 vs EAGLE-3 vs prompt lookup ({target_dir.name}, {args.eval_prompts} held-out prompts, "
          f"K={K}, max {args.max_new_tokens} new tokens, {args.threads} threads)")
    for temperature, result in results.items():
        print(f"\n### temperature {temperature:g}\n\n{markdown_table(result)}")
        identical = result.get("greedy_identical")
        if identical:
            print("\ngreedy output identical to plain decoding: " + ", ".join(f"{m} {v:.0%}" for m, v in identical.items()))
    print(f"\ntraining, same {args.train_prompts} target answers for both (wall clock incl. loading and saving): "
          + "; ".join(f"{family} {run['steps']} steps in {run['seconds'] / 60:.1f} min "
                      f"({run.get('threads', '?')} thread(s))" for family, run in trained.items()))
    # Training's own estimate of tau - 1 on held-out answers, to hold against the decoder's tau - 1 above.
    for family, run in trained.items():
        m = run["final_metrics"]
        estimate = f", sim_accept_len {m['eval/sim_accept_len']:.2f}" if "eval/sim_accept_len" in m else ""
        print(f"  {family}: held-out top-1 accuracy of draft step 1 {m['eval/acc_0']:.3f}{estimate}")
        print(f"    during training (step: acc_0 / sim_accept_len): {eval_history(Path(run['drafter']).parent)}")
    coverage = draft_vocab_coverage(drafters["eagle3"], target_dir, target.tokenizer)
    print(f"  eagle3 draft vocabulary ({drafters['eagle3'].lm_head.out_features} of {target.vocab_size} tokens) covers "
          f"{coverage:.1%} of the tokens of the held-out definitions")


if __name__ == "__main__":
    main()
