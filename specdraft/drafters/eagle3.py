"""EAGLE-3 (Li et al. 2025, arXiv 2503.01840): fused target features, direct token prediction,
and the training-time test.

One draft step, as SGLang's and vLLM's ``llama_eagle3.py`` run it:

    g    = fc([low; mid; high])                        target features at taps, 3H -> H (no bias)
    x    = [input_layernorm(embed(t)); hidden_norm(g)]  2H: q/k/v projections take 2H inputs
    h    = g + o_proj(attention(x))                    the residual is the hidden, not x
    out  = h + mlp(post_attention_layernorm(h))        the pre-norm output: next step's hidden
    logits = lm_head(norm(out))                        over the reduced draft vocabulary

Training-time test (Sec. 3.2): the draft is unrolled ``ttt_steps`` times on its own outputs.
Step k at row i stands for position i + k: it reads the token t_{i+k+1} and step k-1's output
at row i, sits at RoPE position i + k, and attends the step-0 keys of rows 0..i (derived from
real target features, block-causal) plus its own chain's keys at row i from steps 1..k. That is
exactly what it sees when decoding, where step 0 is read from real features and later steps
extend the KV cache; ``tests/test_eagle_decoding.py`` checks the two agree. The EAGLE-3 reference and
SpecForge once also hid step-0 keys i-k+1..i from step k, which decoding does not do (EAGLE issue
#247); both removed that shift (EAGLE 09b1628, SpecForge 7286dc5, PR #245), and at their HEADs they
mask as specdraft does. Row i's later steps read nothing of the other rows but the step-0 keys, so
steps 1.. run only at the rows where some later step's loss counts (an answer token ahead), and every
step's LM head and loss only at its counted rows; the references run both over every position.

Loss: step k's soft cross-entropy against the target's distribution over the draft vocabulary,

    L = sum_k step_weight_decay^k * CE(p_target, q_k)     (0.8^k, as the reference trainer)

or, with ``drafter.loss``, an acceptance-aimed loss in CE's place (``losses.DRAFTER_LOSSES``),
where p_target is the softmax of the target's logits at the draft vocabulary's rows only
(``eagle_losses.draft_vocab_probs``; the target never forms its V-wide logits for this family), and
a position counts when its next token is an answer token the draft vocabulary holds. The draft's LM
head starts at the target's LM-head rows, as vLLM's speculators does.

Taps: the inputs of layers 2, N//2 and N-3 (``target.taps: auto``; a list replaces them one for one).
The draft vocabulary is the N most frequent assistant tokens of the data (``draft_vocab_size``),
stored as ``d2t`` offsets and a boolean ``t2d``, the convention vLLM and SGLang read, and cached under
a hash of the data's content, the tokenizer and N.

Parameter names are SGLang's, so export is a copy: ``fc``, ``midlayer.*``, ``norm``,
``lm_head``, buffers ``d2t`` / ``t2d``. The embedding is the target's: borrowed, not saved.
Exports (``eagle_export.py``): ``sglang`` (``LlamaForCausalLMEagle3``, which the EAGLE repo's
``EaModel`` loads too), ``vllm`` (the speculators ``Eagle3Speculator`` format, which vLLM and the
speculators library load) and ``hf`` (specdraft's own folder); both engine formats ship the target's
``embed_tokens``. ``draft_layer: qwen3`` gives the draft layer QK-norm (``midlayer.self_attn.{q,k}_norm``): vLLM
serves it as ``Eagle3Qwen3ForCausalLM``; SGLang has no such draft, so its export is refused.

Targets: dense Llama, Mistral, Qwen2, Qwen3, GLM-4 and mixture-of-experts Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3,
Llama-4 (text) and GLM-4-MoE (the taps are the layers' inputs, which the router does not touch); each engine export
checks that the engine captures the target's layers (``eagle_export.SERVED_TARGETS``: neither engine for Mixtral and
GLM-4, SGLang only for GLM-4-MoE). The draft layer's RoPE is the target's type and scaling over the whole head
(``eagle_common.make_rotary``), which the export names. Gemma-3 is refused (``eagle_common.REFUSED_LAYERS``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from ..chain_metrics import chain_accuracy_metrics
from ..contract import Family, LossOutput, TargetNeeds, TargetOutputs
from ..data.vocab import DraftVocab
from ..errors import SpecdraftError
from ..losses import DRAFTER_LOSSES, check_drafter_loss
from ..masks import (block_causal_mask, counted_rows, every_row, gathered_index, gathered_rows, rows_at,
                     shift_left, weights_at)
from .eagle_common import (
    BorrowsTargetWeights,
    DraftCache,
    TrainingTimeTestKeys,
    apply_rotary,
    attend,
    check_target_architecture,
    decode_mask,
    head_dim_of,
)
from .eagle_export import EAGLE3_EXPORTERS
from .eagle_losses import draft_vocab_probs, label_in_draft_vocab, ttt_step_weights
from .folder import check_same_target, read_drafter_folder


DRAFT_LAYERS = ("llama", "qwen3")


@dataclass
class Eagle3Config:
    """EAGLE-3 hyper-parameters; defaults are the paper's / reference code's."""

    ttt_steps: int = 7  # training-time-test unroll length (reference: model.length = 7)
    step_weight_decay: float = 0.8  # step k's loss weight is decay**k
    # Reduced draft vocabulary (the most frequent assistant tokens). None, or >= the target's
    # vocabulary size, means the full vocabulary with the identity map.
    draft_vocab_size: int | None = 32000
    # Each step's loss against p (losses.DRAFTER_LOSSES): ce, the paper's; tvd, lk_alpha, lk_hybrid aim at acceptance.
    loss: str = "ce"
    # The draft layer (DRAFT_LAYERS): llama, the reference's, which vLLM and SGLang serve on every target they
    # capture layers of; qwen3 adds QK-norm (an RMSNorm over each head's queries and keys before RoPE), vLLM's
    # Eagle3Qwen3ForCausalLM, which SGLang 0.5.23 does not have.
    draft_layer: str = "llama"
    # Recompute each step's draft logits and loss in the backward instead of keeping them: no [T, draft vocab]
    # float32 tensor of the draft's is kept for the backward (17-20% less peak on SmolLM2 at 1k-8k tokens,
    # eval/bench_long_context.py), for one more LM head forward per step. For long samples.
    checkpoint_logits: bool = False

    # The EAGLE-3 reference's optimizer (eagle/traineagle3/ds_config.json): AdamW betas (0.9, 0.95), no weight
    # decay, gradient-norm clipping at 0.5, and DeepSpeed's WarmupDecayLR: a warmup to the peak lr 5e-5 over
    # 12000 steps, then a linear decay to 0 at the last step (the "linear" schedule; DeepSpeed's warmup curve
    # is logarithmic, specdraft's is linear). Recipes shorter than 12000 steps set their own warmup_steps.
    optimizer_defaults: ClassVar[dict] = {
        "lr": 5e-5, "betas": (0.9, 0.95), "weight_decay": 0.0, "max_grad_norm": 0.5, "schedule": "linear",
        "warmup_steps": 12000,
    }

    def __post_init__(self):
        if isinstance(self.ttt_steps, bool) or not isinstance(self.ttt_steps, int) or self.ttt_steps < 1:
            raise SpecdraftError(f"drafter.ttt_steps must be an integer >= 1, got {self.ttt_steps!r} (default 7)")
        if not self.step_weight_decay > 0:
            raise SpecdraftError(f"drafter.step_weight_decay must be > 0, got {self.step_weight_decay} (default 0.8)")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise SpecdraftError("drafter.draft_vocab_size must be >= 1, or null for the full vocabulary")
        check_drafter_loss(self.loss)
        if not isinstance(self.checkpoint_logits, bool):
            raise SpecdraftError(f"drafter.checkpoint_logits must be true or false, got {self.checkpoint_logits!r}")
        if self.draft_layer not in DRAFT_LAYERS:
            raise SpecdraftError(f"drafter.draft_layer must be one of {', '.join(DRAFT_LAYERS)}, got "
                                 f"{self.draft_layer!r} (llama: the EAGLE-3 reference's; qwen3: with QK-norm)")

    def uses_reduced_vocab(self, target_vocab_size: int) -> bool:
        """Whether a DraftVocab must be built from the data (else the full vocabulary is used)."""
        return self.draft_vocab_size is not None and self.draft_vocab_size < target_vocab_size


def eagle3_default_taps(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high features: inputs of layers 2, N//2 and N-3 (EAGLE-3, vLLM's default)."""
    return (2, num_layers // 2, num_layers - 3)


def eagle3_needs(cfg: Eagle3Config, target_config) -> TargetNeeds:
    """Three tapped layers, and the target's logits at the draft vocabulary's rows only (all rows when
    the draft vocabulary is the target's)."""
    reduced = cfg.uses_reduced_vocab(target_config.vocab_size)
    default = next(f.default for f in fields(Eagle3Config) if f.name == "draft_vocab_size")  # 32000, or all
    if cfg.draft_vocab_size not in (None, default) and cfg.draft_vocab_size > target_config.vocab_size:
        warnings.warn(f"drafter.draft_vocab_size {cfg.draft_vocab_size} is above the target's vocabulary of "
                      f"{target_config.vocab_size} tokens: drafting over the whole vocabulary "
                      f"({target_config.vocab_size}); set draft_vocab_size: null to say so", stacklevel=2)
    return TargetNeeds(logits="draft_rows" if reduced else "full",
                       taps=eagle3_default_taps(target_config.num_hidden_layers))


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H [embedding; hidden] input; with ``qk_norm``, Qwen3's: each head's
    queries and keys RMS-normed (weights over head_dim) before RoPE."""

    def __init__(self, config, qk_norm: bool = False):
        super().__init__()
        hidden, self.head_dim = config.hidden_size, head_dim_of(config)
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        if qk_norm:
            self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.q_proj = nn.Linear(2 * hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(self, x, cos, sin, mask, cache: TrainingTimeTestKeys | DraftCache | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        if isinstance(cache, TrainingTimeTestKeys):  # training: earlier TTT steps' keys, mask = step 0's
            out = cache.attend(q, k, v, mask)
        else:
            if cache is not None:  # decoding: earlier positions
                k, v = cache.update(k, v)
            out = attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class Eagle3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config, qk_norm: bool = False):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Eagle3Attention(config, qk_norm)
        self.mlp = Eagle3MLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=eps)  # on the token embedding
        self.hidden_norm = LlamaRMSNorm(hidden, eps=eps)  # on the incoming hidden
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=eps)

    def forward(self, embeds, hidden, cos, sin, mask, cache: TrainingTimeTestKeys | DraftCache | None) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        h = hidden + self.self_attn(x, cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(BorrowsTargetWeights, nn.Module):
    family = "eagle3"

    def __init__(self, target, cfg: Eagle3Config, draft_vocab: DraftVocab, taps: tuple[int, ...]):
        super().__init__()
        config = target.config
        self.config, self.target_config = cfg, config
        self.needs = TargetNeeds(logits="draft_rows" if draft_vocab.size < target.vocab_size else "full", taps=taps)
        self.fc = nn.Linear(3 * config.hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config, qk_norm=cfg.draft_layer == "qwen3")
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, draft_vocab.size, bias=False)
        self.register_buffer("d2t", draft_vocab.d2t.clone())  # target_id = draft_id + d2t[draft_id]
        self.register_buffer("t2d", draft_vocab.t2d.clone())
        self.register_buffer("draft_ids", draft_vocab.draft_to_target.clone(), persistent=False)
        self.bind_target(target)

    # -- the draft network ------------------------------------------------------------------------
    def draft_step(self, hidden, tokens, positions, cache: TrainingTimeTestKeys | DraftCache | None = None,
                   mask=None) -> torch.Tensor:
        """One draft step over m positions: [B, m, H] hidden + [B, m] next tokens -> [B, m, H] pre-norm outputs."""
        if mask is None:  # decoding: causal over the cache plus the new positions
            mask = decode_mask(tokens.shape[1], len(cache), tokens.device)
        embeds = self.embed_tokens(tokens).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, positions)
        return self.midlayer(embeds, hidden, cos, sin, mask, cache)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden)).float()

    def target_features(self, target_out: TargetOutputs) -> torch.Tensor:
        if target_out.aux_hidden is None or target_out.taps != self.needs.taps:
            raise SpecdraftError(
                f"EAGLE-3 reads target layers {list(self.needs.taps)}, and the target tapped "
                f"{list(target_out.taps)}: build or load the drafter on the target (it calls target.require(needs))"
            )
        return target_out.aux_hidden

    def draft_input(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features.to(self.fc.weight.dtype))

    @property
    def draft_to_target(self) -> torch.Tensor:
        return self.draft_ids

    @property
    def logit_rows(self) -> torch.Tensor | None:
        """The target rows its training reads: the draft vocabulary's, when it is reduced."""
        return self.draft_ids if self.needs.logits == "draft_rows" else None

    # -- training: the training-time test ---------------------------------------------------------
    def unroll(self, features, ids, positions, mask0, rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The training-time test: step k's outputs [B, T, H] for k = 0..ttt_steps-1.

        Step k, row i reads t_{i+k+1} and the previous step's row i at RoPE position i + k, and
        attends the step-0 keys allowed by ``mask0`` plus row i's keys from steps 1..k: the references'
        mask [mask0 | I | ... | I] over the keys of every step, which ``TrainingTimeTestKeys`` computes
        exactly with one attention over the step-0 keys per step.

        Row i's later steps read nothing of the other rows but their step-0 keys, so with ``rows`` [B, n]
        (``masks.gathered_rows``) steps 1.. run at those positions only, and their outputs are [B, n, H].
        """
        cache, hidden, outputs = TrainingTimeTestKeys(rows), self.draft_input(features), []
        for k in range(self.config.ttt_steps):
            tokens, at = shift_left(ids, k + 1), positions + k
            if k > 0 and rows is not None:
                if k == 1:
                    hidden = hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[-1]))
                tokens, at = tokens.gather(1, rows), at.gather(1, rows)
            hidden = self.draft_step(hidden, tokens, at, cache, mask0)
            outputs.append(hidden)
        return outputs

    def step_loss(self, hidden, step_target, weight) -> tuple[torch.Tensor, torch.Tensor]:
        """One training-time-test step's loss against p, and the draft's top-1 ids (for the metrics)."""
        logits = self.draft_logits(hidden)
        return DRAFTER_LOSSES[self.config.loss](logits, step_target, weight), logits.argmax(-1).detach()

    def compute_loss(self, batch: dict[str, torch.Tensor], target_out: TargetOutputs) -> LossOutput:
        ids, attention, loss_mask = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
        seq_ids = batch.get("seq_ids")
        B, T = ids.shape
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(T, device=ids.device).expand(B, T)

        # The target side, once: p over the draft vocabulary, and which next tokens the draft can emit.
        target_probs = draft_vocab_probs(target_out, self.draft_ids)
        in_vocab = label_in_draft_vocab(ids, self.t2d)
        mask0 = block_causal_mask(attention, seq_ids)  # step 0 sees what the target saw
        # Step k, row i predicts t_{i+k+2} ~ logits[:, i+k+1], weighted by loss_mask[:, i+k+2] (the loop's
        # loss_mask[:, 1:] convention). Rows 0..T-k-3 have a target.
        counted = []
        for k in range(self.config.ttt_steps):
            rows = max(T - k - 2, 0)
            weight = loss_mask[:, k + 2 :] & in_vocab[:, k + 2 :] & attention[:, :rows] & attention[:, k + 2 :]
            if seq_ids is not None:  # packing: the predicted token must be in row i's document
                weight = weight & (seq_ids[:, :rows] == seq_ids[:, k + 2 :])
            counted.append(weight)
        # Steps 1.. run only where a later step's loss counts, and the LM head and the loss only over the
        # counted rows (not the prompts' tokens or the padding).
        indices = every_row(counted, T) if self.static_shapes else counted_rows(counted, T)
        rows = rank = None
        if len(counted) > 1 and not self.static_shapes:
            rows, rank = gathered_rows(torch.stack([F.pad(w, (0, T - w.shape[1])) for w in counted[1:]]).any(0))
            if rows.shape[1] == 0:  # no later step counts anywhere: nothing to run them at
                rows = None
        steps = self.unroll(self.target_features(target_out), ids, positions, mask0, rows)
        losses, correct = [], []
        for k, (hidden, weight, index) in enumerate(zip(steps, counted, indices)):
            step_rows = index if k == 0 or rows is None else gathered_index(index, rank, rows.shape[1])
            step_hidden, step_target = rows_at(hidden, step_rows), rows_at(target_probs, index, shift=k + 1)
            step_weight = weights_at(weight, index, T)
            if self.config.checkpoint_logits and torch.is_grad_enabled():
                step_loss, draft_top = checkpoint(self.step_loss, step_hidden, step_target, step_weight,
                                                  use_reentrant=False)
            else:
                step_loss, draft_top = self.step_loss(step_hidden, step_target, step_weight)
            losses.append(step_loss)
            with torch.no_grad():  # the target's top-1 within the draft vocabulary
                hit = torch.zeros(B * T, dtype=torch.bool, device=index.device)
                hit[index] = draft_top == step_target.argmax(-1)
                correct.append(hit.view(B, T)[:, : weight.shape[1]])

        weights = ttt_step_weights(len(losses), self.config.step_weight_decay)
        loss = sum(w * step_loss for w, step_loss in zip(weights, losses))
        metrics = {f"loss_{k}": step_loss.detach() for k, step_loss in enumerate(losses)}
        metrics.update(chain_accuracy_metrics(correct, counted))
        return LossOutput(loss, metrics)

    # -- what save_pretrained records (BorrowsTargetWeights) -------------------------------------------
    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features


def build_eagle3(target, cfg: Eagle3Config, draft_vocab: DraftVocab | None = None,
                 taps: tuple[int, ...] | None = None) -> Eagle3Drafter:
    """A fresh EAGLE-3 drafter for ``target`` (works on the meta device, for sizing).

    ``draft_vocab`` comes from ``specdraft.data.vocab.build_draft_vocab`` when
    ``cfg.uses_reduced_vocab(target.vocab_size)``; otherwise leave it None for the full vocabulary.
    It reads ``taps``, else the layers the target already taps (the recipe's ``target.taps``), else
    layers 2, N//2 and N-3.
    """
    check_target_architecture(target, "EAGLE-3")
    taps = taps or target.taps or eagle3_default_taps(target.num_layers)
    if len(taps) != 3:
        raise SpecdraftError(
            f"EAGLE-3 fuses exactly 3 target layers (low, middle, high); the target taps {list(taps)}. "
            "Set target.taps to auto (layers 2, N//2, N-3) or to three layer indices."
        )
    vocab_size = target.vocab_size
    if draft_vocab is None:
        draft_vocab = _default_draft_vocab(cfg, vocab_size, target.device)
    if draft_vocab.size > vocab_size or draft_vocab.t2d.numel() != vocab_size:
        raise SpecdraftError(
            f"the draft vocabulary ({draft_vocab.size} tokens, map over {draft_vocab.t2d.numel()}) does not fit the "
            f"target's vocabulary of {vocab_size}; rebuild it for this target "
            "(specdraft.data.vocab.build_draft_vocab with its vocab size)."
        )
    with torch.device(target.device):
        drafter = Eagle3Drafter(target, cfg, draft_vocab, tuple(taps))
    drafter = drafter.to(target.device)  # the vocabulary buffers were made on the CPU
    target.require(drafter.needs)
    if target.device.type != "meta":
        # Start the draft head at the target's head rows for the draft vocabulary (trainable),
        # as vLLM's speculators does: step 1 then begins near the target's own next-token map
        # instead of at random, which matters most when the training data is small.
        with torch.no_grad():
            drafter.lm_head.weight.copy_(target.lm_head.weight[drafter.draft_ids].to(drafter.lm_head.weight.dtype))
    return drafter


def _default_draft_vocab(cfg: Eagle3Config, vocab_size: int, device: torch.device) -> DraftVocab:
    if not cfg.uses_reduced_vocab(vocab_size):  # the full vocabulary, identity map
        return DraftVocab.from_target_ids(torch.arange(vocab_size), vocab_size)
    if device.type != "meta":
        raise SpecdraftError(
            f"drafter.draft_vocab_size is {cfg.draft_vocab_size}, below the target's {vocab_size} tokens, so EAGLE-3 "
            "needs a draft vocabulary built from the data: pass build_draft_vocab(...)'s result to build(), "
            "or set drafter.draft_vocab_size: null for the full vocabulary."
        )
    # Sizing on the meta device: only the shapes matter.
    return DraftVocab.from_target_ids(torch.arange(cfg.draft_vocab_size), vocab_size)


def load_eagle3(path, target) -> Eagle3Drafter:
    saved, tensors = read_drafter_folder(path, "eagle3")
    check_same_target(saved, target, path)
    vocab = DraftVocab(d2t=tensors["d2t"].long(), t2d=tensors["t2d"].bool())
    drafter = build_eagle3(target, Eagle3Config(**saved["config"]), vocab, tuple(saved["target_taps"]))
    drafter.load_state_dict(tensors)
    return drafter


EAGLE3 = Family(
    name="eagle3", config_cls=Eagle3Config, needs=eagle3_needs, build=build_eagle3, load=load_eagle3,
    exporters=EAGLE3_EXPORTERS, needs_draft_vocab=True, static_loss=Eagle3Drafter.static_loss,
    selftest_settings={"ttt_steps": 3, "draft_vocab_size": 1024},  # the reduced draft vocabulary
)
