"""EAGLE-1 (Li et al. 2024, arXiv 2401.15077): autoregression at the feature level.

The target's last hidden state f_i (the LM-head input) and the next token t_{i+1} go in;
the draft predicts the next feature f_{i+1}, and the target's frozen LM head turns it
into a token distribution:

    x_i      = fc([embed(t_{i+1}); f_i])          fc: Linear(2H -> H, bias) as in the reference
    f_hat    = DecoderLayer(x)_i                  one layer of the target's own architecture,
                                                  without its input norm (reference cnets.py)
    p_hat    = softmax(LM_Head(f_hat_{i+1}))

Trained with L = SmoothL1(f_hat, f) + 0.1 * CE(p, p_hat) (``eagle_losses.eagle1_loss``),
on input features with uniform noise. Embedding and LM head are the target's: borrowed,
frozen, never saved. Saved parameter names follow the reference checkpoints: ``fc``,
``layers.0.{self_attn,mlp,post_attention_layernorm}``.

Taps: none (``target.taps: auto``); the draft reads the target's final hidden state.

Exports (``specdraft export RUN --format F``; the exporters are in ``eagle_export.py``):
  sglang  the EAGLE reference layout (SGLang's ``LlamaForCausalLMEagle``, also the EAGLE repo's
          ``EaModel``): ``fc`` with its bias, ``layers.0.*``
  vllm    the reference layout with a Llama config (``method: eagle``): ``fc`` without bias, so a
          drafter that learned an fc bias is refused (``drafter.fc_bias: false`` trains one vLLM serves)
  hf      specdraft's own folder, loaded by ``specdraft eval``
Every consumer of these layouts binds the target's embedding itself, so no EAGLE-1 export ships one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..contract import Family, LossOutput, TargetNeeds, TargetOutputs
from ..errors import SpecdraftError
from ..losses import DRAFTER_LOSSES, check_drafter_loss, masked_mean
from ..masks import block_causal_mask, counted_rows, document_lengths, every_row, rows_at, shift_left, weights_at
from ..transformers_compat import cache_kwargs
from .eagle_common import (
    BorrowsTargetWeights,
    DraftCache,
    borrowed_head_logits,
    check_target_architecture,
    decode_mask,
)
from .eagle_export import EAGLE1_EXPORTERS
from .eagle_losses import eagle1_loss
from .folder import check_same_target, read_drafter_folder


@dataclass
class Eagle1Config:
    """EAGLE-1 hyper-parameters; defaults are the reference training script's (eagle/train/main.py)."""

    cls_weight: float = 0.1  # w_cls in L = L_reg + w_cls * L_cls ("p_w")
    noise: str = "uniform"  # feature augmentation: "uniform" or "none"
    # Reference AddUniformNoise: (U[0,1) - 0.5) * noise_width * noise_ref_len / seq_len, i.e.
    # U(-0.1, 0.1) at 512 tokens, wider for shorter sequences. noise_ref_len None: no length scaling.
    noise_width: float = 0.2
    noise_ref_len: int | None = 512
    fc_bias: bool = True
    # L_cls's divergence (losses.DRAFTER_LOSSES): ce, the paper's; tvd, lk_alpha, lk_hybrid aim at acceptance.
    loss: str = "ce"

    # Recommended optimizer for the training loop (reference main.py): AdamW, betas (0.9, 0.95),
    # lr 3e-5, torch's default weight decay 0.01, and gradient *value* clipping at 0.5.
    optimizer_defaults: ClassVar[dict] = {
        "lr": 3e-5, "betas": (0.9, 0.95), "weight_decay": 0.01, "clip_grad_value": 0.5, "max_grad_norm": 0.0,
    }

    def __post_init__(self):
        if self.noise not in ("uniform", "none"):
            raise SpecdraftError(f"drafter.noise must be 'uniform' or 'none', got {self.noise!r}")
        if self.noise_width < 0 or self.cls_weight < 0:
            raise SpecdraftError("drafter.noise_width and drafter.cls_weight must be >= 0")
        check_drafter_loss(self.loss)


def uniform_feature_noise(features: torch.Tensor, lengths: torch.Tensor, cfg: Eagle1Config) -> torch.Tensor:
    """The reference's AddUniformNoise: U(-w/2, w/2) scaled by ref_len / the sample's length. The reference
    adds it to each sample alone (its length is the sample's); ``lengths`` [B, T] is each position's own
    document's length (``masks.document_lengths``), so a packed row's samples get their own scales too."""
    scale = torch.ones_like(lengths, dtype=features.dtype)
    if cfg.noise_ref_len is not None:
        scale = cfg.noise_ref_len / lengths.clamp_min(1).to(features.dtype)
    return (torch.rand_like(features) - 0.5) * cfg.noise_width * scale[..., None]


def eagle1_needs(cfg: Eagle1Config, target_config) -> TargetNeeds:
    """The final hidden state f (its feature), and the full-vocabulary logits (L_cls's p)."""
    return TargetNeeds(logits="full", final_hidden=True)


class Eagle1Drafter(BorrowsTargetWeights, nn.Module):
    family = "eagle1"
    logit_rows = None  # its classification target is the full vocabulary

    def __init__(self, target, cfg: Eagle1Config):
        super().__init__()
        layer_cls = check_target_architecture(target, "EAGLE-1")
        hidden = target.hidden_size
        self.config = cfg
        self.target_config = target.config
        self.needs = eagle1_needs(cfg, target.config)
        self.fc = nn.Linear(2 * hidden, hidden, bias=cfg.fc_bias)
        # The layer must accept our boolean masks and cache: pin the SDPA attention path.
        layer_config = copy.deepcopy(target.config)
        layer_config._attn_implementation = "sdpa"
        layer = layer_cls(layer_config, layer_idx=0)
        # Reference cnets.py: the first draft layer has no input norm (fc's output feeds attention directly).
        layer.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([layer])
        self.bind_target(target)

    # -- the draft network ------------------------------------------------------------------------
    def draft_step(self, features, tokens, positions, cache: DraftCache | None = None,
                   mask=None) -> torch.Tensor:
        """f_hat_{i+1} for each position i from (f_i, t_{i+1}); [B, m, H] -> [B, m, H]."""
        if mask is None:  # decoding: causal over the cache plus the new positions
            mask = decode_mask(tokens.shape[1], len(cache), tokens.device)
        embeds = self.embed_tokens(tokens).to(features.dtype)
        x = self.fc(torch.cat([embeds, features], dim=-1))
        out = self.layers[0](
            x, attention_mask=mask, position_ids=positions, use_cache=cache is not None,
            position_embeddings=self.rotary_emb(x, positions), **cache_kwargs(self.layers[0], cache),
        )
        return out[0] if isinstance(out, tuple) else out

    def draft_logits(self, predicted_features: torch.Tensor) -> torch.Tensor:
        # the target's, in the target's dtype (e.g. bf16 under an fp32 drafter)
        return borrowed_head_logits(self.target_lm_head, predicted_features)

    def target_features(self, target_out: TargetOutputs) -> torch.Tensor:
        if target_out.final_hidden is None:
            raise SpecdraftError("EAGLE-1 reads the target's final hidden state, and this target does not compute "
                                 "it: build or load the drafter on the target (it calls target.require(needs))")
        return target_out.final_hidden

    def draft_input(self, features: torch.Tensor) -> torch.Tensor:
        return features.to(self.fc.weight.dtype)

    draft_to_target = None  # the draft vocabulary is the target's

    # -- training ---------------------------------------------------------------------------------
    def compute_loss(self, batch: dict[str, torch.Tensor], target_out: TargetOutputs) -> LossOutput:
        ids, attention = batch["input_ids"], batch["attention_mask"]
        B, T = ids.shape
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(T, device=ids.device).expand(B, T)
        features = self.target_features(target_out).to(self.fc.weight.dtype)
        noisy = features
        if self.training and self.config.noise == "uniform":
            lengths = document_lengths(attention, batch.get("seq_ids"))
            noisy = features + uniform_feature_noise(features, lengths, self.config)

        # Row i reads (f_i, t_{i+1}) and predicts f_{i+1}, hence token t_{i+2}: its target
        # distribution is logits[:, i + 1], weighted by loss_mask[:, i + 2] (the loop's
        # loss_mask[:, 1:] convention applied to position i + 1). Rows 0..T-3 have targets.
        mask = block_causal_mask(attention, batch.get("seq_ids"))
        predicted = self.draft_step(noisy, shift_left(ids, 1), positions, mask=mask)
        rows = max(T - 2, 0)
        weight = batch["loss_mask"][:, 2:].bool() & attention[:, :rows].bool() & attention[:, 2:].bool()
        if "seq_ids" in batch:  # packing: the predicted token must belong to row i's document
            weight = weight & (batch["seq_ids"][:, :rows] == batch["seq_ids"][:, 2:])

        # The LM head and the loss run over the counted rows only (not the prompts' tokens or the padding).
        (index,) = every_row([weight], T) if self.static_shapes else counted_rows([weight], T)
        predicted_rows = rows_at(predicted, index)
        draft_logits = self.draft_logits(predicted_rows)
        target_logits = rows_at(target_out.logits, index, shift=1)  # the target's dtype: read as float32 below
        counted = weights_at(weight, index, T)
        loss, regression, classification = eagle1_loss(
            predicted_rows, rows_at(features, index, shift=1), draft_logits,
            torch.softmax(target_logits, -1, dtype=torch.float32),
            counted, self.config.cls_weight, DRAFTER_LOSSES[self.config.loss],
        )
        with torch.no_grad():
            acc = masked_mean((draft_logits.argmax(-1) == target_logits.argmax(-1)).float(), counted)
        metrics = {"loss_reg": regression.detach(), "loss_cls": classification.detach(), "acc_0": acc}
        return LossOutput(loss, metrics)

    # -- what save_pretrained records (BorrowsTargetWeights) -------------------------------------------
    @property
    def draft_vocab_size(self) -> int:
        return self.target_lm_head.weight.shape[0]  # it drafts through the target's own LM head


def build_eagle1(target, cfg: Eagle1Config, draft_vocab=None) -> Eagle1Drafter:
    """A fresh EAGLE-1 drafter for ``target`` (works on the meta device, for sizing)."""
    if draft_vocab is not None:
        raise SpecdraftError("EAGLE-1 drafts over the target's full vocabulary; do not pass a draft vocabulary")
    with torch.device(target.device):
        drafter = Eagle1Drafter(target, cfg)
    target.require(drafter.needs)
    return drafter


def load_eagle1(path, target) -> Eagle1Drafter:
    saved, tensors = read_drafter_folder(path, "eagle1")
    check_same_target(saved, target, path)
    drafter = build_eagle1(target, Eagle1Config(**saved["config"]))
    drafter.load_state_dict(tensors)
    return drafter


EAGLE1 = Family(name="eagle1", config_cls=Eagle1Config, needs=eagle1_needs, build=build_eagle1, load=load_eagle1,
                exporters=EAGLE1_EXPORTERS, static_loss=Eagle1Drafter.static_loss,
                selftest_settings={"fc_bias": False})  # vLLM's EAGLE-1 export (no fc bias) among those checked
