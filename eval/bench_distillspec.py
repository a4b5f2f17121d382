"""Benchmark: DistillSpec's grid (divergence x data) on one target, same student init, same steps.

    python eval/bench_distillspec.py --target toy --steps 100 --train-jobs 2
    python eval/bench_distillspec.py --target smollm2-135m-instruct --steps 200 --train-jobs 2

  1. data      the target's own answers to the training prompts (cached, as eval/bench_families.py)
  2. train     recipes/<target>-distillspec.yaml, one cell per divergence (fkl, rkl, jsd beta 0.5, tvd)
               x data (teacher answers: lambda 0; on-policy lambda 0.5; on-policy lambda 1), plus the
               baseline trained by next-token CE on the teacher's answers; each in a fresh 1-thread
               process. The student as initialised (no training) is the floor.
  3. evaluate  one `evaluate` per temperature (0 and 1; --eval-jobs 2 runs the two side by side, a process
               each): every student, prompt lookup and plain decoding, chain K=5: tau, alpha, c, speedup.
               The winner per decoding mode is printed.
  4. assisted  the T=0 winner in transformers' assisted generation (same K, constant schedule, no
               confidence cut-off) against specdraft's decoder, greedy, same prompts: identical tokens
               required, wall clock compared; also with the student's decode step compiled
               (DraftLMSource(compile=True); transformers switches compilation off for its assistant),
               and with the target's verify compiled as well (speculative_decode(compile_target=True));
               and each eager loop's time inside the two models' forwards (alike in both) and outside them.

Writes WORK/results.json and WORK/report.md, and prints the Markdown. `--assisted-only CELL` runs
step 4 alone on one cell (training only that cell if WORK holds no current run of it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from bench_eagle import K, evaluate_at_temperatures, evaluate_temperatures_side_by_side, markdown_table
from bench_families import (
    RECIPE_PREFIX,
    add_grid_arguments,
    fitting_prompts,
    grid_data,
    overrides_for,
    recipe_for,
    train_runs,
)

from specdraft.config import load_recipe
from specdraft.decoding.sampling import SamplingParams
from specdraft.decoding.sources import DraftLMSource
from specdraft.decoding.speculative import speculative_decode
from specdraft.drafters import load_drafter
from specdraft.drafters.distillspec import DISTILLSPEC
from specdraft.evaluation.suites import prompt_token_ids
from specdraft.target import FrozenTarget, resolve_target_path

DIVERGENCE_CELLS = {"fkl": [], "rkl": [], "jsd": ["drafter.beta=0.5"], "tvd": []}
DATA_CELLS = {"teacher": 0.0, "onpolicy0.5": 0.5, "onpolicy1": 1.0}


def cells() -> dict[str, list[str]]:
    """cell name -> its recipe overrides: the grid, then the CE baseline."""
    grid = {f"{div}-{data}": [f"drafter.divergence={div}", f"drafter.on_policy_fraction={lam}", *extra]
            for div, extra in DIVERGENCE_CELLS.items() for data, lam in DATA_CELLS.items()}
    return {**grid, "ce-teacher": ["drafter.divergence=ce", "drafter.on_policy_fraction=0.0"]}


ROW_LABELS = {"fkl": "FKL", "rkl": "RKL", "jsd": "JSD(0.5)", "tvd": "TVD", "ce": "CE (next token)",
              "init-only": "untrained (init only)"}


def grid_table(results: dict) -> str:
    """divergence x data, tau (alpha measured) per temperature: the grid at a glance (report.md's full
    tables give c, tokens/s and speedups)."""
    columns = [(data, temperature) for temperature in results for data in DATA_CELLS]
    lines = ["| divergence | " + " | ".join(f"{data} T={t:g}" for data, t in columns) + " |",
             "|---" + "|---:" * len(columns) + "|"]
    for row in [*DIVERGENCE_CELLS, "ce", "init-only"]:
        cells = []
        for data, temperature in columns:
            if row in DIVERGENCE_CELLS:
                name = f"{row}-{data}"
            else:  # one column each: CE trains on the teacher's answers only, the untrained student on nothing
                name = {"ce": "ce-teacher", "init-only": "init-only"}[row] if data == "teacher" else None
            overall = results[temperature]["methods"].get(name, {}).get("overall")
            cells.append("-" if not overall or overall["acceptance_length"] is None else
                         f"{overall['acceptance_length']:.2f} ({overall['alpha_measured']:.2f})")
        lines.append(f"| {ROW_LABELS[row]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def untrained_student(recipe: Path, target, work: Path) -> Path:
    """The student as its recipe initialises it, saved as a trained one would be."""
    folder = work / "runs" / "init-only" / "drafter"
    torch.manual_seed(0)
    DISTILLSPEC.build(target, load_recipe(recipe).drafter).save_pretrained(folder)
    return folder


@contextmanager
def time_in_forwards(modules):
    """{"seconds": time spent inside these modules' forward calls, "calls": how many calls the first module
    took} (hooks; the modules are not nested). With the target's body first, "calls" counts the target's
    forwards: its prefills and verifies."""
    spent, started = {"seconds": 0.0, "calls": 0}, {}

    def enter(module, args):
        started[id(module)] = time.perf_counter()

    def leave(module, args, output):
        spent["seconds"] += time.perf_counter() - started.pop(id(module))
        spent["calls"] += module is modules[0]

    handles = [h for m in modules for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        yield spent
    finally:
        for handle in handles:
            handle.remove()


def assisted_against_specdraft(target, student, prompts, max_new_tokens: int) -> dict:
    """Greedy, same student, same K: transformers' assisted generation against speculative_decode.

    Also the time each eager loop spends inside the two models' forwards, which both run alike (one
    K+1-token target forward and K one-token student forwards a step), and outside them, per target
    forward (``outside_forwards_ms_per_call``): the decoders differ only there. transformers' time over
    specdraft's forwards is the ratio specdraft would reach with no overhead of its own (``ceiling``)."""
    eos = target.tokenizer.eos_token_id
    assistant = student.lm()
    assistant.generation_config.num_assistant_tokens = K
    assistant.generation_config.num_assistant_tokens_schedule = "constant"  # K drafts every step, as ours
    assistant.generation_config.assistant_confidence_threshold = 0.0  # never cut a proposal short
    seconds = {"transformers": 0.0, "transformers_forwards": 0.0, "specdraft": 0.0, "specdraft_forwards": 0.0,
               "specdraft_compiled": 0.0, "specdraft_compiled_target": 0.0}
    target_calls = {"transformers": 0, "specdraft": 0}
    # The student's decoder and head, not the student itself: DraftLMSource calls model.forward, which runs
    # no hooks of the outer module. transformers calls the same inner modules, so both loops are timed alike.
    forward_modules = [target.base, target.lm_head, assistant.get_decoder(), assistant.get_output_embeddings()]
    identical = identical_compiled = identical_compiled_target = tokens = 0
    # The same student with its decode step compiled (DraftLMSource(compile=True)), then with the target's verify
    # compiled too (compile_target): an untimed pass over the prompts compiles both for every cache size they
    # need (the verify's sizes follow the budget), so the timed loop measures steps, not the compiler.
    compiled = DraftLMSource(assistant, compile=True)
    token_ids = [torch.tensor([prompt_token_ids(target.tokenizer, prompt)]) for prompt in prompts]
    for ids in token_ids:
        speculative_decode(target, compiled, ids, k=K, params=SamplingParams(temperature=0),
                           max_new_tokens=max_new_tokens, compile_target=True)  # fmt: skip
    for ids in token_ids:
        started = time.perf_counter()
        with time_in_forwards(forward_modules) as forwards:
            theirs = target.model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=assistant,
                                           do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                           pad_token_id=eos)[0, ids.shape[1]:].tolist()
        seconds["transformers"] += time.perf_counter() - started
        seconds["transformers_forwards"] += forwards["seconds"]
        target_calls["transformers"] += forwards["calls"]
        started = time.perf_counter()
        with time_in_forwards(forward_modules) as forwards:
            ours = speculative_decode(target, student.draft_source(target), ids, k=K,
                                      params=SamplingParams(temperature=0), max_new_tokens=max_new_tokens,
                                      eos_token_ids=eos).tokens
        seconds["specdraft"] += time.perf_counter() - started
        seconds["specdraft_forwards"] += forwards["seconds"]
        target_calls["specdraft"] += forwards["calls"]
        started = time.perf_counter()
        ours_compiled = speculative_decode(target, compiled, ids, k=K, params=SamplingParams(temperature=0),
                                           max_new_tokens=max_new_tokens, eos_token_ids=eos).tokens
        seconds["specdraft_compiled"] += time.perf_counter() - started
        started = time.perf_counter()
        ours_compiled_target = speculative_decode(target, compiled, ids, k=K, params=SamplingParams(temperature=0),
                                                  max_new_tokens=max_new_tokens, eos_token_ids=eos,
                                                  compile_target=True).tokens  # fmt: skip
        seconds["specdraft_compiled_target"] += time.perf_counter() - started
        identical += theirs == ours
        identical_compiled += theirs == ours_compiled
        identical_compiled_target += theirs == ours_compiled_target
        tokens += len(ours)
    return {"prompts": len(prompts), "identical": identical, "tokens": tokens,
            "seconds": {k: round(v, 2) for k, v in seconds.items()},
            "specdraft_over_transformers": round(seconds["transformers"] / seconds["specdraft"], 2),
            "identical_compiled": identical_compiled,
            "compiled_over_transformers": round(seconds["transformers"] / seconds["specdraft_compiled"], 2),
            "identical_compiled_target": identical_compiled_target,
            "compiled_target_over_transformers": round(seconds["transformers"] / seconds["specdraft_compiled_target"],
                                                       2),  # fmt: skip
            "forward_share": round(seconds["specdraft_forwards"] / seconds["specdraft"], 3),
            "ceiling": round(seconds["transformers"] / seconds["specdraft_forwards"], 2),
            "target_forwards": target_calls,
            "outside_forwards_ms_per_call": {
                name: round(1000 * (seconds[name] - seconds[f"{name}_forwards"]) / max(target_calls[name], 1), 2)
                for name in target_calls}}


def assisted_only(work: Path, target_dir: Path, eval_prompts, max_new_tokens: int, folder: Path, name: str) -> None:
    """Step 4 alone, on one student: writes WORK/assisted-<name>.json."""
    target = FrozenTarget.from_pretrained(target_dir, dtype="float32")
    assisted = {"student": name, **assisted_against_specdraft(target, load_drafter(folder, target).eval(),
                                                              fitting_prompts(target, eval_prompts, max_new_tokens),
                                                              max_new_tokens)}
    (work / f"assisted-{name}.json").write_text(json.dumps(assisted, indent=1))
    print(json.dumps(assisted))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_grid_arguments(parser, work="bench-distillspec", steps=100)
    parser.add_argument("--skip-assisted", action="store_true", help="steps 1-3 only (step 4: --assisted-only)")
    parser.add_argument("--assisted-only", nargs="?", const="winner", default=None, metavar="CELL",
                        help="only step 4, on CELL (trained here if WORK holds no current run of it), or on the T=0 "
                             "winner of the grid WORK/results.json holds; writes WORK/assisted-<cell>.json")
    args = parser.parse_args()
    torch.set_num_threads(1)

    work = Path(args.work)
    target_dir = Path(resolve_target_path(args.target, "float32"))
    recipe = recipe_for(RECIPE_PREFIX.get(args.target, target_dir.name), "distillspec")
    if recipe is None:
        sys.exit(f"no DistillSpec recipe for {args.target}: add recipes/<prefix>-distillspec.yaml")
    data = grid_data(args, target_dir, work)
    answers, heldout_answers, answer_record = data.answers, data.heldout_answers, data.answer_record
    eval_prompts, source = data.eval_prompts, data.source
    grid = {name: ("distillspec", recipe, overrides_for("distillspec", data.overrides) + cell)
            for name, cell in cells().items()}
    if args.assisted_only:
        name = args.assisted_only
        if name == "winner":
            if not (work / "results.json").is_file():
                sys.exit(f"--assisted-only needs a finished grid in {work} (results.json), or a cell: "
                         f"one of {', '.join(grid)}")
            name = json.loads((work / "results.json").read_text())["winners"]["0.0"]
        if name not in grid:
            sys.exit(f"--assisted-only {name}: not a cell of the grid; the cells are {', '.join(grid)}")
        run = train_runs({name: grid[name]}, work, 1, [answers, heldout_answers])[name]
        assisted_only(work, target_dir, eval_prompts, args.max_new_tokens, Path(run["drafter"]), name)
        return
    trained = train_runs(grid, work, args.train_jobs, [answers, heldout_answers])

    target = FrozenTarget.from_pretrained(target_dir, dtype="float32")
    fits = fitting_prompts(target, eval_prompts, args.max_new_tokens)
    folders = {**{name: Path(run["drafter"]) for name, run in trained.items()},
               "init-only": untrained_student(recipe, target, work)}
    if args.eval_jobs == 2:
        results = evaluate_temperatures_side_by_side(target_dir, folders, fits, args.max_new_tokens, work / "eval")
    else:
        students = {name: load_drafter(folder, target).eval() for name, folder in folders.items()}
        results = evaluate_at_temperatures(target, students, fits, args.max_new_tokens, work / "eval")

    lines = [(f"## DistillSpec grid on {args.target} ({len(fits)} prompts from {source}, K={K}, "
             f"{args.steps} steps per cell, max {args.max_new_tokens} new tokens, float32, 1 thread)"), "",
             f"`python {' '.join(sys.argv)}`", "", f"answers: {answer_record}", ""]
    lines += ["### the grid: tau (alpha measured)", "", grid_table(results), ""]
    winners = {}
    for temperature, result in results.items():
        overall = {m: g["overall"] for m, g in result["methods"].items() if m in folders}
        best = max(overall, key=lambda m: overall[m]["acceptance_length"] or 0)
        winners[temperature] = best
        lines += [f"### temperature {temperature:g}", "", markdown_table(result), "",
                  f"**winner at T={temperature:g}: {best}** (tau {overall[best]['acceptance_length']:.2f})", ""]
    lines += ["### training", "", "| cell | minutes | tokens | final held-out alpha |", "|---|---:|---:|---:|"]
    for name, run in trained.items():
        alpha = run["final_metrics"].get("eval/alpha")
        lines.append(f"| {name} | {run['seconds'] / 60:.1f} | {run['tokens']} | "
                     f"{'-' if alpha is None else format(alpha, '.3f')} |")
    record = {"args": vars(args), "training": trained, "winners": winners,
              "eval": {str(t): r for t, r in results.items()}}

    def write(lines: list[str], record: dict) -> str:
        markdown = "\n".join(lines)
        (work / "report.md").write_text(markdown + "\n")
        (work / "results.json").write_text(json.dumps(record, indent=1))
        return markdown

    markdown = write(lines, record)  # the grid is kept even if step 4 is stopped (--assisted-only redoes it alone)
    if not args.skip_assisted:
        print(f"grid written to {work / 'report.md'}; now {winners[0.0]} in transformers' assisted generation")
        assisted = assisted_against_specdraft(target, load_drafter(folders[winners[0.0]], target).eval(), fits,
                                              args.max_new_tokens)
        lines += ["", f"### {winners[0.0]} in transformers' assisted generation vs specdraft's decoder "
                  f"(greedy, K={K})", "", json.dumps(assisted)]
        markdown = write(lines, {**record, "assisted": assisted})
    print("\n" + markdown)


if __name__ == "__main__":
    main()
