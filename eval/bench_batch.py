"""Benchmark: batched decoding, total and per-request tokens/s at batch sizes 1, 4 and 16.

    python eval/bench_batch.py --target toy --drafter bench-trees/runs/medusa1/drafter
    python eval/bench_batch.py --target smollm2-135m-instruct --num-prompts 16 --max-new-tokens 64 --student-layers 8
    python eval/bench_batch.py --target toy --drafter RUNS/eagle3/drafter --tree eagle2-small

One `evaluate(...)` per batch size over the same prompts (the toy's held-out stdlib prompts, or
Spec-Bench's questions for a chat target when ../shared has them): plain decoding, prompt lookup and
each --drafter, chains of K=5, greedy. Greedy output must stay identical to plain decoding at every
batch size. Prints a Markdown table. `--row-by-row` adds, for each drafter that drafts a batch's rows
together (its source declares a ``row_state``: Medusa, the MLP speculator, EAGLE, a DistillSpec
student), the same drafter drafting row by row: what batching the drafts is worth. `--tree SPEC` adds
each drafter that can draft that tree, drafting it every step (rows verified together, each its own tree).
"decode tokens/s" leaves the prefill out: the throughput of the decoding steps alone.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

from specdraft.contract import DraftCapabilities
from specdraft.decoding.sampling import SamplingParams
from specdraft.decoding.sources import PromptLookupSource
from specdraft.drafters import load_drafter
from specdraft.evaluation.run import EvalSettings, drafter_name, evaluate, tree_methods
from specdraft.evaluation.suites import Prompt, load_suite
from specdraft.target import FrozenTarget, resolve_target_path
from specdraft.toy_target import heldout_prompt_sets

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_questions.jsonl"


def prompts_for(target_name: str, count: int) -> tuple[list[Prompt], str]:
    if target_name != "toy" and SPEC_BENCH.is_file():
        questions = load_suite(SPEC_BENCH)
        step = max(1, len(questions) // count)
        return [Prompt(p.id, p.suite, p.category, p.kind, p.turns[:1]) for p in questions[::step][:count]], str(SPEC_BENCH)
    evals, _ = heldout_prompt_sets(count, 0)
    return [Prompt(str(p["question_id"]), "stdlib", p["category"], "question", p["turns"][:1])
            for p in evals[:count]], "the toy's held-out stdlib prompts"


class RowByRow:
    """A source that declares no ``row_state``: the batched decoder drafts its rows one at a time."""

    capabilities = DraftCapabilities()

    def __init__(self, source):
        self.source = source

    def __copy__(self) -> RowByRow:  # each row its own copy of the source (fresh_sources)
        return RowByRow(copy.copy(self.source))

    def start(self, prompt_ids, target_out) -> None:
        self.source.start(prompt_ids, target_out)

    def propose(self, pending, k, params, generator):
        return self.source.propose(pending, k, params, generator)

    def commit(self, kept_ids, target_out) -> None:
        self.source.commit(kept_ids, target_out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="toy")
    parser.add_argument("--drafter", action="append", default=[], help="a trained drafter folder (repeatable)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--num-prompts", type=int, default=32, help="a multiple of every batch size is fairest")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--student-layers", type=int, default=0,
                        help="also an untrained DistillSpec student, the target's first N layers (init: truncate): "
                             "a draft LM, for a target with no trained drafter at hand")
    parser.add_argument("--tree", action="append", default=[], metavar="SPEC",
                        help="also each drafter that can draft this tree, drafting it (repeatable; as specdraft eval)")
    parser.add_argument("--row-by-row", action="store_true",
                        help="also each drafter whose rows draft in one propose, drafting row by row")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = FrozenTarget.from_pretrained(resolve_target_path(args.target, "float32"), dtype="float32")
    drafters = {drafter_name(path): load_drafter(path, target).eval() for path in args.drafter}
    if args.student_layers:
        from specdraft.drafters.distillspec import DistillSpecConfig, build_distillspec

        student = build_distillspec(target, DistillSpecConfig(init="truncate", num_layers=args.student_layers))
        drafters[f"student ({args.student_layers} layers, untrained)"] = student.eval()
    prompts, source = prompts_for(args.target, args.num_prompts)
    rows, verdicts = [], []
    for batch_size in args.batch_sizes:
        sources = {"prompt lookup": PromptLookupSource(), **{n: d.draft_source(target) for n, d in drafters.items()}}
        if args.row_by_row:
            sources.update({f"{n} (drafted row by row)": RowByRow(d.draft_source(target)) for n, d in drafters.items()
                            if d.draft_source(target).capabilities.row_state})  # fmt: skip
        for n, d in drafters.items():
            sources.update(tree_methods(n, d, target, args.tree))
        result = evaluate(target, sources, prompts,
                          EvalSettings(SamplingParams(), k=args.k, max_new_tokens=args.max_new_tokens,
                                       batch_size=batch_size, show_progress=False))  # fmt: skip
        for method, found in result["greedy_mismatches"].items():
            for mismatch in found:  # each one explained: rounding at a near-tie, or a DEFECT
                verdicts.append(f"batch {batch_size}, {method}: {mismatch}")
        for method, groups in result["methods"].items():
            s = groups["overall"]
            same = "-" if method == "plain" else f"{result['greedy_identical'][method]:.0%}"
            rows.append(f"| {batch_size} | {method} | {s['total_tokens_per_second']:.1f} "
                        f"| {s['decode_tokens_per_second']:.1f} | {s['tokens_per_second']:.1f} "
                        f"| {s['acceptance_length']:.2f} | {same} |")
    print(f"\n{len(prompts)} prompts from {source}, {args.max_new_tokens} new tokens, K={args.k}, greedy, float32, "
          f"{args.threads} thread(s)\n")
    print(f"`python eval/bench_batch.py {' '.join(sys.argv[1:])}`\n")
    print("| batch | method | total tokens/s | decode tokens/s | tokens/s per request | tau | identical to plain |")
    print("|---:|---|---:|---:|---:|---:|---|")
    print("\n".join(rows))
    if verdicts:
        print("\ngreedy outputs that differ from plain decoding:\n" + "\n".join(verdicts))


if __name__ == "__main__":
    main()
