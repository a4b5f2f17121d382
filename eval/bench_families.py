"""Benchmark: every registered drafter family on one target, the same data and the same eval.

    python eval/bench_families.py --target smollm2-135m-instruct --train-jobs 2      # the headline table
    python eval/bench_families.py --target toy --num-train-prompts 64 --steps 20      # minutes, the toy
    python eval/bench_families.py --target toy --batch-sizes 1 4     # also at batch 4: the predictions' table

  1. data      training prompts (--train-prompts; ../shared/data/train_prompts.jsonl when present, else
               prompts built from the standard library, and it says so); the target answers them
               itself (batched `regenerate`, prompts/s printed), and answers a disjoint held-out slice:
               the training runs' eval set. Cached: a rerun with the same inputs reuses them.
               --data-only stops here (the answers eval/bench_batch_size.py and the grids read).
  2. train     each family through `specdraft.train.train` with recipes/<target>-<family>.yaml, same
               answers, same step budget, one CPU thread per job (--train-jobs 2 runs two side by
               side); wall clock, tokens seen, trainable parameters and peak memory are recorded. A
               rerun reuses a drafter whose recipe, overrides and data are unchanged.
  3. evaluate  one `evaluate(...)` per temperature (0 and 1): every drafter, prompt lookup and plain
               decoding of the same target (float32) on --eval-prompts (Spec-Bench's questions from
               ../shared, --per-category of each category), chain K=5 (DFlash: its block_size - 1, the
               whole block its one draft forward makes, in an evaluate of its own beside plain decoding;
               the table's K column); tau, per-position acceptance, alpha, c, the measured verify cost,
               tokens/s and speedups, per category.
  4. exports   each drafter in each format it supports, read back: do its draft probabilities match?
  5. predict   per batch size (--batch-sizes) and temperature, each method's measured speedup beside the
               three predictions: Leviathan's (K drafts, a verify costing one plain step), the same with
               the run's own verify cost, and the one from the proposals actually made, each forward priced
               on this device's measured verify-cost curve (specdraft/evaluation/verify_cost.py).

Writes WORK/results.json, WORK/report.md, WORK/tau_by_category.png, WORK/learning_curves.png (each family's
held-out acc_0 against the tokens it trained on) and the eval reports per temperature (with
acceptance-by-position plots), and prints the Markdown.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import resource
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_eagle import (K, eval_history, evaluate_at_temperatures, markdown_table, plot_learning_curves,
                         spawned_workers)

from specdraft.decoding.sampling import SamplingParams
from specdraft.drafters import FAMILIES, load_drafter
from specdraft.evaluation.run import EvalSettings, evaluate, family_report
from specdraft.evaluation.suites import Prompt, load_suite, prompt_token_ids
from specdraft.quickstart import RECIPES_DIR, write_jsonl
from specdraft.target import FrozenTarget, resolve_target_path
from specdraft.toy_target import heldout_prompt_sets, toy_prompts

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"  # beside the checkout; never copied into it
RECIPE_PREFIX = {"smollm2-135m-instruct": "smollm2-135m", "toy": "toy"}


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


# -- 1. data ----------------------------------------------------------------------------------------


def prompt_sets(args) -> tuple[list[dict], list[dict], list[Prompt], str]:
    """(training prompts, held-out prompts answered for training's eval, eval prompts, where they came from)."""
    train_file = Path(args.train_prompts) if args.train_prompts else SHARED / "train_prompts.jsonl"
    eval_file = Path(args.eval_prompts) if args.eval_prompts else SHARED / "spec_bench_questions.jsonl"
    if train_file.is_file() and eval_file.is_file():
        # split("\n"), not splitlines(): a prompt may hold U+2028, which splitlines() breaks on.
        records = [json.loads(line) for line in train_file.read_text(encoding="utf-8").split("\n") if line.strip()]
        wanted = args.num_train_prompts + args.heldout_answers
        if len(records) < wanted:
            sys.exit(f"{train_file} has {len(records)} prompts; --num-train-prompts + --heldout-answers = {wanted}")
        random.Random(0).shuffle(records)  # the file is grouped by source: a prefix would be all one kind
        # The held-out slice comes from the end, the training slice from the start: disjoint.
        train, heldout = records[: args.num_train_prompts], records[len(records) - args.heldout_answers :]
        per_category: dict[str, list[Prompt]] = {}
        for prompt in load_suite(eval_file):
            per_category.setdefault(prompt.category, []).append(prompt)
        evals = [p for group in per_category.values() for p in group[: args.per_category]]
        return train, heldout, evals, f"{train_file} / {eval_file}"
    print(f"{train_file} or {eval_file} is missing: falling back to prompts built from the standard library "
          "(the toy target's own prompt source), which say little about a chat model")
    evals, heldout = heldout_prompt_sets(args.per_category * 4, args.heldout_answers)
    prompts = [Prompt(str(p["question_id"]), "stdlib", p["category"], "question", p["turns"]) for p in evals]
    return toy_prompts("train", args.num_train_prompts), heldout, prompts, "the standard library (fallback)"


def fitting_prompts(target, prompts: list[Prompt], max_new_tokens: int) -> list[Prompt]:
    """The prompts whose tokens and two turns' answers fit the target's context."""
    return [p for p in prompts if len(prompt_token_ids(target.tokenizer, p)) + 2 * max_new_tokens
            < target.config.max_position_embeddings]


ANSWERS_FROM_HELP = ("the data folder of another run of this bench (e.g. WORK/data of eval/gpu_real_target.sh's run on "
                     "a GPU): read the target's answers there instead of generating them, after checking they are "
                     "this target's at these settings")


def add_grid_arguments(parser, work: str, steps: int) -> None:
    """The arguments of a grid benchmark on the toy-sized defaults (eval/bench_distillspec.py, bench_losses.py):
    where the prompts come from, how many, the target's answers, the eval and the training budget."""
    parser.add_argument("--target", default="toy")
    parser.add_argument("--work", default=work)
    parser.add_argument("--train-prompts", default=None)
    parser.add_argument("--eval-prompts", default=None)
    parser.add_argument("--num-train-prompts", type=int, default=400)
    parser.add_argument("--heldout-answers", type=int, default=24)
    parser.add_argument("--answer-tokens", type=int, default=256)
    parser.add_argument("--answer-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--answers-from", default=None, help=ANSWERS_FROM_HELP)  # a str: results.json dumps args
    parser.add_argument("--per-category", type=int, default=2, help="eval prompts per category")
    parser.add_argument("--steps", type=int, default=steps, help="every run's optimizer steps")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for every run, or FAMILY:KEY=VALUE for one family's")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--train-jobs", type=int, default=1, choices=(1, 2))
    parser.add_argument("--eval-jobs", type=int, default=1, choices=(1, 2),
                        help="2: evaluate the two temperatures side by side, a process each")


def target_answers(target_dir: Path, work: Path, name: str, prompts: list[dict], max_new_tokens: int,
                   dtype: str, batch_size: int = 16, device: str | None = None,
                   answers_from: str | Path | None = None) -> tuple[Path, dict]:
    """The target's own greedy answers to ``prompts``, in their order, as WORK/data/NAME.jsonl (answered on
    ``device``, default the CPU, ``batch_size`` prompts at a time).

    Every answer the target gave under these settings accumulates in NAME.all.jsonl, which
    ``regenerate`` resumes by prompt id: asking for more prompts later answers only the new ones,
    and a killed run loses at most one batch. NAME.jsonl is the asked-for subset, rewritten each run.
    With ``answers_from`` (another run's data folder), the answers are read from there instead:
    ``answers_made_elsewhere``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdraft.data.regenerate import id_field_of, read_done, regenerate
    from specdraft.dtypes import slow_cpu_dtype_warning

    everything, selected = work / "data" / f"{name}.all.jsonl", work / "data" / f"{name}.jsonl"
    if answers_from is not None:
        chosen, record = answers_made_elsewhere(Path(answers_from), target_dir, name, prompts, max_new_tokens, dtype)
        write_jsonl(selected, chosen)
        return selected, {"prompts": len(prompts), **record}
    stamp = {"target": str(target_dir.resolve()), "weights": (target_dir / "model.safetensors").stat().st_mtime,
             "max_new_tokens": max_new_tokens, "dtype": dtype}
    stamp_file = everything.with_suffix(".stamp.json")
    everything.parent.mkdir(parents=True, exist_ok=True)
    saved = json.loads(stamp_file.read_text()) if stamp_file.is_file() else {}
    if {key: saved.get(key) for key in stamp} != stamp:
        everything.unlink(missing_ok=True)  # never mix two targets' (or settings') answers
        stamp_file.write_text(json.dumps(stamp))
        saved = stamp
    id_field = id_field_of(prompts)
    if id_field is None:
        sys.exit(f"the {name} prompts need a unique id field (id or question_id) to be cached by id")
    answered = {record[id_field] for record in read_done(everything)}
    todo = [p for p in prompts if p[id_field] not in answered]
    record = saved.get("record", {})
    if todo:
        on_cpu = (device or "cpu") == "cpu"
        slow = slow_cpu_dtype_warning({"--answer-dtype": dtype}, "--answer-dtype float32") if on_cpu else None
        if slow:
            print(f"warning: {slow}")
        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=getattr(torch, dtype)).to(device or "cpu")
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        started = time.perf_counter()
        written = regenerate(model, tokenizer, write_jsonl(work / "data" / f"{name}.prompts.jsonl", todo), everything,
                             max_new_tokens=max_new_tokens, batch_size=batch_size)
        seconds = time.perf_counter() - started
        print(f"the target answered {written} prompts in {seconds:.0f} s ({written / seconds:.2f} prompts/s)")
        record = {"answered_in_last_run": written, "seconds": round(seconds, 1),
                  "prompts_per_second": round(written / seconds, 3)}
        stamp_file.write_text(json.dumps({**stamp, "record": record}))
    else:
        print(f"reusing the target's {len(prompts)} answers in {everything}")
    by_id = {r[id_field]: r for r in read_done(everything)}
    write_jsonl(selected, [by_id[p[id_field]] for p in prompts])
    return selected, {"prompts": len(prompts), **record}


def answers_made_elsewhere(source: Path, target_dir: Path, name: str, prompts: list[dict], max_new_tokens: int,
                           dtype: str) -> tuple[list[dict], dict]:
    """The answers to ``prompts`` in SOURCE/NAME.all.jsonl, written by another run of this bench (or of
    bench_train_and_decode.py, e.g. on a GPU: eval/gpu_real_target.sh), in the prompts' order.

    They are used only if they are this target's greedy answers at these settings: regenerate's record
    beside them must name the same weights (the fingerprint of ``target_dir`` loaded in ``dtype``), chat
    template and ``max_new_tokens``, and every prompt must be answered there, with the same question.
    Returns the answers and where they came from (the source run's own timing record among it).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdraft.data.regenerate import answerer_fingerprints, id_field_of, resolve_chat_template, sidecar_of

    everything = source / f"{name}.all.jsonl"
    if not everything.is_file() or not sidecar_of(everything).is_file():
        sys.exit(f"--answers-from {source}: no {everything.name} with regenerate's record beside it "
                 f"({sidecar_of(everything).name}); name the data folder of a run of this bench")
    settings = json.loads(sidecar_of(everything).read_text())["settings"]
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=getattr(torch, dtype))
    template = resolve_chat_template(AutoTokenizer.from_pretrained(target_dir), None)
    expected = {"temperature": 0.0, "max_new_tokens": max_new_tokens, **answerer_fingerprints(model, template)}
    del model
    differing = [f"{key}: {settings.get(key)!r} there, {value!r} here" for key, value in expected.items()
                 if settings.get(key) != value]
    if differing:
        sys.exit(f"--answers-from {source}: {everything.name} was not written by this target at these settings "
                 f"(--target, --answer-dtype {dtype}, --answer-tokens {max_new_tokens}): " + "; ".join(differing))
    id_field = id_field_of(prompts)
    # Only complete lines: a file another run may still be writing is read, never truncated.
    text = everything.read_text(encoding="utf-8")
    by_id = {r[id_field]: r for r in map(json.loads, text[: text.rfind("\n") + 1].split("\n")[:-1])}
    missing = [p[id_field] for p in prompts if p[id_field] not in by_id]
    if missing:
        sys.exit(f"--answers-from {source}: {len(missing)} of the {len(prompts)} {name} prompts are not answered "
                 f"there (first: {missing[0]}); the same --train-prompts file, --num-train-prompts and "
                 "--heldout-answers as that run select the same prompts (or a prefix of them)")
    asked = [turn for p in prompts for turn in p.get("turns", [])[:1]]
    answered = [next(m["content"] for m in by_id[p[id_field]]["messages"] if m["role"] == "user")
                for p in prompts if p.get("turns")]
    if asked != answered:
        sys.exit(f"--answers-from {source}: its answers under these ids are to other questions")
    print(f"reusing the target's {len(prompts)} answers in {everything} (the same weights, template and settings)")
    stamp_file = everything.with_suffix(".stamp.json")
    made = json.loads(stamp_file.read_text()).get("record", {}) if stamp_file.is_file() else {}
    return [by_id[p[id_field]] for p in prompts], {"answers_from": str(source), **made}


@dataclass
class GridData:
    """What every run of a grid benchmark shares: the target's answers, the eval prompts, the overrides."""

    answers: Path
    heldout_answers: Path
    answer_record: dict
    eval_prompts: list[Prompt]
    source: str
    overrides: list[str]  # the data, the step budget, no acceptance eval in training, and --set


def grid_data(args, target_dir: Path, work: Path) -> GridData:
    """The target's own answers to the training and held-out prompts (``add_grid_arguments``'s settings)."""
    train, heldout, eval_prompts, source = prompt_sets(args)
    answers, answer_record = target_answers(target_dir, work, "answers", train, args.answer_tokens, args.answer_dtype,
                                            answers_from=args.answers_from)
    heldout_answers, _ = target_answers(target_dir, work, "heldout_answers", heldout, args.answer_tokens,
                                        args.answer_dtype, answers_from=args.answers_from)
    overrides = [f"target.path={target_dir}", f"data.path={answers}", f"data.eval_path={heldout_answers}",
                 "eval.enabled=false", f"training.max_steps={args.steps}", *args.set]
    return GridData(answers, heldout_answers, answer_record, eval_prompts, source, overrides)


# -- 2. train ---------------------------------------------------------------------------------------


def train_family(family: str, recipe_path: Path, overrides: list[str], run_dir: Path, data_digest: str) -> dict:
    """One drafter, in this (fresh) process: its own peak memory is this process's."""
    from specdraft.config import load_recipe
    from specdraft.train import train

    torch.set_num_threads(1)
    record_file = run_dir / "bench_record.json"
    stamp = digest([recipe_path.read_text(), overrides, data_digest])  # the answers' content, not just their path
    if record_file.is_file() and json.loads(record_file.read_text()).get("stamp") == stamp:
        return {**json.loads(record_file.read_text()), "reused": True}
    recipe = load_recipe(recipe_path, overrides)
    # A record of another recipe, overrides or data is stale; it is the bench's own file in the run folder, which
    # train's --overwrite refuses to delete as not specdraft's, so it goes first.
    record_file.unlink(missing_ok=True)
    started = time.perf_counter()
    train(recipe, overwrite=True, show_progress=False)
    seconds = time.perf_counter() - started
    drafter_dir = run_dir / "drafter"
    state = json.loads(max((run_dir / "checkpoints").glob("step-*/trainer_state.json")).read_text())
    final = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    record = {"family": family, "stamp": stamp, "drafter": str(drafter_dir), "seconds": seconds,
              "steps": recipe.training.max_steps, "tokens": state["run"]["tokens"],
              "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
              "final_metrics": {k: v for k, v in final.items() if k.startswith("eval/")}}
    record_file.write_text(json.dumps(record, indent=1))
    return record


def recipe_for(prefix: str, family: str) -> Path | None:
    """recipes/<prefix>-<family>.yaml (the toy's are spelled toy_<family>.yaml)."""
    found = [RECIPES_DIR / f"{prefix}{sep}{family}.yaml" for sep in "-_"]
    return next((path for path in found if path.is_file()), None)


def overrides_for(family: str, overrides: list[str]) -> list[str]:
    """The overrides for every family, plus those spelled FAMILY:KEY=VALUE for this one (prefix dropped).

    Stage switches are per family: a shorter budget moves Medusa-2's joint_from_step and the MLP
    speculator's stage2_start_step, keys the other families' configs refuse."""
    kept = []
    for override in overrides:
        owner, sep, rest = override.partition(":")
        if sep and "=" not in owner:  # FAMILY:KEY=VALUE (a value may hold ':', a family name never holds '=')
            if owner not in FAMILIES:
                sys.exit(f"--set {override}: {owner!r} is not a family; known: {', '.join(FAMILIES)}")
            if owner == family:
                kept.append(rest)
        else:
            kept.append(override)
    return kept


def train_all(families, recipe_prefix: str, overrides: list[str], work: Path, jobs: int, data: list[Path]) -> dict:
    """Each family in a fresh 1-thread process, `jobs` at a time (``train_runs``)."""
    runs = {}
    for family in families:
        recipe = recipe_for(recipe_prefix, family)
        if recipe is None:
            sys.exit(f"no recipe {recipe} for family {family}: add one (see recipes/{recipe_prefix}-eagle3.yaml)")
        runs[family] = (family, recipe, overrides_for(family, overrides))
    return train_runs(runs, work, jobs, data)


def train_runs(runs: dict[str, tuple[str, Path, list[str]]], work: Path, jobs: int, data: list[Path]) -> dict:
    """name -> (family, recipe, overrides), each trained into WORK/runs/<name> in a fresh 1-thread process
    (max_tasks_per_child=1), `jobs` at a time; returns name -> its ``train_family`` record."""
    data_digest = digest([hashlib.sha256(path.read_bytes()).hexdigest() for path in data])
    with spawned_workers(jobs, max_tasks_per_child=1) as pool:
        futures = {name: pool.submit(train_family, family, recipe,
                                     overrides + [f"checkpoint.output_dir={work / 'runs' / name}"],
                                     work / "runs" / name, data_digest)
                   for name, (family, recipe, overrides) in runs.items()}
        print(f"training {', '.join(runs)}, {jobs} at a time, one thread each (no progress bars; minutes)")
        return {name: future.result() for name, future in futures.items()}


# -- 3. evaluate and 4. exports ---------------------------------------------------------------------


def export_round_trips(family: str, run_dir: Path, target, drafter, work: Path) -> dict:
    """Each format the family exports to, read back: are its first draft's probabilities the trained ones?"""
    from specdraft.contract import FolderExporter
    from specdraft.export import check_exported, export, exporters_of, load_exported

    prompt = torch.tensor([[1] + list(range(100, 116))])
    greedy = SamplingParams(temperature=0.0)

    def first_draft_probs(model):
        source = model.draft_source(target)
        source.start(prompt[:, :-1], target(prompt[:, :-1]))
        proposal = source.propose(prompt[:, -1:], K, greedy, None)
        return proposal.tokens, proposal.probs

    want_tokens, want_probs = first_draft_probs(drafter)
    results = {}
    for fmt, exporter in sorted(exporters_of(family).items()):
        try:
            out = export(run_dir, fmt, work / "exports" / family / fmt, overwrite=True)
            if isinstance(exporter, FolderExporter):  # a whole model (Medusa-2's merged target): its own check
                check_exported(out, run_dir)
                results[fmt] = "checked"
                continue
            tokens, probs = first_draft_probs(load_exported(out, target).eval())
        except Exception as e:  # noqa: BLE001  a format the family has no exporter for, or a broken one: report, go on
            results[fmt] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            continue
        same = torch.equal(tokens, want_tokens) and (probs is None or torch.allclose(probs, want_probs))
        results[fmt] = "identical" if same else "DIFFERENT"
    return results


def chain_k(drafter, chosen: dict[str, int] | None = None) -> int:
    """The chain length a drafter is evaluated at: ``chosen[family]`` (``--chain-k``), else bench_eagle's K,
    except DFlash's block_size - 1 (issue 34: its one draft forward per step makes the whole block)."""
    if chosen and drafter.family in chosen:
        return chosen[drafter.family]
    return drafter.config.block_size - 1 if drafter.family == "dflash" else K


def parse_chain_ks(pairs: list[str]) -> dict[str, int]:
    """``--chain-k FAMILY=K`` pairs -> {family: K}."""
    chosen = {}
    for pair in pairs:
        family, _, k = pair.partition("=")
        if not family or not k.isdigit() or int(k) < 1:
            sys.exit(f"--chain-k {pair}: expected FAMILY=K with K >= 1, e.g. dflash=1")
        chosen[family] = int(k)
    return chosen


def evaluate_at_chain_ks(target, drafters: dict, prompts: list[Prompt], max_new_tokens: int, out: Path,
                         batch_size: int = 1, chosen_k: dict[str, int] | None = None) -> dict:
    """``evaluate_at_temperatures`` with each drafter at its ``chain_k``: the drafters at K beside prompt lookup
    and plain decoding, each other K in an evaluate of its own (with its own plain decoding: its speedup is
    over that, in the same process), merged into one result per temperature; ``chain_k`` maps method -> K."""
    ks = {family: chain_k(drafter, chosen_k) for family, drafter in drafters.items()}
    results = evaluate_at_temperatures(target, {f: d for f, d in drafters.items() if ks[f] == K}, prompts,
                                       max_new_tokens, out, batch_size)
    for temperature, result in results.items():
        result["chain_k"] = {method: None if method == "plain" else ks.get(method, K) for method in result["methods"]}
        for k in sorted(set(ks.values()) - {K}):
            at_k = {family: drafter.draft_source(target) for family, drafter in drafters.items() if ks[family] == k}
            other = evaluate(target, at_k, prompts, EvalSettings(SamplingParams(temperature=temperature), k=k,
                                                                 max_new_tokens=max_new_tokens, batch_size=batch_size),
                             out / f"k-{k}" / f"temperature-{temperature:g}")
            result["methods"].update({family: other["methods"][family] for family in at_k})
            result["chain_k"].update(dict.fromkeys(at_k, k))
            result.setdefault("plain_of_other_k", {})[k] = other["methods"]["plain"]["overall"]
            for key in ("greedy_identical", "greedy_mismatches"):
                if key in result:
                    result[key].update({family: other[key][family] for family in at_k})
    return results


def plot_tau_by_category(results: dict, path: Path) -> None:
    """Grouped bars: tau of each method in each category, one panel per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(12, 3.5 * len(results)), squeeze=False)
    for ax, (temperature, result) in zip(axes[:, 0], results.items()):
        methods = [m for m in result["methods"] if m != "plain"]
        categories = list(next(iter(result["methods"].values()))["by_category"])
        width = 0.8 / max(1, len(methods))
        for i, method in enumerate(methods):
            taus = [result["methods"][method]["by_category"][c]["acceptance_length"] for c in categories]
            ax.bar([x + i * width for x in range(len(categories))], taus, width, label=method)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(categories))], categories, rotation=30, ha="right")
        ax.set(ylabel="tau (tokens per target forward)", title=f"temperature {temperature:g}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def temperature_sections(results: dict) -> list[str]:
    """Per temperature: the method table, verify costs, greedy identity and tau by category (Markdown lines)."""
    lines = []
    for temperature, result in results.items():
        lines += [f"#### temperature {temperature:g}", "", markdown_table(result), ""]
        lines += ["verify cost (a K+1-token forward / a plain step) and the speedup predicted with it: " + ", ".join(
            f"{m} {s['overall']['verify_cost']:.2f} -> {s['overall']['predicted_speedup_measured_verify']:.2f}x"
            for m, s in result["methods"].items() if s["overall"]["verify_cost"] is not None), ""]
        for k, plain in result.get("plain_of_other_k", {}).items():
            lines += [(f"the K={k} methods' speedups are over their own evaluate's plain decoding: "
                       f"{plain['tokens_per_second']:.1f} tok/s"), ""]
        if "greedy_identical" in result:
            lines += ["greedy output identical to plain decoding: " + ", ".join(
                f"{m} {v:.0%}" for m, v in result["greedy_identical"].items()), ""]
        lines += [category_table(result), ""]
    return lines


def category_table(result: dict) -> str:
    methods = [m for m in result["methods"] if m != "plain"]
    lines = ["| category | " + " | ".join(f"{m} tau" for m in methods) + " |", "|---" + "|---:" * len(methods) + "|"]
    for category in next(iter(result["methods"].values()))["by_category"]:
        taus = [result["methods"][m]["by_category"][category]["acceptance_length"] for m in methods]
        lines.append(f"| {category} | " + " | ".join(f"{t:.2f}" for t in taus) + " |")
    return "\n".join(lines)


PREDICTIONS = (("Leviathan (v=1)", "predicted_speedup"), ("@ verify cost", "predicted_speedup_measured_verify"),
               ("@ proposals", "predicted_speedup_from_proposals"))


def prediction_table(by_batch: dict, adapted_by_batch: dict) -> str:
    """Per batch size, temperature and method: the measured speedup, each prediction and its error. A family
    that adapted its target (Medusa-2) against that target's own plain decoding."""
    lines = ["| batch | T | method | measured | " + " | ".join(f"{name} (error)" for name, _ in PREDICTIONS) + " |",
             "|---:|---:|---|---:|" + "---:|" * len(PREDICTIONS)]
    runs = [(batch, results, None) for batch, results in by_batch.items()]
    runs += [(batch, results, family) for family, per_batch in adapted_by_batch.items()
             for batch, results in per_batch.items()]
    for batch, results, adapted in sorted(runs, key=lambda run: run[0]):
        for temperature, result in results.items():
            for method, groups in result["methods"].items():
                s = groups["overall"]
                if method == "plain" or not s["speedup"] or (adapted and method != adapted):
                    continue
                cells = ["-" if s[key] is None else f"{s[key]:.2f}x ({s[key] / s['speedup'] - 1:+.0%})"
                         for _, key in PREDICTIONS]
                lines.append(f"| {batch} | {temperature:g} | {method} | {s['speedup']:.2f}x | "
                             + " | ".join(cells) + " |")
    return "\n".join(lines)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct", help="a named target, 'toy', or a folder")
    parser.add_argument("--recipe-prefix", default=None,
                        help="recipes/<prefix>-<family>.yaml (default: from --target, e.g. smollm2-135m)")
    parser.add_argument("--families", nargs="+", default=None, help="default: every registered family with a recipe")
    parser.add_argument("--work", default="bench-families", help="data, runs, exports and reports go here")
    parser.add_argument("--train-prompts", default=None, help=f"default: {SHARED / 'train_prompts.jsonl'}")
    parser.add_argument("--eval-prompts", default=None, help=f"default: {SHARED / 'spec_bench_questions.jsonl'}")
    parser.add_argument("--num-train-prompts", type=int, default=1200)
    parser.add_argument("--heldout-answers", type=int, default=48, help="answers the training runs evaluate on")
    parser.add_argument("--answer-tokens", type=int, default=256, help="max new tokens per regenerated answer")
    parser.add_argument("--answer-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="the target's dtype for its training answers: bf16 generates 3x faster on CPU, and "
                             "differs from fp32 greedy only at near-ties")
    parser.add_argument("--answers-from", default=None, help=ANSWERS_FROM_HELP)  # a str: results.json dumps args
    parser.add_argument("--per-category", type=int, default=3, help="eval prompts per category")
    parser.add_argument("--steps", type=int, default=None, help="every family's step budget (default: its recipe's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for every family (repeatable), e.g. training.eval_every=25, "
                             "or for one: medusa2:drafter.joint_from_step=75")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--train-jobs", type=int, default=1, choices=(1, 2))
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the answers and the eval")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1],
                        help="evaluate at each batch size (the first is the report's main table)")
    parser.add_argument("--chain-k", action="append", default=[], metavar="FAMILY=K",
                        help="evaluate FAMILY's drafter at chain length K (e.g. the K the verify-cost model "
                             "recommends) instead of the default (5; DFlash: block_size - 1)")
    parser.add_argument("--data-only", action="store_true",
                        help="make (or reuse) WORK/data/answers.jsonl and heldout_answers.jsonl, then stop: the data "
                             "eval/bench_batch_size.py and eval/bench_train.py read")
    return parser


def main() -> None:
    args = argument_parser().parse_args()
    chosen_k = parse_chain_ks(args.chain_k)
    torch.set_num_threads(args.threads)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the workers as Ctrl-C does (train_all)

    work = Path(args.work)
    target_dir = Path(resolve_target_path(args.target, "float32"))
    prefix = args.recipe_prefix or RECIPE_PREFIX.get(args.target, target_dir.name)
    families = args.families or [f for f in FAMILIES if recipe_for(prefix, f)]
    train, heldout, eval_prompts, source = prompt_sets(args)
    print(f"prompts: {len(train)} to train on, {len(heldout)} held out for training's eval, {len(eval_prompts)} to "
          f"decode, from {source}")
    answers, answer_record = target_answers(target_dir, work, "answers", train, args.answer_tokens, args.answer_dtype,
                                            answers_from=args.answers_from)
    heldout_answers, _ = target_answers(target_dir, work, "heldout_answers", heldout, args.answer_tokens,
                                        args.answer_dtype, answers_from=args.answers_from)
    if args.data_only:
        print(f"the target's answers: {answers} ({len(train)}), held out: {heldout_answers} ({len(heldout)})")
        return
    overrides = [f"target.path={target_dir}", f"data.path={answers}", f"data.eval_path={heldout_answers}",
                 "eval.enabled=false"] + ([f"training.max_steps={args.steps}"] if args.steps else []) + args.set
    trained = train_all(families, prefix, overrides, work, args.train_jobs, [answers, heldout_answers])

    target = FrozenTarget.from_pretrained(target_dir, dtype="float32")  # each loaded drafter adds what it reads
    fits = fitting_prompts(target, eval_prompts, args.max_new_tokens)
    if len(fits) < len(eval_prompts):
        print(f"leaving out {len(eval_prompts) - len(fits)} eval prompts longer than the target's context")
    eval_prompts = fits
    # A family that trains adapters inside the target (Medusa-2) changes the target it is loaded on: it
    # gets a target of its own, and its own eval, whose plain decoding is that adapted target's.
    # Each drafter is loaded on a target copy first: where it put adapters into it (its declared
    # TargetNeeds), that copy is its own; otherwise it is loaded again on the shared target.
    loaded, adapting = {}, set()  # family -> (the target it decodes with, the drafter)
    for family, run in trained.items():
        own = FrozenTarget.from_pretrained(target_dir, dtype="float32")
        drafter = load_drafter(run["drafter"], own).eval()
        if drafter.needs.trains_adapters:
            loaded[family] = (own, drafter)
            adapting.add(family)
        else:
            del own, drafter
            loaded[family] = (target, load_drafter(run["drafter"], target).eval())
    for family, (own, drafter) in loaded.items():
        trained[family]["trainable_parameters"] = sum(p.numel() for p in drafter.trained_module().parameters()
                                                        if p.requires_grad)
        trained[family]["exports"] = export_round_trips(family, Path(trained[family]["drafter"]).parent, own,
                                                        drafter, work)
    shared = {family: drafter for family, (_, drafter) in loaded.items() if family not in adapting}

    def batch_folder(batch: int) -> str:
        return f"batch-{batch}" if batch > 1 else ""

    by_batch = {batch: evaluate_at_chain_ks(target, shared, eval_prompts, args.max_new_tokens,
                                            work / "eval" / batch_folder(batch), batch, chosen_k)
                for batch in args.batch_sizes}
    results = by_batch[args.batch_sizes[0]]
    plot_tau_by_category(results, work / "tau_by_category.png")
    plot_learning_curves({family: Path(run["drafter"]).parent for family, run in trained.items()},
                         work / "learning_curves.png")
    adapted_by_batch, reports = {}, {}
    for family in sorted(adapting):
        own, drafter = loaded[family]
        adapted_by_batch[family] = {batch: evaluate_at_temperatures(own, {family: drafter}, eval_prompts,
                                                                    args.max_new_tokens,
                                                                    work / "eval" / family / batch_folder(batch), batch)
                                    for batch in args.batch_sizes}
        reports[family] = family_report(family, own, drafter, eval_prompts, args.max_new_tokens, work / "eval" / family)
    adapted_results = {family: runs[args.batch_sizes[0]] for family, runs in adapted_by_batch.items()}

    lines = [(f"## Drafter families on {args.target} ({len(eval_prompts)} prompts from {source}, chain K={K} "
              "unless the K column says otherwise, "
              f"max {args.max_new_tokens} new tokens, float32, {args.threads} thread(s))"), "",
             f"`python {' '.join(sys.argv)}`", ""]
    lines += temperature_sections(results)
    lines += ["### predicted against measured speedups (error = predicted / measured - 1)", "",
              prediction_table(by_batch, adapted_by_batch), ""]
    for family, family_results in adapted_results.items():
        lines += [f"### {family}, with the target it adapted (speedups over that target's plain decoding)", "",
                  f"its drift from the original target: {reports[family]}", ""]
        lines += temperature_sections(family_results)
    lines += ["### training (same answers for every family)", "",
              f"answers: {answer_record}", "",
              "| family | steps | tokens seen | minutes | trainable params | peak RSS GiB | exports |",
              "|---|---:|---:|---:|---:|---:|---|"]
    for family, run in trained.items():
        exports = ", ".join(f"{fmt} {verdict}" for fmt, verdict in run["exports"].items())
        lines.append(f"| {family} | {run['steps']} | {run['tokens']} | {run['seconds'] / 60:.1f} | "
                     f"{run['trainable_parameters'] / 1e6:.2f}M | {run['peak_rss_gib']:.2f} | {exports} |")
    lines += [""] + [f"- {family} during training (step: acc_0 / sim_accept_len): "
                     f"{eval_history(Path(run['drafter']).parent)}" for family, run in trained.items()]
    markdown = "\n".join(lines)
    (work / "report.md").write_text(markdown + "\n")
    (work / "results.json").write_text(json.dumps({
        "args": vars(args), "training": trained, "eval": {str(t): r for t, r in results.items()},
        "eval_by_batch": {str(b): {str(t): r for t, r in res.items()} for b, res in by_batch.items()},
        "eval_with_adapted_target": {f: {str(t): r for t, r in res.items()} for f, res in adapted_results.items()},
        "eval_with_adapted_target_by_batch": {
            f: {str(b): {str(t): r for t, r in res.items()} for b, res in runs.items()}
            for f, runs in adapted_by_batch.items()},
        "drift": reports}, indent=1))
    print("\n" + markdown)
    print(f"\nwrote {work / 'report.md'}, {work / 'results.json'}, {work / 'tau_by_category.png'}, "
          f"{work / 'learning_curves.png'}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as stop:
        sys.exit(f"stopped ({stop or 'Ctrl-C'}): each training run saved a checkpoint where it stopped; run the same "
                 "command again to start them over, or `specdraft train --resume` a run folder under WORK/runs")
