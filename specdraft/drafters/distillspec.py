"""DistillSpec (Zhou et al., ICLR 2024, arXiv 2310.08461): a small draft LM distilled from the target.

The student is an ordinary causal LM that shares the target's tokenizer; it drafts through
``DraftLMSource`` like any draft model, and exports as a plain transformers folder. Training
compares the student's next-token distribution Q with the target's P at every answer position:

    L = D(P_T || Q_T)   over the answer tokens,   P_T, Q_T at temperature T (optionally the target's top-k)

with D one of DistillSpec's divergences (``specdraft.losses``), the recipe's ``divergence``: ``fkl``
KL(P||Q), ``rkl`` KL(Q||P), ``jsd`` JSD(beta) with M = beta P + (1 - beta) Q, or ``tvd``; ``ce`` is the
plain next-token baseline on the data's tokens. beta = 0 and beta = 1 are FKL and RKL, as in TRL's GKD
trainer (the formula itself is 0 there). Each step also logs alpha = sum_x min(P, Q) = 1 - TVD at
temperature 1 over the whole vocabulary: the acceptance rate speculative sampling at T = 1 would
measure at those positions (DistillSpec Eq. 2); a test checks it against the decoder's measured
acceptance (within 0.02 over 1,000+ drafts).

Data (DistillSpec Sec. 3, "on-policy data"): the recipe's data is used as given (``fixed``, or the
target's own answers from ``specdraft regenerate``: ``teacher``); with ``on_policy_fraction`` = lambda
> 0, each training sample is, with probability lambda, replaced by the student's own continuation of
its prompt (one batched, KV-cached ``generate``, at ``generation_temperature``, up to
``generation_max_new_tokens``), which the target then scores in the step's one forward. The draw uses
torch's global RNG, which checkpoints restore, so a resume is exact (tested with kill -9); generation
time is logged as ``generate_s``. On-policy data needs ``data.packing: false``, which ``specdraft
train`` checks before anything loads.

The student comes from ``init``:
  config      a fresh Llama-style model: the target's config with ``num_layers`` layers (and any width
              given), randomly initialised; wider than the target warns that c will exceed 1
  truncate    the same shape, with the target's embeddings, first ``num_layers`` layers, final norm
              and LM head copied in
  pretrained  an existing smaller model folder (``student_path``) with the target's vocabulary,
              refused if its vocabulary or tokenizer differs from the target's (never mapped silently)

The whole student trains, or, with ``lora_r`` set, peft's LoRA adapters on ``lora_target_modules`` only
(for a student too large to train in full; not with ``init: config``, whose weights are random), under
the same loop: DDP and ZeRO-2 runs on two processes end at one process's student (tested), and a resume
after kill -9 is exact, LoRA or not. Either way the saved folder is a plain transformers model (config,
safetensors, tokenizer): a LoRA student is saved merged (``merge_and_unload`` on a copy), with its
adapters beside it in peft's format (``adapter/``); a resume reads the checkpoint's own copy of the
trained tensors, not this folder.

``load_drafter``, ``specdraft eval --drafter`` and ``--draft-model``, ``AutoModelForCausalLM`` and the
engines all open the same folder. Its one export, ``hf``, copies and checks it, and prints vLLM's
``draft_model`` and SGLang's ``STANDALONE`` flags. ``specdraft eval --draft-model DIR --compile-draft``
(in Python, ``DraftLMSource(model, compile=True)``) runs the draft's decode steps through
``torch.compile`` over transformers' ``StaticCache``, rolled back by position (gpt-fast's layout); the
first use of a cache size compiles for seconds to a minute. A small draft's step is mostly per-op
overhead, and that is what compiling removes.
"""

from __future__ import annotations

import copy
import json
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import PeftModel
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..atomic import atomic_folder
from ..contract import (
    Example,
    Family,
    FolderExporter,
    LossOutput,
    Optimization,
    TargetNeeds,
    TargetOutputs,
    TrainingContext,
)
from ..decoding.sources import DraftLMSource
from ..errors import SpecdraftError
from ..lora import LORA_MODULES, check_lora_settings, with_lora
from ..losses import DIVERGENCES, acceptance_rate, distillation_view, generalized_jsd
from ..masks import block_causal_mask
from ..optim import recipe_optimization
from ..target import decoder_of

INITS = ("config", "truncate", "pretrained")


@dataclass
class DistillSpecConfig:
    init: str = "truncate"  # config | truncate | pretrained (see the module docstring)
    student_path: str | None = None  # init: pretrained
    num_layers: int = 4  # init: config / truncate
    # init: config only, each None = the target's. A width above the target's is allowed (with a warning).
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    divergence: str = "fkl"  # fkl | rkl | jsd | tvd, or ce: next-token CE on the data's tokens (the SFT baseline)
    beta: float = 0.5  # JSD(beta); 0 = FKL and 1 = RKL (TRL's convention)
    temperature: float = 1.0  # applied to P and Q alike: distil for the temperature you decode at
    top_k: int | None = None  # compare over the target's top-k tokens only (both renormalised)
    on_policy_fraction: float = 0.0  # lambda: the share of samples the student regenerates in the step
    generation_temperature: float = 1.0  # the student's sampling temperature for on-policy data
    generation_max_new_tokens: int = 128
    # LoRA via peft instead of training every weight: null trains the whole student
    lora_r: int | None = None
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_MODULES))

    def __post_init__(self):
        if self.init not in INITS:
            raise SpecdraftError(f"drafter.init must be one of {', '.join(INITS)}, got {self.init!r}")
        if (self.init == "pretrained") != (self.student_path is not None):
            raise SpecdraftError("drafter.student_path goes with init: pretrained (a model folder), and only with it")
        if self.divergence not in (*DIVERGENCES, "ce"):
            raise SpecdraftError(f"drafter.divergence must be one of {', '.join(DIVERGENCES)} (or ce, the plain "
                                 f"next-token baseline), got {self.divergence!r}")
        if not 0.0 <= self.beta <= 1.0:
            raise SpecdraftError(f"drafter.beta must be in [0, 1] (0 = forward KL, 1 = reverse KL), got {self.beta}")
        if not 0.0 <= self.on_policy_fraction <= 1.0:
            raise SpecdraftError("drafter.on_policy_fraction (lambda, the share of samples the student generates) "
                                 f"must be in [0, 1], got {self.on_policy_fraction}")
        if not self.temperature > 0 or not self.generation_temperature > 0:
            raise SpecdraftError("drafter.temperature and drafter.generation_temperature must be > 0")
        if self.top_k is not None and self.top_k < 1:
            raise SpecdraftError(f"drafter.top_k must be >= 1, or null for the whole vocabulary; got {self.top_k}")
        if self.num_layers < 1 or self.generation_max_new_tokens < 1:
            raise SpecdraftError("drafter.num_layers and drafter.generation_max_new_tokens must be >= 1")
        if self.lora_r is not None:
            check_lora_settings(self.lora_r, self.lora_alpha, self.lora_dropout)
            if self.init == "config":
                raise SpecdraftError("a LoRA student (drafter.lora_r) adapts weights that already model language, "
                                     "and init: config starts from random ones: use init: truncate or pretrained, "
                                     "or lora_r: null to train the whole student")


def check_distillspec_recipe(recipe) -> None:
    """On-policy data regenerates whole samples; a packed row holds several. Refused before any load."""
    if recipe.drafter.on_policy_fraction > 0 and recipe.data.packing:
        raise SpecdraftError("on-policy data (drafter.on_policy_fraction > 0) regenerates whole samples, and packed "
                             "rows hold several: set data.packing: false")


def distillspec_needs(cfg: DistillSpecConfig, target_config) -> TargetNeeds:
    context = getattr(target_config, "max_position_embeddings", None)
    if cfg.on_policy_fraction > 0 and context is not None and cfg.generation_max_new_tokens >= context:
        raise SpecdraftError(
            f"drafter.generation_max_new_tokens ({cfg.generation_max_new_tokens}) does not fit the target's context "
            f"({context} tokens) with any prompt: lower it"
        )
    if cfg.init == "truncate" and cfg.num_layers > target_config.num_hidden_layers:
        raise SpecdraftError(f"init: truncate copies the target's first drafter.num_layers layers, and the target "
                             f"has {target_config.num_hidden_layers}; lower num_layers")
    # The divergence compares whole next-token distributions: the target's logits at every position.
    return TargetNeeds(logits="full")


# -- the student -------------------------------------------------------------------------------------


def student_config(cfg: DistillSpecConfig, target_config):
    """The target's config with fewer layers (and, for init: config, any width the recipe gives)."""
    config = type(target_config).from_dict(target_config.to_dict())
    config.num_hidden_layers = cfg.num_layers
    for name in ("layer_types", "max_window_layers"):  # per-layer lists of some configs follow the count
        if isinstance(getattr(config, name, None), list):
            setattr(config, name, getattr(config, name)[: cfg.num_layers])
    if cfg.init == "config":
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
            if getattr(cfg, name) is not None:
                setattr(config, name, getattr(cfg, name))
        if cfg.hidden_size is not None and getattr(target_config, "head_dim", None) is not None:
            config.head_dim = config.hidden_size // config.num_attention_heads
    return config


def check_vocabulary(student, target, where: str) -> None:
    """The student must speak the target's vocabulary: it is refused, never silently mapped."""
    rows = student.get_output_embeddings().weight.shape[0]
    if rows != target.vocab_size:
        raise SpecdraftError(
            f"the student {where} has a {rows}-token vocabulary and the target {target.vocab_size}: DistillSpec "
            "compares their distributions token by token, so the student must use the target's tokenizer. Take a "
            "smaller model of the target's family, or init: truncate / config"
        )


def check_tokenizer(path: Path, target) -> None:
    if target.tokenizer is None or not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return

    if AutoTokenizer.from_pretrained(str(path)).get_vocab() != target.tokenizer.get_vocab():
        raise SpecdraftError(
            f"the student in {path} has a different tokenizer from the target (same size, different tokens): its "
            "drafts would mean other words. Use a student from the target's model family"
        )


def new_student(target, cfg: DistillSpecConfig) -> nn.Module:
    if cfg.init == "pretrained":
        path = Path(cfg.student_path)
        if not (path / "config.json").is_file():
            raise SpecdraftError(f"drafter.student_path {path} is not a model folder (no config.json)")
        student = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(target.device)
        check_vocabulary(student, target, f"in {path}")
        check_tokenizer(path, target)
        return student
    config = student_config(cfg, target.config)
    if config.hidden_size > target.hidden_size:
        warnings.warn(f"the student is wider than the target (hidden_size {config.hidden_size} > "
                      f"{target.hidden_size}): a draft step will cost more than a target step would, c > 1",
                      stacklevel=2)
    with torch.device(target.device):
        student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if cfg.init == "truncate" and target.device.type != "meta":
        # the target's own weights for every tensor the shallower copy has: embeddings, layers 0..N-1,
        # final norm, LM head (tensor names are the same, the layers beyond N simply are not asked for)
        own = target.model.state_dict()
        with torch.no_grad():
            for name, tensor in student.state_dict().items():
                tensor.copy_(own[name])
    return student


class DistillSpecDrafter(nn.Module):
    """The student LM (``student``, a transformers ``*ForCausalLM``): all of it trains."""

    family = "distillspec"

    def __init__(self, target, cfg: DistillSpecConfig, student: nn.Module):
        super().__init__()
        self.config, self.student = cfg, student
        self.needs = distillspec_needs(cfg, target.config)
        self.tokenizer = target.tokenizer  # saved beside the weights: a served draft model needs one

    def trained_module(self) -> nn.Module:
        return self.student  # a PeftModel for a LoRA student: its lora_A / lora_B are what train

    def configure_optimizers(self, recipe, total_steps: int) -> Optimization:
        return recipe_optimization(self.student, recipe, total_steps)

    def lm(self) -> nn.Module:
        """The transformers model itself (for a LoRA student, peft's base model with the adapters in it)."""
        return self.student.get_base_model() if isinstance(self.student, PeftModel) else self.student

    # -- examples ---------------------------------------------------------------------------------
    def prepare(self, batch: dict[str, torch.Tensor], context: TrainingContext) -> Example:
        generate_seconds = 0.0
        if context.training and self.config.on_policy_fraction > 0:
            started = time.perf_counter()
            batch = self.on_policy(batch, context.target)
            generate_seconds = time.perf_counter() - started
        seconds = torch.tensor(generate_seconds, device=batch["input_ids"].device)  # logged as generate_s
        return Example({**batch, "generate_seconds": seconds}, context.target.forward_batch(batch, "full"))

    @torch.no_grad()
    def on_policy(self, batch: dict[str, torch.Tensor], target) -> dict[str, torch.Tensor]:
        """Each sample, with probability lambda (torch's global RNG: a resume restores it), becomes its
        prompt + the student's sampled continuation, with the loss on the generated tokens."""
        if "seq_ids" in batch:
            raise SpecdraftError("on-policy data (drafter.on_policy_fraction > 0) regenerates whole samples, and "
                                 "packed rows hold several: set data.packing: false")
        ids, attention, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        chosen = (torch.rand(ids.shape[0]) < self.config.on_policy_fraction).tolist()
        if not any(chosen):
            return batch
        context = target.config.max_position_embeddings
        rows, prompts = [], []  # rows: (tokens, loss mask) per sample; None where the student writes the answer
        for row, regenerate in enumerate(chosen):
            length = int(attention[row].sum())
            regenerate = regenerate and length > 0  # a padding row (fixed batch shapes) stays empty
            answer = loss_mask[row, :length].nonzero()
            prompt = ids[row, : int(answer[0]) if len(answer) else length]
            if regenerate and prompt.numel() + self.config.generation_max_new_tokens > context:
                raise SpecdraftError(
                    f"an on-policy generation of {self.config.generation_max_new_tokens} tokens after a "
                    f"{prompt.numel()}-token prompt exceeds the target's context ({context}): lower "
                    "drafter.generation_max_new_tokens or data.max_length"
                )
            rows.append(None if regenerate else (ids[row, :length], loss_mask[row, :length]))
            prompts += [prompt] if regenerate else []
        answered = iter(zip(prompts, self.generate(prompts)))
        rows = [row if row is not None else answered_row(*next(answered)) for row in rows]
        width = max(seq.numel() for seq, _ in rows)
        out = {"input_ids": ids.new_zeros(len(rows), width), "attention_mask": attention.new_zeros(len(rows), width),
               "loss_mask": loss_mask.new_zeros(len(rows), width)}
        for i, (seq, mask) in enumerate(rows):
            out["input_ids"][i, : seq.numel()] = seq
            out["attention_mask"][i, : seq.numel()] = 1
            out["loss_mask"][i, : seq.numel()] = mask
        return out

    def generate(self, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
        """The student's continuations of ``prompts`` (one batched, KV-cached ``generate``, left-padded),
        each up to and including its end-of-sequence token."""
        width = max(p.numel() for p in prompts)
        ids = prompts[0].new_zeros(len(prompts), width)
        attention = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - p.numel():] = p
            attention[i, width - p.numel():] = 1
        lm = self.lm()
        eos = lm.config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        was_training = lm.training
        lm.eval()
        try:
            out = lm.generate(
                input_ids=ids, attention_mask=attention, do_sample=True,
                temperature=self.config.generation_temperature, top_k=0, top_p=1.0,
                max_new_tokens=self.config.generation_max_new_tokens,
                pad_token_id=next(iter(eos_ids), 0), eos_token_id=list(eos_ids) or None,
            )[:, width:]
        finally:
            lm.train(was_training)
        continuations = []
        for row in out:
            stop = next((t + 1 for t, token in enumerate(row.tolist()) if token in eos_ids), row.numel())
            continuations.append(row[:stop])
        return continuations

    # -- loss ---------------------------------------------------------------------------------------
    def compute_loss(self, batch: dict[str, torch.Tensor], target_out: TargetOutputs) -> LossOutput:
        if target_out.logits is None or target_out.last_only or target_out.vocab_rows is not None:
            raise SpecdraftError("DistillSpec reads the target's full logits at every position; make the example "
                                 "with drafter.prepare (it asks for them)")
        mask = batch["attention_mask"]
        if "seq_ids" in batch:
            mask = block_causal_mask(mask, batch["seq_ids"])
        lm = self.lm()
        hidden = decoder_of(lm)(input_ids=batch["input_ids"], attention_mask=mask,
                                  position_ids=batch.get("position_ids")).last_hidden_state
        # Position t predicts token t+1: counted where t+1 is an answer token. Only those rows go through
        # the student's LM head, so the [B, T, V] student logits are never formed.
        counted = batch["loss_mask"][:, 1:].bool() & batch["attention_mask"][:, :-1].bool()
        student = lm.get_output_embeddings()(hidden[:, :-1][counted]).float()  # [M, V]
        teacher = target_out.logits[:, :-1][counted]  # [M, V]
        everywhere = torch.ones(student.shape[:-1], device=student.device)
        cfg = self.config
        if cfg.divergence == "ce":  # the baseline DistillSpec improves on: the data's next tokens, no teacher
            loss = F.cross_entropy(student, batch["input_ids"][:, 1:][counted])
        elif cfg.divergence == "jsd":
            loss = generalized_jsd(*distillation_view(student, teacher, cfg.temperature, cfg.top_k), everywhere,
                                   cfg.beta)
        else:
            loss = DIVERGENCES[cfg.divergence](*distillation_view(student, teacher, cfg.temperature, cfg.top_k),
                                               everywhere)
        with torch.no_grad():
            metrics = {
                "loss": loss.detach(),
                "alpha": acceptance_rate(student, teacher, everywhere),  # T = 1, whole vocabulary
                "acc_0": (student.argmax(-1) == teacher.argmax(-1)).float().mean(),  # greedy acceptance
                "generate_s": batch.get("generate_seconds", torch.tensor(0.0)),
            }
        return LossOutput(loss, metrics)

    # -- decoding and saving -------------------------------------------------------------------------
    def draft_source(self, target):
        # imported here: the drafters stay importable without the decoder

        return DraftLMSource(self.lm())

    def save_pretrained(self, path) -> None:
        """A plain transformers folder (config, safetensors, tokenizer) that vLLM and SGLang serve as a
        draft model, with the recipe's settings under config.json's ``distillspec`` (load_drafter reads
        ``family``); model.safetensors is the student's state_dict. A LoRA student is saved merged into a
        copy (the live one keeps training), plus adapter/ (peft's format). A resume reads neither: the
        checkpoint keeps the trained module's own tensors (``specdraft.checkpoint``)."""
        path = Path(path)
        if path.exists() and any(path.iterdir()) and not (path / "config.json").is_file():
            raise SpecdraftError(f"{path} exists and is not a saved drafter; save to a new or empty folder")
        lora = self.lm() is not self.student
        served = copy.deepcopy(self.student).merge_and_unload() if lora else self.student
        served.config.family = self.family
        served.config.distillspec = asdict(self.config)
        with atomic_folder(path) as tmp:
            served.save_pretrained(tmp, safe_serialization=True)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp)
            if lora:
                self.student.save_pretrained(str(tmp / "adapter"))


def answered_row(prompt: torch.Tensor, continuation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt and the student's continuation as one sample: the loss covers the generated tokens."""
    tokens = torch.cat([prompt, continuation])
    loss_mask = torch.zeros_like(tokens)
    loss_mask[prompt.numel():] = 1
    return tokens, loss_mask


def build_distillspec(target, cfg: DistillSpecConfig, draft_vocab=None) -> DistillSpecDrafter:
    distillspec_needs(cfg, target.config)  # the checks, before any weight is made
    student = new_student(target, cfg)
    if cfg.lora_r is not None:
        student = with_lora(student, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules,
                            whose="student")
    drafter = DistillSpecDrafter(target, cfg, student)
    target.require(drafter.needs)
    return drafter


def load_distillspec(path, target) -> DistillSpecDrafter:
    path = Path(path)
    saved = json.loads((path / "config.json").read_text())
    if saved.get("family") != "distillspec":
        raise SpecdraftError(f"{path} holds a {saved.get('family')!r} drafter, not a DistillSpec student")
    cfg = DistillSpecConfig(**saved.get("distillspec", {}))
    student = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(target.device)
    check_vocabulary(student, target, f"in {path}")
    check_tokenizer(path, target)
    drafter = DistillSpecDrafter(target, cfg, student)
    target.require(drafter.needs)
    return drafter


# -- export: the folder itself is what engines load ------------------------------------------------


def write_model_folder(drafter_dir: Path, tmp: Path, out: Path, opts) -> None:
    for item in drafter_dir.iterdir():
        if item.is_file() and item.name != "trained.safetensors":  # a LoRA student's resume state (older runs)
            shutil.copy2(item, tmp / item.name)


def check_model_folder(out: Path, drafter_dir: Path, opts) -> None:
    AutoConfig.from_pretrained(str(out))  # transformers (and so vLLM / SGLang) can read its config
    exported, trained = load_file(str(out / "model.safetensors")), load_file(str(drafter_dir / "model.safetensors"))
    if exported.keys() != trained.keys() or any(not torch.equal(exported[k], trained[k]) for k in trained):
        raise SpecdraftError(f"the export {out} does not hold the trained student of {drafter_dir}")


SERVE_HINT = (
    "vLLM:   vllm serve TARGET --speculative-config "
    "'{\"method\": \"draft_model\", \"model\": \"{out}\", \"num_speculative_tokens\": {k}}'\n"
    "SGLang: python -m sglang.launch_server --model-path TARGET --speculative-algorithm STANDALONE "
    "--speculative-draft-model-path {out} --speculative-num-steps {k} --speculative-eagle-topk 1 "
    "--speculative-num-draft-tokens {k+1}"
)

DISTILLSPEC = Family(
    name="distillspec",
    config_cls=DistillSpecConfig,
    needs=distillspec_needs,
    build=build_distillspec,
    load=load_distillspec,
    exporters={"hf": FolderExporter(write_model_folder, check_model_folder, SERVE_HINT)},
    check_recipe=check_distillspec_recipe,
    compile_refusal="the student's LM head runs over the counted positions, picked by a boolean mask (a new "
                    "shape every step), and on-policy rows are generated inside the step",
    selftest_settings={"num_layers": 2, "on_policy_fraction": 0.5, "generation_max_new_tokens": 16},  # on-policy
)
