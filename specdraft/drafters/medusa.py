"""Medusa-1 (Cai et al. 2024, arXiv 2401.10774): K extra decoding heads on the target's last hidden state.

Head k (k = 0..K-1) reads the final normed hidden state h_t, the LM-head input, at position t and
predicts token t+k+2; the target's own head predicts t+1 (Sec. 2.1.1):

    p_t^(k) = softmax(W2^(k) R^(k)(h_t)),    R^(k) = num_layers ResBlocks,  ResBlock(x) = x + SiLU(W1 x + b1)

W1 and b1 start at zero, so every ResBlock starts as the identity, and W2 starts as a copy of the
target's LM head (its draft-vocabulary rows): each head starts out as the target's own head read one
or more tokens early. A head's ResBlocks are distinct modules. The reference builds them as
``[ResBlock(h)] * num_layers``, one module repeated, so its layers share one weight
(FasterDecoding/Medusa PR #133, Liger-Kernel PR #269); it also zeroes only W1 and leaves nn.Linear's
random b1, so its heads do not start exactly at the LM head.

Training (Medusa-1: the target frozen, Sec. 2.2.1):

    L = sum_k lambda_k CE_k,    lambda_k = loss_decay^k  (0.8^k; head 0, predicting t+2, has weight 1)

CE_k is taken against the data's token t+k+2 (the target's regenerated answers), or, with
``distill: true``, against the target's own distribution for that token, p(. | x_<=t+k+1), which is
the target's logits at position t+k+1 (the soft labels of self-distillation, Sec. 2.3.2). The
reference's Medusa-2 trainer counts the LM head as i = 0, so its first Medusa head gets 0.8^1. That
scales every head by the same 0.8, so only the size of the loss changes.

Decoding: every head reads the hidden state of the last committed token, so one proposal is one pass
of all heads. Draft k is head k's top-1 (greedy), or a sample from its distribution, warped with the
same sampling parameters as the target's. That distribution is the q the verifier uses. A head does
not see the earlier drafts, so q_k(. | d_1..d_k-1) = q_k, and speculative sampling stays exact.
Medusa's typical acceptance is the decoder's ``typical_acceptance`` (lossy, off by default). Static
trees (``medusa-63``, ``medusa-16``, ..., ``specdraft.decoding.trees``) take each depth's top-k from
the head of that depth.

Exports (each name checked against the engine's loader source, cited in the exporter):
  medusa  FasterDecoding's layout: config medusa_num_heads, medusa_num_layers, base_model_name_or_path;
          tensors {h}.{l}.linear.weight/bias and {h}.{num_layers}.weight, in medusa_lm_head.safetensors,
          the file FasterDecoding, TGI and TensorRT-LLM open. Refused for a reduced draft vocabulary:
          FasterDecoding's heads cover the whole vocabulary
  vllm    vLLM's MedusaConfig (model_type medusa) with medusa_fc_bias: true, without which vLLM drops the
          ResBlock biases; tensors blocks.{h}.layers.{l}.weight/bias, lm_heads.{h}.weight, and token_map
          for a reduced vocabulary
  hf      specdraft's own folder
SGLang has no Medusa support: its SpeculativeAlgorithm has no MEDUSA, and the serve hint says so.
Tests re-implement each engine's parsing and weight mapping and check identical head logits.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..chain_metrics import chain_accuracy_metrics
from ..contract import (
    DraftCapabilities,
    Example,
    Exporter,
    ExportOptions,
    Family,
    LossOutput,
    Optimization,
    Proposal,
    TargetNeeds,
    TargetOutputs,
    TrainingContext,
    target_example,
)
from ..data.vocab import DraftVocab
from ..decoding.sampling import draw_drafts
from ..decoding.trees import check_tree_request, expand_static_tree
from ..dtypes import export_dtype
from ..errors import SpecdraftError
from ..losses import DRAFTER_LOSSES, check_drafter_loss, soft_cross_entropy
from ..masks import counted_rows, rows_at
from ..optim import make_scheduler, recipe_optimization
from .folder import (
    check_same_target,
    read_drafter_folder,
    target_config_dict,
    write_drafter_folder,
)


@dataclass
class MedusaConfig:
    """Medusa-1 hyper-parameters; the defaults are the paper's and the reference training command's."""

    num_heads: int = 5  # K: drafts per proposal
    num_layers: int = 1  # distinct ResBlocks per head
    loss_decay: float = 0.8  # lambda_k = loss_decay^k
    distill: bool = False  # soft labels: the target's distribution at the same offset, not the data's token
    # Against soft labels (distill: true), ce or an acceptance-aimed loss (losses.DRAFTER_LOSSES: tvd, lk_alpha,
    # lk_hybrid); hard labels (the data's tokens) train on ce.
    loss: str = "ce"
    resblock_bias: bool = True  # the reference ResBlock's Linear has a bias
    # A reduced draft vocabulary: each head predicts only the N most frequent answer tokens (vLLM's
    # truncated_vocab_size + token_map). None: the target's whole vocabulary, as in the paper.
    draft_vocab_size: int | None = None
    accuracy_top_k: int = 5  # besides top-1, log whether the label is in each head's top-k
    # Warmup = ceil(warmup_ratio x total steps) (HF Trainer's rule); optimizer.warmup_steps > 0 replaces it.
    warmup_ratio: float | None = 0.1

    # The reference command (README, train_legacy.py under HF Trainer): lr 1e-3, cosine, weight decay 0,
    # and the Trainer's AdamW betas (0.9, 0.999) and gradient clipping at norm 1.0.
    optimizer_defaults: ClassVar[dict] = {
        "lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0, "schedule": "cosine", "max_grad_norm": 1.0,
    }

    def __post_init__(self):
        for name in ("num_heads", "num_layers", "accuracy_top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecdraftError(f"drafter.{name} must be an integer >= 1, got {value!r}")
        if not 0.0 < self.loss_decay <= 1.0:
            raise SpecdraftError(f"drafter.loss_decay must be in (0, 1] (the paper's 0.8), got {self.loss_decay}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise SpecdraftError("drafter.draft_vocab_size must be >= 1, or null for the target's whole vocabulary")
        if self.warmup_ratio is not None and not 0.0 <= self.warmup_ratio < 1.0:
            raise SpecdraftError(f"drafter.warmup_ratio must be in [0, 1) or null, got {self.warmup_ratio}")
        check_drafter_loss(self.loss)
        if self.loss != "ce" and not self.distill:
            raise SpecdraftError(f"drafter.loss: {self.loss} compares each head's distribution with the target's, and "
                                 "the heads learn the data's tokens: set drafter.distill: true (the target's "
                                 "distribution as soft labels), or loss: ce")

    def reduces_vocab(self, target_vocab_size: int) -> bool:
        return self.draft_vocab_size is not None and self.draft_vocab_size < target_vocab_size


def medusa_needs(cfg: MedusaConfig, target_config) -> TargetNeeds:
    """The final hidden state (every head's input); logits only for ``distill``'s soft labels, and then
    only the draft vocabulary's rows when it is reduced. Checked against the target's config."""
    vocab_size = target_config.vocab_size
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size > vocab_size:
        raise SpecdraftError(
            f"drafter.draft_vocab_size is {cfg.draft_vocab_size}, above the target's vocabulary of {vocab_size}; "
            "lower it, or set it to null for the whole vocabulary"
        )
    logits = "none"
    if cfg.distill:
        logits = "draft_rows" if cfg.reduces_vocab(vocab_size) else "full"
    return TargetNeeds(logits=logits, final_hidden=True)


# -- the heads ------------------------------------------------------------------------------------


class ResBlock(nn.Module):
    """x + SiLU(W x + b), starting as the identity (W = 0, b = 0)."""

    def __init__(self, hidden_size: int, bias: bool):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=bias)
        nn.init.zeros_(self.linear.weight)
        if bias:
            nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHead(nn.Module):
    """num_layers distinct ResBlocks, then Linear(H -> N, no bias)."""

    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int, bias: bool):
        super().__init__()
        self.resblocks = nn.ModuleList([ResBlock(hidden_size, bias) for _ in range(num_layers)])
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.resblocks:
            hidden = block(hidden)
        return self.lm_head(hidden).float()


class MedusaDrafter(nn.Module):
    """K Medusa heads; parameters ``heads.{k}.resblocks.{l}.linear.{weight,bias}`` and
    ``heads.{k}.lm_head.weight``, plus buffers ``d2t`` / ``t2d`` when the draft vocabulary is reduced
    (the convention of ``specdraft.data.vocab``)."""

    family = "medusa1"

    def __init__(self, target, cfg: MedusaConfig, draft_vocab: DraftVocab | None):
        super().__init__()
        self.config, self.target_config = cfg, target.config
        self.needs = medusa_needs(cfg, target.config)
        self.target_vocab_size = target.vocab_size
        rows = target.vocab_size if draft_vocab is None else draft_vocab.size
        self.heads = nn.ModuleList([MedusaHead(target.hidden_size, rows, cfg.num_layers, cfg.resblock_bias)
                                    for _ in range(cfg.num_heads)])
        if draft_vocab is None:
            self.draft_ids = None  # [N] long, the target id of each draft id; None: the identity
        else:
            self.register_buffer("d2t", draft_vocab.d2t.clone())
            self.register_buffer("t2d", draft_vocab.t2d.clone())
            self.register_buffer("draft_ids", draft_vocab.draft_to_target.clone(), persistent=False)
            # [V] long: the draft id of each target id (-1 outside the draft vocabulary), for hard labels
            self.register_buffer("target_to_draft", torch.cumsum(draft_vocab.t2d.long(), 0) - 1, persistent=False)
        with torch.no_grad():  # W2^(k) = the target's LM head (its draft-vocabulary rows)
            head = target.lm_head.weight
            head = head if self.draft_ids is None else head.index_select(0, self.draft_ids.to(head.device))
            for medusa_head in self.heads:
                medusa_head.lm_head.weight.copy_(head)
        self.target_fingerprint = target_fingerprint(target)

    @property
    def reduced(self) -> bool:
        return self.draft_ids is not None

    @property
    def draft_vocab_size(self) -> int:
        return self.heads[0].lm_head.out_features

    def head_logits(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """[..., H] hidden states -> [..., K, N] float32 logits of the first ``num_heads`` heads."""
        hidden = hidden.to(self.heads[0].lm_head.weight.dtype)
        return torch.stack([head(hidden) for head in self.heads[:num_heads]], dim=-2)

    def final_hidden(self, target_out: TargetOutputs) -> torch.Tensor:
        if target_out.final_hidden is None:
            raise SpecdraftError("Medusa heads read the target's final hidden state, and this target does not compute "
                                 "it: build or load the drafter on the target (it calls target.require(needs))")
        return target_out.final_hidden

    # -- the Drafter contract ---------------------------------------------------------------------
    def trained_module(self) -> nn.Module:
        return self  # the heads; the target stays frozen (Medusa-1)

    def configure_optimizers(self, recipe, total_steps: int) -> Optimization:
        return replace(recipe_optimization(self.trained_module(), recipe, total_steps),
                       schedule=partial(medusa_lr_schedule, recipe=recipe, total_steps=total_steps))

    def prepare(self, batch: dict[str, torch.Tensor], context: TrainingContext) -> Example:
        return target_example(batch, context, self.needs, self.draft_ids if self.needs.logits == "draft_rows" else None)

    def compute_loss(self, batch: dict[str, torch.Tensor], target_out: TargetOutputs) -> LossOutput:
        ids = batch["input_ids"]
        B, T = ids.shape
        hidden = self.final_hidden(target_out)
        if self.config.distill and target_out.logits is None:
            raise SpecdraftError("distill: true trains on the target's logits, and the target computed none; "
                                 "make the example with drafter.prepare (it asks for them)")
        counted = []
        for k in range(len(self.heads)):
            mask = predicted_positions(batch, k + 2)  # head k at position t predicts token t+k+2
            if self.reduced:  # count only tokens the head can emit (as EAGLE-3 does)
                mask = mask & self.t2d[ids[:, k + 2 :]]
            counted.append(mask)
        logits_per_head, targets_per_head, correct, in_top_k = [], [], [], []
        # Only the counted rows go through the heads: the [rows, N] logits of padding and prompt tokens are never
        # formed (their indices found in one host sync for every head, in training only).
        for k, (head, mask, index) in enumerate(zip(self.heads, counted, counted_rows(counted, T))):
            logits = head(rows_at(hidden, index).to(head.lm_head.weight.dtype))  # [M, N]
            if self.config.distill:
                # p(token t+k+2 | x_<=t+k+1): the target's logits at t+k+1, over the draft rows if reduced
                teacher = rows_at(target_out.logits, index, shift=k + 1)
                if self.reduced and target_out.vocab_rows is None:
                    teacher = teacher.index_select(-1, self.draft_ids)
                target = torch.softmax(teacher.float(), dim=-1)
                label = target.argmax(-1)  # what greedy verification would accept
            else:
                label = ids.reshape(-1)[index + k + 2]  # never past the row's end: the mask stops before it
                if self.reduced:
                    label = self.target_to_draft[label]
                target = label
            logits_per_head.append(logits)
            targets_per_head.append(target)
            with torch.no_grad():
                hit = torch.zeros(B * T, dtype=torch.bool, device=ids.device)
                hit[index] = logits.argmax(-1) == label
                correct.append(hit.view(B, T)[:, : mask.shape[1]])
                top_k = logits.topk(min(self.config.accuracy_top_k, logits.shape[-1]), dim=-1).indices
                in_top_k.append((top_k == label[:, None]).any(-1).float().sum() / max(label.numel(), 1))

        loss, per_head = medusa_loss(logits_per_head, targets_per_head, head_weights(len(self.heads),
                                                                                     self.config.loss_decay),
                                     DRAFTER_LOSSES[self.config.loss])
        metrics = {f"loss_{k}": value.detach() for k, value in enumerate(per_head)}
        metrics.update(chain_accuracy_metrics(correct, counted))  # acc_k (top-1), cond_acc_k, sim_accept_len
        metrics.update({f"top{self.config.accuracy_top_k}_{k}": value for k, value in enumerate(in_top_k)})
        return LossOutput(loss, metrics)

    def draft_source(self, target) -> MedusaDraftSource:
        return MedusaDraftSource(self)

    def save_pretrained(self, path) -> None:
        config = {
            "family": self.family,
            "config": asdict(self.config),
            "draft_vocab_size": self.draft_vocab_size,
            "target_config": target_config_dict(self.target_config),
            "target_fingerprint": self.target_fingerprint,
        }
        write_drafter_folder(path, config, self.state_dict())


# -- the loss (pure) --------------------------------------------------------------------------------


def head_weights(num_heads: int, decay: float) -> list[float]:
    """lambda_k = decay^k (Sec. 2.2.1: "lambda_k ... the k-th power of a constant like 0.8")."""
    return [decay**k for k in range(num_heads)]


def predicted_positions(batch: dict[str, torch.Tensor], offset: int) -> torch.Tensor:
    """[B, T - offset] bool: positions t whose token t+offset is trained on: an assistant token
    (``loss_mask``), both ends real tokens, and (packing) both in the same document."""
    attention = batch["attention_mask"].bool()
    rows = max(attention.shape[1] - offset, 0)
    mask = batch["loss_mask"][:, offset:].bool() & attention[:, :rows] & attention[:, offset:]
    if "seq_ids" in batch:
        mask = mask & (batch["seq_ids"][:, :rows] == batch["seq_ids"][:, offset:])
    return mask


def medusa_loss(head_logits: list[torch.Tensor], head_targets: list[torch.Tensor], weights: list[float],
                soft_loss=soft_cross_entropy) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """L = sum_k w_k CE_k (Sec. 2.2.1) and the CE_k.

    ``head_logits[k]`` [M_k, N]: head k's logits at the M_k counted positions. ``head_targets[k]``:
    the labels there, [M_k] long (hard: CE_k = mean -log q_k(y)), or [M_k, N] probabilities
    (soft: CE_k = mean -sum_x p(x) log q_k(x), or ``soft_loss`` in its place, an acceptance-aimed loss of
    ``losses.DRAFTER_LOSSES``). A head with no counted position has CE_k = 0.
    """
    per_head = []
    for logits, target in zip(head_logits, head_targets):
        if target.is_floating_point():
            ce = soft_loss(logits, target, torch.ones(logits.shape[:-1], device=logits.device))
        else:
            ce = F.cross_entropy(logits.float(), target, reduction="sum") / max(target.numel(), 1)
        per_head.append(ce)
    loss = sum(w * ce for w, ce in zip(weights, per_head))
    return loss, per_head


# -- decoding ---------------------------------------------------------------------------------------


class MedusaDraftSource:
    """Medusa heads as a ``DraftSource``. The heads read the hidden state of the last committed token,
    whose next token is the pending one (chosen by the target's own head): head k then drafts the
    token k+1 places after the pending one. ``start`` and ``commit`` only keep that hidden state."""

    # A batch's rows draft in one propose, over their hidden states stacked. Static trees only: the heads never
    # read a draft, so there is nothing for a dynamic tree to expand.
    capabilities = DraftCapabilities(tree_kinds=("static",), row_state=("last_hidden",))

    def __init__(self, drafter: MedusaDrafter):
        self.drafter = drafter

    def start(self, prompt_ids: torch.Tensor, target_out: TargetOutputs) -> None:
        self.last_hidden = self.drafter.final_hidden(target_out)[:, -1]

    @torch.no_grad()
    def propose(self, pending: torch.Tensor, k: int, params, generator: torch.Generator | None) -> Proposal:
        # imported here: the drafters stay importable without the decoder

        d = self.drafter
        num = min(k, len(d.heads))  # K heads propose at most K drafts
        if num == 0:
            B = pending.shape[0]
            return Proposal(pending.new_zeros(B, 0), torch.zeros(B, 0, d.target_vocab_size, device=pending.device))
        logits = d.head_logits(self.last_hidden, num)  # [B, num, N]
        drafts, q = draw_drafts(logits, params, generator)
        if d.reduced:
            drafts = d.draft_ids[drafts]
            if q is not None:  # verify reads q over the target's vocabulary
                q = q.new_zeros(*q.shape[:-1], d.target_vocab_size).index_copy_(-1, d.draft_ids, q)
        return Proposal(drafts, q)

    @torch.no_grad()
    def propose_tree(self, pending: torch.Tensor, tree, params, generator: torch.Generator | None) -> Proposal:
        """Medusa's static tree (``medusa_choices``): node i is the ranks[i]-th best token of head depth_i - 1.
        The heads read one hidden state, so a node's token depends on its depth and rank, not on its parent."""
        check_tree_request(self, tree, pending)
        d = self.drafter
        tree = tree.limited(len(d.heads))  # one depth per head
        logits = d.head_logits(self.last_hidden, tree.depth)[0]  # [depth, N]
        tokens, _ = expand_static_tree(
            tree, lambda depth, _, states, __: (states, logits[depth].expand(states.shape[0], -1)), self.last_hidden,
            pending[0],
        )  # fmt: skip
        if d.reduced:
            tokens = d.draft_ids[tokens]
        parents = torch.tensor(tree.parents, device=pending.device)
        return Proposal(tokens[None], None, parents[None])  # deterministic children: q one-hot

    def commit(self, kept_ids: torch.Tensor, target_out: TargetOutputs) -> None:
        self.last_hidden = self.drafter.final_hidden(target_out)[:, -1]


# -- build, load, and the target it belongs to -------------------------------------------------------


def target_fingerprint(target) -> str | None:
    """A hash of the target's parameters (shapes, and 64 evenly spaced values of each, rounded to
    bfloat16 so a float32 and a bfloat16 load of one checkpoint agree). Heads trained on one target
    are refused on another of the same dimensions (a base model and its instruct version). None on
    the meta device, where there are no values. LoRA adapters that Medusa-2 put inside the target
    (peft's ``lora_*`` tensors) are left out: its heads load back on the target they adapted."""
    digest = hashlib.sha256()
    for name, param in target.model.named_parameters():
        if "lora_" in name:
            continue
        if param.device.type == "meta":
            return None
        flat = param.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 64)][:64]
        digest.update(str(tuple(param.shape)).encode())
        digest.update(sample.to(torch.bfloat16).float().cpu().numpy().tobytes())
    return digest.hexdigest()[:32]


def check_heads_target(saved: dict, target, path) -> None:
    """The target's dimensions (``check_same_target``), and its weights: the heads read the target's own
    hidden states, so heads trained on another target of the same dimensions are refused."""
    check_same_target(saved, target, path)
    name = saved["target_config"].get("_name_or_path") or "see its config.json"
    fingerprint = target_fingerprint(target)
    if saved.get("target_fingerprint") and fingerprint and saved["target_fingerprint"] != fingerprint:
        raise SpecdraftError(
            f"the Medusa heads in {path} were trained on another target with the same dimensions (its weights "
            f"differ: fingerprint {saved['target_fingerprint']}, this target's {fingerprint}). Heads read the "
            f"target's own hidden states, so they only work with that target: load {name}"
        )


def build_medusa(target, cfg: MedusaConfig, draft_vocab: DraftVocab | None = None) -> MedusaDrafter:
    """Fresh heads for ``target`` (on the meta device too, for sizing). A reduced draft vocabulary
    (``draft_vocab_size`` < V) comes from the data (``specdraft.data.vocab.build_draft_vocab``)."""
    vocab_size = target.vocab_size
    medusa_needs(cfg, target.config)  # the size checks
    if draft_vocab is not None and (draft_vocab.size != cfg.draft_vocab_size or draft_vocab.t2d.numel() != vocab_size):
        raise SpecdraftError(
            f"the draft vocabulary ({draft_vocab.size} tokens, map over {draft_vocab.t2d.numel()}) does not match "
            f"drafter.draft_vocab_size {cfg.draft_vocab_size} on a target of {vocab_size} tokens"
        )
    if cfg.reduces_vocab(vocab_size) and draft_vocab is None:
        if target.device.type != "meta":
            raise SpecdraftError(
                f"drafter.draft_vocab_size is {cfg.draft_vocab_size}, below the target's {vocab_size} tokens, so the "
                "heads need a draft vocabulary built from the data (build_draft_vocab), or draft_vocab_size: null"
            )
        draft_vocab = DraftVocab.from_target_ids(torch.arange(cfg.draft_vocab_size), vocab_size)  # sizing only
    if draft_vocab is not None and draft_vocab.size == vocab_size:
        draft_vocab = None  # the whole vocabulary: no map
    with torch.device(target.device):
        drafter = MedusaDrafter(target, cfg, draft_vocab)
    target.require(drafter.needs)
    return drafter


def load_medusa(path, target) -> MedusaDrafter:
    saved, tensors = read_drafter_folder(path, "medusa1")
    check_heads_target(saved, target, path)
    cfg = MedusaConfig(**saved["config"])
    vocab = None
    if "d2t" in tensors:
        vocab = DraftVocab(d2t=tensors["d2t"].long().to(target.device), t2d=tensors["t2d"].bool().to(target.device))
    drafter = build_medusa(target, cfg, vocab)
    drafter.load_state_dict(tensors)
    drafter.target_fingerprint = saved.get("target_fingerprint")
    return drafter


def medusa_lr_schedule(optimizer, recipe, total_steps: int):
    """The recipe's schedule, with warmup = ceil(warmup_ratio x total steps) (HF Trainer's
    ``get_warmup_steps``, as the reference trains) unless ``optimizer.warmup_steps`` is set."""
    ratio = recipe.drafter.warmup_ratio
    if ratio is not None and recipe.optimizer.warmup_steps == 0:
        recipe = replace(recipe, optimizer=replace(recipe.optimizer, warmup_steps=math.ceil(ratio * total_steps)))
    return make_scheduler(optimizer, recipe, total_steps)


# -- exports ----------------------------------------------------------------------------------------


def _dims(saved: dict) -> tuple[int, int, int, int, int]:
    """(K heads, L layers, H, V target vocabulary, N draft vocabulary) of a saved drafter."""
    cfg, tc = saved["config"], saved["target_config"]
    return cfg["num_heads"], cfg["num_layers"], tc["hidden_size"], tc["vocab_size"], saved["draft_vocab_size"]


def _check_tensors(tensors: dict, want: set[str], what: str) -> None:
    if set(tensors) != want:
        raise SpecdraftError(
            f"{what}: the tensors do not match the saved config (unexpected {sorted(set(tensors) - want)}, missing "
            f"{sorted(want - set(tensors))}). Export the drafter folder training wrote, unchanged."
        )


def _own_names(saved: dict) -> set[str]:
    K, L, _, V, N = _dims(saved)
    names = {f"heads.{h}.lm_head.weight" for h in range(K)}
    names |= {f"heads.{h}.resblocks.{l}.linear.weight" for h in range(K) for l in range(L)}
    if saved["config"]["resblock_bias"]:
        names |= {f"heads.{h}.resblocks.{l}.linear.bias" for h in range(K) for l in range(L)}
    return names | ({"d2t", "t2d"} if N < V else set())


def to_fasterdecoding(saved: dict, tensors: dict, opts: ExportOptions) -> tuple[dict, dict]:
    """FasterDecoding/Medusa's layout (main at e2a5d20): the heads as ``medusa_head`` holds them.

    Checked against:
      medusa/model/medusa_model.py, medusa_model_legacy.py  MedusaConfig: medusa_num_heads, medusa_num_layers,
        base_model_name_or_path; medusa_head = ModuleList of Sequential(ResBlock x num_layers,
        Linear(H, V, bias=False)), ResBlock.linear = nn.Linear(H, H) with a bias, always. So its state dict
        names are {h}.{l}.linear.weight, {h}.{l}.linear.bias and {h}.{num_layers}.weight, loaded with
        load_state_dict(strict=False). Its ``[ResBlock(H)] * num_layers`` is one module repeated: with
        num_layers > 1 the last layer's tensors overwrite the others at load. TGI (layers/medusa.py) and
        TensorRT-LLM (models/medusa/weight.py) read the same names into distinct layers.
      medusa/train/train_legacy.py  the trainer saves them with safetensors' save_file, whole vocabulary
    The heads cover the whole vocabulary and the ResBlocks always have a bias (zero where trained without).
    """
    K, L, H, V, N = _dims(saved)
    _check_tensors(tensors, _own_names(saved), "the medusa export")
    if N < V:
        raise SpecdraftError(
            f"FasterDecoding's Medusa heads cover the target's whole vocabulary ({V} tokens), and this drafter drafts "
            f"over {N}. Export --format vllm (truncated_vocab_size + token_map), or retrain with draft_vocab_size: null."
        )
    if not opts.verifier:
        raise SpecdraftError("the medusa config names the base model (base_model_name_or_path): pass --target")
    out = {}
    for h in range(K):
        for layer in range(L):
            weight = tensors[f"heads.{h}.resblocks.{layer}.linear.weight"]
            out[f"{h}.{layer}.linear.weight"] = weight
            out[f"{h}.{layer}.linear.bias"] = tensors.get(f"heads.{h}.resblocks.{layer}.linear.bias",
                                                          weight.new_zeros(H))
        out[f"{h}.{L}.weight"] = tensors[f"heads.{h}.lm_head.weight"]
    config = {"medusa_num_heads": K, "medusa_num_layers": L, "base_model_name_or_path": opts.verifier}
    return config, out


def _own_heads(saved: dict, tensors: dict, resblock, lm_head) -> dict:
    """An engine's head tensors under specdraft's names: ``resblock(h, layer)`` names a ResBlock Linear
    (its .weight and .bias) and ``lm_head(h)`` a head's LM-head weight in the engine's layout."""
    K, L, _, _, _ = _dims(saved)
    out = {}
    for h in range(K):
        for layer in range(L):
            out[f"heads.{h}.resblocks.{layer}.linear.weight"] = tensors[f"{resblock(h, layer)}.weight"]
            if saved["config"]["resblock_bias"]:
                out[f"heads.{h}.resblocks.{layer}.linear.bias"] = tensors[f"{resblock(h, layer)}.bias"]
        out[f"heads.{h}.lm_head.weight"] = tensors[lm_head(h)]
    return out


def from_fasterdecoding(saved: dict, tensors: dict) -> dict:
    _, L, _, _, _ = _dims(saved)
    return _own_heads(saved, tensors, lambda h, layer: f"{h}.{layer}.linear", lambda h: f"{h}.{L}.weight")


def to_vllm(saved: dict, tensors: dict, opts: ExportOptions) -> tuple[dict, dict]:
    """vLLM's Medusa model (vllm-project/vllm at 09cddad).

    Checked against:
      vllm/transformers_utils/configs/medusa.py  MedusaConfig, model_type "medusa": hidden_size (default 4096),
        vocab_size (default 32001), num_heads, num_hidden_layers, truncated_vocab_size (None -> vocab_size);
        from_pretrained renames any key holding "num" and "heads" to num_heads, "num" and "layers" to
        num_hidden_layers (so FasterDecoding's medusa_num_* config keys read, its tensor names do not);
        the num_lookahead_tokens setter sets num_heads = num_speculative_tokens
      vllm/model_executor/models/medusa.py  blocks.{h}.layers.{l} = Linear(H, H, bias=medusa_fc_bias, default
        False); lm_heads.{h} = ParallelLMHead(truncated_vocab_size, H), or one lm_head when original_lm_head;
        load_weights strips "medusa_heads.", drops names it has no parameter for without a word (so without
        medusa_fc_bias the trained biases vanish), loads token_map only when truncated_vocab_size < vocab_size,
        slices lm_heads rows by it, and asserts truncated_vocab_size == vocab_size or a token_map;
        compute_logits scatters each head's truncated logits to token_map's ids, -inf elsewhere
      vllm/v1/spec_decode/medusa.py  MedusaProposer: each head's argmax (top-1) is its draft
      vllm/config/speculative.py  method "medusa" from the draft config's model_type
    """
    K, L, H, V, N = _dims(saved)
    if N < V and "d2t" not in tensors:
        raise SpecdraftError(
            f"this drafter drafts over {N} of the target's {V} tokens but carries no vocabulary map (d2t), so the "
            "export would have no token_map, and vLLM refuses truncated_vocab_size < vocab_size without one. Export "
            "the drafter folder training wrote, which holds the map."
        )
    _check_tensors(tensors, _own_names(saved), "the vllm export")
    bias = saved["config"]["resblock_bias"]
    out = {}
    for h in range(K):
        for layer in range(L):
            out[f"blocks.{h}.layers.{layer}.weight"] = tensors[f"heads.{h}.resblocks.{layer}.linear.weight"]
            if bias:
                out[f"blocks.{h}.layers.{layer}.bias"] = tensors[f"heads.{h}.resblocks.{layer}.linear.bias"]
        out[f"lm_heads.{h}.weight"] = tensors[f"heads.{h}.lm_head.weight"]
    if N < V:
        out["token_map"] = torch.arange(N) + tensors["d2t"].long()  # the target id of each draft id
    dtype = export_dtype(saved, tensors)
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": H,
        "vocab_size": V,
        "num_heads": K,
        "num_hidden_layers": L,
        "truncated_vocab_size": N,
        "medusa_fc_bias": bias,  # vLLM's default is False, which would drop the trained biases silently
        "original_lm_head": False,  # each head has its own LM head
        "torch_dtype": dtype,
        "dtype": dtype,  # transformers 5's name for torch_dtype
    }
    return config, out


def from_vllm(saved: dict, tensors: dict) -> dict:
    _, _, _, V, N = _dims(saved)
    if N < V and "token_map" not in tensors:
        raise SpecdraftError(
            f"this vLLM Medusa export has truncated_vocab_size {N} < vocab_size {V} and no token_map, which vLLM "
            "refuses: export it again"
        )
    out = _own_heads(saved, tensors, lambda h, layer: f"blocks.{h}.layers.{layer}", lambda h: f"lm_heads.{h}.weight")
    if N < V:
        vocab = DraftVocab.from_target_ids(tensors["token_map"], V)
        out.update(d2t=vocab.d2t, t2d=vocab.t2d)
    return out


def _copy(saved: dict, tensors: dict, opts: ExportOptions) -> tuple[dict, dict]:
    return saved, tensors


NO_SGLANG = "(SGLang has no Medusa support: its SpeculativeAlgorithm has no MEDUSA.)"
MEDUSA_EXPORTERS = {
    # FasterDecoding/Medusa, TGI (server/text_generation_server/models/__init__.py) and TensorRT-LLM
    # (models/medusa/weight.py) all open medusa_lm_head.safetensors in the folder.
    "medusa": Exporter(
        to_fasterdecoding, from_fasterdecoding,
        "FasterDecoding/Medusa, TGI and TensorRT-LLM read {out} (medusa_lm_head.safetensors, config.json) with "
        "TARGET as the base model. " + NO_SGLANG,
        weights_file="medusa_lm_head.safetensors"),
    "vllm": Exporter(
        to_vllm, from_vllm,
        "vllm serve TARGET --speculative-config '{\"method\": \"medusa\", \"model\": \"{out}\", "
        "\"num_speculative_tokens\": {k}}' (num_heads in {out}/config.json: vLLM builds as many "
        "heads as num_speculative_tokens, and drafts each head's top-1). " + NO_SGLANG,
        draft_length=lambda saved, opts: saved["config"]["num_heads"]),
    "hf": Exporter(_copy, lambda saved, tensors: tensors,
                   "specdraft eval --target TARGET --drafter {out} " + NO_SGLANG),
}

MEDUSA1 = Family(name="medusa1", config_cls=MedusaConfig, needs=medusa_needs, build=build_medusa, load=load_medusa,
                 exporters=MEDUSA_EXPORTERS, needs_draft_vocab=True,
                 compile_refusal="its heads run over the counted rows only (masks.counted_rows: a host read, and a "
                                 "new shape every step)",
                 selftest_settings={"num_heads": 3, "num_layers": 1})
