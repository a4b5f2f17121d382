"""The one training loop, for every drafter family.

    train(recipe) = check_before_loading -> build_run -> run_steps -> finish

Per micro-batch the drafter makes its own example (``Drafter.prepare``: one target forward, a
feature-cache read, or sequences it generates first) inside the forward of the module accelerate
wraps, then computes its loss; accelerate handles accumulation, mixed precision and gradient sync.
Nothing here knows which family it is training: the family's declaration (``Family.needs``) says
what the target computes, and the drafter names the module that trains (``trained_module``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch import nn
from tqdm.auto import tqdm

from .atomic import atomic_folder, describe_bytes
from .checkpoint import (
    STATE_FILE,
    check_resumable,
    checkpoint_dirs,
    full_parameters,
    load_checkpoint,
    save_checkpoint,
)
from .config import Recipe
from .contract import Drafter, TargetNeeds, TrainingContext
from .data.collate import Collator, EpochOrder, TokenBudgetBatches, bucket_widths, pad_token_id_of
from .data.formats import check_data_source
from .data.pipeline import build_datasets, data_fingerprint, vocab_cache_key_parts
from .data.vocab import build_draft_vocab
from .decoding.sampling import SamplingParams
from .decoding.sources import PromptLookupSource
from .drafters import get_family, load_drafter
from .dtypes import (
    FLOAT32_OVERRIDES,
    MIXED_PRECISION_DTYPES,
    cpu_computes_natively,
    resolve_dtype,
    slow_cpu_dtype_warning,
)
from .errors import SpecdraftError, StoppedBySignal
from .evaluation.report import format_table
from .evaluation.run import PROMPT_LOOKUP, EvalSettings, evaluate, family_report
from .evaluation.suites import heldout_prompts, load_suite
from .features import check_feature_cache, open_feature_caches, with_sample_index
from .named_targets import cache_home
from .recipe_target import load_target, recipe_needs
from .run_folder import Replacement, check_run_dir, resume_changes
from .sdpa import cudnn_attention_off
from .target import FrozenTarget
from .target_fingerprint import embedding_probe, record_target
from .train_parts import (
    RunState,
    StopRequested,
    append_jsonl,
    bound_cpu_kernel_caches,
    check_fsdp,
    check_trackers_installed,
    check_target_stays_whole,
    clip_grad_value,
    deepspeed_arguments,
    fill_deepspeed_micro_batch,
    flat_config,
    load_models_whole,
    look_for_unused_parameters,
    mean_over_batches,
    mean_over_processes,
    release_freed_memory,
)


class TrainStep(nn.Module):
    """The module accelerate wraps (DDP, DeepSpeed): the drafter's trained module, with the drafter's
    ``prepare`` and ``compute_loss`` as its forward, so the wrappers see one ordinary forward call
    (and adapters inside the target, where a family trains them, take part in it)."""

    def __init__(self, drafter: Drafter, target: FrozenTarget, caches: dict | None, compute_loss=None):
        super().__init__()
        self.trained = drafter.trained_module()
        # In a tuple, outside the module tree: never wrapped, cast, sharded or saved by the loop. compute_loss:
        # the drafter's own, or its fixed-shape loss compiled (training.compile).
        self._outside = (drafter, target, caches, compute_loss or drafter.compute_loss)
        # Which target the drafter trains for, recorded with every save (specdraft.target_fingerprint).
        self.target_probe = embedding_probe(target.embed_tokens.weight)
        self.prepare_seconds = 0.0  # training time in prepare: the target forward (or generation)
        self.total_steps = 0  # set once the loader is sharded (build_run): the run's length, for prepare

    def forward(self, batch: dict[str, torch.Tensor], step: int, split: str = "train"):
        drafter, target, caches, compute_loss = self._outside
        context = TrainingContext(target, None if caches is None else caches[split], step, split == "train",
                                  self.total_steps)
        start = time.perf_counter()
        example = drafter.prepare(batch, context)
        if split == "train":
            self.prepare_seconds += time.perf_counter() - start
        out = compute_loss(example.batch, example.target)
        return out.loss, out.metrics, example.batch["attention_mask"].sum()

    def save_pretrained(self, path):
        self._outside[0].save_pretrained(path)
        record_target(path, self.target_probe)


@dataclass
class Run:
    """One training run, as ``build_run`` assembles it."""

    recipe: Recipe
    accelerator: Any
    run_dir: Path
    target: FrozenTarget
    drafter: Drafter
    step_module: nn.Module  # TrainStep, wrapped by accelerate
    optimizer: Any
    scheduler: Any
    loader: Any
    eval_loader: Any
    total_steps: int
    state: RunState = field(default_factory=RunState)
    trackers: list[str] = field(default_factory=list)
    evaluated_at: int | None = None  # the step of the last periodic eval: the final eval does not repeat it
    replacement: Replacement | None = None  # --overwrite: the old run, kept aside until the first checkpoint
    data_fingerprints: dict = field(default_factory=dict)  # recorded in checkpoints: a resume checks the data
    heldout: Any = None  # the held-out samples, whole (eval_loader shards them): the acceptance eval's prompts


def train(recipe: Recipe, resume: bool = False, overwrite: bool = False, show_progress: bool = True) -> Path:
    """Train the recipe's drafter; returns the run folder (with ``drafter/`` when finished). SIGINT or SIGTERM
    saves a checkpoint at the next step and raises ``StoppedBySignal``: the command around it ends too."""
    bound_cpu_kernel_caches()  # before the process's first matmul: memory that does not grow with the steps
    needs = check_before_loading(recipe, resume, overwrite)
    run = build_run(recipe, resume, overwrite, needs)
    bar = tqdm(total=run.total_steps, initial=run.state.step, desc="train", unit="step", dynamic_ncols=True,
               disable=not (show_progress and run.accelerator.is_local_main_process))
    try:
        # Batches padded to their longest row bring new attention shapes: no per-shape plans (specdraft/sdpa.py).
        with cudnn_attention_off(run.accelerator.device):
            with StopRequested() as stop:
                stopped = run_steps(run, stop, bar)
            bar.close()
            if stopped:
                run.accelerator.end_training()
                raise StoppedBySignal(stop.signum, f"stopped at step {run.state.step}, after its checkpoint in "
                                      f"{run.run_dir}; resume with `specdraft train RECIPE --resume`")
            finish(run, show_progress)
    except StoppedBySignal:
        raise  # after its checkpoint: the run stays, to resume
    except BaseException:
        if run.replacement is not None and run.replacement.pending:  # failed before its first checkpoint
            run.replacement.undo()
            print(f"the new run failed before its first checkpoint: the run it was replacing is back in {run.run_dir}")
        raise
    return run.run_dir


# -- build the run ------------------------------------------------------------------------------


# Shown beside the progress bar when a family logs them: alpha (DistillSpec's predicted acceptance)
# and generate_s (its on-policy generation, reported apart from the step's other costs).
PROGRESS_METRICS = ("loss", "acc_0", "sim_accept_len", "alpha", "generate_s", "tokens_per_s")


def check_before_loading(recipe: Recipe, resume: bool, overwrite: bool) -> TargetNeeds:
    """Everything that can be checked before the target's weights load: the run folder rules, the
    data files, the eval prompt file, the feature cache, and what the family needs of this target
    (from its config alone). A mistake then costs seconds, not a load. Returns those needs."""
    check_run_dir(recipe, resume, overwrite)
    check_trackers_installed(recipe.tracking.trackers)
    if resume:
        resume_changes(recipe, Path(recipe.checkpoint.output_dir))
        check_resumed_data(recipe)
    family = get_family(recipe.drafter_family)
    if family.check_recipe is not None:
        family.check_recipe(recipe)
    if recipe.training.compile and family.static_loss is None:
        raise SpecdraftError(f"training.compile: the {family.name} family does not compile: {family.compile_refusal}. "
                             "Train it eager (training.compile: false); eagle1, eagle3 and dflash compile.")
    check_data_source(recipe.data.path)
    if recipe.data.eval_path:
        check_data_source(recipe.data.eval_path)
    if recipe.eval.enabled and recipe.eval.prompts:
        load_suite(recipe.eval.prompts, recipe.eval.num_prompts)
    needs = recipe_needs(recipe)
    check_feature_cache(recipe, needs)
    return needs


def build_run(recipe: Recipe, resume: bool, overwrite: bool, needs: TargetNeeds) -> Run:
    """The accelerator, the target computing ``needs``, the data, the drafter, and everything wrapped."""
    tcfg = recipe.training
    run_dir = Path(recipe.checkpoint.output_dir)
    trackers = [t for t in recipe.tracking.trackers if t != "none"]
    family = get_family(recipe.drafter_family)
    deepspeed = deepspeed_arguments(tcfg)
    accelerator = Accelerator(
        gradient_accumulation_steps=tcfg.grad_accumulation,
        mixed_precision=tcfg.mixed_precision,
        log_with=trackers or None,
        project_dir=str(run_dir),
        # data_seed: the shuffle follows training.seed, whatever a drafter's build does to torch's
        # global seed (without it accelerate seeds the sampler from torch.initial_seed() at prepare).
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=tcfg.seed),
        **deepspeed,
    )
    load_models_whole(accelerator)
    check_fsdp(accelerator)
    if accelerator.device.type == "cpu":
        slow = slow_cpu_dtype_warning({"target.dtype": recipe.target.dtype,
                                       "training.mixed_precision": MIXED_PRECISION_DTYPES[tcfg.mixed_precision]},
                                      " ".join(FLOAT32_OVERRIDES))
        if slow:
            warnings.warn(slow, stacklevel=2)
    if resume:  # the process count and the kind of run, known now: before the target loads
        check_resumable(accelerator, checkpoint_dirs(run_dir)[-1])
    set_seed(tcfg.seed)

    target = load_target(recipe, accelerator.device, needs)
    train_ds, eval_ds = build_datasets(recipe.data, target.tokenizer)
    drafter = family.build(target, recipe.drafter, _draft_vocab(recipe, family, target, train_ds))
    if recipe.target.gradient_checkpointing:
        target.checkpoint_activations()
    caches = open_feature_caches(recipe, target, needs)
    shapes = batch_shapes(recipe, accelerator.device)
    collate = Collator(pad_token_id_of(target.tokenizer), recipe.data.max_length, recipe.data.packing, **shapes)
    if caches is not None:  # offline mode: batches carry sample indices to find their cached features
        train_ds = train_ds.add_column("sample_index", list(range(len(train_ds))))
        eval_ds = eval_ds.add_column("sample_index", list(range(len(eval_ds))))
        collate = with_sample_index(collate)
    loader, eval_loader = data_loaders(recipe, train_ds, eval_ds, collate, shapes.get("rows"))

    # The data first: the run's length is known once the loader is sharded across the processes, and the
    # drafter configures its optimisation for that length (nanoGPT's configure_optimizers).
    loader, eval_loader = accelerator.prepare(loader, eval_loader)
    steps_per_epoch = max(1, len(loader) // tcfg.grad_accumulation)
    total_steps = tcfg.max_steps or math.ceil(tcfg.epochs * steps_per_epoch)
    optimization = drafter.configure_optimizers(recipe, total_steps)
    o = recipe.optimizer
    optimizer = torch.optim.AdamW(optimization.param_groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    step_module = TrainStep(drafter, target, caches, compiled_loss(recipe, family, drafter, fixed_shapes=bool(shapes)))
    step_module.total_steps = total_steps
    check_target_stays_whole(accelerator, step_module, target)
    if optimization.unused_parameters:
        look_for_unused_parameters(accelerator)
    fill_deepspeed_micro_batch(accelerator, shapes.get("rows", tcfg.micro_batch_size))
    step_module, optimizer = accelerator.prepare(step_module, optimizer)
    # The scheduler is stepped by hand once per optimizer step: accelerate's wrapper steps it
    # once per process, which would make N processes follow a different schedule than one.
    scheduler = optimization.schedule(optimizer)
    run = Run(recipe, accelerator, run_dir, target, drafter, step_module, optimizer, scheduler, loader, eval_loader,
              total_steps, trackers=trackers, data_fingerprints=data_fingerprints(recipe), heldout=eval_ds)
    # Everything has loaded: only now may --overwrite move the old run out of the way (kept until the
    # new run's first checkpoint lands, see specdraft.run_folder).
    if overwrite and accelerator.is_main_process:
        run.replacement = Replacement(run_dir)
        run.replacement.begin()
    accelerator.wait_for_everyone()
    _start_or_resume(run, resume)
    return run


def _local_data_files(recipe: Recipe) -> dict[str, str]:
    paths = {"data.path": recipe.data.path, "data.eval_path": recipe.data.eval_path}
    return {key: path for key, path in paths.items() if path and Path(path).expanduser().exists()}


def data_fingerprints(recipe: Recipe) -> dict[str, str]:
    """A hash of each local data file the run trains and evaluates on (``data.path``, ``data.eval_path``),
    recorded in every checkpoint, so a resume can tell the same path with other content."""
    return {key: data_fingerprint(path, recipe.data.split) for key, path in _local_data_files(recipe).items()}


def check_resumed_data(recipe: Recipe) -> None:
    """--resume: the data files must hold what the checkpoint trained on (checkpoints record their hashes)."""
    ckpt = checkpoint_dirs(Path(recipe.checkpoint.output_dir))[-1]
    recorded = json.loads((ckpt / STATE_FILE).read_text()).get("data_fingerprints") or {}
    files = _local_data_files(recipe)
    changed = [f"{key} ({files[key]})" for key, digest in data_fingerprints(recipe).items()
               if key in recorded and recorded[key] != digest]
    if changed:
        raise SpecdraftError(
            f"--resume: {', '.join(changed)} no longer holds the data checkpoint {ckpt.name} trained on (its content "
            "changed), so the run cannot continue exactly. Restore that file, or start a new run (another "
            "checkpoint.output_dir, or --overwrite).")


def _draft_vocab(recipe: Recipe, family, target: FrozenTarget, train_ds):
    """A family that drafts over a reduced vocabulary gets it built (or read from its cache) from the data."""
    size = getattr(recipe.drafter, "draft_vocab_size", None)
    if not (family.needs_draft_vocab and size and size < target.vocab_size):
        return None

    return build_draft_vocab(train_ds, target.vocab_size, size, cache_dir=cache_home() / "draft_vocab",
                             cache_key_parts=vocab_cache_key_parts(recipe.data, target.tokenizer))


def _start_or_resume(run: Run, resume: bool) -> None:
    """Restore the newest checkpoint (--resume), write the recipe, start the trackers."""
    accelerator, recipe = run.accelerator, run.recipe
    changed = []
    if resume:
        ckpt = checkpoint_dirs(run.run_dir)[-1]
        changed = resume_changes(recipe, run.run_dir)  # checked before loading: only the changes a resume may make
        saved = load_checkpoint(accelerator, ckpt, run.step_module, run.drafter.trained_module(), run.optimizer,
                                run.scheduler)
        run.state = RunState(**saved["run"])
        accelerator.print(f"resumed from {ckpt} at step {run.state.step}")
        for key, was, now in changed:
            accelerator.print(f"  {key}: {was!r} -> {now!r} (applied from here on)")
    if accelerator.is_main_process:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        # The recipe this run follows from here: a resume changed only what resume_changes allows.
        (run.run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
        if resume:  # lines after this one supersede any the killed run logged past the checkpoint
            event = {"step": run.state.step, "event": "resumed", "checkpoint": ckpt.name}
            if changed:
                event["changed"] = {key: [was, now] for key, was, now in changed}
            append_jsonl(run.run_dir / "metrics.jsonl", event)
    if run.trackers:
        init_kwargs = {"wandb": {"name": recipe.tracking.run_name,
                                 "dir": os.environ.get("WANDB_DIR", str(run.run_dir))}}
        accelerator.init_trackers(recipe.tracking.project, config=flat_config(recipe.to_dict()),
                                  init_kwargs=init_kwargs)


# -- step -----------------------------------------------------------------------------------------


@dataclass
class LogWindow:
    """What this process trained on since the last log line, kept on the device: read once, at the log line."""

    history: list[dict[str, torch.Tensor]] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # the optimizer step each micro-batch of ``history`` is in
    tokens: list[torch.Tensor] = field(default_factory=list)
    counted: int = 0  # micro-batches of ``history`` and ``tokens`` already checked and added to the run's tokens
    started: float = field(default_factory=time.perf_counter)
    prepare_seconds_at_start: float = 0.0


def check_losses_finite(run: Run, window: LogWindow, checked: int = 0) -> None:
    """Raise naming the first micro-batch whose loss was not finite, from ``window.history[checked:]``: one host
    read, at a log line or before a checkpoint (never after a bad step), instead of one in every step."""
    losses = torch.stack([h["loss"] for h in window.history[checked:]])
    finite = torch.isfinite(losses)
    if bool(finite.all()):
        return
    first = int((~finite).nonzero()[0, 0])
    last = checkpoint_dirs(run.run_dir)
    kept = f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was written yet"
    raise SpecdraftError(
        f"loss is {losses[first].item()} at step {window.steps[checked + first]} (epoch {run.state.epoch}); stopped, "
        f"{kept}. Lower optimizer.lr, set training.max_grad_norm, or use bf16 instead of fp16."
    )


def run_steps(run: Run, stop: StopRequested, bar) -> bool:
    """Train to ``total_steps``, logging, evaluating and saving on the way; True if a signal stopped it."""
    state, tcfg, accelerator = run.state, run.recipe.training, run.accelerator
    inner = accelerator.unwrap_model(run.step_module)
    window = LogWindow(prepare_seconds_at_start=inner.prepare_seconds)
    run.step_module.train()
    while state.step < run.total_steps:
        run.loader.set_epoch(state.epoch)
        loader = run.loader
        if state.batches_in_epoch:
            loader = accelerator.skip_first_batches(run.loader, state.batches_in_epoch)
        for batch in loader:
            state.batches_in_epoch += 1
            metrics, tokens = train_micro_batch(run, batch)
            window.history.append(metrics)
            window.steps.append(state.step + 1)
            window.tokens.append(tokens)
            if not accelerator.sync_gradients:
                continue
            run.scheduler.step()
            release_freed_memory()  # the step's activations are freed: their pages go back (CPU, glibc)
            state.step += 1
            bar.update(1)
            saving = state.step % run.recipe.checkpoint.save_every == 0 or stop.requested
            if saving or state.step % tcfg.log_every == 0 or state.step == run.total_steps:
                # the window's host reads, at most once a log line: losses finite, tokens counted
                check_losses_finite(run, window, window.counted)
                counted = window.tokens[window.counted:]
                state.tokens += int(torch.stack(counted).sum()) * accelerator.num_processes if counted else 0
                window.counted = len(window.tokens)
            if state.step % tcfg.log_every == 0 or state.step == run.total_steps:
                logs = log_train(run, window, inner.prepare_seconds)
                bar.set_postfix({k.split("/")[-1]: f"{v:.3g}" for k, v in logs.items()
                                 if k.split("/")[-1] in PROGRESS_METRICS})
                window = LogWindow(prepare_seconds_at_start=inner.prepare_seconds)
            if tcfg.eval_every and state.step % tcfg.eval_every == 0:
                log_metrics(run, heldout_loss(run))
                run.evaluated_at = state.step
            if saving:
                save(run, "signal" if stop.requested else "periodic")
            if stop.requested:
                return True
            if state.step >= run.total_steps:
                break
        else:
            state.epoch, state.batches_in_epoch = state.epoch + 1, 0
    return False


def train_micro_batch(run: Run, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Forward (prepare + loss), backward, and at an accumulation boundary clip and step; no host read (the loss,
    metrics and token count stay on the device until the log line)."""
    accelerator, tcfg, state = run.accelerator, run.recipe.training, run.state
    with accelerator.accumulate(run.step_module):
        loss, metrics, tokens = run.step_module(batch, state.step)
        # a non-finite loss is caught at the next log line or checkpoint (check_losses_finite)
        accelerator.backward(loss)
        if accelerator.sync_gradients and tcfg.clip_grad_value:
            clip_grad_value(accelerator, run.step_module.parameters(), tcfg.clip_grad_value)
        if accelerator.sync_gradients and tcfg.max_grad_norm:
            accelerator.clip_grad_norm_(run.step_module.parameters(), tcfg.max_grad_norm)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
    return {"loss": loss.detach(), **{k: v.detach() for k, v in metrics.items()}}, tokens.detach()


def save(run: Run, reason: str) -> None:
    trainer_state = {"run": vars(run.state), "world_size": run.accelerator.num_processes,
                     "distributed_type": run.accelerator.distributed_type.value, "reason": reason,
                     "recipe": run.recipe.to_dict(), "data_fingerprints": run.data_fingerprints}
    save_checkpoint(run.accelerator, run.run_dir, run.state.step, run.step_module, run.drafter.trained_module(),
                    run.optimizer, run.scheduler, trainer_state, run.recipe.checkpoint.keep_last)
    if run.replacement is not None:  # the new run has a checkpoint: the old one it replaces can go
        run.replacement.commit()


# -- log --------------------------------------------------------------------------------------------


def log_train(run: Run, window: LogWindow, prepare_seconds: float) -> dict[str, float]:
    """The window's metrics, each a mean over this process's micro-batches and then over the processes;
    throughput over this window only, so warm-up does not dilute it."""
    local = mean_over_batches(window.history)
    local["_tokens"] = torch.stack(window.tokens).sum()
    local["_prepare_seconds"] = prepare_seconds - window.prepare_seconds_at_start
    reduced = mean_over_processes(run.accelerator, local)
    elapsed = max(time.perf_counter() - window.started, 1e-9)
    logs = {f"train/{k}": v for k, v in reduced.items() if not k.startswith("_")}
    logs["train/tokens_per_s"] = reduced["_tokens"] * run.accelerator.num_processes / elapsed
    logs["train/tokens_seen"] = float(run.state.tokens)  # so far, every process's: a learning curve's x-axis
    # The share of the step spent making examples (the target forward, or generation).
    logs["train/target_fraction"] = reduced["_prepare_seconds"] / elapsed
    logs["train/lr"] = run.scheduler.get_last_lr()[0]
    log_metrics(run, logs)
    return logs


def log_metrics(run: Run, metrics: dict[str, float]) -> None:
    """To the trackers, and always to RUN/metrics.jsonl so a run describes itself without them."""
    if not metrics:
        return
    run.accelerator.log(metrics, step=run.state.step)
    if run.accelerator.is_main_process:
        append_jsonl(run.run_dir / "metrics.jsonl", {"step": run.state.step, **metrics})


# -- held-out loss ---------------------------------------------------------------------------------


def heldout_loss(run: Run) -> dict[str, float]:
    """The loss and metrics on up to ``eval_batches`` held-out micro-batches per process, averaged
    over them and then over the processes (every process calls this)."""
    run.step_module.eval()
    history = []
    with torch.no_grad():
        for i, batch in enumerate(run.eval_loader):
            if i >= run.recipe.training.eval_batches:
                break
            loss, metrics, _ = run.step_module(batch, run.state.step, "eval")
            history.append({"loss": loss.detach(), **metrics})
    run.step_module.train()
    if not history:
        return {}
    return {f"eval/{k}": v for k, v in mean_over_processes(run.accelerator, mean_over_batches(history)).items()}


def finish(run: Run, show_progress: bool) -> None:
    """The last checkpoint and eval, the final drafter, and the acceptance eval.

    The acceptance eval decodes on the main process alone, after the drafter is on disk: the other
    processes end right away instead of waiting in a barrier for its whole length.
    """
    accelerator, recipe = run.accelerator, run.recipe
    ckpts = checkpoint_dirs(run.run_dir)
    if not ckpts or ckpts[-1].name != f"step-{run.state.step:07d}":
        save(run, "final")
    if run.evaluated_at != run.state.step:
        log_metrics(run, heldout_loss(run))
    with full_parameters(accelerator, run.step_module):  # ZeRO-3, FSDP: every process takes part in the gather
        if accelerator.is_main_process:
            write_final_drafter(run)
    accelerator.wait_for_everyone()  # the last collective: the drafter is written
    if accelerator.is_main_process and recipe.eval.enabled:
        # The saved drafter, reloaded: what is evaluated is exactly what was written (and under
        # ZeRO-3 the live parameters are partitioned across processes).
        wandb_run = accelerator.get_tracker("wandb", unwrap=True) if "wandb" in run.trackers else None
        target = eval_target(recipe, run.target)
        acceptance_eval(recipe, target, load_drafter(run.run_dir / "drafter", target), run.run_dir / "eval",
                        wandb_run, show_progress, heldout=run.heldout)
    accelerator.end_training()


def write_final_drafter(run: Run) -> None:
    """RUN/drafter, written then renamed; a failure (a full disk) says which checkpoint holds the same weights."""
    try:
        with atomic_folder(run.run_dir / "drafter") as tmp:
            run.accelerator.unwrap_model(run.step_module).save_pretrained(tmp)
    except Exception as e:
        last = checkpoint_dirs(run.run_dir)[-1]
        raise SpecdraftError(
            f"could not write the final drafter to {run.run_dir / 'drafter'} ({getattr(e, 'strerror', None) or e}). "
            f"The last checkpoint {last} holds the same weights: free space (about "
            f"{describe_bytes(sum(f.stat().st_size for f in (last / 'drafter').rglob('*') if f.is_file()))}) and run "
            "`specdraft train RECIPE --resume`, which writes it, or export that checkpoint directly."
        ) from e


def compiled_loss(recipe: Recipe, family, drafter: Drafter, fixed_shapes: bool):
    """``training.compile``: the family's fixed-shape loss, torch.compiled whole (``fullgraph``: a graph break, a
    host read inside the loss, is an error, not a slow step) for the run's few batch shapes; else None."""
    if not recipe.training.compile:
        return None
    if not fixed_shapes:
        raise SpecdraftError("training.compile needs fixed batch shapes, or it compiles again at every new one: set "
                             "data.tokens_per_micro_batch (one shape) or data.shapes: buckets (four)")
    return torch.compile(family.static_loss(drafter), dynamic=False, fullgraph=True)


def data_loaders(recipe: Recipe, train_ds, eval_ds, collate, rows: int | None) -> tuple:
    """The train loader (shuffled by ``training.seed``, epoch by epoch) and the held-out one: batches of
    ``training.micro_batch_size`` samples, or with ``data.tokens_per_micro_batch`` as many as its ``rows`` hold."""
    tcfg, data = recipe.training, recipe.data
    if data.tokens_per_micro_batch is None:
        loader = torch.utils.data.DataLoader(train_ds, batch_size=tcfg.micro_batch_size, shuffle=True,
                                             collate_fn=collate, num_workers=tcfg.num_workers,
                                             generator=torch.Generator().manual_seed(tcfg.seed))
        return loader, torch.utils.data.DataLoader(eval_ds, batch_size=tcfg.micro_batch_size, collate_fn=collate)

    def batches(dataset, shuffle):
        lengths = [len(ids) for ids in dataset["input_ids"]]
        return TokenBudgetBatches(lengths, rows, data.max_length, EpochOrder(len(dataset), tcfg.seed, shuffle))

    # The generator: each iterator draws its workers' base seed from it, not from torch's global RNG, whose state
    # a resume restores and which a draw at another moment (the resume's first iterator) would shift.
    generator = torch.Generator().manual_seed(tcfg.seed)
    return (torch.utils.data.DataLoader(train_ds, batch_sampler=batches(train_ds, True), collate_fn=collate,
                                        num_workers=tcfg.num_workers, generator=generator),
            torch.utils.data.DataLoader(eval_ds, batch_sampler=batches(eval_ds, False), collate_fn=collate))


def batch_shapes(recipe: Recipe, device: torch.device) -> dict:
    """The Collator's fixed shapes: one, ``[tokens_per_micro_batch / max_length, max_length]``, with a token budget;
    else as ``data.shapes`` says (auto: buckets on CUDA, dynamic elsewhere, and with a feature cache, whose
    features are stored at each sample's own length)."""
    if recipe.data.tokens_per_micro_batch is not None:
        return {"rows": recipe.data.tokens_per_micro_batch // recipe.data.max_length,
                "widths": (recipe.data.max_length,)}
    if recipe.data.shapes == "dynamic" or recipe.training.feature_cache or \
            (recipe.data.shapes == "auto" and device.type != "cuda"):
        return {}
    return {"rows": recipe.training.micro_batch_size, "widths": bucket_widths(recipe.data.max_length)}


def eval_target(recipe: Recipe, target: FrozenTarget) -> FrozenTarget:
    """The target in ``eval.dtype``: the training one when the dtypes agree, else loaded again."""
    wanted = recipe.eval.dtype
    if wanted == "auto":  # the training dtype, unless this CPU would emulate it
        native = target.device.type != "cpu" or cpu_computes_natively(recipe.target.dtype)
        wanted = recipe.target.dtype if native else "float32"
    if resolve_dtype(wanted) == target.lm_head.weight.dtype:
        return target
    print(f"acceptance eval: loading the target in {wanted} (eval.dtype; it trained in {recipe.target.dtype})")
    return load_target(dataclasses.replace(recipe, target=dataclasses.replace(recipe.target, dtype=wanted)),
                       target.device, TargetNeeds())


def acceptance_eval(recipe: Recipe, target: FrozenTarget, drafter, out_dir: Path, wandb_run=None,
                    show_progress: bool = True, heldout=None) -> dict[float, dict]:
    """The recipe's ``eval:`` section: the trained drafter in the real decoder, per temperature, on
    ``eval.prompts``, else on ``eval.num_prompts`` of the ``heldout`` samples (each up to its first answer)."""
    cfg = recipe.eval
    prompts = cfg.prompts or heldout_prompts(heldout if heldout is not None else [], cfg.num_prompts)
    if not prompts:
        print("acceptance eval skipped: no held-out samples to prompt with (data.eval_fraction is 0 and "
              "data.eval_path unset); set eval.prompts to a prompt suite (e.g. Spec-Bench questions JSONL)")
        return {}
    if not cfg.prompts:
        print(f"acceptance eval: {len(prompts)} held-out samples of the data, each up to its first answer "
              "(eval.prompts unset)")
    drafter.eval()
    results = {}
    for temperature in cfg.temperatures:
        sources = {recipe.drafter_family: drafter.draft_source(target)}
        if cfg.prompt_lookup_baseline:
            sources[PROMPT_LOOKUP] = PromptLookupSource()
        settings = EvalSettings(SamplingParams(temperature=temperature), k=cfg.k, max_new_tokens=cfg.max_new_tokens,
                                num_prompts=cfg.num_prompts, verify_backend=cfg.verify_backend,
                                show_progress=show_progress)  # fmt: skip
        results[temperature] = evaluate(target, sources, prompts, settings,
                                        out_dir / f"temperature-{temperature:g}", wandb_run=wandb_run)  # fmt: skip
        print(format_table(results[temperature], legend=temperature == cfg.temperatures[-1]) + "\n")
    family_report(recipe.drafter_family, target, drafter, prompts, cfg.max_new_tokens, out_dir, cfg.num_prompts)
    return results
