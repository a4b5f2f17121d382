"""Benchmark: EAGLE-1's step with the target's frozen LM head over flattened rows, against the 3-D slice.

    python eval/bench_head_rows.py --target smollm2-135m-instruct --rows 4 --length 512 --repeats 3

EAGLE-1 applies the target's frozen LM head to ``predicted[:, :rows]``, a non-contiguous [B, T-2, H] slice
that requires grad. torch's matmul does not fold such an input against a weight that needs no grad: it
expands the weight into a [B, H, V] batched product, copying the whole head once per row of the batch, in the
forward and again in the backward. ``eagle_common.borrowed_head_logits`` flattens the rows into one [B*T, H]
product. This times one EAGLE-1 drafter step (forward and backward, the recipe's precision) each way,
alternated in one process on the same micro-batch (plain-text chunks of the standard library, as
eval/bench_train.py), and the target's forward: the step / target-forward ratio of eval/bench_train.py.
Minimum over the repeats. Host timers: exact on CPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from specdraft.config import load_recipe
from specdraft.contract import TrainingContext
from specdraft.data.collate import Collator, pad_token_id_of
from specdraft.data.pipeline import build_datasets
from specdraft.drafters import eagle1 as eagle1_module
from specdraft.drafters import get_family
from specdraft.recipe_target import load_target, recipe_needs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import RECIPE_PREFIX, text_data, time_alternately  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def sliced_head_logits(lm_head, hidden):
    """Before: the head applied to the [B, T, H] input as it comes (a slice, when the caller sliced it)."""
    return lm_head(hidden.to(lm_head.weight.dtype)).float()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="toy", choices=sorted(RECIPE_PREFIX))
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="then one step each way under torch.profiler: "
                        "the top operators by own CPU time, with their input shapes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        data = text_data(Path(tmp) / "text.jsonl", n_files=8 * args.rows, chars=16 * args.length)
        recipe = load_recipe(REPO / "recipes" / f"{RECIPE_PREFIX[args.target]}eagle1.yaml",
                             [f"data.path={data}", "data.format=text", f"data.max_length={args.length}"])
        target = load_target(recipe, torch.device("cpu"), recipe_needs(recipe))
        train_ds, _ = build_datasets(recipe.data, target.tokenizer)
    torch.manual_seed(0)
    drafter = get_family("eagle1").build(target, recipe.drafter, None)
    collate = Collator(pad_token_id_of(target.tokenizer), args.length, recipe.data.packing)
    batch = {key: value[:args.rows] for key, value in collate([train_ds[i] for i in range(len(train_ds))]).items()}
    bf16 = recipe.training.mixed_precision == "bf16"

    def target_forward():
        with torch.no_grad():
            return drafter.prepare(batch, TrainingContext(target))

    def drafter_step(example):
        torch.manual_seed(1)  # the same feature noise either way
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = drafter.compute_loss(example.batch, example.target)
        out.loss.backward()
        drafter.zero_grad(set_to_none=True)
        return out.loss.item()

    flattened = eagle1_module.borrowed_head_logits
    best, losses, example = time_alternately(target_forward, drafter_step, eagle1_module, "borrowed_head_logits",
                                             {"flattened": flattened, "sliced": sliced_head_logits}, args.repeats)
    tokens = int(batch["attention_mask"].sum())
    print(f"\n## bench_head_rows: {args.target}, EAGLE-1, torch {torch.__version__}, {args.threads} thread(s), "
          f"{args.rows} x {args.length} tokens, min of {args.repeats} alternated repeats")
    print(f"`python eval/bench_head_rows.py {' '.join(sys.argv[1:])}`\n")
    print("| LM head over | drafter step ms | step / target forward | training tokens/s (target forward + step) "
          "| loss |")
    print("|---|---:|---:|---:|---:|")
    for name, label in (("sliced", "the [B, T-2, H] slice (before)"), ("flattened", "flattened rows (now)")):
        print(f"| {label} | {best[name] * 1e3:.0f} | {(best['target'] + best[name]) / best['target']:.2f} | "
              f"{tokens / (best['target'] + best[name]):.0f} | {losses[name]:.6f} |")
    print(f"\nTarget forward: {best['target'] * 1e3:.0f} ms for {tokens} tokens.")
    if args.profile:
        from torch.profiler import profile

        for name, head in (("sliced", sliced_head_logits), ("flattened", flattened)):
            eagle1_module.borrowed_head_logits = head
            with profile(record_shapes=True) as prof:
                drafter_step(example)
            eagle1_module.borrowed_head_logits = flattened
            print(f"\n### One drafter step, LM head over {name} rows, under torch.profiler\n\n```")
            print(prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=36, max_shapes_column_width=60))
            print("```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
