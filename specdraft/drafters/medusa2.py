"""Medusa-2 (Cai et al. 2024, arXiv 2401.10774, Sec. 2.2.2 and 2.3.2): Medusa heads trained jointly with
LoRA adapters inside the target, by self-distillation.

The heads are Medusa-1's (``specdraft.drafters.medusa``). peft puts LoRA adapters (r=32, alpha=16,
dropout 0.05 by default) on the target's attention and MLP projections, and one run trains in two stages:

    steps [0, joint_from_step)   the heads only; the target is its original self (B = 0, no step taken)
    steps [joint_from_step, ..)  L = L_LM + lambda_heads * sched(step) * sum_k 0.8^k CE_k

lambda_heads is ``heads_coefficient`` (0.2), sched is ``heads_schedule`` (below).

L_LM = KL(p_original || p_adapted) on the target's own answers (self-distillation, Sec. 2.3.2): the
teacher is the same model with its adapters switched off (peft's ``disable_adapter()``), under no_grad,
so the target sits in memory once. The heads learn the answers' tokens from the adapted target's hidden
states. sched is the reference trainer's (FasterDecoding's axolotl patch): constant 1, or a linear or
sine (sin(pi/2 x)) warmup over ``heads_warmup_ratio`` of the run's steps (its ``sine_<ratio>``).

The heads train at ``head_lr_multiplier`` (4x) the adapters' lr (the reference's medusa_lr_multiplier),
and a stage-1 step leaves the adapters without a gradient: its ``configure_optimizers`` says both to the
loop (a group per lr, and ``Optimization.unused_parameters``, so DDP looks for them). It also uses the
contract's optional parts: its own end-of-training report (``Family.eval_report``), a whole-folder
export (``FolderExporter``) and the run's length (``TrainingContext.total_steps``, for sched).
Tests show two DDP processes train both stages to one process's weights, and ZeRO-2 matches one process
when training is joint from the first step. With a stage 1 under DeepSpeed, the adapters still do not
move (weight decay 0), but DeepSpeed steps their Adam moments on zero gradients where torch's AdamW
skips them, so their bias correction in stage 2 differs from one process's.

Serving: the ``merged`` export folds the adapters into the target's weights (peft's merge_and_unload) as
a normal transformers folder with the tokenizer, with the heads in ``medusa_heads/`` (a Medusa-1 drafter
of that merged target; ``specdraft export OUT/medusa_heads --format vllm --target OUT`` gives vLLM's
layout). The export checks that the merged model's logits and the heads' logits on it equal the adapted
target's. ``hf`` is specdraft's own folder.

The end-of-training eval decodes with the adapted target (its LoRA unmerged), so its speedups are over
that target's plain decoding, and reports how far the adapted target drifted from the original
(``drift_report``, in ``eval/family_report.json``): the mean KL along the original's greedy answer and
the greedy agreement of the two. It warns above a mean KL of 0.05 nats (``DRIFT_WARNING_KL``) and names
the knob that keeps the target (``optimizer.lr=5e-5 drafter.head_lr_multiplier=20``): at the paper's
settings the adapted target drifts far enough that Medusa-2's figures describe another model
(eval/README.md, "Medusa-2's drift, knob by knob").
"""

from __future__ import annotations

import json
import math
import warnings
import weakref
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from ..atomic import atomic_folder
from ..contract import (
    Example,
    ExportOptions,
    Family,
    FolderExporter,
    LossOutput,
    Optimization,
    TargetNeeds,
    TrainingContext,
)
from ..data.vocab import DraftVocab
from ..decoding.speculative import plain_decode
from ..errors import SpecdraftError
from ..lora import LORA_MODULES, check_lora_modules, check_lora_settings, with_lora
from ..losses import forward_kl, forward_kl_from_hidden
from ..optim import param_groups
from ..target import FrozenTarget
from .folder import target_config_dict
from .medusa import (
    MEDUSA1,
    MedusaConfig,
    MedusaDrafter,
    check_heads_target,
    load_medusa,
    medusa_needs,
)

SCHEDULES = ("constant", "linear", "sine")
# Answer rows whose vocabulary-wide logits L_LM forms at once: 128 x 49,152 float32 is 24 MiB per tensor, and a
# chunk holds about a dozen such tensors (both logits, their softmaxes, the log-ratio, the gradients).
KL_CHUNK_ROWS = 128


@dataclass
class Medusa2Config(MedusaConfig):
    """Medusa-2: the heads (Medusa-1's fields) plus LoRA on the target and the joint objective."""

    lora_r: int = 32
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_MODULES))
    heads_coefficient: float = 0.2  # lambda_heads
    heads_schedule: str = "constant"  # sched(step): constant, linear or sine
    heads_warmup_ratio: float = 1.0  # a linear / sine sched reaches 1 after this share of the run's steps
    head_lr_multiplier: float = 4.0  # the heads' lr = optimizer.lr x this (the reference's medusa_lr_multiplier)
    joint_from_step: int = 0  # stage 1 (heads only) before this optimizer step, stage 2 (joint) from it

    def __post_init__(self):
        super().__post_init__()
        if self.distill:
            raise SpecdraftError("Medusa-2's heads learn the answers' tokens; drafter.distill is Medusa-1's option")
        if self.heads_schedule not in SCHEDULES:
            raise SpecdraftError(f"drafter.heads_schedule must be one of {', '.join(SCHEDULES)}, got "
                                 f"{self.heads_schedule!r}")
        if not 0.0 < self.heads_warmup_ratio <= 1.0:
            raise SpecdraftError(f"drafter.heads_warmup_ratio must be in (0, 1], got {self.heads_warmup_ratio}")
        check_lora_settings(self.lora_r, self.lora_alpha, self.lora_dropout)
        if self.heads_coefficient < 0 or self.head_lr_multiplier <= 0:
            raise SpecdraftError("drafter.heads_coefficient must be >= 0 and head_lr_multiplier > 0")
        if self.joint_from_step < 0:
            raise SpecdraftError("drafter.joint_from_step must be >= 0 (0: joint training from the start)")


def heads_schedule(cfg: Medusa2Config, step: int, total_steps: int) -> float:
    """sched(step) in [0, 1]: constant 1, or linear / sine (sin(pi/2 x)) in x = step / (ratio x total_steps)."""
    if cfg.heads_schedule == "constant":
        return 1.0
    if total_steps < 1:
        raise SpecdraftError(f"drafter.heads_schedule {cfg.heads_schedule} follows the run's length, and this "
                             "context gives none (TrainingContext.total_steps); use heads_schedule: constant")
    progress = min(1.0, step / (cfg.heads_warmup_ratio * total_steps))
    return progress if cfg.heads_schedule == "linear" else math.sin(progress * math.pi / 2)


def medusa2_needs(cfg: Medusa2Config, target_config) -> TargetNeeds:
    """The final hidden state (the heads, and L_LM's logits, formed a chunk at a time), trained adapters. The LoRA
    names are checked on a meta-device copy of the target: no weight loads."""
    medusa_needs(cfg, target_config)
    with torch.device("meta"):
        check_lora_modules(cfg.lora_target_modules, AutoModelForCausalLM.from_config(target_config))
    return TargetNeeds(final_hidden=True, trains_adapters=True)


# The PeftModel around each adapted target, so a second drafter on that target finds its adapters.
_ADAPTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def adapt(target, cfg: Medusa2Config):
    """LoRA adapters inside ``target.model`` (peft injects them in place, so the target's own forward runs
    through them); returns the PeftModel, for ``disable_adapter()`` and peft's save format."""
    if target in _ADAPTED:
        return _ADAPTED[target]
    # eval(): the target stays in eval mode (peft's new dropout modules start in train mode); the loop
    # puts the trained module, adapters included, in train mode while it trains.
    _ADAPTED[target] = with_lora(target.model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout,
                                 cfg.lora_target_modules).eval()
    return _ADAPTED[target]


class Medusa2Drafter(MedusaDrafter):
    """Medusa heads plus LoRA adapters in the target. ``trained_module()`` holds both, as ``heads.*`` and
    ``adapters.*`` (the PeftModel, whose only trainable tensors are its lora_A / lora_B)."""

    family = "medusa2"

    def __init__(self, target, cfg: Medusa2Config, draft_vocab: DraftVocab | None):
        super().__init__(target, cfg, draft_vocab)  # the fingerprint is of the target's own weights
        self.needs = TargetNeeds(final_hidden=True, trains_adapters=True)
        peft_model = adapt(target, cfg)
        # Outside the module tree: the target is not this module's to save, cast or move.
        self._outside = (target, peft_model, nn.ModuleDict({"heads": self.heads, "adapters": peft_model}))
        self._checked_data = False

    def trained_module(self) -> nn.Module:
        return self._outside[2]

    def configure_optimizers(self, recipe, total_steps: int) -> Optimization:
        """Medusa-1's, with the heads at ``head_lr_multiplier`` x the adapters' lr; a stage 1 (before
        ``joint_from_step``) leaves the adapters without a gradient, so DDP must look for unused parameters."""
        o, cfg = recipe.optimizer, self.config
        groups = param_groups(self.trained_module(), o.weight_decay, o.lr, {"heads.": cfg.head_lr_multiplier})
        return replace(super().configure_optimizers(recipe, total_steps), param_groups=groups,
                       unused_parameters=cfg.joint_from_step > 0)

    @property
    def peft_model(self):
        return self._outside[1]

    def train(self, mode: bool = True):
        """The adapters follow the heads: drafter.eval() (the acceptance eval's) turns LoRA dropout off."""
        self.peft_model.train(mode)
        return super().train(mode)

    def prepare(self, batch: dict[str, torch.Tensor], context: TrainingContext) -> Example:
        target, cfg = self._outside[0], self.config
        # No logits from either forward: L_LM forms them from the final hidden states a chunk of answer rows at
        # a time (compute_loss), never as two [B, T, V] float32 tensors and their softmaxes.
        with torch.no_grad(), self.peft_model.disable_adapter():  # the teacher: the original target
            original = target.forward_batch(batch, "none")
        if context.training and not self._checked_data:
            self._warn_unless_regenerated(batch, original.final_hidden)
        joint = context.step >= cfg.joint_from_step
        # Stage 1 reads the original target (its adapters take no step); stage 2 the adapted one, with
        # autograd through the adapters.
        adapted = target.forward_batch(batch, "none") if joint else original
        device = original.final_hidden.device
        weight = cfg.heads_coefficient * heads_schedule(cfg, context.step, context.total_steps)
        extra = {"teacher_hidden": original.final_hidden, "heads_weight": torch.tensor(weight, device=device),
                 "joint": torch.tensor(float(joint), device=device)}
        return Example({**batch, **extra}, adapted)

    def _warn_unless_regenerated(self, batch, final_hidden) -> None:
        """Medusa-2 distills the target on its own answers: data it would not have written pulls it away
        from itself. The original's top-1 matching under half the answer tokens says so."""
        self._checked_data = True
        mask = batch["loss_mask"][:, 1:].bool() & batch["attention_mask"][:, :-1].bool()
        hidden = final_hidden[:, :-1][mask]
        top1 = torch.cat([self._original_logits(hidden[i : i + KL_CHUNK_ROWS]).argmax(-1)
                          for i in range(0, hidden.shape[0], KL_CHUNK_ROWS)])
        agree = (top1 == batch["input_ids"][:, 1:][mask]).float().mean().item()
        if agree < 0.5:
            warnings.warn(
                f"the target's own top-1 matches only {agree:.0%} of the answer tokens: this data does not look like "
                "its own answers, and Medusa-2 fine-tunes the target on it. Regenerate it first: specdraft "
                "regenerate --target TARGET --data DATA --out data/regenerated.jsonl", stacklevel=2)

    def _original_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The original target's float32 logits from its final hidden states, as its frozen forward forms them
        (no autocast: a mixed-precision step does not change the teacher's numbers)."""
        with torch.autocast(hidden.device.type, enabled=False):
            return self._outside[0].logits_of(hidden, "full")

    def _adapted_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The adapted target's float32 logits, under the step's autocast, as its forward with autograd forms them."""
        return self._outside[0].logits_of(hidden, "full")

    def compute_loss(self, batch: dict[str, torch.Tensor], target_out) -> LossOutput:
        heads = super().compute_loss(batch, target_out)  # sum_k 0.8^k CE_k on the answers' tokens
        attention = batch["attention_mask"].bool()
        mask = batch["loss_mask"][:, 1:].bool() & attention[:, :-1] & attention[:, 1:]
        if "seq_ids" in batch:
            mask = mask & (batch["seq_ids"][:, :-1] == batch["seq_ids"][:, 1:])
        # L_LM = KL(p_original || p_adapted) at every answer position (0 in stage 1: the target is the original),
        # the vocabulary-wide logits formed KL_CHUNK_ROWS answer rows at a time.
        lm = forward_kl_from_hidden(target_out.final_hidden[:, :-1][mask], batch["teacher_hidden"][:, :-1][mask],
                                    self._adapted_logits, self._original_logits, KL_CHUNK_ROWS)
        loss = batch["joint"] * lm + batch["heads_weight"] * heads.loss
        metrics = {**heads.metrics, "loss_heads": heads.loss.detach(), "kl_original_adapted": lm.detach(),
                   "heads_weight": batch["heads_weight"]}
        return LossOutput(loss, metrics)

    def save_pretrained(self, path) -> None:
        """config.json, model.safetensors (the trained tensors, heads.* and adapters.*lora_*: what a resume
        restores) and adapter/ in peft's own format (adapter_config.json, adapter_model.safetensors)."""
        config = {"family": self.family, "config": asdict(self.config), "draft_vocab_size": self.draft_vocab_size,
                  "target_config": target_config_dict(self.target_config),
                  "target_fingerprint": self.target_fingerprint}
        trained = {n: p.detach().cpu().contiguous() for n, p in self.trained_module().named_parameters()
                   if n.startswith("heads.") or "lora_" in n}
        buffers = {n: b.cpu() for n, b in self.state_dict().items() if n in ("d2t", "t2d")}
        with atomic_folder(Path(path)) as tmp:
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            save_file({**trained, **buffers}, str(tmp / "model.safetensors"))
            self.peft_model.save_pretrained(str(tmp / "adapter"))


def build_medusa2(target, cfg: Medusa2Config, draft_vocab: DraftVocab | None = None) -> Medusa2Drafter:
    medusa2_needs(cfg, target.config)
    vocab_size = target.vocab_size
    if cfg.reduces_vocab(vocab_size) and draft_vocab is None:
        if target.device.type != "meta":
            raise SpecdraftError("drafter.draft_vocab_size below the target's vocabulary needs a draft vocabulary "
                                 "built from the data (build_draft_vocab), or draft_vocab_size: null")
        draft_vocab = DraftVocab.from_target_ids(torch.arange(cfg.draft_vocab_size), vocab_size)  # sizing only
    if draft_vocab is not None and draft_vocab.size == vocab_size:
        draft_vocab = None
    with torch.device(target.device):
        drafter = Medusa2Drafter(target, cfg, draft_vocab)
    target.require(drafter.needs)
    return drafter


def load_medusa2(path, target) -> Medusa2Drafter:
    """Heads and adapters on ``target``: the original target (adapters are injected), or the very target
    they trained in (its adapters are loaded over)."""
    path = Path(path)
    saved = json.loads((path / "config.json").read_text())
    if saved.get("family") != "medusa2":
        raise SpecdraftError(f"{path} holds a {saved.get('family')!r} drafter, not 'medusa2'")
    check_heads_target(saved, target, path)
    tensors = load_file(str(path / "model.safetensors"))
    vocab = None
    if "d2t" in tensors:
        vocab = DraftVocab(d2t=tensors.pop("d2t").long(), t2d=tensors.pop("t2d").bool())
    drafter = build_medusa2(target, Medusa2Config(**saved["config"]), vocab)
    missing, unexpected = drafter.trained_module().load_state_dict(tensors, strict=False)
    trainable = {n for n, p in drafter.trained_module().named_parameters() if n.startswith("heads.") or "lora_" in n}
    if unexpected or trainable & set(missing):
        raise SpecdraftError(f"{path} does not match this Medusa-2 drafter (missing "
                             f"{sorted(trainable & set(missing))[:3]}, unexpected {sorted(unexpected)[:3]})")
    drafter.target_fingerprint = saved.get("target_fingerprint")
    return drafter


# -- what the end-of-training eval adds: the adapted target's drift ---------------------------------------

# Mean KL(original || adapted) in nats per token above which the report warns. On SmolLM2 (eval/README.md, 42 joint
# steps, eval/bench_medusa2_drift.py) the paper's settings drifted 0.20 and kept 12% of the original's greedy
# tokens; adapters at a fifth of that lr drifted 0.003 and kept 53%.
DRIFT_WARNING_KL = 0.05


@torch.no_grad()
def drift_report(target, drafter: Medusa2Drafter, prompts: list[torch.Tensor], max_new_tokens: int = 128) -> dict:
    """How far the adapted target drifted from the original on held-out prompts: the mean KL(p_original ||
    p_adapted) along the original's greedy continuation (teacher-forced), and the greedy agreement of the
    two over ``max_new_tokens``: the share of positions that agree, and the mean common prefix."""
    peft_model = drafter.peft_model
    kls, agree, prefix = [], [], []
    for prompt in prompts:
        with peft_model.disable_adapter():
            original = plain_decode(target, prompt, max_new_tokens=max_new_tokens).tokens
        adapted = plain_decode(target, prompt, max_new_tokens=max_new_tokens).tokens
        ids = torch.cat([prompt, torch.tensor([original], device=prompt.device)], dim=1)
        with peft_model.disable_adapter():
            p = target(ids).logits[:, prompt.shape[1] - 1 : -1]
        q = target(ids).logits[:, prompt.shape[1] - 1 : -1]
        kls.append(forward_kl(q, p, torch.ones(p.shape[:-1], device=p.device)).item())
        n = min(len(original), len(adapted))
        same = [a == b for a, b in zip(original[:n], adapted[:n])]
        agree.append(sum(same) / max(n, 1))
        prefix.append(next((i for i, s in enumerate(same) if not s), n))
    report = {"mean_kl_original_adapted": sum(kls) / len(kls), "greedy_agreement": sum(agree) / len(agree),
              "greedy_common_prefix": sum(prefix) / len(prefix), "prompts": len(prompts), "tokens": max_new_tokens}
    if report["mean_kl_original_adapted"] > DRIFT_WARNING_KL:
        warnings.warn(
            f"the adapted target drifted from the original: mean KL {report['mean_kl_original_adapted']:.3f} nats a "
            f"token, greedy agreement {report['greedy_agreement']:.0%}; Medusa-2's acceptance then describes another "
            "model than the one you trained against. The adapters' lr sets the drift: lower optimizer.lr and raise "
            "drafter.head_lr_multiplier to keep the heads' lr (or lower drafter.heads_coefficient); eval/README.md's "
            "Medusa-2 drift table measures the trade", stacklevel=2)
    return report


# -- the merged export: the adapted target as a plain transformers model, the heads beside it ------------


def _adapted(drafter_dir: Path, opts: ExportOptions):
    if not opts.verifier:
        raise SpecdraftError("the merged export folds the adapters into the target: pass --target with the "
                             "target's folder or hub id (no recipe with target.path was found)")
    target = FrozenTarget.from_pretrained(opts.verifier, dtype="float32")
    return target, load_medusa2(drafter_dir, target)


def write_merged(drafter_dir: Path, tmp: Path, out: Path, opts: ExportOptions) -> None:
    """OUT: the merged target (config, safetensors in the target's dtype, tokenizer, generation config) and
    OUT/medusa_heads (a Medusa-1 drafter of the merged target, which its config names by OUT's path)."""
    target, drafter = _adapted(drafter_dir, opts)
    merged = drafter.peft_model.merge_and_unload()  # W + (alpha/r) B A, the adapters gone
    merged.to(_saved_dtype(drafter.target_config)).save_pretrained(tmp)  # the target's own dtype
    target.tokenizer.save_pretrained(tmp)
    heads_only = MedusaConfig(**{k: v for k, v in asdict(drafter.config).items() if k in MedusaConfig.__dataclass_fields__})
    merged_target = _merged_target(tmp)
    merged_target.model.config._name_or_path = str(out)  # where it will be once the driver renames tmp
    vocab = DraftVocab(drafter.d2t, drafter.t2d) if drafter.reduced else None
    medusa1 = MEDUSA1.build(merged_target, heads_only, vocab)
    medusa1.load_state_dict(drafter.state_dict())
    medusa1.save_pretrained(tmp / "medusa_heads")


def _saved_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _merged_target(folder: Path):
    return FrozenTarget.from_pretrained(folder, dtype="float32")


def check_merged(out: Path, drafter_dir: Path, opts: ExportOptions) -> None:
    """The merged target's logits and the heads' on it equal the adapted target's, on a fixed sequence,
    to the rounding of the export's dtype."""
    target, drafter = _adapted(drafter_dir, opts)
    drafter.eval()
    merged = _merged_target(out)
    heads = load_medusa(out / "medusa_heads", merged)
    merged.require(heads.needs)
    ids = torch.arange(1, 17, device=target.device)[None] % target.vocab_size
    adapted_out, merged_out = target(ids), merged(ids)
    # A float32 target merges exactly up to summation order; a bf16 one is rounded once more on saving.
    saved = json.loads((out / "config.json").read_text())
    tolerance = 1e-4 if saved.get("dtype", "float32") == "float32" else 5e-2
    for what, have, want in (("logits", merged_out.logits, adapted_out.logits),
                             ("head logits", heads.head_logits(merged_out.final_hidden),
                              drafter.head_logits(adapted_out.final_hidden))):
        gap = (have - want).abs().max().item()
        if gap > tolerance * max(1.0, want.abs().max().item()):
            raise SpecdraftError(f"{out}: the merged target's {what} differ from the adapted target's by {gap:.3g}; "
                                 "export it again")


MERGED = FolderExporter(
    write_merged, check_merged,
    "vllm serve {out} (the merged target), with the heads: specdraft export {out}/medusa_heads --format vllm "
    "--target {out} --out HEADS, then --speculative-config '{\"method\": \"medusa\", \"model\": \"HEADS\", "
    "\"num_speculative_tokens\": NUM_HEADS}'")

MEDUSA2 = Family(name="medusa2", config_cls=Medusa2Config, needs=medusa2_needs, build=build_medusa2,
                 load=load_medusa2, exporters={"merged": MERGED}, needs_draft_vocab=True,
                 eval_report=drift_report,
                 compile_refusal="its heads run over the counted rows only (masks.counted_rows: a host read, and a "
                                 "new shape every step), and its LoRA adapters train inside the target's forward",
                 selftest_settings={"num_heads": 3, "num_layers": 1, "lora_r": 8, "joint_from_step": 0})
