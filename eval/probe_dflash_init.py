"""What a fresh (or trained) DFlash drafter's loss is made of, on a real target (issue 34).

For a fresh drafter built from a recipe (or a trained one, --drafter), on a few rows of the target's own
answers, it prints:
  - the loss per block position (nats), against a uniform guess (log V);
  - the same loss with the target's injected features zeroed, and with the anchor token replaced by MASK
    (how much each input moves the predictions);
  - the gradient norm per parameter group at that first step;
  - the argmax the block predicts most often, and how often it is the anchor token or the MASK token;
  - where each draft layer's attention goes from the block's draft slots: the share on the block's own anchor
    slot, on the last context position (the target's state just before the anchor) and on the rest, against
    the share uniform attention over the same visible keys would give;
  - how alike the context is from position to position: per tapped layer and after the fusion (fc + RMSNorm)
    the keys and values are made from, the mean cosine between two positions' vectors, and how much of a
    vector's squared norm its largest channel holds (a "massive activation" channel shared by every position
    makes positions alike, and attention over them near uniform).

    python eval/probe_dflash_init.py --recipe recipes/smollm2-135m-dflash.yaml --data ANSWERS.jsonl --rows 8

It trains nothing; one forward and one backward per variant.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch
import yaml

import specdraft.drafters.dflash as dflash_module
from specdraft.contract import TrainingContext
from specdraft.drafters import load_drafter
from specdraft.drafters.dflash import DFlashConfig, build_dflash
from specdraft.target import FrozenTarget, resolve_target_path


def answer_rows(tokenizer, path: Path, rows: int, max_length: int) -> dict[str, torch.Tensor]:
    """The first ``rows`` conversations, chat-templated; the loss mask covers the assistant's tokens."""
    ids, masks = [], []
    for line in path.read_text().splitlines()[:rows]:
        messages = json.loads(line)["messages"]
        prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
        answer = messages[-1]["content"] + tokenizer.eos_token
        p = tokenizer(prompt, add_special_tokens=False).input_ids
        a = tokenizer(answer, add_special_tokens=False).input_ids
        row = (p + a)[:max_length]
        ids.append(row)
        masks.append(([0] * len(p) + [1] * len(a))[:max_length])
    width = max(len(r) for r in ids)
    pad = tokenizer.pad_token_id or 0
    batch = {
        "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in ids]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids]),
        "loss_mask": torch.tensor([m + [0] * (width - len(m)) for m in masks]),
    }
    return batch


def per_position(out, block_size: int) -> str:
    return " ".join(f"{out.metrics[f'loss_{j}'].item():.2f}" for j in range(block_size - 1))


def context_positions(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, T] the real positions past the first 4 (the chat template's start: attention sinks in many targets)."""
    valid = batch["attention_mask"].bool().clone()
    valid[:, :4] = False
    return valid


def context_likeness(vectors: torch.Tensor, valid: torch.Tensor) -> str:
    """Over the ``valid`` [B, T] positions of ``vectors`` [B, T, H]: the mean cosine between two different
    positions, the mean share of a vector's squared norm in its largest channel, and max |x| / median |x|."""
    x = vectors[valid].float()
    unit = torch.nn.functional.normalize(x, dim=-1)
    cosines = unit @ unit.T
    off_diagonal = cosines[~torch.eye(len(x), dtype=torch.bool)]
    square = x.pow(2)
    top_share = (square.max(-1).values / square.sum(-1)).mean()
    return (f"mean cosine between positions {off_diagonal.mean():.3f}, largest channel's share of the squared "
            f"norm {top_share:.3f}, max |x| / median |x| {x.abs().max() / x.abs().median():.0f}")


def attention_shares(drafter, compute_loss) -> list[dict[str, tuple[float, float]]]:
    """Per draft layer: {where: (measured share, uniform share)} of the draft slots' (1..bs-1) attention, over
    one ``compute_loss`` call. Each block's anchor slot is key S + n * bs; its last context key is the highest
    context key its mask shows (the position before the anchor)."""
    bs, captured = drafter.config.block_size, []

    def attend_and_keep(q, k, v, mask):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        captured.append((weights.detach(), mask.detach()))
        return weights @ v

    real = dflash_module.attend
    dflash_module.attend = attend_and_keep
    try:
        with torch.no_grad():
            compute_loss()
    finally:
        dflash_module.attend = real
    shares = []
    for weights, mask in captured:  # weights [B, h, Q, S + Q], mask [B, 1, Q, S + Q]
        Q = weights.shape[2]
        S = weights.shape[3] - Q
        slot = torch.arange(Q) % bs
        rows = (slot > 0) & mask[:, 0, :, :S].any(-1).all(0)  # draft slots of blocks with a context
        anchor_key = S + (torch.arange(Q) // bs) * bs
        ctx = mask[:, 0, :, :S]
        last_key = (ctx * torch.arange(S)).argmax(-1)  # [B, Q]
        visible = mask[:, 0].float()
        uniform = visible / visible.sum(-1, keepdim=True)  # [B, Q, S + Q]
        measured = weights.mean(1)  # over heads
        pick = lambda w, idx: w.gather(-1, idx[..., None])[..., 0]  # noqa: E731
        anchor_idx = anchor_key.expand(weights.shape[0], Q)
        row_mean = lambda x: x[:, rows].mean().item()  # noqa: E731
        layer = {}
        for name, w in (("measured", measured), ("uniform", uniform)):
            a, c = pick(w, anchor_idx), pick(w, last_key)
            block = w[..., S:].sum(-1) - a
            layer[name] = {"anchor slot": row_mean(a), "last context position": row_mean(c),
                           "other block slots": row_mean(block), "rest of the context": row_mean(1 - a - c - block)}
        shares.append({where: (layer["measured"][where], layer["uniform"][where]) for where in layer["measured"]})
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--data", required=True, help="a messages JSONL of the target's own answers")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a drafter: setting")
    parser.add_argument("--drafter", default=None, help="a trained drafter folder to probe instead of a fresh one")
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    recipe = yaml.safe_load(Path(args.recipe).read_text())
    settings = {k: v for k, v in recipe["drafter"].items() if k != "family"}
    for item in args.set:
        key, value = item.split("=", 1)
        settings[key] = yaml.safe_load(value)
    path = recipe["target"]["path"]
    target = FrozenTarget.from_pretrained(resolve_target_path(path, "float32"), dtype="float32")
    if args.drafter:
        drafter = load_drafter(args.drafter, target)
    else:
        drafter = build_dflash(target, DFlashConfig(**settings), None, tuple(recipe["target"].get("taps") or ()))
    drafter.train()
    bs, vocab = drafter.config.block_size, target.vocab_size
    batch = answer_rows(target.tokenizer, Path(args.data), args.rows, args.max_length)
    example = drafter.prepare(batch, TrainingContext(target))

    def loss(target_out, batch=example.batch, seed=args.seed):
        torch.manual_seed(seed)  # the same anchors for every variant
        return drafter.compute_loss(batch, target_out)

    print(f"{path}: vocab {vocab}, uniform guess {math.log(vocab):.2f} nats; block {bs}; "
          f"answer tokens {int(batch['loss_mask'].sum())}")
    out = loss(example.target)
    kind = "trained" if args.drafter else "fresh"
    print(f"{kind} drafter        loss {out.loss.item():.2f}  per position: {per_position(out, bs)}")
    zeroed = replace(example.target, aux_hidden=torch.zeros_like(example.target.aux_hidden))
    print(f"target features zeroed loss {loss(zeroed).loss.item():.2f}  per position: {per_position(loss(zeroed), bs)}")
    masked = dict(example.batch, input_ids=torch.full_like(example.batch["input_ids"], drafter.mask_token_id))
    masked_out = loss(example.target, masked)
    print(f"anchor -> MASK         loss {masked_out.loss.item():.2f}  per position: {per_position(masked_out, bs)}")

    # What the fresh block predicts: the anchor itself (a tied head reads the input embedding back)?
    with torch.no_grad():
        ids = example.batch["input_ids"]
        block = torch.full((1, bs), drafter.mask_token_id, dtype=torch.long)
        block[0, 0] = ids[0, 40]
        ctx = drafter.context(example.target.aux_hidden[:1, :40])
        kv = drafter.context_keys_values(ctx, torch.arange(40)[None])
        top = drafter.draft_logits(drafter.block_hidden(block, torch.arange(40, 40 + bs)[None], kv, None)).argmax(-1)[0]
    tok = target.tokenizer.convert_ids_to_tokens
    print(f"row 0 at 40: anchor {tok([int(ids[0, 40])])}, block argmax {tok(top.tolist())}")

    features, valid = example.target.aux_hidden, context_positions(batch)
    hidden = target.config.hidden_size
    for i in range(features.shape[-1] // hidden):
        print(f"tap {drafter.needs.taps[i]:>2}: {context_likeness(features[..., i * hidden:(i + 1) * hidden], valid)}")
    with torch.no_grad():
        print(f"fused context (fc + norm): {context_likeness(drafter.context(features), valid)}")

    for i, layer in enumerate(attention_shares(drafter, lambda: loss(example.target))):
        print(f"layer {i} attention from the draft slots (measured / uniform over the same keys): "
              + ", ".join(f"{where} {m:.3f} / {u:.3f}" for where, (m, u) in layer.items()))

    out = loss(example.target)
    out.loss.backward()
    groups = Counter()
    for name, p in drafter.named_parameters():
        group = name.split(".")[-2] if name.startswith("layers.") else name.rsplit(".", 1)[0]
        groups[group] += p.grad.float().pow(2).sum().item() if p.grad is not None else 0.0
    print("grad norm per group at step 1: " + ", ".join(f"{g} {math.sqrt(v):.3g}" for g, v in groups.items()))


if __name__ == "__main__":
    main()
