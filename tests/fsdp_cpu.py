"""specdraft's drafter under FSDP2 on CPU: what tests/test_fsdp_cpu.py launches with torchrun (gloo).

    torchrun --nproc_per_node 2 tests/fsdp_cpu.py RECIPE OUT --steps 4 [--save-at 2] [--resume CKPT]

accelerate selects FSDP only for accelerator devices (``accelerate/state.py``), so `specdraft train` cannot run
FSDP on CPU processes; this runner drives the same parts `specdraft train` does (the recipe, ``recipe_needs``,
``load_target``, the family's ``build``, ``train.TrainStep`` and the Collator) with torch's own FSDP2 in
accelerate's place:

  * ``fully_shard`` wraps the TrainStep, whose parameters are the drafter's trained module only: the frozen
    target sits outside its module tree and stays whole (plain tensors, full shapes) on every rank;
  * each step is one global batch of 4 samples: with 2 processes each rank runs 2 of them and FSDP averages the
    gradients (reduce-scatter); with 1 process the same 2 + 2 are accumulated, each loss halved, which is the
    same mean;
  * ``--save-at S`` writes a sharded ``torch.distributed.checkpoint`` of the model and optimizer at step S (one
    file per rank), and ``--resume CKPT`` restores one, resharding it to this run's process count;
  * rank 0 writes the gathered full weights to OUT/initial.safetensors (a run from scratch) and
    OUT/final.safetensors, and OUT/report.json says how the parameters were placed.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from specdraft.config import load_recipe
from specdraft.data.collate import Collator, pad_token_id_of
from specdraft.data.pipeline import build_datasets
from specdraft.drafters import get_family
from specdraft.recipe_target import load_target, recipe_needs
from specdraft.train import TrainStep

GLOBAL_BATCH, PARTS = 4, 2  # samples per optimizer step, and the micro-batches they are cut into


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    recipe = load_recipe(args.recipe)
    torch.manual_seed(recipe.training.seed)
    target = load_target(recipe, "cpu", recipe_needs(recipe))
    train_ds, _ = build_datasets(recipe.data, target.tokenizer)
    drafter = get_family(recipe.drafter_family).build(target, recipe.drafter, None)
    step_module = TrainStep(drafter, target, None)
    fully_shard(step_module)
    optimizer = torch.optim.AdamW(step_module.parameters(), lr=recipe.optimizer.lr, weight_decay=0.0)

    report = {
        "world": world,
        "drafter_sharded": all(isinstance(p, DTensor) and p.to_local().shape[0] <= -(-p.shape[0] // world)
                               for p in step_module.parameters()),
        "drafter_local_numel": sum(p.to_local().numel() for p in step_module.parameters()),
        "drafter_numel": sum(p.numel() for p in step_module.parameters()),
        "target_whole": all(not isinstance(p, DTensor) and not p.requires_grad for p in target.parameters()),
        "target_numel": sum(p.numel() for p in target.parameters()),
    }

    full_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if not args.resume:  # the weights training starts from, for the test to see it moved them
        initial = get_model_state_dict(step_module, options=full_options)
        if rank == 0:
            save_file({name: t.contiguous() for name, t in initial.items()}, out / "initial.safetensors")
    start = 0
    if args.resume:
        state = dict(zip(("model", "optim"), get_state_dict(step_module, optimizer)))
        dcp.load(state, checkpoint_id=args.resume)
        set_state_dict(step_module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = json.loads((Path(args.resume) / "step.json").read_text())["step"]

    collate = Collator(pad_token_id_of(target.tokenizer), recipe.data.max_length, False)
    per_part = GLOBAL_BATCH // PARTS
    mine = [rank] if world == PARTS else list(range(PARTS))  # 2 ranks: one part each; 1 rank: both
    for step in range(start, args.steps):
        rows = [(step * GLOBAL_BATCH + i) % len(train_ds) for i in range(GLOBAL_BATCH)]
        optimizer.zero_grad()
        for part in mine:
            batch = collate([train_ds[r] for r in rows[part * per_part:(part + 1) * per_part]])
            loss, _, _ = step_module(batch, step)
            (loss / len(mine)).backward()
        optimizer.step()
        if step + 1 == args.save_at:
            ckpt = out / f"step-{step + 1}"
            model_state, optim_state = get_state_dict(step_module, optimizer)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=ckpt)
            if rank == 0:
                (ckpt / "step.json").write_text(json.dumps({"step": step + 1, "world": world}))
            dist.barrier()

    full = get_model_state_dict(step_module, options=full_options)
    if rank == 0:
        save_file({name: t.contiguous() for name, t in full.items()}, out / "final.safetensors")
        (out / "report.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
