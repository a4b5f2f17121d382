"""LoRA adapters through peft, for the families that train them: Medusa-2 (inside the target) and
DistillSpec (a LoRA student). peft does the work; this module holds what the recipes' lora_* fields
mean, their checks, and the error that names the modules a model does have."""

from __future__ import annotations

from peft import LoraConfig, get_peft_model
from torch import nn

from .errors import SpecdraftError

# Attention and MLP projections of Llama-style models (Medusa-2's paper setting).
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_lora_settings(r: int, alpha: int, dropout: float) -> None:
    if r < 1 or alpha < 1:
        raise SpecdraftError(f"drafter.lora_r and drafter.lora_alpha must be >= 1, got {r} and {alpha}")
    if not 0.0 <= dropout < 1.0:
        raise SpecdraftError(f"drafter.lora_dropout must be in [0, 1), got {dropout}")


def check_lora_modules(names, model: nn.Module, whose: str = "target") -> None:
    """LoRA goes on Linear modules of these names. A name the model lacks is refused, listing those it
    has (peft itself only says it found none of them)."""
    head = model.get_output_embeddings()
    have = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, nn.Linear) and m is not head})
    missing = sorted(set(names) - set(have))
    if missing:
        raise SpecdraftError(f"drafter.lora_target_modules names {missing}, which this {whose} does not have; its "
                             f"Linear modules are {have} (the LM head left out)")


def with_lora(model: nn.Module, r: int, alpha: int, dropout: float, modules, whose: str = "target"):
    """``model`` with peft's LoRA adapters injected in place (only lora_A / lora_B train); the PeftModel."""
    check_lora_modules(modules, model, whose)
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                                            target_modules=list(modules)))
