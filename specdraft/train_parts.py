"""The parts the training loop (``specdraft.train``) is assembled from, none of which knows a family:
where a run stands (its folder rules are ``specdraft.run_folder``), the accelerator's DeepSpeed
arguments, the optimizer's groups and schedule, signals, and metrics reduced across processes."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .config import Recipe, flatten
from .errors import SpecdraftError


@dataclass
class RunState:
    """Where training is; saved in every checkpoint so a resume continues exactly."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches this process consumed in the current epoch
    tokens: int = 0


def ddp_arguments(family) -> dict:
    """Extra ``Accelerator`` arguments for DDP: a family whose steps leave parameters without a gradient
    (``Family.unused_parameters``) needs DDP to look for them, or DDP raises at the next step (its reduction never finished)."""
    if not family.unused_parameters:
        return {}
    from accelerate.utils import DistributedDataParallelKwargs

    return {"kwargs_handlers": [DistributedDataParallelKwargs(find_unused_parameters=True)]}


# -- DeepSpeed (begin) --------------------------------------------------------------------------
# `accelerate launch --config_file recipes/accelerate/deepspeed_zero{2,3}.yaml` sets
# ACCELERATE_USE_DEEPSPEED; the loop is then unchanged: accelerator.backward runs the engine's
# backward and step, and optimizer.step/zero_grad become no-ops.
def deepspeed_arguments(tcfg) -> dict:
    """Extra ``Accelerator`` arguments when launched for DeepSpeed, else none."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return {}
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    # Under DeepSpeed, clip_grad_norm_ is a no-op and the engine clips: the JSON's "auto"
    # gradient_clipping takes the recipe's value. zero3_init_flag=False: the target is loaded
    # whole, only the trained module is sharded (by the engine, at prepare).
    arguments = {"deepspeed_plugin": DeepSpeedPlugin(gradient_clipping=tcfg.max_grad_norm, zero3_init_flag=False)}
    if not torch.cuda.is_available():
        # accelerate picks a process-group backend only for accelerators; on CPU DeepSpeed
        # (DS_ACCELERATOR=cpu) runs over gloo. This is what makes the CPU tests possible.
        arguments["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    return arguments


def load_models_whole(accelerator) -> None:
    """Stop transformers from building models inside ``deepspeed.zero.Init``.

    accelerate registers the DeepSpeed config with transformers even when zero3_init_flag is off,
    and under ZeRO-3 ``from_pretrained`` would then shard the target, which never enters
    the engine, so its forward would see empty weights.
    """
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
# -- DeepSpeed (end) ----------------------------------------------------------------------------


def param_groups(model: nn.Module, weight_decay: float, lr: float,
                 lr_multipliers: dict[str, float] | None = None) -> list[dict]:
    """AdamW groups: decay matrices only (norms and biases are scale parameters, decaying them only
    hurts), each at ``lr`` times the multiplier of the longest ``lr_multipliers`` prefix its name has."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise SpecdraftError("the drafter has no trainable parameters; check the drafter family config")
    prefixes = sorted(lr_multipliers or {}, key=len, reverse=True)
    unmatched = [prefix for prefix in prefixes if not any(n.startswith(prefix) for n, _ in params)]
    if unmatched:  # a family naming parameters it does not have would silently train them at 1x
        raise SpecdraftError(f"the family's lr_multipliers name {unmatched}, which match no trained parameter")

    def multiplier(name: str) -> float:
        return next((lr_multipliers[prefix] for prefix in prefixes if name.startswith(prefix)), 1.0)

    groups: dict[tuple[bool, float], list] = {}
    for name, param in params:
        groups.setdefault((param.ndim >= 2, multiplier(name)), []).append(param)
    return [{"params": group, "weight_decay": weight_decay if decays else 0.0, "lr": lr * scale}
            for (decays, scale), group in sorted(groups.items(), key=lambda item: (-item[0][0], item[0][1]))]


def make_scheduler(optimizer, recipe: Recipe, total_steps: int):
    """The recipe's warmup then decay (``optimizer.schedule``), stepped once per optimizer step."""
    from transformers import get_scheduler

    o = recipe.optimizer
    name, extra = {
        "cosine": ("cosine_with_min_lr", {"min_lr_rate": o.min_lr_ratio}),
        "linear": ("linear", {}),
        "constant": ("constant_with_warmup", {}),
    }[o.schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=o.warmup_steps, num_training_steps=total_steps,
                         scheduler_specific_kwargs=extra or None)


class StopRequested:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint at the next step boundary and exits 0."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def flat_config(config: dict) -> dict:
    """``{"optimizer.lr": 1e-4, ...}``: trackers (tensorboard hparams) want flat scalars."""
    return {key: value if isinstance(value, (int, float, str, bool)) else str(value)
            for key, value in flatten(config).items()}


def mean_over_batches(history: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each metric's mean over this process's micro-batches, still on the device."""
    return {k: torch.stack([h[k].float() for h in history]).mean() for k in history[0]}


def mean_over_processes(accelerator, metrics: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Each metric's mean over the processes, in one collective: every process calls it, with the
    same keys (each process's means cover the same number of batches: accelerate's even_batches)."""
    keys = sorted(metrics)
    local = torch.stack([torch.as_tensor(metrics[k], dtype=torch.float32).to(accelerator.device) for k in keys])
    return dict(zip(keys, accelerator.reduce(local, reduction="mean").tolist()))


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
