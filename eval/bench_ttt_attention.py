"""Benchmark: EAGLE-3's training-time-test attention, one attention per step against the extended mask.

    python eval/bench_ttt_attention.py --target smollm2-135m-instruct --lengths 512 1024 --rows 4 3
    python eval/bench_ttt_attention.py --target toy --lengths 256 --rows 8

Step k of the training-time test attends the step-0 keys plus each row's own keys of steps 1..k. The
references concatenate every step's keys and mask them with [mask0 | I | ... | I], so step k's attention
reads (k + 1) T keys; specdraft's ``TrainingTimeTestKeys`` reads T + 1 (the step-0 keys and a sink that
carries the own keys' log-sum-exp). This times one EAGLE-3 drafter step (forward and backward, the
recipe's precision) on one micro-batch of the recipe's data layout (plain-text chunks of the standard
library, as eval/bench_train.py), with each attention in turn, alternated in one process, and the target's
forward on the same batch: the step / target forward ratio eval/bench_train.py reports for a whole run.
Minimum over the repeats. Host timers: exact on CPU; on CUDA add torch.cuda.synchronize (not done here).
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
from specdraft.data.vocab import build_draft_vocab
from specdraft.drafters import eagle3 as eagle3_module
from specdraft.drafters import get_family
from specdraft.drafters.eagle_common import attend
from specdraft.recipe_target import load_target, recipe_needs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import RECIPE_PREFIX, text_data, time_alternately  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class ExtendedMaskKeys:
    """The references' training-time test: every step's keys concatenated, step k's mask [mask0 | I | ... | I]."""

    def __init__(self):
        self.keys = self.values = None
        self.steps = 0

    def attend(self, q, k, v, mask0):
        T = q.shape[2]
        self.keys = k if self.keys is None else torch.cat([self.keys, k], 2)
        self.values = v if self.values is None else torch.cat([self.values, v], 2)
        same_position = torch.eye(T, dtype=torch.bool, device=q.device)[None, None].expand(mask0.shape[0], 1, T, T)
        mask = torch.cat([mask0] + [same_position] * self.steps, -1)
        self.steps += 1
        return attend(q, self.keys, self.values, mask)


def one_length(target_name: str, length: int, rows: int, repeats: int, tmp: Path) -> dict:
    data = text_data(tmp / f"text{length}.jsonl", n_files=8 * rows, chars=16 * length)
    recipe = load_recipe(REPO / "recipes" / f"{RECIPE_PREFIX[target_name]}eagle3.yaml",
                         [f"data.path={data}", "data.format=text", f"data.max_length={length}"])
    target = load_target(recipe, torch.device("cpu"), recipe_needs(recipe))
    train_ds, _ = build_datasets(recipe.data, target.tokenizer)
    size = recipe.drafter.draft_vocab_size
    vocab = build_draft_vocab(train_ds, target.vocab_size, size, None, []) if size and size < target.vocab_size \
        else None
    torch.manual_seed(0)
    drafter = get_family("eagle3").build(target, recipe.drafter, vocab)
    collate = Collator(pad_token_id_of(target.tokenizer), length, recipe.data.packing)
    batch = {key: value[:rows] for key, value in collate([train_ds[i] for i in range(len(train_ds))]).items()}
    bf16 = recipe.training.mixed_precision == "bf16"

    def target_forward():
        with torch.no_grad():
            return drafter.prepare(batch, TrainingContext(target))

    def drafter_step(example):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = drafter.compute_loss(example.batch, example.target)
        out.loss.backward()
        drafter.zero_grad(set_to_none=True)
        return out.loss.item()

    best, losses, _ = time_alternately(target_forward, drafter_step, eagle3_module, "TrainingTimeTestKeys",
                                       {"sink": eagle3_module.TrainingTimeTestKeys, "extended": ExtendedMaskKeys},
                                       repeats)
    return {"length": length, "rows": rows, "tokens": int(batch["attention_mask"].sum()), **best,
            "loss_difference": abs(losses["sink"] - losses["extended"]) / abs(losses["extended"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="toy", choices=sorted(RECIPE_PREFIX))
    parser.add_argument("--lengths", type=int, nargs="+", default=[256])
    parser.add_argument("--rows", type=int, nargs="+", default=[8], help="rows per micro-batch, one per length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = args.rows * len(args.lengths) if len(args.rows) == 1 else args.rows
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for length, row_count in zip(args.lengths, rows):
            results.append(one_length(args.target, length, row_count, args.repeats, Path(tmp)))
    print(f"\n## bench_ttt_attention: {args.target}, torch {torch.__version__}, {args.threads} thread(s), "
          f"min of {args.repeats} alternated repeats")
    print(f"`python eval/bench_ttt_attention.py {' '.join(sys.argv[1:])}`\n")
    print("| tokens per row | rows | target forward ms | drafter step ms, one attention per step | drafter step ms, "
          "extended mask | step / target forward | the same, extended mask | loss relative difference |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['length']} | {r['rows']} | {r['target'] * 1e3:.0f} | {r['sink'] * 1e3:.0f} | "
              f"{r['extended'] * 1e3:.0f} | {(r['target'] + r['sink']) / r['target']:.2f} | "
              f"{(r['target'] + r['extended']) / r['target']:.2f} | {r['loss_difference']:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
