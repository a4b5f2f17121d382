"""How far a verify forward's logits drift from plain decoding's 1-token forward, per dtype.

    python eval/bench_rounding.py [--target smollm2-135m-instruct] [--prompts 4] [--threads 1]

For positions along the target's own greedy answers, the next-token logits are computed twice, as
plain decoding does (one token on the cache) and as a verify forward does (that token and 5 more),
and the largest difference is printed relative to the largest logit. These figures set
``specdraft.evaluation.mismatch.ROUNDING``: a greedy mismatch at a top-2 gap within that rounding is
a near-tie, not a defect.
"""

from __future__ import annotations

import argparse

import torch

from specdraft.evaluation.mismatch import ROUNDING, one_token_and_verify_logits
from specdraft.target import FrozenTarget, resolve_target_path

QUESTIONS = ["What is the capital of France?", "Write a poem about the sea.", "Explain quicksort in Python.",
             "How do I bake bread?", "Summarise the plot of Hamlet.", "What is 17 times 23?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| dtype | positions | median rel. difference | max rel. difference | min top-2 gap | ROUNDING |")
    print("|---|---:|---:|---:|---:|---:|")
    for dtype in ("float32", "bfloat16"):
        target = FrozenTarget.from_pretrained(resolve_target_path(args.target, "float32"), dtype=dtype)
        tokenizer = target.tokenizer
        diffs, gaps = [], []
        for question in QUESTIONS[: args.prompts]:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)["input_ids"]
            answer = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                           do_sample=False)[0].tolist()
            for end in range(ids.shape[1] + 1, len(answer) - 5, 3):
                one, verify = one_token_and_verify_logits(target, answer[:end], answer[end : end + 5])
                diffs.append(((one - verify).abs().max() / one.abs().max()).item())
                top = one.topk(2).values
                gaps.append((top[0] - top[1]).item())
        diffs.sort()
        print(f"| {dtype} | {len(diffs)} | {diffs[len(diffs) // 2]:.2e} | {diffs[-1]:.2e} | {min(gaps):.3f} | "
              f"{ROUNDING[getattr(torch, dtype)]:.0e} |")


if __name__ == "__main__":
    main()
