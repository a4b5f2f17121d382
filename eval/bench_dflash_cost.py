"""Benchmark: the draft cost per decoding step of DFlash (one block forward) against EAGLE-3 (K chained steps).

A step's draft cost depends on the drafter's shapes, not on its weights, so each family is built from its
shipped recipe (recipes/<prefix>-<family>.yaml) with the weights it is built with, on one float32 target, and
the same prompts are decoded greedily at each K with the decoder's own timing. Per family and K it prints the
draft milliseconds per step (propose + commit), the verify milliseconds per step, the plain decoding
milliseconds per token measured in the same run, the draft time of a step in plain steps, and c as
`specdraft eval` reports it (specdraft.evaluation.metrics.draft_cost_ratio: draft time per drafted token over
verify time per step). Acceptance
here means nothing (the drafters are untrained); greedy output is checked identical to plain decoding.

  python eval/bench_dflash_cost.py --target smollm2-135m-instruct --k 3 5 7 --num-prompts 4 --max-new-tokens 48
  python eval/bench_dflash_cost.py --target toy --k 3 5 7
"""

from __future__ import annotations

import argparse
import statistics

import torch

from specdraft.config import load_recipe
from specdraft.data.vocab import DraftVocab
from specdraft.decoding.speculative import plain_decode, speculative_decode
from specdraft.drafters import get_family
from specdraft.evaluation.metrics import draft_cost_ratio
from specdraft.quickstart import RECIPES_DIR
from specdraft.target import FrozenTarget, resolve_target_path

RECIPE_PREFIX = {"smollm2-135m-instruct": "smollm2-135m", "toy": "toy"}
QUESTIONS = ["Explain why the sky is blue in two sentences.", "Write a Python function that reverses a string.",
             "What is the capital of France, and what is it known for?", "List three uses of a paperclip.",
             "How do I boil an egg?", "Summarise the plot of Romeo and Juliet."]


def build(family: str, prefix: str, target):
    """The recipe's drafter on ``target``, its weights as built (a reduced draft vocabulary: any N ids)."""
    recipe = load_recipe(RECIPES_DIR / f"{prefix}{'_' if prefix == 'toy' else '-'}{family}.yaml")
    fam = get_family(family)
    vocab = None
    size = getattr(recipe.drafter, "draft_vocab_size", None)
    if fam.needs_draft_vocab and size is not None and size < target.vocab_size:
        vocab = DraftVocab.from_target_ids(torch.arange(size), target.vocab_size)
    taps = tuple(recipe.target.taps) if isinstance(recipe.target.taps, list) else None
    torch.manual_seed(0)
    return fam.build(target, recipe.drafter, vocab, taps).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--families", nargs="+", default=["dflash", "eagle3"])
    parser.add_argument("--k", type=int, nargs="+", default=[3, 5, 7])
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(1)

    target_dir = resolve_target_path(args.target, "float32")
    target = FrozenTarget.from_pretrained(target_dir, dtype="float32")
    prefix = RECIPE_PREFIX.get(args.target, args.target)
    drafters = {family: build(family, prefix, target) for family in args.families}
    prompts = [target.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    return_tensors="pt", return_dict=True)["input_ids"]
               for q in QUESTIONS[: args.num_prompts]]

    plain_decode(target, prompts[0], max_new_tokens=4)  # warm-up
    plain = [plain_decode(target, p, max_new_tokens=args.max_new_tokens) for p in prompts]
    per_token = sum(o.seconds - o.prefill_seconds for o in plain) / sum(len(o.tokens) - 1 for o in plain)
    print(f"target {args.target} ({target_dir}), float32, 1 thread; {len(prompts)} prompts, "
          f"{args.max_new_tokens} new tokens; plain decoding {1000 * per_token:.1f} ms/token\n")
    print("| family | K | draft ms / step | verify ms / step | draft step / plain step | c | greedy identical |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for family, drafter in drafters.items():
        for k in args.k:
            steps, same = [], True
            for prompt, base in zip(prompts, plain):
                out = speculative_decode(target, drafter.draft_source(target), prompt, k=k,
                                         max_new_tokens=args.max_new_tokens)
                same &= out.tokens == base.tokens
                steps += out.steps
            draft = statistics.mean(s.draft_seconds for s in steps)
            verify = statistics.mean(s.target_seconds for s in steps)
            print(f"| {family} | {k} | {1000 * draft:.1f} | {1000 * verify:.1f} | {draft / per_token:.3f} | "
                  f"{draft_cost_ratio(steps):.3f} | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
