"""The contract every drafter family implements, and what the target hands it.

A drafter is trained by the one loop in ``specdraft.train`` and served by the one
decoder in ``specdraft.decoding``. Neither knows which family it holds: they talk
to it only through ``Drafter`` (training, saving) and ``DraftSource`` (decoding).

Batch layout (made by ``specdraft.data``), all ``[B, T]``:
  input_ids       token ids
  attention_mask  1 for real tokens, 0 for padding
  loss_mask       1 where the token is an assistant token we want predicted
                  (position t's target is token t+1, so the loop uses loss_mask[:, 1:])
  position_ids    positions, restarted at 0 for each document when packing
  seq_ids         (packing only) which document of the row each token belongs to;
                  ``specdraft.data.collate.attention_mask_4d`` turns it into the
                  block-causal mask both the target and the drafter use
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import torch


@dataclass
class TargetOutputs:
    """What one no-grad target forward yields, aligned with the batch positions.

    ``logits[:, t]`` is the target's distribution over token t+1.
    """

    logits: torch.Tensor  # [B, T, V] target logits (float)
    last_hidden: torch.Tensor  # [B, T, H] final *normed* hidden state: the LM-head input (EAGLE-1 feature)
    aux_hidden: torch.Tensor | None = None  # [B, T, n_taps * H] tapped layer inputs, concatenated in tap order (EAGLE-3)

    def slice(self, positions: slice) -> "TargetOutputs":
        """The same outputs restricted to a range of positions (dim 1)."""
        aux = None if self.aux_hidden is None else self.aux_hidden[:, positions]
        return TargetOutputs(self.logits[:, positions], self.last_hidden[:, positions], aux)


@dataclass
class Proposal:
    """K drafted tokens per row, in *target* vocabulary ids, and the draft distribution q.

    ``probs[:, k]`` is the (warped) draft distribution that ``tokens[:, k]`` was
    drawn from, over the target vocabulary. ``None`` means the drafts are
    deterministic (q is one-hot on the token), as for prompt lookup.
    """

    tokens: torch.Tensor  # [B, K] long
    probs: torch.Tensor | None  # [B, K, V_target] float, or None


@runtime_checkable
class DraftSource(Protocol):
    """What the speculative decoder talks to.

    One decoding step, for a sequence s_0..s_{L-1} whose next token s_L is
    already chosen but not yet run through the target ("pending"):

      proposal = source.propose(pending, k, params, generator)
      target runs [pending, d_1..d_k] in one forward, verify keeps n drafts
      source.commit(kept=[pending, d_1..d_n], target_out for those n+1 positions)

    so a source always knows the target's outputs for every committed token,
    and never for the pending one (that is what EAGLE needs: feature f_i and
    token s_{i+1} predict s_{i+2}).
    """

    def start(self, prompt_ids: torch.Tensor, target_out: TargetOutputs) -> None:
        """Reset state for a new sequence; ``target_out`` covers every prompt position."""

    def propose(
        self,
        pending: torch.Tensor,  # [B, 1] the chosen-but-unverified token
        k: int,
        params: Any,  # specdraft.decoding.sampling.SamplingParams
        generator: torch.Generator | None,
    ) -> Proposal: ...

    def commit(self, kept_ids: torch.Tensor, target_out: TargetOutputs) -> None:
        """``kept_ids`` [B, n+1] = pending + accepted drafts; ``target_out`` covers exactly those positions."""


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    metrics: dict[str, torch.Tensor]  # scalars for logging (acc_0, loss_0, ...); detached


@dataclass(frozen=True)
class Family:
    """One drafter family, as registered in ``specdraft.drafters.FAMILIES`` (a plain dict).

    ``config_cls`` is a dataclass of the family's hyper-parameters; its defaults are
    the paper's. The recipe's ``drafter:`` section (minus ``family``) is parsed into it.
    """

    name: str
    config_cls: type
    # build(target: FrozenTarget, cfg: config_cls, draft_vocab: DraftVocab | None) -> Drafter
    # Works on the meta device too (target built with FrozenTarget.from_config on "meta").
    build: Callable[..., Any]
    # load(path, target: FrozenTarget) -> Drafter, from a save_pretrained folder (re-binds frozen target weights)
    load: Callable[..., Any]
    # export format name -> export(drafter, target, out_dir: Path) -> None
    exporters: dict[str, Callable[..., None]]
    needs_draft_vocab: bool = False  # the loop builds d2t/t2d from the training data first


@runtime_checkable
class Drafter(Protocol):
    """A trainable drafter: an ``nn.Module`` defined in one file of ``specdraft/drafters/``."""

    family: str

    def compute_loss(self, batch: dict[str, torch.Tensor], target_out: TargetOutputs) -> LossOutput:
        """Loss and metrics for one batch, given the frozen target's outputs on it."""

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters the optimizer updates (frozen target-derived weights excluded)."""

    def draft_source(self, target: Any) -> DraftSource:
        """A decoding-time view of this drafter bound to a live target."""

    def save_pretrained(self, path: str | Path) -> None:
        """config.json (family, hyper-parameters, target dims) + model.safetensors, trainable weights only."""
