"""The one training loop, for every drafter family.

Per micro-batch: the frozen target runs once under no_grad (or its features are
read from an offline cache), the drafter computes its loss from the batch and
the target's outputs, accelerate handles accumulation, mixed precision and
gradient sync. Nothing here knows which family it is training.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import nn

from .atomic import atomic_folder
from .checkpoint import checkpoint_dirs, full_parameters, load_checkpoint, save_checkpoint
from .config import Recipe
from .drafters import get_family, load_drafter
from .errors import SpecdraftError
from .named_targets import cache_home
from .target import FrozenTarget, resolve_target_path


class TrainStep(nn.Module):
    """Routes the loss through ``forward`` so DDP/DeepSpeed wrappers see a normal forward call."""

    def __init__(self, drafter: nn.Module):
        super().__init__()
        self.drafter = drafter

    def forward(self, batch, target_out):
        out = self.drafter.compute_loss(batch, target_out)
        return out.loss, out.metrics

    def save_pretrained(self, path):
        self.drafter.save_pretrained(path)


@dataclass
class RunState:
    """Where training is; saved in every checkpoint so a resume continues exactly."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches this process consumed in the current epoch
    tokens: int = 0


def prepare_run_dir(run_dir: Path, resume: bool, overwrite: bool, is_main: bool) -> None:
    """Never clobber a run: an existing non-empty folder needs --resume or --overwrite."""
    exists = run_dir.is_dir() and any(run_dir.iterdir())
    if resume:
        if not checkpoint_dirs(run_dir):
            raise SpecdraftError(f"--resume: no checkpoint in {run_dir}/checkpoints; start without --resume")
        return
    if exists and not overwrite:
        raise SpecdraftError(
            f"run folder {run_dir} already exists; pass --resume to continue it, --overwrite to replace it, "
            "or set checkpoint.output_dir to a new folder"
        )
    if exists and overwrite and is_main:
        shutil.rmtree(run_dir)


def load_target(recipe: Recipe, device) -> FrozenTarget:
    cfg = recipe.target
    return FrozenTarget.from_pretrained(
        resolve_target_path(cfg.path, cfg.dtype), dtype=cfg.dtype, taps=cfg.taps,
        trust_remote_code=cfg.trust_remote_code, device=device, attn_implementation=cfg.attn_implementation,
    )


# -- DeepSpeed (begin) --------------------------------------------------------------------------
# `accelerate launch --config_file recipes/accelerate/deepspeed_zero{2,3}.yaml` sets
# ACCELERATE_USE_DEEPSPEED; the loop below is then unchanged: accelerator.backward runs the engine's
# backward and step, and optimizer.step/zero_grad become no-ops.
def deepspeed_arguments(tcfg) -> dict:
    """Extra ``Accelerator`` arguments when launched for DeepSpeed, else none."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return {}
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    # Under DeepSpeed, clip_grad_norm_ is a no-op and the engine clips: the JSON's "auto"
    # gradient_clipping takes the recipe's value. zero3_init_flag=False: the frozen target is
    # loaded whole, only the drafter is sharded (by the engine, at prepare).
    arguments = {"deepspeed_plugin": DeepSpeedPlugin(gradient_clipping=tcfg.max_grad_norm, zero3_init_flag=False)}
    if not torch.cuda.is_available():
        # accelerate picks a process-group backend only for accelerators; on CPU DeepSpeed
        # (DS_ACCELERATOR=cpu) runs over gloo. This is what makes the CPU tests possible.
        arguments["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    return arguments


def load_models_whole(accelerator) -> None:
    """Stop transformers from building models inside ``deepspeed.zero.Init``.

    accelerate registers the DeepSpeed config with transformers even when zero3_init_flag is off,
    and under ZeRO-3 ``from_pretrained`` would then shard the frozen target, which never enters
    the engine, so its forward would see empty weights.
    """
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
# -- DeepSpeed (end) ----------------------------------------------------------------------------


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms and biases are scale parameters, decaying them only hurts."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise SpecdraftError("the drafter has no trainable parameters; check the drafter family config")
    return [
        {"params": [p for _, p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for _, p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def make_scheduler(optimizer, recipe: Recipe, total_steps: int):
    from transformers import get_scheduler

    o = recipe.optimizer
    name, extra = {
        "cosine": ("cosine_with_min_lr", {"min_lr_rate": o.min_lr_ratio}),
        "linear": ("linear", {}),
        "constant": ("constant_with_warmup", {}),
    }[o.schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=o.warmup_steps, num_training_steps=total_steps,
                         scheduler_specific_kwargs=extra or None)


class StopRequested:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint at the next step boundary and exits 0."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def flat_config(config: dict, prefix: str = "") -> dict:
    """``{"optimizer.lr": 1e-4, ...}``: trackers (tensorboard hparams) want flat scalars."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flat_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


def _mean_metrics(history: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    keys = history[0].keys()
    return {k: float(torch.stack([h[k].float() for h in history]).mean()) for k in keys}


def train(recipe: Recipe, resume: bool = False, overwrite: bool = False, show_progress: bool = True) -> Path:
    """Train the recipe's drafter; returns the run folder (with ``drafter/`` when finished)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from tqdm.auto import tqdm

    from .data.collate import Collator, pad_token_id_of
    from .data.pipeline import build_datasets
    from .features import open_feature_caches, with_sample_index

    tcfg = recipe.training
    run_dir = Path(recipe.checkpoint.output_dir)
    trackers = [t for t in recipe.tracking.trackers if t != "none"]
    accelerator = Accelerator(
        gradient_accumulation_steps=tcfg.grad_accumulation,
        mixed_precision=tcfg.mixed_precision,
        log_with=trackers or None,
        project_dir=str(run_dir),
        # data_seed: the shuffle follows training.seed, whatever a drafter's build does to torch's
        # global seed (without it accelerate seeds the sampler from torch.initial_seed() at prepare).
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=tcfg.seed),
        **deepspeed_arguments(tcfg),
    )
    load_models_whole(accelerator)
    prepare_run_dir(run_dir, resume, overwrite, accelerator.is_main_process)
    accelerator.wait_for_everyone()
    set_seed(tcfg.seed)

    if recipe.eval.enabled and recipe.eval.prompts:  # a bad prompt file fails now, not after training
        from .evaluation.suites import load_suite

        load_suite(recipe.eval.prompts, recipe.eval.num_prompts)
    family = get_family(recipe.drafter_family)
    target = load_target(recipe, accelerator.device)
    train_ds, eval_ds = build_datasets(recipe.data, target.tokenizer)
    draft_vocab = None
    draft_vocab_size = getattr(recipe.drafter, "draft_vocab_size", None)
    if family.needs_draft_vocab and draft_vocab_size and draft_vocab_size < target.vocab_size:
        from .data.pipeline import vocab_cache_key_parts
        from .data.vocab import build_draft_vocab

        draft_vocab = build_draft_vocab(
            train_ds, target.vocab_size, draft_vocab_size,
            cache_dir=cache_home() / "draft_vocab",
            cache_key_parts=vocab_cache_key_parts(recipe.data, target.tokenizer),
        )
    drafter = family.build(target, recipe.drafter, draft_vocab)
    step_module = TrainStep(drafter)

    o = recipe.optimizer
    optimizer = torch.optim.AdamW(param_groups(step_module, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    collate = Collator(pad_token_id_of(target.tokenizer), recipe.data.max_length, recipe.data.packing)
    features = open_feature_caches(recipe, target)
    if features is not None:  # offline mode: batches carry sample indices to find their cached features
        train_ds = train_ds.add_column("sample_index", list(range(len(train_ds))))
        eval_ds = eval_ds.add_column("sample_index", list(range(len(eval_ds))))
        collate = with_sample_index(collate)
    loader = torch.utils.data.DataLoader(train_ds, batch_size=tcfg.micro_batch_size, shuffle=True,
                                         collate_fn=collate, num_workers=tcfg.num_workers,
                                         generator=torch.Generator().manual_seed(tcfg.seed))
    eval_loader = torch.utils.data.DataLoader(eval_ds, batch_size=tcfg.micro_batch_size, collate_fn=collate)
    step_module, optimizer, loader, eval_loader = accelerator.prepare(step_module, optimizer, loader, eval_loader)
    # The scheduler is stepped by hand once per optimizer step: accelerate's wrapper steps it
    # once per process, which would make N processes follow a different schedule than one.
    steps_per_epoch = max(1, len(loader) // tcfg.grad_accumulation)
    total_steps = tcfg.max_steps or math.ceil(tcfg.epochs * steps_per_epoch)
    scheduler = make_scheduler(optimizer, recipe, total_steps)

    state = RunState()
    if resume:
        ckpt = checkpoint_dirs(run_dir)[-1]
        state = RunState(**load_checkpoint(accelerator, ckpt, drafter, optimizer, scheduler)["run"])
        accelerator.print(f"resumed from {ckpt} at step {state.step}")
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
        if resume:  # lines after this one supersede any the killed run logged past the checkpoint
            event = {"step": state.step, "event": "resumed", "checkpoint": ckpt.name}
            _append_jsonl(run_dir / "metrics.jsonl", event)
    if trackers:
        init_kwargs = {"wandb": {"name": recipe.tracking.run_name, "dir": os.environ.get("WANDB_DIR", str(run_dir))}}
        accelerator.init_trackers(recipe.tracking.project, config=flat_config(recipe.to_dict()), init_kwargs=init_kwargs)

    def target_outputs(batch, split="train"):
        return features[split].lookup(batch) if features is not None else target.forward_batch(batch)

    def log_metrics(metrics: dict[str, float], step: int) -> None:
        """To the trackers, and always to RUN/metrics.jsonl so a run describes itself without them."""
        if not metrics:
            return
        accelerator.log(metrics, step=step)
        if accelerator.is_main_process:
            _append_jsonl(run_dir / "metrics.jsonl", {"step": step, **metrics})

    def save(reason: str) -> None:
        trainer_state = {"run": vars(state), "world_size": accelerator.num_processes, "reason": reason}
        save_checkpoint(accelerator, run_dir, state.step, step_module, optimizer, scheduler, trainer_state,
                        recipe.checkpoint.keep_last)

    def evaluate() -> dict[str, float]:
        step_module.eval()
        history = []
        with torch.no_grad():
            for i, batch in enumerate(eval_loader):
                if i >= tcfg.eval_batches:
                    break
                loss, metrics = step_module(batch, target_outputs(batch, "eval"))
                history.append({"loss": loss.detach(), **metrics})
        step_module.train()
        if not history:
            return {}
        return {f"eval/{k}": v for k, v in _mean_metrics(history).items()}

    bar = tqdm(total=total_steps, initial=state.step, disable=not (show_progress and accelerator.is_local_main_process),
               desc="train", unit="step", dynamic_ncols=True)
    history: list[dict[str, torch.Tensor]] = []
    evaluated_at = None  # the step of the last periodic eval: the final eval does not repeat it
    t_start, tokens_at_start, target_seconds = time.perf_counter(), state.tokens, 0.0
    step_module.train()
    with StopRequested() as stop:
        while state.step < total_steps:
            loader.set_epoch(state.epoch)
            epoch_loader = accelerator.skip_first_batches(loader, state.batches_in_epoch) if state.batches_in_epoch else loader
            for batch in epoch_loader:
                state.batches_in_epoch += 1
                with accelerator.accumulate(step_module):
                    t0 = time.perf_counter()
                    target_out = target_outputs(batch)
                    target_seconds += time.perf_counter() - t0
                    loss, metrics = step_module(batch, target_out)
                    if not torch.isfinite(loss):
                        last = checkpoint_dirs(run_dir)
                        kept = f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was written yet"
                        raise SpecdraftError(
                            f"loss is {loss.item()} at step {state.step + 1} (epoch {state.epoch}); stopped, {kept}. "
                            "Lower optimizer.lr, set training.max_grad_norm, or use bf16 instead of fp16."
                        )
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and tcfg.clip_grad_value:
                        accelerator.clip_grad_value_(step_module.parameters(), tcfg.clip_grad_value)
                    if accelerator.sync_gradients and tcfg.max_grad_norm:
                        accelerator.clip_grad_norm_(step_module.parameters(), tcfg.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                state.tokens += int(batch["attention_mask"].sum()) * accelerator.num_processes
                history.append({"loss": loss.detach(), **{k: v.detach() for k, v in metrics.items()}})
                if not accelerator.sync_gradients:
                    continue
                scheduler.step()
                state.step += 1
                bar.update(1)
                if state.step % tcfg.log_every == 0 or state.step == total_steps:
                    logs = {f"train/{k}": v for k, v in _mean_metrics(history).items()}
                    # Throughput over this log window only, so warm-up does not dilute it.
                    elapsed = time.perf_counter() - t_start
                    logs["train/tokens_per_s"] = (state.tokens - tokens_at_start) / max(elapsed, 1e-9)
                    logs["train/target_fraction"] = target_seconds / max(elapsed, 1e-9)
                    logs["train/lr"] = scheduler.get_last_lr()[0]
                    t_start, tokens_at_start, target_seconds = time.perf_counter(), state.tokens, 0.0
                    log_metrics(logs, state.step)
                    bar.set_postfix({k.split("/")[-1]: f"{v:.3g}" for k, v in logs.items()
                                     if k.split("/")[-1] in ("loss", "acc_0", "sim_accept_len", "tokens_per_s")})
                    history.clear()
                if tcfg.eval_every and state.step % tcfg.eval_every == 0:
                    log_metrics(evaluate(), state.step)
                    evaluated_at = state.step
                if state.step % recipe.checkpoint.save_every == 0 or stop.requested:
                    save("signal" if stop.requested else "periodic")
                if stop.requested:
                    accelerator.print(f"stopped by signal at step {state.step}; resume with --resume")
                    bar.close()
                    accelerator.end_training()
                    return run_dir
                if state.step >= total_steps:
                    break
            else:
                state.epoch, state.batches_in_epoch = state.epoch + 1, 0
    bar.close()
    if not checkpoint_dirs(run_dir) or checkpoint_dirs(run_dir)[-1].name != f"step-{state.step:07d}":
        save("final")
    if evaluated_at != state.step:
        log_metrics(evaluate(), state.step)
    with full_parameters(accelerator, step_module):  # ZeRO-3: every process takes part in the gather
        if accelerator.is_main_process:
            _write_final_drafter(run_dir, step_module, accelerator)
    if accelerator.is_main_process and recipe.eval.enabled:
        # The saved drafter, reloaded: what is evaluated is exactly what was written (and under
        # ZeRO-3 the live parameters are partitioned across processes).
        wandb_run = accelerator.get_tracker("wandb", unwrap=True) if "wandb" in trackers else None
        acceptance_eval(recipe, target, load_drafter(run_dir / "drafter", target), run_dir / "eval",
                        wandb_run, show_progress)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return run_dir


def acceptance_eval(recipe: Recipe, target: FrozenTarget, drafter, out_dir: Path, wandb_run=None,
                    show_progress: bool = True) -> dict[float, dict]:
    """The recipe's ``eval:`` section: the trained drafter in the real decoder, per temperature."""
    from .decoding.sampling import SamplingParams
    from .decoding.sources import PromptLookupSource
    from .evaluation.report import format_table
    from .evaluation.run import evaluate

    cfg = recipe.eval
    if not cfg.prompts:
        print("acceptance eval skipped: set eval.prompts to a prompt suite (e.g. Spec-Bench questions JSONL)")
        return {}
    drafter.eval()
    results = {}
    for temperature in cfg.temperatures:
        sources = {recipe.drafter_family: drafter.draft_source(target)}
        if cfg.prompt_lookup_baseline:
            sources["prompt-lookup"] = PromptLookupSource()
        results[temperature] = evaluate(
            target, sources, cfg.prompts, SamplingParams(temperature=temperature), k=cfg.k,
            max_new_tokens=cfg.max_new_tokens, out_dir=out_dir / f"temperature-{temperature:g}",
            num_prompts=cfg.num_prompts, wandb_run=wandb_run, show_progress=show_progress,
        )
        print(format_table(results[temperature]))
    return results


def _append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _write_final_drafter(run_dir: Path, step_module, accelerator) -> None:
    with atomic_folder(run_dir / "drafter") as tmp:
        accelerator.unwrap_model(step_module).save_pretrained(tmp)
