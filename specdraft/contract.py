"""The contract between the target, the training loop, the decoder, the exporters and the drafter families.

Nothing here knows a family. The loop (``specdraft.train``), the decoder (``specdraft.decoding``)
and the export driver (``specdraft.export``) talk to a drafter only through these types; a family
is one module of ``specdraft/drafters/`` that fills them in, and one line in its registry.

    Family.needs(cfg, target_config)        -> TargetNeeds   what to compute, before any weight loads
    Family.build(target, cfg, draft_vocab)  -> Drafter       (Family.load(path, target) for a saved one)
    drafter.prepare(batch, context)         -> Example       its own training example (target forward,
                                                             cache read, or sequences it generates first)
    drafter.compute_loss(batch, target_out) -> LossOutput
    drafter.trained_module()                -> nn.Module     what is optimised, wrapped, checkpointed, resumed
    drafter.configure_optimizers(recipe, total_steps) -> Optimization   its parameter groups and schedule
    drafter.draft_source(target)            -> DraftSource   start / propose / commit, for the decoder; its
                                                             class declares the rest (DraftCapabilities)
    drafter.save_pretrained(path)                            config.json + model.safetensors
    Family.exporters[format]                -> Exporter      write / read_back / serve hint
                                               (FolderExporter: a format that is a whole folder)
    Family.eval_report, .check_recipe                        optional: a family's own end-of-training
                                                             figures, and checks across a recipe's sections
    Family.static_loss                                       optional: its loss at fixed shapes, which
                                                             training.compile compiles

A family declares what it needs from the target (``TargetNeeds``: which logits — none, full, only its
draft vocabulary's rows, or the last position — the final hidden state, which layers to tap, and whether
it trains adapters inside the target), and the target computes only that: EAGLE-3 training never forms
the 49k-wide logits of SmolLM2, only its 8,192 draft rows, and decode prefill asks for the last
position. Taps follow vLLM's convention: tap ``i`` is the *input* of decoder layer ``i``. A drafter
makes its own training example from a batch (``prepare``: one target forward or a feature-cache read by
default; a family may generate sequences first), names the module the loop optimises, wraps,
checkpoints and resumes (``trained_module``), configures its own optimisation for the run's length, as
nanoGPT's model does (``configure_optimizers``: parameter groups, each at its own learning rate, the
schedule, and whether some steps leave parameters without a gradient, so DDP looks for them), and owns its
exporters with their serve hints. A family may also declare, in its registry entry, its own
end-of-training report (``eval_report``), checks across the recipe's sections (``check_recipe``), and
export formats that are whole folders (``FolderExporter``); ``prepare`` sees the run's length
(``TrainingContext.total_steps``). A new family is one module under ``specdraft/drafters/``, its recipes, its tests
and one registry line. Everything cheap in a recipe (data files, eval prompts, run folder, feature
cache, taps against the target's config) is checked before any weight loads.

Batch layout (made by ``specdraft.data``), all ``[B, T]``:
  input_ids       token ids
  attention_mask  1 for real tokens, 0 for padding
  loss_mask       1 where the token is an assistant token we want predicted
                  (position t's target is token t+1, so a loss uses loss_mask[:, 1:])
  position_ids    positions, restarted at 0 for each document when packing
  seq_ids         (packing only) which document of the row each token belongs to;
                  ``specdraft.masks.block_causal_mask`` turns it into the block-causal mask
                  both the target and the drafter use
  sample_index    (offline features only) each row's index in its split, for the feature cache
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from .errors import SpecdraftError

# Which logits a family's training reads from the target:
#   none        no logits (the family predicts from features and the data's tokens)
#   full        [B, T, V] over the whole vocabulary at every position
#   draft_rows  [B, T, N] only the rows of the drafter's draft vocabulary (ids the drafter gives):
#               hidden @ lm_head.weight[ids].T, never the V-wide logits
#   last        [B, 1, V] the last position only (decode prefill)
LOGITS = ("none", "full", "draft_rows", "last")


@dataclass(frozen=True)
class TargetNeeds:
    """What a drafter family needs from the target. The loop builds the target and the feature
    cache from it, and the target computes nothing else (``FrozenTarget.require``)."""

    logits: str = "none"  # one of LOGITS: what the family's training loss reads
    final_hidden: bool = False  # the final *normed* hidden state, the LM-head input, at every position
    taps: tuple[int, ...] = ()  # layers whose *input* is tapped (vLLM's convention), in this order
    trains_adapters: bool = False  # the family trains adapters inside the target (Medusa-2's LoRA):
    # the target's forward then keeps autograd, and the adapters are part of ``trained_module()``

    def __post_init__(self):
        if self.logits not in LOGITS:
            raise SpecdraftError(f"TargetNeeds.logits must be one of {', '.join(LOGITS)}, got {self.logits!r}")
        object.__setattr__(self, "taps", tuple(int(t) for t in self.taps))


@dataclass
class TargetOutputs:
    """What one target forward yields, aligned with the batch positions. Every field is optional:
    the target fills what it was asked for (``TargetNeeds``, and the ``logits`` of the call).

    ``logits[:, t]`` is the target's distribution over token t+1, over the vocabulary rows
    ``vocab_rows`` (None: all of them), at every position, or only the last (``last_only``).
    """

    logits: torch.Tensor | None = None  # float32 [B, T, V]; [B, T, N] for draft rows; [B, 1, V] last only
    vocab_rows: torch.Tensor | None = None  # [N] long: the target id of each logit column; None = all V
    last_only: bool = False  # logits hold the last position only (features still cover every position)
    final_hidden: torch.Tensor | None = None  # [B, T, H] final normed hidden state: the LM-head input
    aux_hidden: torch.Tensor | None = None  # [B, T, len(taps) * H] tapped layer inputs, concatenated in order
    taps: tuple[int, ...] = ()  # the layers ``aux_hidden`` holds

    def slice(self, positions: slice) -> TargetOutputs:
        """The same outputs restricted to a range of positions (dim 1)."""
        if self.last_only:
            raise SpecdraftError("last-position logits cannot be sliced by position; ask the target for logits='full'")

        def cut(x):
            return None if x is None else x[:, positions]

        return TargetOutputs(cut(self.logits), self.vocab_rows, False, cut(self.final_hidden), cut(self.aux_hidden),
                             self.taps)


@dataclass
class Proposal:
    """Drafted tokens, in *target* vocabulary ids, with the draft distribution q of each.

    A proposal is a tree of K nodes: node k's parent is ``parents[:, k]``, -1 meaning the pending
    token (the root), in topological order (a parent before its children), with no two siblings
    sharing a token. ``parents=None`` is the chain, node k's parent being node k-1. The decoder
    verifies a tree in one target forward with a tree attention mask (``specdraft.decoding.trees``);
    sources that declare tree kinds (``DraftCapabilities.tree_kinds``) draft trees through
    ``propose_tree(pending, tree, params, generator)`` when asked by ``specdraft.decoding.speculative.TreeDrafting``.

    ``probs[:, k]`` is the (warped) draft distribution that ``tokens[:, k]`` was drawn from,
    over the target vocabulary. ``None`` means the drafts are deterministic (q is one-hot on the
    token), as for prompt lookup.
    """

    tokens: torch.Tensor  # [B, K] long
    probs: torch.Tensor | None  # [B, K, V_target] float, or None
    parents: torch.Tensor | None = None  # [B, K] long, parents[:, k] < k; None = a chain

    def is_chain(self) -> bool:
        """Whether the tree is a chain (a host sync, only when ``parents`` is given)."""
        if self.parents is None:
            return True
        K = self.tokens.shape[1]
        chain = torch.arange(-1, K - 1, device=self.parents.device).expand_as(self.parents)
        return bool(torch.equal(self.parents, chain))


TREE_KINDS = ("static", "dynamic")  # specdraft.decoding.trees' StaticTree and DynamicTree (their ``kind``)


@dataclass(frozen=True)
class DraftCapabilities:
    """What a ``DraftSource`` can do besides drafting one sequence's chain (``propose``), declared by its class
    (``capabilities = DraftCapabilities(...)``) and read by the decoder. The default declares nothing: chains
    only, a batch's rows drafted one at a time."""

    # The trees the source drafts through ``propose_tree(pending [1, 1], tree, params, generator) -> Proposal``,
    # by kind (TREE_KINDS: "static", Medusa-style StaticTree; "dynamic", EAGLE-2's DynamicTree). () : chains only.
    tree_kinds: tuple[str, ...] = ()
    # The attributes that hold the source's whole per-sequence state after ``start`` (tensors, dim 0 the batch).
    # Copies of one source (one model) then draft a batch's rows together (``specdraft.decoding.rows``): in
    # one ``propose`` on a shallow copy holding the rows' states concatenated, and each row keeps the first
    # drafts it asked for, so a chain of k drafts must begin with the chain of k' < k. () : row by row.
    row_state: tuple[str, ...] = ()
    # The rows' states cannot be concatenated (a KV cache per row, of the row's length): the class's staticmethod
    # ``propose_rows(sources, pending [R, 1], k, params, generator) -> Proposal [R, k]`` drafts for R copies of
    # itself at once instead, leaving each as its own ``propose`` would.
    ragged_rows: bool = False

    def __post_init__(self):
        object.__setattr__(self, "tree_kinds", tuple(self.tree_kinds))
        object.__setattr__(self, "row_state", tuple(self.row_state))
        unknown = [kind for kind in self.tree_kinds if kind not in TREE_KINDS]
        if unknown:
            raise SpecdraftError(f"DraftCapabilities.tree_kinds lists {', '.join(map(repr, unknown))}; the tree kinds "
                                 f"are {', '.join(TREE_KINDS)}")
        if self.ragged_rows and not self.row_state:
            raise SpecdraftError("DraftCapabilities(ragged_rows=True) needs row_state: the attributes propose_rows "
                                 "reads and leaves as each row's own propose would")

    def promised_methods(self) -> tuple[str, ...]:
        """The methods, besides start / propose / commit, that the declaration promises the source's class gives."""
        return tuple(method for method, promised in (("propose_tree", bool(self.tree_kinds)),
                                                     ("propose_rows", self.ragged_rows)) if promised)


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
    token s_{i+1} predict s_{i+2}). The target's outputs carry the features its
    drafters declared (``TargetNeeds``) at every position; prefill's logits cover the
    last position only.

    What else a source can do, its class declares in ``capabilities`` (``DraftCapabilities``: trees,
    rows drafted together, and the methods those take); ``DraftCapabilities()`` declares nothing
    else. Callers read the declaration, and ``check_capabilities`` refuses one the class's methods
    do not back. A batch's rows each decode with ``copy.copy(source)``: a shallow copy shares the
    model, and ``start`` makes the per-sequence state (a source holding another source copies that
    one too, in its ``__copy__``).
    """

    capabilities: DraftCapabilities

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


def check_capabilities(source) -> DraftCapabilities:
    """``source``'s declared capabilities, once its class is checked to give the methods they promise: a source
    that cannot do what it declares is refused before decoding, naming it, rather than failing mid-decode."""
    name = type(source).__name__
    if not isinstance(source, DraftSource):
        raise SpecdraftError(
            f"{name} is not a DraftSource: a source has start, propose and commit, and its class declares what else "
            "it can do, `capabilities = DraftCapabilities(...)` (specdraft.contract; DraftCapabilities() for nothing)"
        )
    capabilities = source.capabilities
    if not isinstance(capabilities, DraftCapabilities):
        raise SpecdraftError(f"{name}.capabilities must be a specdraft.contract.DraftCapabilities, got "
                             f"{type(capabilities).__name__}")  # fmt: skip
    cls = type(source)
    missing = [method for method in capabilities.promised_methods() if not callable(getattr(cls, method, None))]
    if missing:
        raise SpecdraftError(f"{name} declares {capabilities} but its class has no {' or '.join(missing)}: define "
                             "it, or leave that capability out of its declaration")
    return capabilities


@dataclass
class TrainingContext:
    """What ``Drafter.prepare`` may use besides the batch."""

    target: Any  # the FrozenTarget (loaded in offline mode too: drafters borrow its weights)
    cache: Any = None  # specdraft.features.FeatureCache of this split, or None: run the target
    step: int = 0  # optimizer steps done so far: a family with stages switches on it
    training: bool = True  # False for the held-out batches of the periodic eval
    total_steps: int = 0  # the run's optimizer steps in all: for a schedule over the run's length (0: unknown)


@dataclass
class Example:
    """One training example, as ``Drafter.prepare`` makes it from a data batch."""

    batch: dict[str, torch.Tensor]  # the tokens the loss reads: the data's, or sequences generated from it
    target: TargetOutputs  # the target's outputs on ``batch``


def target_example(batch: dict[str, torch.Tensor], context: TrainingContext, needs: TargetNeeds,
                   rows: torch.Tensor | None = None) -> Example:
    """The default ``prepare``: the target's outputs on the batch, from one forward or from the
    feature cache. ``rows``: the draft vocabulary's target ids, when ``needs.logits`` is "draft_rows"."""
    if context.cache is not None:
        return Example(batch, context.cache.lookup(batch, needs.logits, rows))
    return Example(batch, context.target.forward_batch(batch, needs.logits, rows))


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    metrics: dict[str, torch.Tensor]  # scalars for logging (acc_0, loss_0, ...); detached


@dataclass
class Optimization:
    """How a drafter is optimised over a run (``Drafter.configure_optimizers``): the loop builds AdamW from the
    groups (the recipe's betas and eps), prepares it with the drafter, and steps the schedule once per optimizer
    step. ``specdraft.optim.recipe_optimization`` makes the recipe's own, which most families return."""

    # AdamW parameter groups over trained_module()'s parameters: "params", "lr", "weight_decay"
    param_groups: list[dict]
    # optimizer -> LR scheduler: the optimizer as prepared (what the scheduler must step), so made after prepare
    schedule: Callable[[torch.optim.Optimizer], Any]
    # Some steps leave trained parameters without a gradient (a stage that trains part of the module): DDP
    # must then look for them (find_unused_parameters, a graph walk per step), or its next step raises.
    unused_parameters: bool = False


@runtime_checkable
class Drafter(Protocol):
    """A trainable drafter: an ``nn.Module`` defined in one module of ``specdraft/drafters/``.

    The loop calls ``train()``/``eval()`` on it as on any module.
    """

    family: str
    needs: TargetNeeds  # what it reads from the target; building it made the target compute that

    def trained_module(self) -> nn.Module:
        """The module the loop optimises (its parameters with requires_grad), wraps (DDP, DeepSpeed),
        checkpoints and resumes: the drafter's own weights, plus adapters inside the target where
        the family trains them. A checkpoint writes its trainable tensors and buffers, and a resume loads
        them back into it (``specdraft.checkpoint``)."""

    def configure_optimizers(self, recipe: Any, total_steps: int) -> Optimization:
        """How ``trained_module()`` trains over a run of ``total_steps`` optimizer steps, from the recipe
        (``specdraft.config.Recipe``): usually ``specdraft.optim.recipe_optimization``; a family with stages
        or parts trained at other rates gives its own groups, schedule or unused parameters."""

    def prepare(self, batch: dict[str, torch.Tensor], context: TrainingContext) -> Example:
        """This drafter's training example from a data batch: usually ``target_example``; a family
        may generate sequences first (with the target, or itself) and score them with the target.

        It runs inside the forward of the module the loop wraps, once per micro-batch (and on the
        held-out batches, with ``context.training`` False). To generate with the target, KV-cached:
        ``context.target(ids, past_key_values=DynamicCache(config=target.config), use_cache=True,
        logits="last")`` gives the last position's logits and the declared features at every
        position; sampling with torch's global RNG keeps a resumed run exact (checkpoints restore it)."""

    def compute_loss(self, batch: dict[str, torch.Tensor], target_out: TargetOutputs) -> LossOutput:
        """Loss and metrics for one example (``Example.batch``, ``Example.target``)."""

    def draft_source(self, target: Any) -> DraftSource:
        """A decoding-time view of this drafter bound to a live target."""

    def save_pretrained(self, path: str | Path) -> None:
        """The drafter as published: config.json (family, hyper-parameters, target dims) and its weights,
        which exporters and ``load_drafter`` read, in whatever layout the family serves (DistillSpec's LoRA
        student merged). A resume never reads this folder: a checkpoint also writes ``trained_module()``'s
        trainable tensors and buffers itself (``specdraft.checkpoint.trained_tensors``), and the frozen
        rest is rebuilt from the recipe."""


@dataclass
class ExportOptions:
    # The target: a folder or hub id an engine can open. Named in engine configs, and the
    # checkpoint a shipped embedding is read from.
    verifier: str | None = None
    num_speculative_tokens: int = 3  # the proposal length written where a format records one


@dataclass(frozen=True)
class Exporter:
    """One export format of one family. ``specdraft export`` reads the saved drafter folder
    (config.json as ``saved``, model.safetensors as ``tensors``), calls ``write`` and writes its
    result; ``load_exported`` calls ``read_back`` on an export to check it and load it again."""

    # (saved, tensors, ExportOptions) -> (the format's config.json, its tensors)
    write: Callable[[dict, dict, ExportOptions], tuple[dict, dict]]
    # (saved, the export's tensors) -> the drafter's own tensors (write's inverse, without the embedding)
    read_back: Callable[[dict, dict], dict]
    # How to serve an export, printed by `specdraft export`: "{out}" is the export folder, TARGET the target,
    # "{k}" (and "{k+1}") the number of drafts per step it serves with (``draft_length``).
    serve_hint: str | None = None
    # (saved, ExportOptions) -> the drafts per step the export serves with; None: opts.num_speculative_tokens.
    draft_length: Callable[[dict, ExportOptions], int] | None = None
    # Ship the target's token embedding under this tensor name: the driver reads it from the target's
    # checkpoint (in the export dtype) into ``tensors`` before ``write``.
    target_embedding: str | None = None
    # The file the tensors go to: the name the consumer's loader opens.
    weights_file: str = "model.safetensors"


@dataclass(frozen=True)
class FolderExporter:
    """An export format that is not one config and one tensor file (a whole transformers model, say):
    ``write(drafter_dir, tmp, out, ExportOptions)`` fills the temporary folder ``tmp`` that the driver
    then renames to ``out`` (a format that names its own folder writes ``out``), and
    ``check(out, drafter_dir, ExportOptions)`` reads it back and raises if it is not what it should be."""

    write: Callable[[Path, Path, Path, ExportOptions], None]
    check: Callable[[Path, Path, ExportOptions], None]
    serve_hint: str | None = None  # as Exporter's
    draft_length: Callable[[dict, ExportOptions], int] | None = None  # as Exporter's


@dataclass(frozen=True)
class Family:
    """One drafter family, as registered in ``specdraft.drafters.FAMILIES`` (a plain dict).

    ``config_cls`` is a dataclass of the family's hyper-parameters; its defaults are the paper's
    (and its ``optimizer_defaults`` ClassVar fills the recipe's optimizer and clipping). The recipe's
    ``drafter:`` section (minus ``family``) is parsed into it.
    """

    name: str
    config_cls: type
    # (cfg, target's transformers config) -> TargetNeeds. Runs before any weight loads: also the place
    # to check the config against the target's dimensions (context length, layer count).
    needs: Callable[[Any, Any], TargetNeeds]
    # (target: FrozenTarget, cfg, draft_vocab: DraftVocab | None) -> Drafter. Calls target.require(
    # drafter.needs). Works on the meta device too (target built with FrozenTarget.from_config on "meta").
    build: Callable[..., Drafter]
    # (path, target) -> Drafter, from a save_pretrained folder (re-binds the target's frozen weights)
    load: Callable[..., Drafter]
    # export format -> Exporter (or FolderExporter). "hf" (specdraft's own folder, a copy) exists for every
    # family unless the family gives its own.
    exporters: dict[str, Exporter | FolderExporter] = field(default_factory=dict)
    needs_draft_vocab: bool = False  # the loop builds d2t/t2d of cfg.draft_vocab_size from the training data
    # (target, drafter, prompt_ids: list of [1, L] tensors, max_new_tokens) -> {name: number}: the family's
    # own figures for the end-of-training eval (Medusa-2: how far its adapted target drifted), printed and
    # written to eval/family_report.json. None: nothing beyond the decoding eval.
    eval_report: Callable[..., dict] | None = None
    # (recipe) -> None: checks across the recipe's sections (the drafter's settings against its data), run
    # before anything loads; raise SpecdraftError naming the fix. None: the sections are checked alone.
    check_recipe: Callable[[Any], None] | None = None
    # The drafter section `specdraft selftest` trains the family with: 8 steps on the toy target in seconds, every
    # path switched on, and at least 3 drafts a step (selftest decodes chains of 3). {}: the family's defaults.
    selftest_settings: dict = field(default_factory=dict)
    # training.compile: (drafter) -> its loss, (batch, target_out) -> LossOutput, switched to fixed shapes and no
    # host read (every row computed and masked, none gathered by a count), for torch.compile to capture whole.
    # None: the family does not compile, and ``compile_refusal`` says why.
    static_loss: Callable[[Any], Callable[..., LossOutput]] | None = None
    compile_refusal: str = ""
