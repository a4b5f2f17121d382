"""Experiment (issue 34): DFlash trained with its fc started so that no tapped channel dominates the context.

SmolLM2's tapped hidden states have a few channels 50-190 times the median, shared by every position, and its
fused context has a mean cosine of .53 between positions against the toy's .14 (eval/probe_dflash_init.py,
eval/README.md "The learning rate, and where the attention goes"). This builds the recipe's drafter as
`specdraft train` does, then scales each input column of fc by (the median channel RMS) / (that channel's RMS)
over --stat-rows answers: the features standardised per channel at the start, as a diagonal scale folded into
fc's weight, so the drafter, its training and its export are unchanged otherwise. It prints the fused
context's likeness before and after, and trains the recipe with the overrides given.

    python eval/try_dflash_fc_scaling.py recipes/smollm2-135m-dflash.yaml --stat-data ANSWERS.jsonl KEY=VALUE ...
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
from probe_dflash_init import answer_rows, context_likeness, context_positions

from specdraft.config import load_recipe
from specdraft.contract import TrainingContext
from specdraft.drafters import FAMILIES
from specdraft.drafters.dflash import DFLASH, build_dflash
from specdraft.train import train


def channel_scaled_build(stat_data: Path, rows: int):
    def build(target, cfg, draft_vocab=None, taps=None):
        drafter = build_dflash(target, cfg, draft_vocab, taps)
        batch = answer_rows(target.tokenizer, stat_data, rows, 512)
        with torch.no_grad():
            features = drafter.prepare(batch, TrainingContext(target)).target.aux_hidden
            valid = context_positions(batch)
            print(f"fused context at the start, as built: {context_likeness(drafter.context(features), valid)}")
            rms = features[valid].float().pow(2).mean(0).sqrt()  # [n * H]
            scale = rms.median() / rms.clamp_min(1e-6)
            drafter.fc.weight.mul_(scale.to(drafter.fc.weight.dtype)[None])
            print(f"fc's columns scaled by {scale.min():.3g}..{scale.max():.3g} (median channel RMS / channel RMS)")
            print(f"fused context at the start, scaled:   {context_likeness(drafter.context(features), valid)}")
        return drafter

    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--stat-data", required=True, help="a messages JSONL of the target's own answers")
    parser.add_argument("--stat-rows", type=int, default=16)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_intermixed_args()
    torch.set_num_threads(1)
    FAMILIES["dflash"] = dataclasses.replace(DFLASH, build=channel_scaled_build(Path(args.stat_data), args.stat_rows))
    train(load_recipe(args.recipe, args.overrides), overwrite=True, show_progress=False)


if __name__ == "__main__":
    main()
