"""What every family's optimisation is made of: AdamW parameter groups and the recipe's learning-rate
schedule, put together by ``recipe_optimization``, what a drafter's ``configure_optimizers`` usually returns.

Below the drafters and the training loop (both import it), so it imports neither, nor the config.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from transformers import get_scheduler

from .contract import Optimization
from .errors import SpecdraftError


def recipe_optimization(module: nn.Module, recipe, total_steps: int,
                        lr_multipliers: dict[str, float] | None = None) -> Optimization:
    """The recipe's optimisation of ``module`` over ``total_steps``: its optimizer section's lr and weight decay
    (``param_groups``, with ``lr_multipliers`` by parameter-name prefix) and its warmup and decay
    (``make_scheduler``). A family with its own schedule replaces ``schedule`` (``dataclasses.replace``)."""
    o = recipe.optimizer
    return Optimization(param_groups(module, o.weight_decay, o.lr, lr_multipliers),
                        partial(make_scheduler, recipe=recipe, total_steps=total_steps))


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
        raise SpecdraftError(f"the drafter's lr_multipliers name {unmatched}, which match no trained parameter")

    def multiplier(name: str) -> float:
        return next((lr_multipliers[prefix] for prefix in prefixes if name.startswith(prefix)), 1.0)

    groups: dict[tuple[bool, float], list] = {}
    for name, param in params:
        groups.setdefault((param.ndim >= 2, multiplier(name)), []).append(param)
    return [{"params": group, "weight_decay": weight_decay if decays else 0.0, "lr": lr * scale}
            for (decays, scale), group in sorted(groups.items(), key=lambda item: (-item[0][0], item[0][1]))]


def make_scheduler(optimizer, recipe, total_steps: int):
    """The recipe's (``specdraft.config.Recipe``) warmup then decay (``optimizer.schedule``), stepped once per
    optimizer step."""
    o = recipe.optimizer
    name, extra = {
        "cosine": ("cosine_with_min_lr", {"min_lr_rate": o.min_lr_ratio}),
        "linear": ("linear", {}),
        "constant": ("constant_with_warmup", {}),
    }[o.schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=o.warmup_steps, num_training_steps=total_steps,
                         scheduler_specific_kwargs=extra or None)
