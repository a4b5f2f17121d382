"""DFlash (Chen, Liang and Liu 2026, arXiv 2602.06036): a block of drafts in one non-causal forward.

The draft is a small stack of decoder layers that shares, and freezes, the target's token embedding and LM
head. It predicts a whole block in one forward, as z-lab's reference (dflash/model.py), SpecForge
(specforge/core/dflash.py), vLLM (model_executor/models/qwen3_dflash.py) and SGLang (srt/models/dflash.py)
run it:

    ctx    = hidden_norm(fc([f_1; ...; f_n]))             the tapped target features of every committed token
    h      = embed([anchor, MASK, ..., MASK])              block_size positions; MASK = mask_token_id
    layer  x = input_layernorm(h)
           q = q_norm(q_proj(x))                           the block's queries only
           k = k_norm(k_proj([ctx; x])), v = v_proj([ctx; x])   the target's features injected as keys and
                                                           values in every layer; RoPE on q and k at their
                                                           sequence positions
           h = h + o_proj(attention(q, k, v))              no mask: the block sees all its context (every
                                                           position before the anchor) and itself, both ways
           h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))[1:]                          block position j predicts the token j after the anchor

QK-norm (``draft_layer: qwen3``) is the Qwen3-style layer every engine loads; ``draft_layer: llama`` drops
it (exported as ``hf`` only). The layers take the target's width, heads, head_dim, MLP width, norm eps and
RoPE, as z-lab's checkpoints do.

Taps: z-lab's ``target_layer_ids`` name the layer whose *output* is read (HF hidden_states[i + 1]); our tap
is the *input* of a layer (vLLM's convention, speculators' ``aux_hidden_state_layer_ids``), so tap = id + 1.
The default ids are z-lab's and SGLang's ``build_target_layer_ids``: the middle layer for one feature, else
``num_taps`` evenly spaced from layer 1 to layer N-3.

The MASK token: the engines embed the block's masked slots with the target's embedding row
``mask_token_id`` (vLLM DFlashQwen3Model.embed_input_ids, SGLang's DFLASH worker, z-lab's dflash_generate),
and the draft trains with that frozen row. A target whose tokenizer has no mask token lends a row that text
never uses: z-lab's Qwen3 drafters use 151669, the first embedding row past Qwen3's tokenizer, which is where
SpecForge's train_dflash.py puts the ``<|MASK|>`` token it adds; a vocabulary with no spare row lends a
reserved special token (Llama 3's ``<|reserved_special_token_0|>``, 128002). ``mask_token_id: null`` picks the
tokenizer's mask token, else the first row past the tokenizer (a tokenizer that fills the embedding is refused:
the recipe must name a row), or, for a target with no tokenizer, the last row; the chosen id is saved with the
drafter.

Training (SpecForge's OnlineDFlashModel, the paper's Sec. 4): per sequence, ``num_anchors`` anchor positions
drawn at random (torch's global RNG: a resumed run is exact) among those whose next token is an answer token.
Block b is [t_a, MASK, ...] at positions a..a+block_size-1; it sees the target's features strictly before a
(the same document only), and itself both ways; blocks never see each other, so all of a batch's blocks run in
one forward. Block position j is distilled from the target's distribution over token a + j (its logits at
a + j - 1), with the paper's exponentially decaying weight (its Eq. 4),

    L = sum_{b, j>=1} w_j m_{b,j} CE(p_target(. | t_<a+j), q_{b,j}) / sum_{b, j>=1} w_j m_{b,j},
    w_j = exp(-(j - 1) / gamma)

where m counts answer tokens inside the sequence and document. The paper's gamma is 7 for blocks of 16, 5
for 10 and 4 for 8 (SpecForge's --loss-decay-gamma help); SpecForge trains on the data's tokens (hard labels),
the issue and Model-Optimizer's ``dflash_self_logit_distillation`` on the target's logits, which is what this
does by default (``drafter.labels: tokens`` trains on the data's tokens instead, as SpecForge). Held-out
batches draw their anchors from a fixed generator, leaving the training RNG alone.

``drafter.position_weights: dpace`` replaces the fixed w_j by D-PACE's (arXiv 2605.18810, which SpecForge,
speculators and Model-Optimizer ship as an option): per block, the accepted length still to gain at slot j,
from the draft's own detached confidence exp(-CE) in each slot (``losses.dpace_position_weights``). While the
first drafts are mostly wrong, the far slots, which a rejection before them discards, weigh little. The loss
stays a weighted mean over the counted slots.

Decoding (``DFlashDraftSource``): one draft forward per step. The source keeps each layer's context keys and
values in a preallocated cache; ``propose`` projects the features the last ``commit`` handed over into it
and runs the block [pending, MASK x (block_size - 1)] over the cache, always the whole block the draft was
trained on, and returns its first k drafts (at most block_size - 1, as an MLP speculator drafts at most its heads). At temperature > 0 each draft is drawn
from its own position's warped distribution; no draft depends on another, so q_j is the exact distribution
the verifier compares with. The paper drafts chains; no trees.

Exports: ``sglang`` is z-lab's checkpoint layout (``DFlashDraftModel``, a Qwen3 config with ``dflash_config``),
which SGLang's DFLASH and z-lab's reference load; ``vllm`` is the speculators DFlash format
(``speculators_model_type: dflash``) that vLLM turns into ``DFlashDraftModel`` for ``method: dflash``.
Neither ships the embedding or the LM head: both engines use the target's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from ..chain_metrics import chain_accuracy_metrics
from ..contract import (
    DraftCapabilities,
    Example,
    ExportOptions,
    Exporter,
    Family,
    LossOutput,
    Optimization,
    Proposal,
    TargetNeeds,
    TargetOutputs,
    TrainingContext,
    target_example,
)
from ..decoding.sampling import draw_drafts
from ..errors import SpecdraftError
from ..losses import dpace_position_weights
from ..optim import recipe_optimization
from .eagle3 import Eagle3MLP
from .eagle_common import (
    DraftCache,
    attend,
    borrowed_head_logits,
    check_target_architecture,
    head_dim_of,
    make_rotary,
    rotate_half,
)
from .eagle_export import _layer_fields, check_served_target
from .folder import check_same_target, read_drafter_folder, target_config_dict, write_drafter_folder

FAMILY = "dflash"
DRAFT_LAYERS = ("qwen3", "llama")  # qwen3: with QK-norm, the layer vLLM and SGLang load; llama: without
# target: the target's next-token distribution at a + j - 1 (logit distillation, the paper's Eq. 4 weights);
# tokens: the data's token a + j (hard-label cross-entropy, z-lab's and SpecForge's "dflash" loss_type)
DFLASH_LABELS = ("target", "tokens")
# How the block's positions are weighed in the loss: decay, the paper's fixed exp(-(j - 1) / gamma); dpace, by
# how likely the draft is to reach each position (D-PACE, arXiv 2605.18810; losses.dpace_position_weights)
DFLASH_POSITION_WEIGHTS = ("decay", "dpace")


@dataclass
class DFlashConfig:
    """The recipe's ``drafter:`` section for ``family: dflash``; defaults are z-lab's Qwen3-8B-DFlash-b16."""

    block_size: int = 16  # anchor + block_size - 1 drafts per forward
    num_layers: int = 5  # draft decoder layers
    num_taps: int | None = None  # target features fused by fc; None = num_layers (z-lab's default)
    mask_token_id: int | None = None  # the embedding row of the MASK slots; None: see the module docstring
    loss_decay_gamma: float = 7.0  # w_j = exp(-(j - 1) / gamma); the paper: 7 for block 16, 5 for 10, 4 for 8
    num_anchors: int = 512  # blocks per sequence in training (SpecForge's --num-anchors)
    draft_layer: str = "qwen3"  # one of DRAFT_LAYERS
    norm_init: float = 1.0  # the final RMSNorm's starting weight (z-lab, SpecForge: 1); see DFlashDrafter
    labels: str = "target"  # one of DFLASH_LABELS: what slot j is trained toward
    position_weights: str = "decay"  # one of DFLASH_POSITION_WEIGHTS
    dpace_alpha: float = 0.5  # D-PACE's confidence smoothing (its Eq. 7; the paper's and the anchors' 0.5)

    # SpecForge scripts/train_dflash.py: AdamW at lr 6e-4, gradient-norm clipping at 1.0.
    optimizer_defaults: ClassVar[dict] = {"lr": 6e-4, "betas": (0.9, 0.999), "weight_decay": 0.0, "max_grad_norm": 1.0}

    def __post_init__(self):
        def whole(name, low):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise SpecdraftError(f"drafter.{name} must be an integer >= {low}, got {value!r}")

        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 2:
            raise SpecdraftError(f"drafter.block_size must be an integer >= 2 (the anchor and at least one draft), "
                                 f"got {self.block_size!r}; the paper uses 16, 10 or 8")
        whole("num_layers", 1)
        whole("num_anchors", 1)
        if self.num_taps is not None:
            whole("num_taps", 1)
        if self.mask_token_id is not None:
            whole("mask_token_id", 0)
        if not self.loss_decay_gamma > 0:
            raise SpecdraftError(f"drafter.loss_decay_gamma must be > 0, got {self.loss_decay_gamma} (the paper: "
                                 "7 for block_size 16, 5 for 10, 4 for 8)")
        if isinstance(self.norm_init, bool) or not isinstance(self.norm_init, (int, float)) or not self.norm_init > 0:
            raise SpecdraftError(f"drafter.norm_init must be a number > 0 (the final norm's starting weight; 1 as "
                                 f"z-lab and SpecForge, 0.1 for SmolLM2's tied head), got {self.norm_init!r}")
        if self.labels not in DFLASH_LABELS:
            raise SpecdraftError(f"drafter.labels must be one of {', '.join(DFLASH_LABELS)}, got {self.labels!r} "
                                 "(target: distil the target's distribution; tokens: cross-entropy on the data's tokens)")
        if self.position_weights not in DFLASH_POSITION_WEIGHTS:
            raise SpecdraftError(f"drafter.position_weights must be one of {', '.join(DFLASH_POSITION_WEIGHTS)}, got "
                                 f"{self.position_weights!r} (decay: the paper's exp(-(j - 1) / gamma); dpace: D-PACE)")
        if isinstance(self.dpace_alpha, bool) or not isinstance(self.dpace_alpha, (int, float)) \
                or not 0 < self.dpace_alpha <= 1:
            raise SpecdraftError(f"drafter.dpace_alpha must be a number in (0, 1] (D-PACE's smoothing; the paper's "
                                 f"0.5), got {self.dpace_alpha!r}")
        if self.draft_layer not in DRAFT_LAYERS:
            raise SpecdraftError(f"drafter.draft_layer must be one of {', '.join(DRAFT_LAYERS)}, got "
                                 f"{self.draft_layer!r} (qwen3: QK-norm, what vLLM and SGLang load)")

    @property
    def taps_wanted(self) -> int:
        return self.num_layers if self.num_taps is None else self.num_taps


def zlab_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """z-lab's build_target_layer_ids (SGLang's copy in srt/speculative/dflash_utils.py): the layers whose
    outputs are read. (SGLang refuses targets under 4 layers for more than one feature; the formula's ids are
    returned here, and a target refuses ids it does not have when it is asked to tap them.)"""
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_features - 1))) for i in range(num_features)]


def dflash_default_taps(num_target_layers: int, num_features: int) -> tuple[int, ...]:
    """Our taps (inputs of layers) for z-lab's layer ids (outputs of layers): id + 1."""
    return tuple(i + 1 for i in zlab_layer_ids(num_target_layers, num_features))


def check_taps(taps, num_target_layers: int) -> None:
    """Distinct inputs of layers the target has, with DFlash's conventions in the message."""
    bad = [t for t in taps if not 0 <= t < num_target_layers]
    if bad or len(set(taps)) != len(taps):
        problem = "are out of range" if bad else "repeat a layer"
        raise SpecdraftError(f"DFlash taps {list(taps)} {problem} for a {num_target_layers}-layer target: each tap is "
                             f"the input of a distinct layer, 0..{num_target_layers - 1} (z-lab's layer id + 1); set "
                             "target.taps, or drafter.num_taps for fewer default features")


def check_against_target(cfg: DFlashConfig, target_config) -> None:
    """What the recipe says against the target's dimensions, before any weight loads."""
    context = getattr(target_config, "max_position_embeddings", None)
    if context is not None and cfg.block_size >= context:
        raise SpecdraftError(f"drafter.block_size {cfg.block_size} does not fit the target's context of {context} "
                             "tokens (max_position_embeddings) with room for a prompt: use a smaller block_size")
    vocab = target_config.vocab_size
    if cfg.mask_token_id is not None and cfg.mask_token_id >= vocab:
        raise SpecdraftError(f"drafter.mask_token_id {cfg.mask_token_id} is outside the target's vocabulary of {vocab} "
                             "embedding rows: give a row the target has (a reserved or unused token), or null")


def dflash_needs(cfg: DFlashConfig, target_config) -> TargetNeeds:
    """The target's logits at every position (the loss distils them) and the tapped features."""
    check_against_target(cfg, target_config)
    return TargetNeeds(logits="full", taps=dflash_default_taps(target_config.num_hidden_layers, cfg.taps_wanted))


def resolve_mask_token_id(cfg: DFlashConfig, target) -> int:
    """The recipe's id, else the tokenizer's mask token, else the first embedding row past the tokenizer
    (SpecForge's added <|MASK|>), else the last row (a target without a tokenizer: tests)."""
    if cfg.mask_token_id is not None:
        return cfg.mask_token_id
    tokenizer = target.tokenizer
    if tokenizer is None:
        return target.vocab_size - 1
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id)
    if len(tokenizer) < target.vocab_size:
        return len(tokenizer)
    raise SpecdraftError(
        f"the target's tokenizer has no mask token and its {len(tokenizer)} tokens fill the embedding: set "
        "drafter.mask_token_id to a token text never holds (a reserved special token: Llama 3's "
        "<|reserved_special_token_0|> is 128002), as the engines' DFlash configs name one"
    )


# -- the draft network ----------------------------------------------------------------------------------------


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [B, heads, T, d]; cos/sin [B, T, d] from the rotary module."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from the context features and the block (KV injection)."""

    def __init__(self, config, qk_norm: bool):
        super().__init__()
        hidden, self.head_dim = config.hidden_size, head_dim_of(config)
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        eps = config.rms_norm_eps
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=eps) if qk_norm else nn.Identity()
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=eps) if qk_norm else nn.Identity()

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """[B, m, H] -> keys (normed, rotated) and values [B, h_kv, m, d]."""
        B, m, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, m, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, m, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, cos, sin), v

    def forward(self, x, cos, sin, context_kv, mask) -> torch.Tensor:
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.num_heads, self.head_dim)).transpose(1, 2)
        q = rotate(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        k, v = torch.cat([context_kv[0], k], dim=2), torch.cat([context_kv[1], v], dim=2)
        return self.o_proj(attend(q, k, v, mask).transpose(1, 2).reshape(B, Q, -1))


class DFlashLayer(nn.Module):
    def __init__(self, config, qk_norm: bool):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.self_attn = DFlashAttention(config, qk_norm)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.mlp = Eagle3MLP(config)  # the gated silu MLP of Llama and Qwen3 layers

    def forward(self, h, cos, sin, context_kv, mask) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, context_kv, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    family = FAMILY
    # training.compile: every batch draws num_anchors anchors (those a row lacks are masked), not as many as its
    # fullest row offers, so a step has fixed shapes and no host read.
    static_shapes = False

    def __init__(self, target, cfg: DFlashConfig, taps: tuple[int, ...]):
        super().__init__()
        config = target.config
        self.config, self.target_config = cfg, config
        self.needs = TargetNeeds(logits="full", taps=taps)
        H = config.hidden_size
        self.fc = nn.Linear(len(taps) * H, H, bias=False)
        self.hidden_norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config, cfg.draft_layer == "qwen3") for _ in range(cfg.num_layers))
        # The final norm feeds the target's frozen LM head. At weight 1 a fresh draft's unit-RMS state, which
        # points nowhere the head was trained on, gives SmolLM2's tied head logits tens of nats wide (a first
        # loss of 47 nats against log V = 10.8: eval/probe_dflash_init.py), and training spends its first
        # steps undoing that; a small start (norm_init) begins near the uniform guess.
        self.norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        nn.init.constant_(self.norm.weight, cfg.norm_init)
        # The target's embedding and head, and a float32 copy of its RoPE: borrowed, outside the module tree
        # (never trained, saved or cast with the drafter).
        self._borrowed = (target.embed_tokens, target.lm_head, make_rotary(target))

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def target_features(self, target_out: TargetOutputs) -> torch.Tensor:
        if target_out.aux_hidden is None or target_out.taps != self.needs.taps:
            raise SpecdraftError(f"DFlash reads target layers {list(self.needs.taps)}, and the target tapped "
                                 f"{list(target_out.taps)}: build or load the drafter on the target (it calls "
                                 "target.require(needs))")
        return target_out.aux_hidden

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """[B, S, n*H] tapped features -> [B, S, H], what every layer projects to keys and values."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_keys_values(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple]:
        """Each layer's keys and values of the context at its positions [B, S]."""
        cos, sin = self._borrowed[2](context, positions)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def block_hidden(self, block_ids, positions, context_kv, mask) -> torch.Tensor:
        """The block's normed outputs [B, Q, H]: ids and positions [B, Q], each layer's context keys and
        values, and a bool mask [B or 1, 1, Q, S + Q] over [context; block] (None: all visible)."""
        h = self._borrowed[0](block_ids).to(self.fc.weight.dtype)
        cos, sin = self._borrowed[2](h, positions)
        for layer, kv in zip(self.layers, context_kv):
            h = layer(h, cos, sin, kv, mask)
        return self.norm(h)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return borrowed_head_logits(self._borrowed[1], hidden)

    # -- training -------------------------------------------------------------------------------------------
    def trained_module(self) -> nn.Module:
        return self

    def configure_optimizers(self, recipe, total_steps: int) -> Optimization:
        return recipe_optimization(self, recipe, total_steps)

    def prepare(self, batch: dict[str, torch.Tensor], context: TrainingContext) -> Example:
        return target_example(batch, context, self.needs)

    def sample_anchors(self, valid: torch.Tensor, generator: torch.Generator | None):
        """SpecForge's _sample_anchor_positions: up to num_anchors positions per row drawn uniformly, without
        replacement, among ``valid`` [B, T]; returns anchors [B, N] (sorted) and which are real [B, N]."""
        counts = valid.sum(1)
        if self.static_shapes:
            N = min(self.config.num_anchors, valid.shape[1])
        else:
            N = max(min(self.config.num_anchors, int(counts.max())), 1)  # one host sync per micro-batch
        if self.static_shapes and generator is not None:  # held-out, compiled (no generator in a graph): a fixed
            # pseudo-random value per position, so every eval draws the same anchors
            at = torch.arange(valid.numel(), device=valid.device, dtype=torch.float32).view(valid.shape)
            noise = torch.frac(torch.sin(at * 12.9898) * 43758.5453).abs()
        else:
            noise = torch.rand(valid.shape, generator=generator, device="cpu").to(valid.device)
        noise = torch.where(valid, noise, torch.full_like(noise, 2.0))  # invalid positions sort last
        chosen = noise.argsort(dim=1)[:, :N]
        chosen = torch.where(valid.gather(1, chosen), chosen, valid.shape[1])  # invalid picks sort last
        anchors = chosen.sort(dim=1).values
        keep = torch.arange(N, device=valid.device)[None] < counts[:, None]
        return torch.where(keep, anchors, torch.zeros_like(anchors)), keep

    def static_loss(self):
        """``Family.static_loss``: this drafter's ``compute_loss``, switched to fixed shapes."""
        self.static_shapes = True
        return self.compute_loss

    def compute_loss(self, batch: dict[str, torch.Tensor], target_out: TargetOutputs) -> LossOutput:
        ids, attention, loss_mask = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
        seq_ids = batch.get("seq_ids")
        B, T = ids.shape
        bs, device = self.config.block_size, ids.device
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(T, device=device).expand(B, T)
        if target_out.logits is None or target_out.last_only:
            raise SpecdraftError("DFlash distils the target's logits at every position: the target must be asked "
                                 "for logits='full' (the family's needs)")

        # Anchors: a real token whose next token is an answer token (of the same document).
        valid = torch.zeros_like(attention)
        valid[:, :-1] = attention[:, :-1] & loss_mask[:, 1:] & attention[:, 1:]
        if seq_ids is not None:
            valid[:, :-1] &= seq_ids[:, :-1] == seq_ids[:, 1:]
        generator = None if self.training else torch.Generator().manual_seed(0)  # held-out: fixed anchors
        anchors, keep = self.sample_anchors(valid, generator)  # [B, N]
        N = anchors.shape[1]
        offsets = torch.arange(bs, device=device)
        where = anchors[:, :, None] + offsets  # [B, N, bs]: the sequence position each block slot stands for
        inside = where < T
        at = where.clamp(max=T - 1)

        # The blocks: [anchor, MASK, ...] at positions p_a + j; keys [context (T); blocks (N * bs)].
        block_ids = torch.full((B, N, bs), self.mask_token_id, dtype=torch.long, device=device)
        block_ids[:, :, 0] = ids.gather(1, anchors)
        block_positions = positions.gather(1, anchors)[:, :, None] + offsets
        ctx_visible = (torch.arange(T, device=device)[None, None] < anchors[:, :, None]) & attention[:, None]
        if seq_ids is not None:
            ctx_visible &= seq_ids[:, None] == seq_ids.gather(1, anchors)[:, :, None]
        same_block = torch.eye(N, dtype=torch.bool, device=device)  # a block sees itself, no other block
        block_visible = same_block[:, None, :, None].expand(N, bs, N, bs).reshape(N * bs, N * bs)
        mask = torch.cat([ctx_visible.repeat_interleave(bs, dim=1), block_visible.expand(B, -1, -1)], dim=-1)

        features = self.context(self.target_features(target_out))
        context_kv = self.context_keys_values(features, positions)
        hidden = self.block_hidden(block_ids.view(B, N * bs), block_positions.view(B, N * bs), context_kv,
                                   mask[:, None]).view(B, N, bs, -1)
        logits = self.draft_logits(hidden[:, :, 1:])  # [B, N, bs-1, V]: slot j predicts token a + j

        # The target's distribution over token a + j: its logits at a + j - 1 (inside the sequence).
        source = (at[:, :, 1:] - 1).reshape(B, -1)
        target_logits = target_out.logits[torch.arange(B, device=device)[:, None], source].view_as(logits)
        counted = keep[:, :, None] & inside[:, :, 1:] & loss_mask.gather(1, at[:, :, 1:].reshape(B, -1)).view(
            B, N, bs - 1) & attention.gather(1, at[:, :, 1:].reshape(B, -1)).view(B, N, bs - 1)
        if seq_ids is not None:
            counted &= seq_ids.gather(1, at[:, :, 1:].reshape(B, -1)).view(B, N, bs - 1) == \
                seq_ids.gather(1, anchors)[:, :, None]
        if self.config.labels == "tokens":
            tokens = ids.gather(1, at[:, :, 1:].reshape(B, -1)).view(B, N, bs - 1)
            per_slot = block_cross_entropy(logits, tokens)  # [B, N, bs-1]
        else:
            per_slot = dflash_distillation(logits, target_logits)
        # exp(-CE): the label's probability (with the target's labels, q's geometric mean under p: the paper's q_i
        # where p is one-hot); the weights are detached
        if self.config.position_weights == "dpace":
            w = dpace_position_weights(torch.exp(-per_slot.detach()), counted, self.config.dpace_alpha)
        else:
            w = counted.float() * block_weights(bs, self.config.loss_decay_gamma, device)  # [bs-1]
        loss = (per_slot * w).sum() / w.sum().clamp_min(1e-6)

        metrics = {}
        with torch.no_grad():
            correct = logits.argmax(-1) == target_logits.argmax(-1)
            for j in range(bs - 1):
                metrics[f"loss_{j}"] = (per_slot[:, :, j] * counted[:, :, j]).sum() / counted[:, :, j].sum().clamp_min(1)
            metrics.update(chain_accuracy_metrics([correct[:, :, j] for j in range(bs - 1)],
                                                  [counted[:, :, j] for j in range(bs - 1)]))
        return LossOutput(loss, metrics)

    # -- decoding and saving --------------------------------------------------------------------------------
    def draft_source(self, target) -> DFlashDraftSource:
        return DFlashDraftSource(self)

    def save_pretrained(self, path) -> None:
        config = {
            "family": FAMILY,
            "config": asdict(self.config),
            "target_taps": list(self.needs.taps),
            "target_config": target_config_dict(self.target_config),
        }
        write_drafter_folder(path, config, self.state_dict())


def block_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """The paper's Eq. 4 weight of block slots j = 1..block_size-1: exp(-(j - 1) / gamma)."""
    j = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(j - 1) / gamma)


def dflash_distillation(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Per-slot CE(p, q) = -sum_x p(x) log q(x), p = softmax(target logits), q = softmax(draft logits): logit
    distillation of each block slot from the target's next-token distribution at its position."""
    p = torch.softmax(target_logits.float(), dim=-1)
    return -(p * torch.log_softmax(draft_logits.float(), dim=-1)).sum(-1)


def block_cross_entropy(draft_logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-slot CE(onehot(token), q) = -log q(token): the hard-label loss z-lab and SpecForge train DFlash with
    (on the data's tokens, which for the target's own answers are its greedy choices)."""
    flat = F.cross_entropy(draft_logits.float().flatten(0, -2), tokens.flatten(), reduction="none")
    return flat.view(tokens.shape)


# -- decoding ----------------------------------------------------------------------------------------------------


class DFlashDraftSource:
    """A DFlash drafter as a ``DraftSource``: one draft forward per step, the whole block.

      start    queue the prompt's features (positions 0..L-1); the pending token s_L is the next anchor
      propose  the queued features become context keys and values in each layer's cache, and the block
               [pending, MASK x (block_size - 1)] at positions L..L+block_size-1 runs over it in the same
               forward; the first k block outputs are the drafts
      commit   queue the features of the kept tokens (pending + accepted drafts)

    A batch's rows draft one at a time (each row's caches are its own length)."""

    capabilities = DraftCapabilities()
    room = 256  # cache slots past the prompt before a cache first grows

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, target_out: TargetOutputs) -> None:
        self.caches = [DraftCache(prompt_ids.shape[1] + self.room) for _ in self.drafter.layers]
        self.queued = self.drafter.target_features(target_out)

    @torch.no_grad()
    def propose(self, pending: torch.Tensor, k: int, params, generator: torch.Generator | None) -> Proposal:
        d, bs = self.drafter, self.drafter.config.block_size
        k = min(k, bs - 1)  # the block holds block_size - 1 drafts: asked for more, it drafts those
        start = len(self.caches[0])
        queued = d.context(self.queued)
        positions = torch.arange(start, start + queued.shape[1], device=pending.device)[None]
        context_kv = [cache.update(*kv) for cache, kv in zip(self.caches, d.context_keys_values(queued, positions))]
        self.queued = self.queued[:, :0]  # in the cache now: another propose before a commit drafts the same
        length = start + queued.shape[1]  # the committed tokens; the pending one is the anchor
        block = torch.full((1, bs), d.mask_token_id, dtype=torch.long, device=pending.device)
        block[:, :1] = pending
        block_positions = torch.arange(length, length + bs, device=pending.device)[None]
        hidden = d.block_hidden(block, block_positions, context_kv, None)
        drafts, q = draw_drafts(d.draft_logits(hidden[:, 1 : 1 + k]), params, generator)  # [1, k], [1, k, V]
        return Proposal(drafts, q)

    def commit(self, kept_ids: torch.Tensor, target_out: TargetOutputs) -> None:
        self.queued = self.drafter.target_features(target_out)


# -- building, loading ---------------------------------------------------------------------------------------------


def check_target_layers(target) -> None:
    """DFlash's layers take the target's dimensions and RoPE, and read its residual stream: EAGLE-3's targets."""
    check_target_architecture(target, "DFlash")


def build_dflash(target, cfg: DFlashConfig, draft_vocab=None, taps: tuple[int, ...] | None = None) -> DFlashDrafter:
    """A fresh DFlash drafter for ``target`` (works on the meta device). Its taps: ``taps``, else the layers the
    target already taps (the recipe's ``target.taps``), else z-lab's default for ``num_taps`` features."""
    if draft_vocab is not None:
        raise SpecdraftError("DFlash drafts over the target's whole vocabulary with the target's LM head: it takes "
                             "no draft vocabulary")
    check_target_layers(target)
    check_against_target(cfg, target.config)
    taps = tuple(taps or target.taps or dflash_default_taps(target.num_layers, cfg.taps_wanted))
    check_taps(taps, target.num_layers)
    cfg = replace(cfg, mask_token_id=resolve_mask_token_id(cfg, target))
    if cfg.mask_token_id >= target.vocab_size:
        raise SpecdraftError(f"drafter.mask_token_id {cfg.mask_token_id} is outside the target's vocabulary of "
                             f"{target.vocab_size} embedding rows")
    with torch.device(target.device):
        drafter = DFlashDrafter(target, cfg, taps)
    target.require(drafter.needs)
    return drafter


def load_dflash(path, target) -> DFlashDrafter:
    saved, tensors = read_drafter_folder(path, FAMILY)
    check_same_target(saved, target, path)
    taps = tuple(saved["target_taps"])
    if len(taps) * target.hidden_size != tensors["fc.weight"].shape[1]:
        raise SpecdraftError(f"{path}: fc reads {tensors['fc.weight'].shape[1]} features, not {len(taps)} taps of "
                             f"width {target.hidden_size}; the folder is damaged")
    drafter = build_dflash(target, DFlashConfig(**saved["config"]), None, taps)
    drafter.load_state_dict(tensors)
    return drafter


# -- exports ------------------------------------------------------------------------------------------------------

SPECULATORS_VERSION = "0.3.0"


def dflash_tensor_names(num_layers: int, qk_norm: bool = True) -> set[str]:
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        p = f"layers.{i}."
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if qk_norm:
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    return names


def _engine_layers(saved: dict, tensors: dict, engine: str) -> dict:
    """The draft's layers as the Qwen3 config both engines build DFlash layers from (num_hidden_layers = the
    draft's), after refusing what their layer cannot run."""
    cfg = saved["config"]
    check_served_target(saved, engine, "DFlash")
    if cfg["draft_layer"] != "qwen3":
        raise SpecdraftError(f"{engine}'s DFlash layers are Qwen3 layers (with QK-norm); this drafter's draft_layer is "
                             f"{cfg['draft_layer']!r}, which {engine} does not have. Retrain with draft_layer: qwen3, "
                             "or export --format hf")
    have, want = set(tensors), dflash_tensor_names(cfg["num_layers"])
    if have != want:
        raise SpecdraftError(f"{engine} cannot load this drafter: no parameter for {sorted(have - want)}, missing "
                             f"{sorted(want - have)}. Export --format hf")
    tc = saved["target_config"]
    if tc.get("hidden_act") != "silu":
        raise SpecdraftError(f"{engine}'s DFlash MLP is silu only; the target's is {tc.get('hidden_act')!r}. Export "
                             "--format hf")
    return {
        **_layer_fields(saved, tensors, "qwen3", tc["vocab_size"]),  # the target's dimensions, eps, RoPE, dtype
        "num_hidden_layers": cfg["num_layers"],
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * cfg["num_layers"],  # bidirectional, no window
    }


def dflash_to_sglang(saved: dict, tensors: dict, opts: ExportOptions) -> tuple[dict, dict]:
    """z-lab's checkpoint layout, which SGLang's DFLASH (srt/models/dflash.py, srt/speculative/dflash_utils.py)
    and z-lab's reference (dflash/model.py DFlashDraftModel) load; tensor names are ours.

    Checked against:
      sglang srt/speculative/dflash_utils.py  dflash_config.target_layer_ids (0..N-1: the layer whose output is
        read; checked in range), dflash_config.block_size over a top-level block_size, dflash_config.mask_token_id
        (a non-negative int; without it SGLang looks the <|MASK|> string up in the tokenizer)
      sglang srt/models/dflash.py  DFlashDraftModel: layers.{i} with q/k/v -> qkv_proj, gate/up ->
        gate_up_proj, q_norm / k_norm per head; fc = len(target_layer_ids) * hidden -> hidden, no bias;
        hidden_norm, norm; no embedding or LM head (the target's); layer_types full_attention = non-causal;
        silu only
      z-lab dflash/model.py  DFlashDraftModel(Qwen3Config): dflash_config.target_layer_ids (required),
        block_size, mask_token_id; hidden_states[layer_id + 1] is the feature (the output of layer id)
    """
    layers = _engine_layers(saved, tensors, "SGLang")
    cfg, taps = saved["config"], list(saved["target_taps"])
    ids = [t - 1 for t in taps]
    if min(ids) < 0:
        raise SpecdraftError(f"this drafter taps layer inputs {taps}; SGLang and z-lab read layer outputs, so tap 0 (the "
                             "embedding) has no layer id. Retrain with taps >= 1, or export --format hf")
    config = {
        "architectures": ["DFlashDraftModel"],
        **layers,
        "block_size": cfg["block_size"],
        "num_target_layers": saved["target_config"]["num_hidden_layers"],
        "dflash_config": {"block_size": cfg["block_size"], "mask_token_id": cfg["mask_token_id"],
                          "target_layer_ids": ids},
    }
    return config, dict(tensors)


def dflash_to_vllm(saved: dict, tensors: dict, opts: ExportOptions) -> tuple[dict, dict]:
    """The speculators DFlash format, which vLLM serves with method dflash (DFlashQwen3ForCausalLM).

    Checked against vLLM (vllm-project/vllm main):
      vllm/transformers_utils/configs/speculators/base.py  speculators_model_type, speculators_config.
        proposal_methods[0].speculative_tokens, verifier.name_or_path, transformer_layer_config -> the draft
        config
      vllm/transformers_utils/configs/speculators/algos.py update_dflash  draft_vocab_size,
        target_hidden_size, aux_hidden_state_layer_ids (required; vLLM's convention = our taps) ->
        eagle_aux_hidden_state_layer_ids, and dflash_config {mask_token_id (required), target_layer_ids: ids - 1};
        architectures DFlashDraftModel; block_size is not read
      vllm/v1/spec_decode/dflash.py  the query block is 1 + num_speculative_tokens: the export writes
        block_size - 1, the block the draft was trained on
      vllm/model_executor/models/qwen3_dflash.py  DFlashQwen3Model: fc = len(aux layers) * target_hidden_size
        -> hidden, no bias; layers.{i} with qkv_proj / gate_up_proj stacked from q/k/v, gate/up; q_norm, k_norm;
        context = hidden_norm(fc(aux)) projected to k/v with k_norm and RoPE; all names but lm_head under
        model.; no embed_tokens or lm_head tensor: the target's are shared; draft_vocab_size = vocab_size: no
        draft_id_to_target_id
    """
    if not opts.verifier:
        raise SpecdraftError("vLLM's speculators config names the target model (speculators_config.verifier."
                             "name_or_path), and no recipe with target.path was found next to the drafter: pass "
                             "--target HUB_ID_OR_PATH")
    layers = _engine_layers(saved, tensors, "vLLM")
    cfg, tc = saved["config"], saved["target_config"]
    taps = list(saved["target_taps"])
    if min(taps) < 1:
        raise SpecdraftError(f"this drafter taps layer inputs {taps}; vLLM's DFlash config maps each to layer id - 1, "
                             "so tap 0 (the embedding) has no id. Retrain with taps >= 1, or export --format hf")
    config = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg["block_size"] - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": opts.verifier, "architectures": tc.get("architectures") or []},
        },
        "transformer_layer_config": layers,
        "draft_vocab_size": tc["vocab_size"],
        "block_size": cfg["block_size"],
        "target_hidden_size": tc["hidden_size"],
        "aux_hidden_state_layer_ids": taps,
        "mask_token_id": cfg["mask_token_id"],
        "torch_dtype": layers["torch_dtype"],
    }
    return config, dict(tensors)


def dflash_read_back(saved: dict, tensors: dict) -> dict:
    return dict(tensors)


DFLASH_EXPORTERS = {
    "sglang": Exporter(dflash_to_sglang, dflash_read_back,
                       "python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH "
                       "--speculative-draft-model-path {out}"),
    "vllm": Exporter(dflash_to_vllm, dflash_read_back,
                     "vllm serve TARGET --speculative-config "
                     "'{\"method\": \"dflash\", \"model\": \"{out}\", \"num_speculative_tokens\": {k}}'  (block_size - 1, "
                     "as the export's speculative_tokens: the block the draft was trained on)",
                     draft_length=lambda saved, opts: saved["config"]["block_size"] - 1),
}

DFLASH = Family(name=FAMILY, config_cls=DFlashConfig, needs=dflash_needs, build=build_dflash, load=load_dflash,
                exporters=DFLASH_EXPORTERS, static_loss=DFlashDrafter.static_loss,
                selftest_settings={"block_size": 4, "num_layers": 1, "num_anchors": 8,
                                   "mask_token_id": 1})  # the toy's <|pad|>, as recipes/toy_dflash.yaml

__all__ = ["DFLASH", "DFlashConfig", "DFlashDrafter", "DFlashDraftSource", "block_weights", "dflash_default_taps",
           "dflash_distillation", "zlab_layer_ids"]
