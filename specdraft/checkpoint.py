"""Checkpoints that describe themselves, are written then renamed, and resume exactly.

A run folder:
  RUN/recipe.yaml                      the resolved recipe
  RUN/checkpoints/step-0000100/        one checkpoint (newest ``keep_last`` are kept)
      trained.safetensors              the trained module's state_dict: what a resume restores
      drafter/                         save_pretrained: the drafter as published (config.json + weights)
      optimizer.pt, scheduler.pt       tensors and plain containers only (weights_only=True loads)
      rng-rank{r}.pt                   every process's RNG streams
      optimizer-rank{r}.pt             instead of optimizer.pt under DeepSpeed ZeRO: each process's shard
      trainer_state.json               step, data position, world size, distributed type
  RUN/drafter/                         the final drafter, at the end of training

Under FSDP2 a checkpoint has the same files: the drafter's shards are gathered into whole tensors, and the
optimizer's state into one whole state dict keyed by parameter name (``optimizer.pt``).

Each checkpoint is written into ``.tmp-step-...`` and renamed into place, so a
crash or a full disk mid-write never damages the previous one.
"""

from __future__ import annotations

import errno
import json
import random
import shutil
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import DistributedType
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from .atomic import describe_bytes, disk_full_reason, move_into_place, separate_tensors
from .errors import SpecdraftError

STATE_FILE = "trainer_state.json"
TRAINED_FILE = "trained.safetensors"


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a folder counts once its state file exists)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / STATE_FILE).is_file())


def find_drafter_dir(path: str | Path) -> Path:
    """A drafter folder itself, else RUN/drafter, else the newest checkpoint's drafter."""
    path = Path(path)
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    if (path / "drafter" / "config.json").is_file():
        return path / "drafter"
    ckpts = checkpoint_dirs(path)
    if (path / "drafter").is_dir():  # a final drafter that lost its config: not silently an older checkpoint
        newest = f"; the newest checkpoint's is {ckpts[-1] / 'drafter'}, which you can name instead" if ckpts else ""
        raise SpecdraftError(f"{path / 'drafter'} has no config.json, so it is not a whole drafter{newest}. "
                             "`specdraft train RECIPE --resume` on a finished run writes it again.")
    if ckpts:
        return ckpts[-1] / "drafter"
    raise SpecdraftError(
        f"no drafter checkpoint in {path}: expected {path}/drafter or {path}/checkpoints/step-*/. "
        "Train first (`specdraft train RECIPE`) or point at a run folder that has one."
    )


def damaged_drafter_message(file: Path, error: Exception) -> str:
    """What to say when a saved drafter's file cannot be read: which file, and which checkpoint of the same
    run still holds weights that read back."""
    holder = file.parent.parent  # RUN for RUN/drafter/FILE, RUN/checkpoints/step-N for a checkpoint's
    run = holder.parent.parent if holder.parent.name == "checkpoints" else holder

    def readable(ckpt: Path) -> bool:
        try:
            json.loads((ckpt / "drafter" / "config.json").read_text())
            with safe_open(str(ckpt / "drafter" / "model.safetensors"), framework="pt"):
                return True
        except Exception:
            return False

    good = next((c for c in reversed(checkpoint_dirs(run)) if c != holder and readable(c)), None)
    where = (f"Checkpoint {good} still holds readable weights: use it (e.g. `specdraft export {good} ...`)."
             if good else "No other checkpoint of that run holds readable weights: train again.")
    return f"{file} is damaged and cannot be read ({type(error).__name__}: {error}). {where}"


def _rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": list(random.getstate()[1]),
        "python_pos": random.getstate()[2],
        "numpy_keys": torch.from_numpy(np_state[1].astype("int64")),
        "numpy_pos": int(np_state[2]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype("uint32"), state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _torch_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # torch's optimizer inside accelerate's wrapper


# -- DeepSpeed ZeRO (begin) ------------------------------------------------------------------------
# ZeRO-2/3 split the optimizer state (and fp32 master weights) across processes, so each process
# saves and loads its own shard; ZeRO-3 also splits every parameter, so whole tensors are gathered
# before save_pretrained and scattered back after a load.
def uses_deepspeed(accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.DEEPSPEED


def full_parameters(accelerator, model, modify: bool = False):
    """Context in which ``model`` holds whole tensors on every process (ZeRO-3, FSDP2); a no-op otherwise.

    Every process must enter it. ``modify=True``: the main process's values are scattered back to all
    shards on exit (after loading weights). FSDP2 loads through its own hooks instead, from weights cut
    into this process's slices (``fsdp_slices``): a no-op there.
    """
    if uses_fsdp(accelerator):
        return nullcontext() if modify else _fsdp_whole_parameters(model)
    if not uses_deepspeed(accelerator):
        return nullcontext()
    import deepspeed  # optional: the deepspeed extra (ZeRO runs only)

    return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0 if modify else None)


def _zero_shard_file(ckpt: Path, rank: int) -> Path:
    return ckpt / f"optimizer-rank{rank}.pt"


@contextmanager
def _zero_state_classes():
    """The plain-data DeepSpeed classes a ZeRO optimizer state holds, allowed for weights_only loads."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # optional: deepspeed
    from deepspeed.runtime.zero.config import ZeroStageEnum  # optional: deepspeed
    from deepspeed.utils.tensor_fragment import fragment_address  # optional: deepspeed

    with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]):
        yield


def _read_zero_shard(accelerator, ckpt: Path) -> dict:
    shard = _zero_shard_file(ckpt, accelerator.process_index)
    if not shard.is_file():
        raise SpecdraftError(
            f"checkpoint {ckpt} was written without DeepSpeed and holds no ZeRO optimizer shards: resume it "
            "with the launcher config it was trained with, or start again with --overwrite."
        )
    with _zero_state_classes():
        return torch.load(shard, map_location="cpu", weights_only=True)


def _load_zero_shard(accelerator, optimizer, shard: dict) -> None:
    # The ZeRO optimizer takes every rank's state, indexed by rank; with an unchanged world size it
    # reads only its own. load_from_fp32_weights: restore the fp32 master copy exactly (bf16/fp16 runs).
    shards = [None] * accelerator.num_processes
    shards[accelerator.process_index] = shard
    _torch_optimizer(optimizer).load_state_dict(shards, load_from_fp32_weights=True)


# -- DeepSpeed ZeRO (end) --------------------------------------------------------------------------


# -- FSDP2 (begin) ---------------------------------------------------------------------------------
# accelerate's FSDP2 shards the module it prepares (the TrainStep: the drafter's trained module; the frozen
# target is outside it) into DTensor parameters, one slice per process. A checkpoint holds them whole, and
# the optimizer's state whole, keyed by parameter name, so its files are those of a DDP run.
def uses_fsdp(accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.FSDP


@contextmanager
def _fsdp_whole_parameters(model):
    """Each sharded parameter of ``model`` replaced by its whole tensor (an all-gather on every process), for
    reading, and the sharded one put back on exit: those are the ones FSDP and the optimizer hold. Outside
    forward and backward FSDP2 keeps them registered and leaves the swap alone."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # the root stays unsharded after a forward with no backward (the held-out loss)
    swapped = []
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                setattr(module, name, torch.nn.Parameter(param.full_tensor(), requires_grad=param.requires_grad))
                swapped.append((module, name, param))
    try:
        yield
    finally:
        for module, name, sharded in swapped:
            setattr(module, name, sharded)


def fsdp_slices(model, weights: dict) -> dict:
    """Whole tensors, each cut as ``model``'s sharded parameter of that name is, for its load_state_dict. Every
    process read the same file, so each keeps its own slice: no communication."""
    current = model.state_dict()
    return {name: distribute_tensor(tensor, current[name].device_mesh, current[name].placements, src_data_rank=None)
            if isinstance(current.get(name), DTensor) else tensor for name, tensor in weights.items()}


def _fsdp_optimizer_state(step_module, optimizer) -> dict:
    """The optimizer's whole state, keyed by parameter name, on the main process (every process calls it)."""
    return get_optimizer_state_dict(step_module, _torch_optimizer(optimizer),
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _load_fsdp_optimizer_state(step_module, optimizer, state: dict) -> None:
    set_optimizer_state_dict(step_module, _torch_optimizer(optimizer), optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))


# -- FSDP2 (end) -----------------------------------------------------------------------------------


def checkpoint_bytes(run_dir: Path, drafter, optimizer) -> int:
    """The space one more checkpoint needs: the newest one's size, else the trained weights twice (the
    published drafter and the resume copy) and the optimizer's state (AdamW: two more tensors per weight)
    as they are in memory."""
    previous = checkpoint_dirs(run_dir)
    if previous:
        return sum(f.stat().st_size for f in previous[-1].rglob("*") if f.is_file())
    weights = sum(t.numel() * t.element_size() for t in drafter.state_dict().values())
    moments = sum(t.numel() * t.element_size() for state in optimizer.state.values()
                  for t in state.values() if torch.is_tensor(t))
    return 2 * weights + (moments or 2 * weights)


def save_checkpoint(accelerator, run_dir: Path, step: int, drafter, trained, optimizer, scheduler,
                    trainer_state: dict, keep_last: int) -> Path:
    """Write RUN/checkpoints/step-N atomically; every rank writes its RNG (and ZeRO shard), rank 0 the rest.

    A failed write (a full disk, anything else) removes the temporary folder and leaves the previous
    checkpoints as they were; the error says how much space a checkpoint needs."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:07d}"
    tmp = root / f".tmp-step-{step:07d}"
    need = checkpoint_bytes(run_dir, accelerator.unwrap_model(drafter), optimizer)
    try:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        free = shutil.disk_usage(tmp).free
        if free < need:  # refuse before writing: a partial write would only fill the disk further
            raise OSError(errno.ENOSPC, f"No space left on device: {describe_bytes(free)} free")
        torch.save(_rng_state(), tmp / f"rng-rank{accelerator.process_index}.pt")
        zero = uses_deepspeed(accelerator)
        if zero:
            torch.save(optimizer.state_dict(), _zero_shard_file(tmp, accelerator.process_index))
        optimizer_state = _fsdp_optimizer_state(drafter, optimizer) if uses_fsdp(accelerator) else None
        accelerator.wait_for_everyone()  # every shard is on disk before rank 0 marks the checkpoint complete
        with full_parameters(accelerator, drafter):
            if accelerator.is_main_process:
                accelerator.unwrap_model(drafter).save_pretrained(tmp / "drafter")
                # The trained module's own tensors, whatever layout the published folder has (DistillSpec
                # serves a LoRA student merged): a resume reads this, never the published folder.
                save_file(separate_tensors(trained_tensors(trained)), str(tmp / TRAINED_FILE))
        if accelerator.is_main_process:
            if not zero:
                whole = optimizer.state_dict() if optimizer_state is None else optimizer_state
                torch.save(whole, tmp / "optimizer.pt")
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            # Written last: its presence marks the checkpoint complete.
            (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            move_into_place(tmp, final)  # a checkpoint of this step saved again: the old one goes after the swap
    except Exception as e:  # torch.save wraps ENOSPC in a RuntimeError, safetensors in a SafetensorError
        shutil.rmtree(tmp, ignore_errors=True)
        previous = checkpoint_dirs(run_dir)
        kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
        full = disk_full_reason(e)
        detail = getattr(e, "strerror", None)  # an OSError's own words ("... 100 B free"); a library's are noise
        reason = f"{full}: {detail}" if full and detail else full or detail or str(e)
        room = "raise the file size limit (`ulimit -f unlimited`)" if full and "EFBIG" in full else \
            f"free that much in {root}"
        fix = f"A checkpoint needs about {describe_bytes(need)}: {room}" if full else "Fix the cause"
        raise SpecdraftError(
            f"could not write checkpoint step {step} ({reason}); {kept}. {fix} and resume with --resume."
        ) from e
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for old in checkpoint_dirs(run_dir)[:-keep_last]:
            prune(old)
        for left in root.glob(".pruned-step-*"):  # an earlier prune that a kill cut short
            shutil.rmtree(left, ignore_errors=True)
    return final


def prune(ckpt: Path) -> None:
    """Delete a checkpoint: renamed out of ``checkpoint_dirs``' sight first, so a kill in the middle of the delete
    never leaves a half-deleted folder that still looks like a checkpoint."""
    gone = ckpt.with_name(f".pruned-{ckpt.name}")
    ckpt.rename(gone)
    shutil.rmtree(gone)


def load_checkpoint(accelerator, ckpt: Path, drafter, trained, optimizer, scheduler) -> dict:
    """Restore weights, optimizer, scheduler and this rank's RNG; returns the trainer state.

    ``drafter`` is the module accelerate prepared, ``trained`` the trained module inside it (as in
    ``save_checkpoint``)."""
    zero = uses_deepspeed(accelerator)
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
        weights = load_file(_trained_file(ckpt), device="cpu")
        if not zero and not (ckpt / "optimizer.pt").is_file() and _zero_shard_file(ckpt, 0).is_file():
            raise SpecdraftError(
                f"checkpoint {ckpt} holds DeepSpeed ZeRO optimizer shards; resume it with the DeepSpeed launcher "
                f"config it was trained with ({state.get('world_size')} processes), or start again with --overwrite."
            )
        optim_state = (_read_zero_shard(accelerator, ckpt) if zero
                       else torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True))
        sched_state = torch.load(ckpt / "scheduler.pt", map_location="cpu", weights_only=True)
        # Every process saved its own; a missing one means an incomplete checkpoint, not "skip it".
        rng = torch.load(ckpt / f"rng-rank{accelerator.process_index}.pt", map_location="cpu", weights_only=True)
    except SpecdraftError:
        raise
    except Exception as e:  # truncated safetensors, bad pickle, bad JSON: all mean the same to the user
        raise SpecdraftError(
            f"checkpoint {ckpt} is corrupt or incomplete ({type(e).__name__}: {e}). Delete that folder to "
            "resume from the one before it, or start again with --overwrite."
        ) from e
    model = accelerator.unwrap_model(trained)
    if uses_fsdp(accelerator):
        weights = fsdp_slices(model, weights)
    with full_parameters(accelerator, model, modify=True):
        missing, unexpected = model.load_state_dict(weights, strict=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if unexpected or trainable & set(missing):
        raise SpecdraftError(
            f"checkpoint {ckpt} does not match this drafter (missing {sorted(trainable & set(missing))[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}); it was trained from a different recipe."
        )
    if zero:
        _load_zero_shard(accelerator, optimizer, optim_state)
    elif uses_fsdp(accelerator):
        _load_fsdp_optimizer_state(drafter, optimizer, optim_state)
    else:
        optimizer.load_state_dict(optim_state)
    scheduler.load_state_dict(sched_state)
    _set_rng_state(rng)
    return state


def trained_tensors(module) -> dict:
    """What a resume restores: the parameters that train and the module's persistent buffers (a draft
    vocabulary's maps). Frozen parameters (a target the adapters sit in, a student's base weights) are
    rebuilt from the recipe, and never written to a checkpoint."""
    frozen = {name for name, param in module.named_parameters(remove_duplicate=False) if not param.requires_grad}
    return {name: tensor for name, tensor in module.state_dict().items() if name not in frozen}


def _trained_file(ckpt: Path) -> Path:
    """The trained module's tensors. A checkpoint written before they were saved on their own kept them in
    its drafter folder: in drafter/trained.safetensors where the published weights had another layout (a
    LoRA student merged), else as drafter/model.safetensors."""
    for file in (ckpt / TRAINED_FILE, ckpt / "drafter" / TRAINED_FILE, ckpt / "drafter" / "model.safetensors"):
        if file.is_file():
            return file
    return ckpt / TRAINED_FILE  # missing: reading it reports the checkpoint as incomplete


def check_resumable(accelerator, ckpt: Path) -> None:
    """--resume, before anything loads: the checkpoint was written by as many processes as this run has (each
    process's data position and RNG streams resume only in the same setup, and so do ZeRO optimizer shards), and
    an FSDP run resumes only an FSDP checkpoint: FSDP loads the optimizer's state by parameter name, which other
    runs do not save (they save it by position, which any run reads, an FSDP checkpoint's too). A checkpoint
    records both (``trainer_state.json``: world_size, distributed_type)."""
    state = json.loads((ckpt / STATE_FILE).read_text())
    saved = state.get("world_size", 1)
    if saved != accelerator.num_processes:
        raise SpecdraftError(
            f"checkpoint {ckpt} was written by {saved} process(es) and this run has "
            f"{accelerator.num_processes}: each process's data position and RNG resume only in the same "
            f"setup. Resume with {saved} process(es) (`accelerate launch --num_processes {saved} ...`, with "
            "the launcher config it was trained with), or start again with --overwrite."
        )
    written = state.get("distributed_type", DistributedType.NO.value)
    if uses_fsdp(accelerator) and written != DistributedType.FSDP.value:
        raise SpecdraftError(
            f"checkpoint {ckpt} was written by a {written} run, without FSDP, and this run is FSDP, which loads the "
            "optimizer's state by parameter name (other runs save it by position). Resume it with the launcher "
            "config it was trained with, or start again with --overwrite."
        )
