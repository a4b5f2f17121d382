"""What slows DFlash's learning on SmolLM2 (issue 34): the drafter trained alone on cached target outputs.

The target runs once over the first --rows training answers and --eval-rows held-out answers, each cut at 256
tokens, and its outputs are cached in --cache (with --target-each-step it runs on each step's rows instead, so
with --rows >= steps x micro no row repeats). Then only the drafter trains: --steps steps of AdamW at a constant
--lr over the micro-batches in turn, 32 anchors per row. A step of the recipe's block of 8 takes about 4 s here
against `specdraft train`'s 16, and nothing but the drafter's settings changes between variants. Every 10 steps
it prints the training loss and accuracy, and the held-out accuracy (against the target's top-1) at block
positions 1..3, at the held-out rows' fixed anchors.

Variants: any drafter setting (--set block_size=2, --set position_weights=dpace, --set loss_decay_gamma=0.05 to
train position 1 alone), and --anchor-only-attention, where each draft slot sees the context, the anchor and
itself but no other MASK slot. --score RUN/drafter ... scores drafters trained elsewhere on the same held-out rows.

    python eval/probe_dflash_positions.py --data ANSWERS.jsonl --heldout HELDOUT.jsonl [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import time
from pathlib import Path

import torch
import yaml
from probe_dflash_init import answer_rows

from specdraft.contract import TargetOutputs, TrainingContext
from specdraft.drafters import load_drafter
from specdraft.drafters.dflash import DFlashConfig, build_dflash
from specdraft.target import FrozenTarget, resolve_target_path


class MicroBatches:
    """(batch, target outputs) of each micro-batch of a file's first ``rows`` answers, the target run on demand."""

    def __init__(self, drafter, target, path, rows: int, micro: int):
        self.drafter, self.target, self.micro = drafter, target, micro
        self.rows = answer_rows(target.tokenizer, Path(path), rows, 256)
        self.count = -(-rows // micro)
        # what the cached outputs depend on: the rows' tokens and the target's taps
        tokens = self.rows["input_ids"].numpy().tobytes() + repr(drafter.needs.taps).encode()
        self.key = f"{rows}-{micro}-{hashlib.sha256(tokens).hexdigest()[:12]}"

    def __getitem__(self, i: int):
        with torch.no_grad():
            part = {k: v[i * self.micro:(i + 1) * self.micro] for k, v in self.rows.items()}
            example = self.drafter.prepare(part, TrainingContext(self.target))
        return example.batch, example.target

    def __len__(self) -> int:
        return self.count


def cached(micro_batches: MicroBatches, cache: Path) -> list:
    """Every micro-batch, computed once and kept in a file named by what it depends on (the target's full logits:
    ~50 MB a row); read back with weights_only=True (tensors, and the target outputs as plain dicts)."""
    path = cache.with_suffix(f".{micro_batches.key}.pt")
    if not path.exists():
        chunks = [micro_batches[i] for i in range(len(micro_batches))]
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save([(batch, dataclasses.asdict(out)) for batch, out in chunks], path)
    return [(batch, TargetOutputs(**out)) for batch, out in torch.load(path, weights_only=True)]


def anchor_only_attention(drafter) -> None:
    """Each draft slot sees the context, its block's anchor and itself: no other MASK slot."""
    bs, block_hidden = drafter.config.block_size, drafter.block_hidden

    def patched(block_ids, positions, context_kv, mask):
        Q = block_ids.shape[1]
        slot = torch.arange(Q) % bs
        keep = (slot[None, :] == 0) | (slot[None, :] == slot[:, None])
        mask = mask.clone()
        mask[..., mask.shape[-1] - Q:] &= keep
        return block_hidden(block_ids, positions, context_kv, mask)

    drafter.block_hidden = patched


def held_out(drafter, chunks) -> dict[str, float]:
    drafter.eval()
    sums: dict[str, list[float]] = {}
    with torch.no_grad():
        for batch, target_out in chunks:
            metrics = drafter.compute_loss(batch, target_out).metrics
            for j in range(3):
                if f"acc_{j}" in metrics:
                    sums.setdefault(f"acc_{j}", []).append(float(metrics[f"acc_{j}"]))
    drafter.train()
    return {k: sum(v) / len(v) for k, v in sums.items()}


def by_position(accuracy: dict[str, float]) -> str:
    return " ".join(f"{accuracy[f'acc_{j}']:.3f}" for j in range(3) if f"acc_{j}" in accuracy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/smollm2-135m-dflash.yaml")
    parser.add_argument("--data", required=True, help="a messages JSONL of the target's own answers")
    parser.add_argument("--heldout", required=True, help="held-out answers, the same format")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--eval-rows", type=int, default=8)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a drafter: setting")
    parser.add_argument("--anchor-only-attention", action="store_true")
    parser.add_argument("--target-each-step", action="store_true",
                        help="run the target on each step's rows instead of caching them (for --rows beyond a few "
                             "dozen: with --rows >= steps x micro no row repeats)")
    parser.add_argument("--cache", default="/tmp/probe_dflash_positions/targets.pt")
    parser.add_argument("--score", nargs="+", metavar="DRAFTER", help="instead of training: score these trained "
                        "drafter folders (e.g. specdraft train's RUN/drafter) on the probe's held-out rows")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    recipe = yaml.safe_load(Path(args.recipe).read_text())
    settings = {k: v for k, v in recipe["drafter"].items() if k != "family"} | {"num_anchors": 32}
    for item in args.set:
        key, value = item.split("=", 1)
        settings[key] = yaml.safe_load(value)
    target = FrozenTarget.from_pretrained(resolve_target_path(recipe["target"]["path"], "float32"), dtype="float32")
    drafter = build_dflash(target, DFlashConfig(**settings), None, tuple(recipe["target"].get("taps") or ()))
    cache = Path(args.cache)
    eval_chunks = cached(MicroBatches(drafter, target, args.heldout, args.eval_rows, args.micro), cache)
    if args.score:
        for folder in args.score:
            scored = held_out(load_drafter(folder, target), eval_chunks)
            print(f"{folder}: held-out acc by position {by_position(scored)}")
        return
    train_chunks = MicroBatches(drafter, target, args.data, args.rows, args.micro)
    if not args.target_each_step:
        train_chunks = cached(train_chunks, cache)
    if args.anchor_only_attention:
        anchor_only_attention(drafter)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0)
    print(f"settings {args.set} anchor-only attention {args.anchor_only_attention}; "
          f"{sum(p.numel() for p in params) / 1e6:.2f}M trained", flush=True)
    start = time.time()
    for step in range(1, args.steps + 1):
        batch, target_out = train_chunks[(step - 1) % len(train_chunks)]
        out = drafter.compute_loss(batch, target_out)
        optimizer.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if step % 10 == 0 or step == 1:
            print(f"step {step:4d}  train loss {out.loss.item():.3f} acc_0 {float(out.metrics['acc_0']):.3f}  "
                  f"held-out acc by position {by_position(held_out(drafter, eval_chunks))}  "
                  f"{time.time() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
