"""IBM's MLP speculator (Wertheimer et al. 2024, arXiv 2404.19124; fms-extras ``MLPSpeculator``,
trained as in fms-fsdp's ``speculator/train_speculator*.py``).

A chain of n_predict small MLP heads on top of the target's final hidden state h_t (the LM-head
input, which predicts token t+1). Head i reads the state the previous head left and the token
before the one it predicts, and predicts one token further ahead:

    s_0     = h_t                                   (scale_input: s_0 = RMSNorm(h_t) / sqrt(2))
    s_{i+1} = GELU(LN_i(proj_i(s_i) + (emb_weight / state_weight) * emb_i(x_{t+i+1})))
    p_i     = softmax(head_i(s_{i+1}))              head i's distribution over token x_{t+i+2}

    state_weight = 0.5 ** (0.5 / n_predict)          so that s_0 is about half of the final
    emb_weight   = sqrt((1 - state_weight**2) * inner_dim / 2)   state's magnitude (fms-extras)

LN_i is fms's ``LayerNormParameterized(elementwise_scale=True, elementwise_shift=True)``: an RMS
norm (no mean subtraction) with a learned weight *and* bias, eps 1e-6. ``proj_0`` maps the target
width (emb_dim) to inner_dim; the others are inner -> inner; none has a bias. ``tie_weights``
shares emb, head and LN across heads and proj_2.. with proj_1 (fms-extras' tying).

Training (fms-fsdp): the input token of head i is the true token x_{t+i+1} and its label is
x_{t+i+2}; the loss is the sum over heads of each head's mean cross-entropy (weights
configurable, fms-fsdp's are all 1).
  stage 1  the training data, with the target's hidden states over it (labels: the answer tokens);
  stage 2  after ``stage2_start_step`` optimizer steps: prompts cut from the data, continued by the
           target itself (temperature 1, top-k 10, KV-cached, batched); the heads learn the target's
           own tokens, reading its states from the last prompt position on. fms-fsdp cuts every head to
           the same S - n_predict states; here each head counts every label the sequence has.
AdamW with fms-fsdp's betas (0.9, 0.95), weight decay 0.1 (the loop decays matrices only; fms-fsdp
also decays the LN weights), gradient-norm clipping at 1.0, and fms-fsdp's learning-rate schedule:
warmup, cosine to 10% at the switch, a re-warmup to 10% and cosine to 1% (``two_stage_lr_factor``).
Both stages run in one ``specdraft train``, and a resume across the switch is exact.
Decoding: a chain, head by head. Head i's token is drawn from q_i = its distribution warped like
the target's p (same temperature, top-k, top-p) over the target's vocabulary, and that q_i is what
the decoder verifies against, so speculative sampling stays exact. Static trees
(``specdraft.decoding.trees``) draft each depth from its parent's state and token; fms-extras'
candidate-tree fields (top_k_tokens_per_head) are exported for engines that read them.

Saved and exported names are fms-extras' Hugging Face names (``MLPSpeculatorPreTrainedModel`` keeps
the network as ``self.speculator``): ``speculator.emb.{i}.weight``, ``speculator.proj.{i}.weight``,
``speculator.head.{i}.weight``, ``speculator.ln.{i}.weight`` and ``speculator.ln.{i}.bias``. The
drafter holds its network under the same attribute, so its state_dict already has those names.

Exports: ``hf`` and ``vllm`` are the drafter folder itself, fms-extras' Hugging Face layout
(``MLPSpeculatorConfig``), which vLLM reads; vLLM's V1 engine does not route ``mlp_speculator`` (vLLM
issue #47825), and the serve hint says that too. Tests re-implement vLLM's parsing and weight mapping
and check identical head logits.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from functools import partial
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from transformers import DynamicCache

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
from ..decoding.sampling import SamplingParams, draw_drafts, logits_to_probs, sample
from ..decoding.trees import check_tree_request, expand_static_tree
from ..errors import SpecdraftError
from ..losses import DRAFTER_LOSSES, check_drafter_loss, masked_mean
from ..masks import counted_rows, rows_at, shift_left
from ..optim import make_scheduler, recipe_optimization
from ..target import FrozenTarget
from .folder import read_drafter_folder, write_drafter_folder

FAMILY = "mlp_speculator"
HF_ARCHITECTURE = "MLPSpeculatorPreTrainedModel"  # fms-extras models/hf/modeling_mlp_speculator.py; vLLM's registry key
NORM_EPS = 1e-6  # fms LayerNormParameterized's default, and vLLM's MLPSpeculatorLayerNorm's
FMS_TOP_K_PER_HEAD = (5, 4, 3)  # fms-extras MLPSpeculatorConfig's default top_k_tokens_per_head
# fms-fsdp stage 2 (speculator/train_speculator_utils.py generate(), config/training.py): prompts of
# 64 tokens, 256 new tokens, sampled at temperature 1 with top-k 10. fms-fsdp cuts stage2_batch_size /
# batch_size prompts (48 by default) from each 4096-token pretraining row; chat rows are shorter, so the
# default here is one per row.
FMS_STAGE2 = {"stage2_prompt_length": 64, "stage2_new_tokens": 256, "stage2_prompts_per_row": 1,
              "stage2_temperature": 1.0, "stage2_top_k": 10}
STAGE2_FIELDS = tuple(FMS_STAGE2)


@dataclass
class MLPSpeculatorConfig:
    """The recipe's ``drafter:`` section for ``family: mlp_speculator``.

    Architecture defaults are fms-extras' ``MLPSpeculator``'s (inner_dim 0 = the target's width,
    no tying, no input scaling); fms-fsdp's training script turns tying and scaling on for its
    large speculators, and recipes may too.
    """

    n_predict: int = 3  # heads = tokens drafted per step
    inner_dim: int = 0  # the heads' width; 0 = the target's hidden size (fms-extras' convention)
    tie_weights: bool = False
    scale_input: bool = False
    head_weights: list[float] | None = None  # loss weight per head; None = all 1 (fms-fsdp's plain sum)
    # Exported for engines that build candidate trees (fms-extras' generate_suffixes). None: fms-extras'
    # default [5, 4, 3], cut to n_predict or continued with 3s. specdraft's decoder drafts one chain.
    top_k_tokens_per_head: list[int] | None = None
    n_candidates: int = 5  # fms-extras' default: candidate sequences kept from the tree
    # Stage 2 (fms-fsdp): after stage2_start_step optimizer steps, the heads train on the target's own
    # continuations of prompts cut from the data. None = stage 1 only. The other stage-2 settings
    # default to FMS_STAGE2 (fms-fsdp's values) and need a start step.
    stage2_start_step: int | None = None
    stage2_prompt_length: int | None = None  # tokens of each prompt (windows of one document)
    stage2_new_tokens: int | None = None  # tokens the target generates per prompt
    stage2_prompts_per_row: int | None = None  # prompts cut from each batch row, at most (fms: batch growth)
    stage2_temperature: float | None = None
    stage2_top_k: int | None = None
    # Each head's loss (losses.DRAFTER_LOSSES): ce on the data's (stage 2: the target's sampled) tokens, fms-fsdp's;
    # tvd, lk_alpha or lk_hybrid against the target's distribution there (the target then computes its logits).
    loss: str = "ce"

    # fms-fsdp speculator/train_speculator.py: AdamW betas (0.9, 0.95), weight decay 0.1, gradient-norm
    # clipping at 1.0 (config grad_clip_thresh), lr 1e-3 (scripts/train_speculator.sh), cosine to 10%.
    optimizer_defaults: ClassVar[dict] = {
        "lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1, "min_lr_ratio": 0.1, "max_grad_norm": 1.0,
        "clip_grad_value": None,
    }

    def __post_init__(self):
        if isinstance(self.n_predict, bool) or not isinstance(self.n_predict, int) or self.n_predict < 1:
            raise SpecdraftError(f"drafter.n_predict must be an integer >= 1 (heads, tokens drafted per step), "
                                 f"got {self.n_predict!r}; fms-extras uses 3 to 5")
        if self.tie_weights and self.n_predict == 1:
            raise SpecdraftError("drafter.tie_weights shares weights between heads, but n_predict is 1 (one head): "
                                 "set tie_weights: false, or n_predict >= 2")
        if self.inner_dim < 0:
            raise SpecdraftError(f"drafter.inner_dim must be >= 0 (0 = the target's hidden size), got {self.inner_dim}")
        weights = self.head_weights
        if weights is not None and (len(weights) != self.n_predict or min(weights) < 0 or max(weights) <= 0):
            raise SpecdraftError(f"drafter.head_weights needs one weight >= 0 per head ({self.n_predict}), not all 0; "
                                 f"got {weights}")
        top_k = self.tree_top_k
        if len(top_k) != self.n_predict or any(k < 1 for k in top_k):
            raise SpecdraftError(f"drafter.top_k_tokens_per_head needs one integer >= 1 per head ({self.n_predict}), "
                                 f"got {self.top_k_tokens_per_head}")
        if not 1 <= self.n_candidates <= math.prod(top_k):
            raise SpecdraftError(f"drafter.n_candidates must be between 1 and the tree's {math.prod(top_k)} "
                                 f"candidates (the product of top_k_tokens_per_head {top_k}), got {self.n_candidates}")
        check_drafter_loss(self.loss)
        given = [name for name in STAGE2_FIELDS if getattr(self, name) is not None]
        if self.stage2_start_step is None and given:
            raise SpecdraftError(
                f"drafter.{given[0]} is a stage-2 setting, but drafter.stage2_start_step is not set, so stage 2 never "
                "starts: set stage2_start_step (the optimizer steps of stage 1), or remove the stage-2 settings")
        if self.stage2_start_step is not None:
            s = self.stage2
            if self.stage2_start_step < 0:
                raise SpecdraftError(f"drafter.stage2_start_step must be >= 0, got {self.stage2_start_step}")
            for name in ("stage2_prompt_length", "stage2_new_tokens", "stage2_prompts_per_row"):
                if s[name] < 1:
                    raise SpecdraftError(f"drafter.{name} must be >= 1, got {s[name]}")
            if s["stage2_new_tokens"] <= self.n_predict:
                raise SpecdraftError(
                    f"drafter.stage2_new_tokens ({s['stage2_new_tokens']}) leaves head {self.n_predict - 1} no generated "
                    f"label: generate more than n_predict ({self.n_predict}) tokens")
            if not s["stage2_temperature"] > 0 or s["stage2_top_k"] < 0:
                raise SpecdraftError("drafter.stage2_temperature must be > 0 (the target samples) and stage2_top_k "
                                     ">= 0 (0 = off)")

    @property
    def tree_top_k(self) -> list[int]:
        if self.top_k_tokens_per_head is not None:
            return list(self.top_k_tokens_per_head)
        return [FMS_TOP_K_PER_HEAD[min(i, 2)] for i in range(self.n_predict)]

    @property
    def weights(self) -> list[float]:
        return list(self.head_weights) if self.head_weights is not None else [1.0] * self.n_predict

    @property
    def stage2(self) -> dict:
        """The stage-2 settings, fms-fsdp's where the recipe gives none."""
        return {name: FMS_STAGE2[name] if getattr(self, name) is None else getattr(self, name)
                for name in STAGE2_FIELDS}

    def stage_at(self, steps_done: int) -> int:
        """1 or 2: the stage of the optimizer step after ``steps_done`` steps (fms-fsdp: steps
        1..stage2_start_step are stage 1)."""
        return 2 if self.stage2_start_step is not None and steps_done >= self.stage2_start_step else 1


# -- the network ------------------------------------------------------------------------------------


class SpeculatorNorm(nn.Module):
    """fms ``LayerNormParameterized`` without mean subtraction: x / sqrt(mean(x^2) + eps), then
    ``weight * x + bias`` when ``learned`` (the heads' LN) or nothing more (``scale_input``'s norm)."""

    def __init__(self, dim: int, learned: bool = True, eps: float = NORM_EPS):
        super().__init__()
        self.eps, self.learned = eps, learned
        if learned:
            self.weight = nn.Parameter(torch.ones(dim))
            self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.weight + self.bias if self.learned else x


class SpeculatorHeads(nn.Module):
    """The network itself, with fms-extras' parameter names (emb, proj, head, ln)."""

    def __init__(self, emb_dim: int, inner_dim: int, vocab_size: int, n_predict: int, tie_weights: bool,
                 scale_input: bool):
        super().__init__()
        self.n_predict, self.emb_dim, self.inner_dim, self.vocab_size = n_predict, emb_dim, inner_dim, vocab_size
        self.emb = nn.ModuleList([nn.Embedding(vocab_size, inner_dim) for _ in range(n_predict)])
        self.proj = nn.ModuleList([nn.Linear(emb_dim if i == 0 else inner_dim, inner_dim, bias=False)
                                   for i in range(n_predict)])
        self.head = nn.ModuleList([nn.Linear(inner_dim, vocab_size, bias=False) for _ in range(n_predict)])
        self.ln = nn.ModuleList([SpeculatorNorm(inner_dim) for _ in range(n_predict)])
        self.ln0 = SpeculatorNorm(emb_dim, learned=False) if scale_input else None  # no parameters
        self.state_weight = 0.5 ** (0.5 / n_predict)
        self.emb_weight = math.sqrt((1 - self.state_weight**2) * (inner_dim / 2))
        if tie_weights:
            for i in range(1, n_predict):
                self.emb[i].weight = self.emb[0].weight
                self.head[i].weight = self.head[0].weight
                self.ln[i].weight, self.ln[i].bias = self.ln[0].weight, self.ln[0].bias
                if i >= 2:  # proj_0 reads the target's width, so proj_1 is the first one that can be shared
                    self.proj[i].weight = self.proj[1].weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """fms-extras ``reset_parameters``: embeddings and linears N(0, 1/sqrt(inner_dim)); LN 1 and 0."""
        std = 1 / math.sqrt(self.inner_dim)
        for module in self.modules():
            if isinstance(module, (nn.Embedding, nn.Linear)):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, SpeculatorNorm) and module.learned:
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def input_state(self, hidden: torch.Tensor) -> torch.Tensor:
        """s_0 from the target's final hidden state, in the heads' dtype."""
        state = hidden.to(self.proj[0].weight.dtype)
        return self.ln0(state) / math.sqrt(2) if self.ln0 is not None else state

    def advance(self, i: int, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Head i's state: (s_i [..., D], x [...]) -> s_{i+1} [..., inner]."""
        mixed = self.proj[i](state) + (self.emb_weight / self.state_weight) * self.emb[i](tokens)
        return F.gelu(self.ln[i](mixed))

    def step(self, i: int, state: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Head i: (s_i [..., D], x [...]) -> (s_{i+1} [..., inner], logits [..., V])."""
        state = self.advance(i, state, tokens)
        return state, self.head[i](state)

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced logits of every head at every position: head i at t reads x_{t+i+1}
        (zero past the end; those positions are never counted) and predicts x_{t+i+2}."""
        state, logits = self.input_state(hidden), []
        for i in range(self.n_predict):
            state, head_logits = self.step(i, state, shift_left(ids, i + 1))
            logits.append(head_logits)
        return logits

    def forward_at(self, hidden: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor,
                   head_rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """``forward``'s logits where they are counted only: the states run at ``rows`` (flat ``b * T + t``
        indices: a position's states read nothing of the others), and head i's vocabulary projection at
        ``head_rows[i]`` (indices into ``rows``): [len(head_rows[i]), V] per head."""
        state, logits = self.input_state(hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)), []
        for i in range(self.n_predict):
            state = self.advance(i, state, shift_left(ids, i + 1).reshape(-1).index_select(0, rows))
            logits.append(self.head[i](state.index_select(0, head_rows[i])))
        return logits


# -- the loss (pure functions) -----------------------------------------------------------------------


def head_masks(state_ok: torch.Tensor, label_ok: torch.Tensor, n_predict: int,
               seq_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Where head i is trained: state t counted (``state_ok[t]``), label t+i+2 counted and inside
    the sequence (``label_ok[t+i+2]``), and with packing both in the same document (documents are
    contiguous, so the input tokens between them are too). Each [B, T] bool."""
    masks = []
    for i in range(n_predict):
        mask = state_ok.bool() & shift_left(label_ok.bool(), i + 2, fill=False)
        if seq_ids is not None:
            mask = mask & (seq_ids == shift_left(seq_ids, i + 2, fill=-1))
        masks.append(mask)
    return masks


def per_head_cross_entropy(logits: list[torch.Tensor], ids: torch.Tensor, masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """CE_i = mean over head i's counted positions t of -log p_i(x_{t+i+2}) (fms-fsdp's
    CrossEntropyLoss on head i's predictions against input[:, i+2:]), over dense [B, T, V] logits: the
    reference ``compute_loss``'s counted-rows form equals."""
    losses = []
    for i, (head_logits, mask) in enumerate(zip(logits, masks)):
        labels = shift_left(ids, i + 2)
        nll = F.cross_entropy(head_logits.float().flatten(0, -2), labels.flatten(), reduction="none")
        losses.append(masked_mean(nll.view_as(labels), mask))
    return losses


def target_logits_of(target_out: TargetOutputs) -> torch.Tensor:
    """The target's next-token logits [B, T, V] (position t: of token t+1), for an acceptance-aimed loss."""
    if target_out.logits is None or target_out.last_only:
        raise SpecdraftError("drafter.loss other than ce compares each head with the target's distribution, and these "
                             "target outputs have no logits at every position: make the example with drafter.prepare "
                             "(it asks for them), or rebuild the feature cache for this recipe")
    return target_out.logits


def per_head_soft_loss(logits: list[torch.Tensor], target_probs: torch.Tensor, masks: list[torch.Tensor],
                       loss) -> list[torch.Tensor]:
    """Head i at t against the target's distribution of token t+i+2 (its logits at t+i+1), by ``loss``
    (losses.DRAFTER_LOSSES): what an acceptance-aimed ``drafter.loss`` trains on, in place of the label's CE; over
    dense logits, the reference ``compute_loss``'s counted-rows form equals."""
    return [loss(head_logits, F.pad(target_probs[:, i + 1 :], (0, 0, 0, i + 1)), mask)
            for i, (head_logits, mask) in enumerate(zip(logits, masks))]


def speculator_loss(per_head: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """L = sum_i w_i CE_i (fms-fsdp: w_i = 1)."""
    return sum(w * loss for w, loss in zip(weights, per_head))


# -- training examples ------------------------------------------------------------------------------------
# Stage 1 trains on a data batch with the target's outputs over it. Stage 2 makes its own batch: the
# generated sequences, with ``loss_mask`` on the generated tokens and ``state_mask`` on the states the
# heads read (from the last prompt position on); the target outputs hold their hidden states.


def final_hidden_of(target_out: TargetOutputs) -> torch.Tensor:
    if target_out.final_hidden is None:
        raise SpecdraftError(
            "the MLP speculator reads the target's final hidden state (the LM-head input), and these target outputs "
            "have none: build or load the drafter on the target (it calls target.require(needs)), or rebuild the "
            "feature cache for this recipe")
    return target_out.final_hidden


def cut_prompts(batch: dict[str, torch.Tensor], length: int, per_row: int) -> torch.Tensor:
    """[N, length] prompts that end inside answers, so the target continues an assistant turn (not the user's).

    An answer is a run of ``loss_mask`` tokens. Its first prompt is the ``length`` real tokens of its document
    before its first token, or, where the document has fewer before it, before the first of its tokens that has
    ``length`` (the prompt then holds the answer's start); later prompts end ``length``, ``2 length``, ... tokens
    further into the answer. The first ``per_row`` of each row are taken. fms-fsdp reshapes each row's first
    per_row * length tokens: on its pretraining text any window will do, but on chat rows those are the system
    and user turns. On text data (``loss_mask`` on every real token) the prompts are windows one after another, as
    fms-fsdp's, each followed by more of its document."""
    ids, real = batch["input_ids"], batch["attention_mask"].bool()
    B, T = ids.shape
    answer = real & batch["loss_mask"].bool()
    docs = batch["seq_ids"] if "seq_ids" in batch else torch.zeros_like(ids)
    position = torch.arange(T, device=ids.device).expand(B, T)
    # where each stretch of real tokens of one document starts
    breaks = ~real | (docs != F.pad(docs, (1, 0), value=-1)[:, :-1])
    stretch_start = torch.where(breaks, position, 0).cummax(1).values
    # e ends a prompt (the first generated token takes position e): e is answer text with `length` tokens before it
    fits = answer & (position - stretch_start >= length)
    first = fits & ~F.pad(fits, (1, 0), value=False)[:, :-1]  # an answer's first such e
    answer_first = torch.where(first, position, 0).cummax(1).values
    ends = fits & ((position - answer_first) % length == 0)
    ends = ends & (ends.cumsum(1) <= per_row)
    rows, end = ends.nonzero(as_tuple=True)
    if rows.numel() == 0:
        longest = int(real.sum(1).max())
        raise SpecdraftError(
            f"stage 2 found no prompt of drafter.stage2_prompt_length={length} tokens before answer text (loss_mask) "
            f"in this micro-batch (its longest sample has {longest} tokens): lower stage2_prompt_length below the "
            "tokens your samples have before and into their answers")
    return ids[rows[:, None], end[:, None] - length + torch.arange(length, device=ids.device)]


@torch.no_grad()
def sample_continuations(target, prompts: torch.Tensor, new_tokens: int, params,
                         keep_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The target continues ``prompts`` [N, P] by ``new_tokens`` sampled tokens, batched and KV-cached.

    Returns ids [N, P + S], the target's final hidden state at every position but the last
    [N, P + S - 1, H] (the last token is never run through the target; nothing is predicted from
    it), and with ``keep_logits`` its (unwarped) logits at positions P - 1 .. P + S - 2 [N, S, V], the
    distributions the generated tokens were drawn from (else None). Draws use torch's global RNG, which
    checkpoints restore: a resumed run generates the same.
    """
    # lazy: keeps the drafters importable without the decoder


    cache = DynamicCache(config=target.config)
    out = target(prompts, past_key_values=cache, use_cache=True, logits="last")
    hidden, tokens, logits = [final_hidden_of(out)], [], []
    for step in range(new_tokens):
        if keep_logits:
            logits.append(out.logits[:, -1:])
        probs = logits_to_probs(out.logits[:, -1], params)  # warped as the target's p is when decoding
        tokens.append(sample(probs)[:, None])
        if step + 1 < new_tokens:
            out = target(tokens[-1], past_key_values=cache, use_cache=True, logits="last")
            hidden.append(final_hidden_of(out))
    return torch.cat([prompts, *tokens], dim=1), torch.cat(hidden, dim=1), torch.cat(logits, 1) if logits else None


def mlp_speculator_needs(cfg: MLPSpeculatorConfig, target_config) -> TargetNeeds:
    """The final hidden state, and no logits with ``loss: ce`` (the heads learn the data's, or the target's
    sampled, tokens); an acceptance-aimed loss compares with the target's distribution: the full logits. Checked here, before any weight loads: a stage-2 prompt plus its continuation must fit
    the target's context."""
    if cfg.stage2_start_step is not None:
        s = cfg.stage2
        total = s["stage2_prompt_length"] + s["stage2_new_tokens"]
        context = getattr(target_config, "max_position_embeddings", None)
        if context is not None and total > context:
            raise SpecdraftError(
                f"stage 2 generates sequences of stage2_prompt_length + stage2_new_tokens = {s['stage2_prompt_length']} "
                f"+ {s['stage2_new_tokens']} = {total} tokens, longer than the target's context of {context} "
                "(max_position_embeddings): lower drafter.stage2_new_tokens or drafter.stage2_prompt_length")
    return TargetNeeds(logits="none" if cfg.loss == "ce" else "full", final_hidden=True)


def stage2_batch(target, batch: dict[str, torch.Tensor], cfg: MLPSpeculatorConfig) -> tuple[dict, TargetOutputs]:
    """Prompts cut from ``batch``, continued by the target: (the new batch, the target's outputs over it: its
    hidden states [N, T, H], and its logits [N, T, V] where ``loss`` compares with its distribution).

    fms-fsdp stage 2: the heads read the states from the last prompt position on (the one that
    predicted the first generated token), so every input token and label is the target's own. Unlike
    fms-fsdp (pretraining text, no end), labels stop at the first end-of-sequence token the target emits."""
    s = cfg.stage2
    P = s["stage2_prompt_length"]
    prompts = cut_prompts(batch, P, s["stage2_prompts_per_row"])
    params = SamplingParams(temperature=float(s["stage2_temperature"]), top_k=s["stage2_top_k"])
    ids, hidden, logits = sample_continuations(target, prompts, s["stage2_new_tokens"], params,
                                               keep_logits=cfg.loss != "ce")
    hidden = F.pad(hidden, (0, 0, 0, 1))  # the last position's state: no label, never counted
    if logits is not None:  # at every position, as a teacher-forced forward gives them (the prompt's never read)
        logits = F.pad(logits, (0, 0, P - 1, 1))
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    # The answer ends at the target's first end-of-sequence token: it is a label, nothing after it is.
    stop = torch.isin(ids, torch.tensor(target.stop_token_ids(), dtype=ids.dtype, device=ids.device)) & (positions >= P)
    first_stop = torch.where(stop, positions, ids.shape[1]).amin(1, keepdim=True)
    generated = batch_of(ids, loss_mask=(positions >= P) & (positions <= first_stop),
                         state_mask=(positions >= P - 1) & (positions < first_stop))
    return generated, TargetOutputs(logits=logits, final_hidden=hidden)


def batch_of(ids: torch.Tensor, loss_mask: torch.Tensor, state_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    ones = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": ones, "loss_mask": loss_mask.long(), "state_mask": state_mask.long()}


# -- the learning rate: fms-fsdp's two stages ------------------------------------------------------------


def two_stage_lr_factor(step: int, total_steps: int, stage2_start: int, warmup_steps: int, floor: float) -> float:
    """fms-fsdp speculator/train_speculator.py's schedule, as a factor of the peak lr, after ``step``
    optimizer steps (the factor the next step uses), with ``floor`` = 0.1 there:

      stage 1 (step <= S1):  min(warm(step, w1), floor + (1 - floor) (1 + cos(pi step / S1)) / 2)
      stage 2 (x = step - S1, over S2 = total - S1): a re-warmup to floor, then cosine to floor^2:
                             min(floor warm(x, w2), floor^2 + (floor - floor^2) (1 + cos(pi min(x, S2) / S2)) / 2)

    warm(x, w) = 1 - (1 - min(x, w) / w)^2 (fms-fsdp's parabolic warmup; 1 when w = 0). w1 is the
    recipe's warmup_steps (fms-fsdp: min(2000, S1 / 20)); w2 = min(w1, S2 / 20), as fms-fsdp's min(2000, S2 / 20).
    """
    def warm(x: int, w: int) -> float:
        return 1.0 if w <= 0 else 1 - (1 - min(x, w) / w) ** 2

    s1, s2 = max(stage2_start, 1), max(total_steps - stage2_start, 1)
    if step <= stage2_start:
        return min(warm(step, warmup_steps), floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * step / s1)))
    x = step - stage2_start
    w2 = min(warmup_steps, s2 // 20)
    return min(floor * warm(x, w2), floor**2 + (floor - floor**2) * 0.5 * (1 + math.cos(math.pi * min(x, s2) / s2)))


def make_lr_schedule(optimizer, recipe, total_steps: int):
    """With a stage 2: fms-fsdp's two-stage schedule (re-warmup at the switch); else the recipe's own."""
    cfg, o = recipe.drafter, recipe.optimizer
    if cfg.stage2_start_step is None:
        return make_scheduler(optimizer, recipe, total_steps)
    if o.schedule != "cosine":
        raise SpecdraftError(f"optimizer.schedule is {o.schedule!r}, but an MLP speculator with a stage 2 follows "
                             "fms-fsdp's two-stage cosine (a re-warmup at the switch): set optimizer.schedule: cosine")
    return LambdaLR(optimizer, lambda step: two_stage_lr_factor(step, total_steps, cfg.stage2_start_step,
                                                                 o.warmup_steps, o.min_lr_ratio))


# -- the drafter ---------------------------------------------------------------------------------------


class MLPSpeculator(nn.Module):
    family = FAMILY

    def __init__(self, target: FrozenTarget, cfg: MLPSpeculatorConfig):
        """``target`` exposes its final hidden state: a FrozenTarget refuses a model without one."""
        super().__init__()
        self.needs = mlp_speculator_needs(cfg, target.config)
        self.config = cfg
        self.target_name = getattr(target.config, "_name_or_path", None) or None
        self.speculator = SpeculatorHeads(target.hidden_size, cfg.inner_dim or target.hidden_size, target.vocab_size,
                                          cfg.n_predict, cfg.tie_weights, cfg.scale_input)

    # -- training --------------------------------------------------------------------------------
    def trained_module(self) -> nn.Module:
        return self  # the heads (self.speculator); its state_dict names are fms-extras' HF names

    def configure_optimizers(self, recipe, total_steps: int) -> Optimization:
        return replace(recipe_optimization(self, recipe, total_steps),
                       schedule=partial(make_lr_schedule, recipe=recipe, total_steps=total_steps))

    def prepare(self, batch: dict[str, torch.Tensor], context: TrainingContext) -> Example:
        """Stage 1: the target's hidden states over the data (or the feature cache). Stage 2 (training
        steps after stage2_start_step; held-out batches stay on stage 1): sequences the target samples."""
        if context.training and self.config.stage_at(context.step) == 2:
            return Example(*stage2_batch(context.target, batch, self.config))
        return target_example(batch, context, self.needs)

    def compute_loss(self, batch: dict[str, torch.Tensor], target_out: TargetOutputs) -> LossOutput:
        """Head i at position t reads state t and token t+i+1 and predicts token t+i+2: counted where
        state t is (``state_mask``, default the real tokens) and the label is (``loss_mask``)."""
        ids, real = batch["input_ids"], batch["attention_mask"].bool()
        state_ok = batch["state_mask"].bool() if "state_mask" in batch else real
        masks = head_masks(state_ok, real & batch["loss_mask"].bool(), self.config.n_predict, batch.get("seq_ids"))
        # The heads run only where one of them counts, and each vocabulary projection and loss only where its
        # head counts (the same loss as per_head_cross_entropy / per_head_soft_loss over every position).
        B, T = ids.shape
        anywhere = torch.stack(masks).any(0)
        rows, *counted = counted_rows([anywhere, *masks], T)  # one host sync
        rank = anywhere.reshape(-1).long().cumsum(0) - 1  # a counted position's row in `rows`
        logits = self.speculator.forward_at(final_hidden_of(target_out), ids, rows, [rank[i] for i in counted])
        labels = [ids.reshape(-1)[index + i + 2] for i, index in enumerate(counted)]  # never past a row's end
        every = [torch.ones(index.shape, dtype=torch.bool, device=ids.device) for index in counted]
        if self.config.loss == "ce":
            per_head = [masked_mean(F.cross_entropy(head_logits.float(), label, reduction="none"), ones)
                        for head_logits, label, ones in zip(logits, labels, every)]
        else:
            teacher = target_logits_of(target_out)
            per_head = [DRAFTER_LOSSES[self.config.loss](
                head_logits, torch.softmax(rows_at(teacher, index, shift=i + 1).float(), dim=-1), ones)
                for i, (head_logits, index, ones) in enumerate(zip(logits, counted, every))]
        loss = speculator_loss(per_head, self.config.weights)
        with torch.no_grad():
            correct = []
            for head_logits, label, index in zip(logits, labels, counted):
                hit = torch.zeros(B * T, dtype=torch.bool, device=ids.device)
                hit[index] = head_logits.argmax(-1) == label
                correct.append(hit.view(B, T))
            metrics = chain_accuracy_metrics(correct, masks)
            metrics.update({f"loss_{i}": value.detach() for i, value in enumerate(per_head)})
            metrics["stage"] = torch.tensor(2.0 if "state_mask" in batch else 1.0, device=loss.device)
        return LossOutput(loss, metrics)

    # -- decoding --------------------------------------------------------------------------------
    def draft_source(self, target=None) -> MLPSpeculatorSource:
        return MLPSpeculatorSource(self)

    # -- saving ----------------------------------------------------------------------------------
    def hf_config(self) -> dict:
        """fms-extras' ``MLPSpeculatorConfig`` (as vLLM's copy reads it), every field explicit, plus what
        specdraft needs to rebuild the drafter (``family``, ``specdraft``; both loaders keep unknown keys
        as plain attributes)."""
        heads, cfg = self.speculator, self.config
        return {
            "architectures": [HF_ARCHITECTURE],
            "model_type": FAMILY,
            "vocab_size": heads.vocab_size,
            "emb_dim": heads.emb_dim,
            "inner_dim": heads.inner_dim,
            "n_predict": cfg.n_predict,
            "top_k_tokens_per_head": cfg.tree_top_k,
            "n_candidates": cfg.n_candidates,
            "tie_weights": cfg.tie_weights,
            "scale_input": cfg.scale_input,
            "torch_dtype": str(heads.proj[0].weight.dtype).removeprefix("torch."),
            "family": FAMILY,
            "specdraft": {"config": asdict(cfg), "target": self.target_name},
        }

    def save_pretrained(self, path: str | Path) -> None:
        write_drafter_folder(path, self.hf_config(), self.state_dict())


class MLPSpeculatorSource:
    """The speculator as a ``DraftSource``: a chain of its heads from the newest verified state.

    ``start``/``commit`` keep the target's final hidden state at the last committed position
    (the one that predicted the pending token); ``propose`` runs heads 0..k-1 on it, head 0 reading
    the pending token and head i the draft head i-1 drew. No host sync.
    """

    # A batch's rows draft in one propose, over their states stacked; fms-extras' candidates are per-head top-k,
    # a static tree.
    capabilities = DraftCapabilities(tree_kinds=("static",), row_state=("state",))

    def __init__(self, drafter: MLPSpeculator):
        self.heads = drafter.speculator

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, target_out: TargetOutputs) -> None:
        self.state = final_hidden_of(target_out)[:, -1:]

    @torch.no_grad()
    def propose(self, pending: torch.Tensor, k: int, params, generator: torch.Generator | None) -> Proposal:
        k = min(k, self.heads.n_predict)  # one token per head: a source may propose fewer than asked
        state, token, drafts, probs = self.heads.input_state(self.state), pending, [], []
        for i in range(k):
            state, logits = self.heads.step(i, state, token)
            token, q = draw_drafts(logits[:, -1], params, generator)  # [B], [B, V] or None
            token = token[:, None]
            probs += [] if q is None else [q]
            drafts.append(token)
        if not drafts:
            B = pending.shape[0]
            return Proposal(pending.new_zeros(B, 0), torch.zeros(B, 0, self.heads.vocab_size, device=pending.device))
        return Proposal(torch.cat(drafts, dim=1), torch.stack(probs, dim=1) if probs else None)

    @torch.no_grad()
    def propose_tree(self, pending: torch.Tensor, tree, params, generator: torch.Generator | None) -> Proposal:
        """A static candidate tree from the top-k of each head (fms-extras' top_k_tokens_per_head, as a tree):
        node i is the ranks[i]-th best token of head depth_i - 1 run on its parent's state and token."""
        check_tree_request(self, tree, pending)
        tree = tree.limited(self.heads.n_predict)  # one depth per head

        def step(depth, _, states, tokens):
            states, logits = self.heads.step(depth, states, tokens[:, None])  # [m, 1, inner], [m, 1, V]
            return states, logits[:, -1]

        tokens, _ = expand_static_tree(tree, step, self.heads.input_state(self.state), pending[0])  # state [1, 1, D]
        parents = torch.tensor(tree.parents, device=pending.device)
        return Proposal(tokens[None], None, parents[None])  # deterministic children: q one-hot

    def commit(self, kept_ids: torch.Tensor, target_out: TargetOutputs) -> None:
        self.state = final_hidden_of(target_out)[:, -1:]


# -- folders: save, load, export ---------------------------------------------------------------------------


def tied_groups(module: nn.Module) -> list[list[str]]:
    """state_dict names that share one tensor (tie_weights), each group in registration order."""
    groups: dict[int, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def config_from_hf(saved: dict) -> MLPSpeculatorConfig:
    """specdraft's settings from a folder it wrote, or from a plain fms-extras config (IBM's released ones)."""
    if "specdraft" in saved:
        known = {f.name for f in fields(MLPSpeculatorConfig)}
        return MLPSpeculatorConfig(**{k: v for k, v in saved["specdraft"]["config"].items() if k in known})
    return MLPSpeculatorConfig(n_predict=saved["n_predict"], inner_dim=saved.get("inner_dim", 0),
                               tie_weights=saved.get("tie_weights", False), scale_input=saved.get("scale_input", False),
                               top_k_tokens_per_head=saved.get("top_k_tokens_per_head"),
                               n_candidates=saved.get("n_candidates", 5))


def load_mlp_speculator(path: str | Path, target) -> MLPSpeculator:
    saved, tensors = read_drafter_folder(path, FAMILY, family_key="model_type")
    for key, have in (("emb_dim", target.hidden_size), ("vocab_size", target.vocab_size)):
        if saved[key] != have:
            raise SpecdraftError(
                f"the MLP speculator in {path} was trained for a target with {key}={saved[key]}, but this target has "
                f"{have}; load the target it was trained on ({(saved.get('specdraft') or {}).get('target') or 'see config.json'})")
    drafter = build_mlp_speculator(target, config_from_hf(saved))
    expected = drafter.state_dict()
    if set(tensors) != set(expected) or saved["inner_dim"] != drafter.speculator.inner_dim:
        raise SpecdraftError(f"{path} does not hold this configuration's tensors (missing "
                             f"{sorted(set(expected) - set(tensors))[:4]}, unexpected {sorted(set(tensors) - set(expected))[:4]}); "
                             "it was changed after saving: save or export it again")
    for group in tied_groups(drafter):
        if any(not torch.equal(tensors[group[0]], tensors[name]) for name in group[1:]):
            raise SpecdraftError(f"{path} has tie_weights but different values in {group}: it was changed after saving")
    drafter.load_state_dict(tensors)
    return drafter


def build_mlp_speculator(target, cfg: MLPSpeculatorConfig, draft_vocab=None) -> MLPSpeculator:
    """A fresh speculator for ``target`` (works on the meta device, for sizing)."""
    if draft_vocab is not None:
        raise SpecdraftError("the MLP speculator drafts over the target's whole vocabulary; it takes no draft vocabulary")
    with torch.device(target.device):
        drafter = MLPSpeculator(target, cfg)
    target.require(drafter.needs)  # from now on the target computes its final hidden state
    return drafter


def _same_folder(saved: dict, tensors: dict, opts: ExportOptions) -> tuple[dict, dict]:
    """The drafter folder already is fms-extras' Hugging Face layout (``save_pretrained``), which vLLM reads."""
    return saved, tensors


# vLLM V1 does not route the method (vllm-project/vllm#47825), and "MLPSpeculatorPreTrainedModel" is commented
# out of vllm/model_executor/models/registry.py ("Re-enable this once the MLP Speculator is supported in V1"),
# so the hint says that no current vLLM serves this folder. `specdraft export` fills in {out}, TARGET and {k}.
VLLM_SERVE_HINT = (
    "(not on a current vLLM: its V1 engine does not route mlp_speculator as of 2026, vLLM issue #47825) "
    "vllm serve TARGET --speculative-config '{\"method\": \"mlp_speculator\", \"model\": \"{out}\", "
    "\"num_speculative_tokens\": {k}}' ({k} = n_predict, or fewer), on a vLLM release that still has the V0 engine; "
    "fms-extras loads it with MLPSpeculatorPreTrainedModel.from_pretrained(\"{out}\")"
)

# "hf" is the default copy of the drafter folder (specdraft.export.DRAFTER_FOLDER): fms-extras' layout.
MLP_SPECULATOR = Family(name=FAMILY, config_cls=MLPSpeculatorConfig, needs=mlp_speculator_needs,
                        build=build_mlp_speculator, load=load_mlp_speculator,
                        compile_refusal="its heads run over the counted positions only (masks.counted_rows: a host "
                                        "read, and a new shape every step), and stage 2 generates inside the step",
                        exporters={"vllm": Exporter(write=_same_folder, read_back=lambda saved, tensors: tensors,
                                                    serve_hint=VLLM_SERVE_HINT,
                                                    draft_length=lambda saved, opts: saved["n_predict"])},  # fms-extras layout
                        # stage 2 (the target generates) for the last 4 of selftest's 8 steps
                        selftest_settings={"n_predict": 3, "stage2_start_step": 4, "stage2_prompt_length": 16,
                                           "stage2_new_tokens": 16, "stage2_prompts_per_row": 1})
