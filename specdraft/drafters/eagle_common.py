"""What EAGLE-1 and EAGLE-3 share.

* ``TrainingTimeTestKeys``: the draft layer's keys/values in EAGLE-3's training-time test (the "extended KV"
  each unrolled step adds to) and its attention there; ``DraftCache``: the draft's preallocated KV cache at
  decode time.
* ``attend``: softmax attention with an explicit boolean mask, the one place both use.
* the target-architecture check, the borrowed (frozen, unsaved) target weights, the parts of
  the ``Drafter`` contract both fill in the same way (saving through ``folder.write_drafter_folder``), and
  ``EagleDraftSource`` for the speculative decoder.

An EAGLE drafter plugs into ``EagleDraftSource`` through ``EagleNetwork``.
"""

from __future__ import annotations

import copy
from dataclasses import asdict
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from ..contract import (
    DraftCapabilities,
    Example,
    Optimization,
    Proposal,
    TargetOutputs,
    TrainingContext,
    target_example,
)
from ..decoding.kv_cache import PreallocatedLayer, ragged_rows, rows_step_mask
from ..decoding.sampling import draw_drafts
from ..errors import SpecdraftError
from ..optim import recipe_optimization
from .eagle_tree import propose_tree
from .folder import target_config_dict, write_drafter_folder


class EagleNetwork(Protocol):
    """The draft network of an EAGLE family, as ``EagleDraftSource`` drives it."""

    draft_to_target: torch.Tensor | None  # [N] long: the target id of each draft id; None = the identity

    def target_features(self, target_out: TargetOutputs) -> torch.Tensor:
        """[B, n, F]: what the target hands over per position (EAGLE-1: final hidden; EAGLE-3: taps)."""

    def draft_input(self, features: torch.Tensor) -> torch.Tensor:
        """[B, n, H]: the hidden the draft layer reads (EAGLE-3: fc of the taps)."""

    def draft_step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, m, H] next hiddens from m hiddens and the m tokens that follow them."""

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., N] float32 logits over the draft vocabulary."""


# Decoder layers whose config, rotary embedding and RMSNorm conventions the EAGLE and DFlash drafters follow: their
# input is the residual stream (HF's hidden_states[i], what vLLM and SGLang capture as hidden + residual).
# EAGLE-1's draft layer is a copy of the target's own layer, so it takes only the dense ones; EAGLE-3 and DFlash
# build their own layers, so mixture-of-experts targets serve too.
SUPPORTED_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
# Layers EAGLE-3 and DFlash tap but EAGLE-1 cannot copy: mixture-of-experts (gpt-oss with attention sinks, DeepSeek-V3
# with latent attention, Llama-4 with chunked attention), and GLM-4's (partial RoPE, sandwich norms). Their input
# is the residual stream too: vLLM and SGLang capture hidden + residual before them as before a Llama layer.
TAPPED_ONLY_LAYERS = ("Qwen3MoeDecoderLayer", "MixtralDecoderLayer", "GptOssDecoderLayer", "DeepseekV3DecoderLayer",
                      "Llama4TextDecoderLayer", "Glm4DecoderLayer", "Glm4MoeDecoderLayer")
# Why no EAGLE drafter taps these (checked against vLLM 0.33.0 and sglang 0.5.23, the PyPI wheels).
REFUSED_LAYERS = {
    "Gemma3DecoderLayer": (
        "vLLM 0.33's Gemma3ForCausalLM (model_executor/models/gemma3.py) does not implement SupportsEagle3, so it "
        "captures no layer for a draft; SGLang 0.5.23's gemma3_causal.py captures a layer's output without its "
        "residual (not the hidden + residual the draft is trained on) and hands the draft the unscaled embedding, "
        "and Gemma's sqrt(hidden) embedding scale, (1 + w) norms and per-layer-type RoPE are not the Llama layer's"
    ),
}


def check_target_architecture(target, family: str) -> type:
    """The target's decoder layer class, if ``family`` (EAGLE-1, EAGLE-3, DFlash) can serve on it; else a clear
    error. EAGLE-1 copies the target's layer; EAGLE-3 and DFlash tap its layers' inputs and build their own."""
    layer_cls = type(target.layers[0])
    name, model_type = layer_cls.__name__, target.config.model_type
    if family == "EAGLE-1":
        if name not in SUPPORTED_LAYERS:
            raise SpecdraftError(
                f"EAGLE-1's draft layer is a copy of the target's own decoder layer: specdraft copies "
                f"{', '.join(SUPPORTED_LAYERS)}, and this target ({model_type}) uses {name}; vLLM 0.33 and SGLang "
                "0.5.23 have EAGLE-1 models for dense Llama and Qwen2 layers only. Train eagle3 (its own Llama draft "
                "layer) where the engines capture the target's layers, or medusa1, medusa2, mlp_speculator or "
                "distillspec."
            )
        return layer_cls
    if name in REFUSED_LAYERS:
        raise SpecdraftError(
            f"{family} drafters cannot serve on this target ({model_type}, {name}): {REFUSED_LAYERS[name]}. Train "
            "medusa1, medusa2, mlp_speculator or distillspec for it."
        )
    if name not in SUPPORTED_LAYERS + TAPPED_ONLY_LAYERS:
        raise SpecdraftError(
            f"{family} drafters support targets built from {', '.join(SUPPORTED_LAYERS + TAPPED_ONLY_LAYERS)}; this target "
            f"({model_type}) uses {name}. Use one of those targets, or another drafter family "
            "(medusa1, medusa2, mlp_speculator and distillspec read only the final hidden state or the logits)."
        )
    return layer_cls


def draft_rope_parameters(rope_parameters: dict) -> dict:
    """The RoPE of the drafters' own layers: the target's type, theta and scaling, over the whole head.

    GLM-4 rotates a part of each head (partial_rotary_factor); the draft layer is a Llama layer, which vLLM and
    SGLang rotate over the part its config names, so the draft rotates all of it and its export names no part
    (``eagle_export._rope_fields`` writes these parameters).
    """
    return {k: v for k, v in rope_parameters.items() if k != "partial_rotary_factor"}


def make_rotary(target) -> nn.Module:
    """A fresh Llama rotary embedding over the target's RoPE parameters (rope type, scaling, head_dim).

    The draft attends over the same positions as the target, so it uses the target's RoPE type and scaling (gpt-oss:
    yarn, with its truncate: false; Llama-4: llama3). vLLM and SGLang build the draft layer's RoPE from its config
    with get_rope, neox-style (rotate_half), whatever the target's own rotary module lays out (gpt-oss: half-width
    cos/sin; Llama-4: complex frequencies); LlamaRotaryEmbedding computes exactly that from the same parameters.
    """
    config = copy.copy(target.config)
    config.rope_parameters = draft_rope_parameters(target.config.rope_parameters)
    return LlamaRotaryEmbedding(config=config)


def head_dim_of(config) -> int:
    """Qwen3 sets head_dim != hidden_size / heads; Llama may leave it unset."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def borrowed_head_logits(lm_head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """Float32 logits [..., V] of the target's frozen LM head over ``hidden`` [..., H], in the head's dtype.

    The rows are flattened into one [N, H] product first. Given a non-contiguous [B, T, H] input that requires
    grad (a slice such as ``predicted[:, :rows]``) and a weight that does not, torch's matmul does not fold
    the rows: it expands the weight into a [B, H, V] batched product, a copy of the whole head per row of the
    batch, which made EAGLE-1's LM head on SmolLM2 about twice as slow (eval/bench_train.py)."""
    flat = hidden.reshape(-1, hidden.shape[-1]).to(lm_head.weight.dtype)
    return lm_head(flat).float().view(*hidden.shape[:-1], -1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """RoPE on [B, heads, T, d] queries and keys; cos/sin are [B, T, d] from the rotary module."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
           scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d), masked) v, with grouped-query heads.

    q [B, h, Tq, d], k/v [B, h_kv, Tk, d], mask bool [B or 1, 1, Tq, Tk] (True = may attend).
    Key head j // (h / h_kv) serves query head j, as in transformers' ``repeat_kv``.
    SDPA with a mask runs the memory-efficient kernel on GPU: no [B, h, Tq, Tk] scores tensor.
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def decode_mask(num_new: int, num_cached: int, device) -> torch.Tensor:
    """[1, 1, m, c + m] bool: new position i (absolute c + i) sees cached keys and new keys up to itself."""
    query = torch.arange(num_new, device=device)[:, None] + num_cached
    key = torch.arange(num_cached + num_new, device=device)[None, :]
    return (key <= query)[None, None]


class TrainingTimeTestKeys:
    """The draft layer's keys and values in EAGLE-3's training-time test, and its attention there.

    Step 0's row i attends the step-0 keys its mask allows; step k's row i attends those same keys plus its
    *own* keys of steps 1..k (the "extended KV" of the references, whose mask is [mask0 | I | ... | I]). Only
    the step-0 keys are shared across rows, so step k runs one attention over them and one extra key per row:
    a "sink" key whose score is the log-sum-exp of row i's own step keys, with a value column that returns
    its softmax weight beta (``attend_with_own_keys``). That is the same softmax as the extended mask's, for
    a cost of one step-0 attention per step instead of k + 1, with no [T, (k + 1) T] mask. ``attend`` keeps
    each step's keys as they were, for autograd.
    """

    def __init__(self, rows: torch.Tensor | None = None):
        self.rows = rows  # [B, n]: the positions steps 1..k run at (``masks.gathered_rows``); None: every one
        self.keys: torch.Tensor | None = None  # step 0's [B, h_kv, T, d]
        self.values: torch.Tensor | None = None
        self.own_keys: list[torch.Tensor] = []  # steps 1..k, each [B, h_kv, T or n, d]: row i's keys at step j
        self.own_values: list[torch.Tensor] = []
        self.padded: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # step 0's keys + the sink

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask0: torch.Tensor) -> torch.Tensor:
        """This step's attention output [B, h, T, d] (steps 1..k with ``rows``: [B, h, n, d]); ``mask0``
        [B or 1, 1, T, T] is step 0's mask."""
        if self.keys is None:
            self.keys, self.values = k, v
            return attend(q, k, v, mask0)
        self.own_keys.append(k)
        self.own_values.append(v)
        if self.padded is None:  # step 0's keys and the sink, built once for steps 1..k
            keys, values, mask = sink_padded_keys(self.keys, self.values, mask0)
            if self.rows is not None:  # the queries are those rows' only: their rows of the mask
                (B, n), width = self.rows.shape, mask.shape[-1]
                mask = mask.expand(B, -1, -1, -1).gather(2, self.rows[:, None, :, None].expand(B, 1, n, width))
            self.padded = keys, values, mask
        return attend_with_own_keys(q, *self.padded, torch.stack(self.own_keys, 3), torch.stack(self.own_values, 3))


SINK_COLUMNS = 3  # the padded head dims: the sink's score (two columns, high and low part) and beta


def sink_padded_keys(keys, values, mask0):
    """Step 0's keys and values with one more key (the sink), over a head dim padded to a multiple of 8 (the GPU
    kernels' alignment) with room for the sink's columns: keys [k, 0] and the sink [0, 1, 1, 0]; values [v, 0]
    and the sink [0, 0, 0, 1]; the mask with a column that lets every row see the sink."""
    B, H, T, d = keys.shape
    width = -(-(d + SINK_COLUMNS) // 8) * 8
    sink_key = keys.new_zeros(B, H, 1, width)
    sink_key[..., d : d + 2] = 1
    sink_value = values.new_zeros(B, H, 1, width)
    sink_value[..., d + 2] = 1
    padded_keys = torch.cat([F.pad(keys, (0, width - d)), sink_key], dim=2)
    padded_values = torch.cat([F.pad(values, (0, width - d)), sink_value], dim=2)
    mask = torch.cat([mask0, mask0.new_ones(*mask0.shape[:-1], 1)], dim=-1)
    return padded_keys, padded_values, mask


def attend_with_own_keys(q, padded_keys, padded_values, mask, own_keys, own_values):
    """softmax over [row i's allowed step-0 keys, row i's own keys] of q, exactly, in one SDPA over the step-0
    keys plus the sink: q [B, h, T, d]; own keys/values [B, h_kv, T, k, d], row i's at each of k steps.

    The sink's score is L_i = logsumexp_j(q_i . own_ij / sqrt(d)), carried in q's padding as two parts (high and
    low, so that bf16 keeps it to ~2^-16), so SDPA's output is (sum_step0 e^s v + e^L [0, beta]) / Z, its beta
    column e^L / Z: adding beta x (own keys' softmax-weighted values) completes the softmax over both."""
    B, h, T, d = q.shape
    groups = h // own_keys.shape[1]
    if groups > 1:
        own_keys, own_values = own_keys.repeat_interleave(groups, 1), own_values.repeat_interleave(groups, 1)
    scale = d**-0.5
    with torch.autocast(q.device.type, enabled=False):  # float32 scores, as SDPA keeps its own
        own_scores = torch.matmul(own_keys.float(), q.float().unsqueeze(-1)).squeeze(-1) * scale  # [B, h, T, k]
        own_lse = torch.logsumexp(own_scores, dim=-1, keepdim=True)  # [B, h, T, 1]
        own_out = torch.matmul(torch.softmax(own_scores, dim=-1).unsqueeze(-2), own_values.float()).squeeze(-2)
    # SDPA multiplies the sink's score (q . [0, 1, 1, 0] = high + low) by scale: divide it out first.
    target = own_lse / scale
    high = target.to(q.dtype)
    low = (target - high.float()).to(q.dtype)
    width = padded_keys.shape[-1]
    padded_q = torch.cat([q, high, low, q.new_zeros(B, h, T, width - d - 2)], dim=-1)
    out = attend(padded_q, padded_keys, padded_values, mask, scale=scale)
    beta = out[..., d + 2 : d + 3].float()
    return (out[..., :d].float() + beta * own_out).to(q.dtype)


class DraftCache(PreallocatedLayer):
    """The draft layer's decoding cache: the target's preallocated layer (one buffer written in place,
    doubled when outgrown; a rollback only moves the length), so a draft step copies only its own keys.
    Its ``update`` takes the arguments transformers' attention layers pass, so it serves EAGLE-1 (a
    transformers decoder layer) and EAGLE-3 (our own) alike."""

    def __len__(self) -> int:
        return self.length

    def keep(self, length: int) -> None:
        """Keep the first ``length`` positions."""
        self.crop(min(0, length - self.length))


class BorrowsTargetWeights:
    """Mixin: the parts of a drafter that are not its own trainable weights.

    The target's frozen embedding and LM head are used by reference, and the RoPE module is a
    fresh float32 copy of the target's. All three live in a tuple, outside the module tree: they
    are neither parameters nor state_dict entries (never trained, never saved), and
    ``drafter.to(torch.bfloat16)`` neither casts the target's weights nor rounds the RoPE
    frequencies (the rotary module moves them to the input's device itself).
    """

    # training.compile: every row computed and masked (``masks.every_row``) instead of the counted ones gathered,
    # so that a step has fixed shapes and no host read.
    static_shapes = False

    def bind_target(self, target) -> None:
        self._borrowed = (target.embed_tokens, target.lm_head, make_rotary(target))

    def static_loss(self):
        """``Family.static_loss``: this drafter's ``compute_loss``, switched to fixed shapes."""
        self.static_shapes = True
        return self.compute_loss

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._borrowed[0]

    @property
    def target_lm_head(self) -> nn.Linear:
        return self._borrowed[1]

    @property
    def rotary_emb(self) -> nn.Module:
        return self._borrowed[2]

    # -- the Drafter contract, the same for both EAGLE families ------------------------------------
    # Each provides ``family``, ``needs``, ``config``, ``target_config``, ``draft_vocab_size`` and
    # ``logit_rows`` (the draft vocabulary's target ids when it trains on those rows only).
    def trained_module(self) -> nn.Module:
        return self  # its own weights; the target's embedding and head are borrowed, not trained

    def configure_optimizers(self, recipe, total_steps: int) -> Optimization:
        return recipe_optimization(self, recipe, total_steps)

    def prepare(self, batch: dict[str, torch.Tensor], context: TrainingContext) -> Example:
        return target_example(batch, context, self.needs, self.logit_rows)

    def draft_source(self, target) -> EagleDraftSource:
        return EagleDraftSource(self)

    def save_pretrained(self, path) -> None:
        config = {
            "family": self.family,
            "config": asdict(self.config),
            "draft_vocab_size": self.draft_vocab_size,
            "target_taps": list(self.needs.taps),
            "target_config": target_config_dict(self.target_config),
        }
        write_drafter_folder(path, config, self.state_dict())


# -- decoding -------------------------------------------------------------------------------------


class EagleDraftSource:
    """An EAGLE drafter as a ``DraftSource``: chained draft steps over its own KV cache.

    Draft position j reads (f_j, t_{j+1}): the target's feature at j and the next token,
    and predicts t_{j+2}, exactly as in training. The draft therefore always lags one
    token: pairs whose next token is not known yet wait in a queue. Bookkeeping:

      start   queue f_0..f_{L-1} with t_1..t_{L-1}; the pending token t_L completes the last pair
      propose step 0 reads every queued pair (real features) -> d_1; steps 1..k-1 read the
              draft's own hidden and d_i -> d_{i+1}. Cache: committed pairs, then k-1 chain states
      commit  drop the chain states; queue the verified features with the kept drafts, to be
              read by the next propose (one draft forward per decoding step, not two)

    In a batch (``specdraft.decoding.rows``) the rows' sources draft together in ``propose_rows``.
    """

    # The per-sequence state. Rows' caches and queues differ in length, so a batch drafts through
    # ``propose_rows`` (padded, masked) rather than by concatenating these.
    capabilities = DraftCapabilities(tree_kinds=("static", "dynamic"),
                                     row_state=("cache", "num_committed", "queued_features", "queued_tokens"),
                                     ragged_rows=True)  # fmt: skip
    room = 256  # cache slots past the prompt before the cache first grows

    def __init__(self, drafter: nn.Module):
        self.drafter = drafter

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, target_out: TargetOutputs) -> None:
        self.cache = DraftCache(prompt_ids.shape[1] + self.room)
        self.num_committed = 0  # cache positions computed from verified target features
        self.queued_features = self.drafter.target_features(target_out)
        self.queued_tokens = prompt_ids[:, 1:]

    @torch.no_grad()
    def propose(self, pending: torch.Tensor, k: int, params, generator: torch.Generator | None) -> Proposal:
        hidden = self._read_queued(pending)[:, -1:]
        return self._draft_chain(hidden, k, self.cache, self._positions(1), None, params, generator)

    @staticmethod
    @torch.no_grad()
    def propose_rows(sources: list, pending: torch.Tensor, k: int, params, generator) -> Proposal:
        """k drafts for each of R sequences in one draft forward per step ([R, k]): ``sources`` are R copies of
        one source (one drafter), ``pending`` [R, 1]. Each source ends as its own ``propose`` leaves it, less
        the chain states its ``commit`` drops.

        The rows' caches (L_b slots) and queued pairs (m_b) differ in length: step 0 reads the queues
        right-padded to [R, M] over the caches right-padded to [R, L], each row at its own positions
        (L_b + j) under a mask of its real slots; the chain steps then append one slot per row."""
        d, R, device = sources[0].drafter, len(sources), pending.device
        cached = [len(s.cache) for s in sources]
        queued = [torch.cat([s.queued_tokens[0], pending[i]]) for i, s in enumerate(sources)]
        lengths = [q.shape[0] for q in queued]  # m_b, like L_b known on the host: no sync
        L, M = max(cached), max(lengths)
        cache = DraftCache.stacked([s.cache for s in sources], room=M + k)
        tokens = nn.utils.rnn.pad_sequence(queued, batch_first=True)  # [R, M], padded with 0
        features = nn.utils.rnn.pad_sequence([d.draft_input(s.queued_features)[0] for s in sources], batch_first=True)
        slot_valid, positions = ragged_rows(cached, lengths, device)
        mask = rows_step_mask(slot_valid[:, :L], slot_valid[:, L:])  # each row its cached slots, its queue causally
        hidden = d.draft_step(features, tokens, positions, cache, mask=mask)  # [R, M, H]
        last = torch.tensor(lengths, device=device) - 1  # each row's pending position
        hidden = hidden[torch.arange(R, device=device), last][:, None]
        proposal = sources[0]._draft_chain(hidden, k, cache, positions.gather(1, last[:, None]) + 1, slot_valid,
                                           params, generator)  # fmt: skip
        for i, s in enumerate(sources):  # each row's cache gains its queue's slots: its committed ones
            s.cache.keep(cached[i])
            s.cache.update(cache.keys[i : i + 1, :, L : L + lengths[i]], cache.values[i : i + 1, :, L : L + lengths[i]])
            s.num_committed = cached[i] + lengths[i]
        return proposal

    def _draft_chain(self, hidden: torch.Tensor, k: int, cache: DraftCache, position: torch.Tensor,
                     slot_valid: torch.Tensor | None, params, generator) -> Proposal:
        """k chained drafts from ``hidden`` [R, 1, H], the hidden that predicts draft 1. Step i > 0 reads draft i
        with the hidden it came from into ``cache``, at ``position`` [R, 1] + i - 1; ``slot_valid`` [R, S] marks
        the cache slots each row sees (None: all of them, one sequence)."""
        d = self.drafter
        drafts, probs = [], []
        for step in range(k):
            if step > 0:  # read the previous draft with the hidden it came from
                mask = None
                if slot_valid is not None:  # the rows' real slots, then their chains' (all real)
                    mask = rows_step_mask(slot_valid, slot_valid.new_ones(slot_valid.shape[0], 1))
                    slot_valid = F.pad(slot_valid, (0, 1), value=True)
                hidden = d.draft_step(hidden[:, -1:], drafts[-1], position + step - 1, cache, mask=mask)
            draft_ids, q = draw_drafts(d.draft_logits(hidden[:, -1]), params, generator)  # [R], [R, N]
            if q is not None:
                probs.append(self._to_target_vocab(q))  # verify reads q over the target's vocabulary
            drafts.append(self._to_target_ids(draft_ids)[:, None])
        if not drafts:
            R = hidden.shape[0]
            return Proposal(hidden.new_zeros(R, 0, dtype=torch.long),
                            torch.zeros(R, 0, self._target_vocab_size(), device=hidden.device))
        return Proposal(torch.cat(drafts, dim=1), torch.stack(probs, dim=1) if probs else None)

    @torch.no_grad()
    def propose_tree(self, pending: torch.Tensor, tree, params, generator: torch.Generator | None) -> Proposal:
        """A static tree, or an EAGLE-2 dynamic tree, drafted with tree attention (``eagle_tree``)."""
        return propose_tree(self, pending, tree, params)

    def _read_queued(self, pending: torch.Tensor) -> torch.Tensor:
        """Step 0: read every queued (verified feature, next token) pair, the pending token completing the last;
        returns their hiddens [B, m, H], the last one predicting the token after the pending one."""
        d = self.drafter
        tokens = torch.cat([self.queued_tokens, pending], dim=1)
        hidden = d.draft_step(d.draft_input(self.queued_features), tokens, self._positions(tokens.shape[1]), self.cache)
        self.num_committed = len(self.cache)
        return hidden

    def commit(self, kept_ids: torch.Tensor, target_out: TargetOutputs) -> None:
        self.cache.keep(self.num_committed)
        self.queued_features = self.drafter.target_features(target_out)
        self.queued_tokens = kept_ids[:, 1:]

    def _positions(self, num_new: int) -> torch.Tensor:
        start = len(self.cache)
        return torch.arange(start, start + num_new, device=self.queued_tokens.device)[None]

    def _target_vocab_size(self) -> int:
        return self.drafter.target_lm_head.weight.shape[0]

    def _to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        mapping = self.drafter.draft_to_target
        return draft_ids if mapping is None else mapping[draft_ids]

    def _to_target_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """q over the draft vocabulary -> over the target's, zero outside the draft vocabulary."""
        mapping = self.drafter.draft_to_target
        if mapping is None:
            return q
        full = q.new_zeros(q.shape[0], self._target_vocab_size())
        return full.index_copy_(1, mapping, q)
