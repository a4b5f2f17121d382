"""The parts the training loop (``specdraft.train``) is assembled from, none of which knows a family:
where a run stands (its folder rules are ``specdraft.run_folder``), the accelerator's DeepSpeed
arguments, the optimizer's groups and schedule, signals, and metrics reduced across processes."""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import (
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    DistributedType,
    InitProcessGroupKwargs,
)
from transformers.integrations import unset_hf_deepspeed_config

from .config import flatten
from .errors import SpecdraftError


@dataclass
class RunState:
    """Where training is; saved in every checkpoint so a resume continues exactly."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches this process consumed in the current epoch
    tokens: int = 0


def look_for_unused_parameters(accelerator) -> None:
    """Have DDP look for trained parameters a step leaves without a gradient (``Optimization.unused_parameters``),
    or its next step raises (its reduction never finished). Set before the model is prepared: the handler is
    what ``Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(...)])`` sets, known only once the drafter is
    built, after the accelerator (the target loads on its device)."""
    accelerator.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=True)


# -- DeepSpeed (begin) --------------------------------------------------------------------------
# `accelerate launch --config_file recipes/accelerate/deepspeed_zero{2,3}.yaml` sets
# ACCELERATE_USE_DEEPSPEED; the loop is then unchanged: accelerator.backward runs the engine's
# backward and step, and optimizer.step/zero_grad become no-ops.
def deepspeed_arguments(tcfg) -> dict:
    """Extra ``Accelerator`` arguments when launched for DeepSpeed, else none."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return {}

    # Under DeepSpeed, clip_grad_norm_ is a no-op and the engine clips: the JSON's "auto"
    # gradient_clipping takes the recipe's value. zero3_init_flag=False: the target is loaded
    # whole, only the trained module is sharded (by the engine, at prepare).
    arguments = {"deepspeed_plugin": DeepSpeedPlugin(gradient_clipping=tcfg.max_grad_norm, zero3_init_flag=False)}
    if not torch.cuda.is_available():
        # accelerate picks a process-group backend only for accelerators; on CPU DeepSpeed
        # (DS_ACCELERATOR=cpu) runs over gloo. This is what makes the CPU tests possible.
        arguments["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    return arguments


def fill_deepspeed_micro_batch(accelerator, micro_batch_size: int) -> None:
    """DeepSpeed's "auto" micro-batch, which accelerate fills only from loaders prepared in the same call as the
    model: the loop prepares its loaders first (the run's length is what the drafter's optimisation is made for),
    so it fills the value accelerate would have (the loaders' batch size)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and plugin.is_auto("train_micro_batch_size_per_gpu"):
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch_size


def load_models_whole(accelerator) -> None:
    """Stop transformers from building models inside ``deepspeed.zero.Init``.

    accelerate registers the DeepSpeed config with transformers even when zero3_init_flag is off,
    and under ZeRO-3 ``from_pretrained`` would then shard the target, which never enters
    the engine, so its forward would see empty weights.
    """
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        unset_hf_deepspeed_config()
# -- DeepSpeed (end) ----------------------------------------------------------------------------


# -- FSDP (begin) -------------------------------------------------------------------------------
# `accelerate launch --config_file recipes/accelerate/fsdp.yaml` sets ACCELERATE_USE_FSDP; accelerate then
# shards the TrainStep at prepare (fully_shard), and the checkpoints gather it (specdraft.checkpoint).
def check_fsdp(accelerator) -> None:
    """Refuse, before anything loads, an FSDP launch the loop cannot train as configured."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return
    if accelerator.distributed_type != DistributedType.FSDP:
        # accelerate selects FSDP only on accelerators (accelerate/state.py) and would go on without it.
        raise SpecdraftError(
            f"the launcher config asks for FSDP, but accelerate runs FSDP only on GPUs (and other accelerators), "
            f"and on {accelerator.device.type} it would run {accelerator.distributed_type.value} instead. Launch "
            "with a DDP or DeepSpeed config (recipes/accelerate/), or on GPUs."
        )
    plugin = accelerator.state.fsdp_plugin
    if plugin.fsdp_version != 2:
        raise SpecdraftError(
            f"FSDP version {plugin.fsdp_version}: specdraft trains and checkpoints under FSDP2 only. Set "
            "fsdp_version: 2 in the launcher config's fsdp_config (as recipes/accelerate/fsdp.yaml does)."
        )
    if plugin.cpu_ram_efficient_loading:
        # transformers then loads every model on the processes after the first of each node with placeholder
        # weights, for FSDP to broadcast at prepare: the frozen target is never prepared, and would stay so.
        raise SpecdraftError(
            "FSDP with cpu_ram_efficient_loading (accelerate's default): every process but the first of each node "
            "would load the frozen target with placeholder weights, and only the module accelerate prepares (the "
            "drafter) gets the first process's weights broadcast. "
            "Set fsdp_cpu_ram_efficient_loading: false in the launcher config's fsdp_config (as "
            "recipes/accelerate/fsdp.yaml does)."
        )
    if plugin.auto_wrap_policy is not None:
        # A unit's parameters are gathered by its own forward, but the loop calls the drafter's prepare and
        # compute_loss: a wrapped submodule's parameters would be used still sharded.
        raise SpecdraftError(
            "FSDP with an auto-wrap policy: the loop runs the drafter through its own methods, not each module's "
            "forward, so a separately wrapped submodule would be used sharded. Set fsdp_auto_wrap_policy: "
            "NO_WRAP in the launcher config's fsdp_config (the drafter is one FSDP unit; the frozen target is "
            "not sharded)."
        )


def check_target_stays_whole(accelerator, step_module, target) -> None:
    """Under FSDP the frozen target stays whole on every process, outside the sharded TrainStep. A family whose
    trained module holds the target's own weights (Medusa-2: LoRA adapters inside the target) would have the
    target sharded with it, and then every use of the target outside the TrainStep's forward (the acceptance eval
    at the end, which runs on the main process alone) would see only its slice."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return
    target_parameters = {id(p) for p in target.parameters()}
    shared = [name for name, p in step_module.named_parameters() if id(p) in target_parameters]
    if shared:
        raise SpecdraftError(
            f"FSDP would shard the frozen target: this drafter trains inside it ({len(shared)} of the target's "
            f"parameters are in its trained module, e.g. {shared[0]}). Train it with DDP or DeepSpeed "
            "(recipes/accelerate/ddp_8gpu.yaml, deepspeed_zero2.yaml, or their _2x8 multi-node versions)."
        )


def clip_grad_value(accelerator, parameters, value: float) -> None:
    """Element-wise gradient clipping (``training.clip_grad_value``). accelerate refuses it under FSDP, yet it
    needs no communication there: each process clamps its own slice of the gradient to what clamping the
    whole would give."""
    if accelerator.distributed_type == DistributedType.FSDP:
        accelerator.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, value)
    else:
        accelerator.clip_grad_value_(parameters, value)


# -- FSDP (end) ---------------------------------------------------------------------------------


def check_trackers_installed(trackers: list[str]) -> None:
    """Each tracker a recipe names is installed (they are extras: ``specdraft[wandb]``, ``specdraft[tensorboard]``),
    or the error names the extra, before anything loads."""
    for tracker in trackers:
        if tracker != "none" and importlib.util.find_spec(tracker) is None:
            raise SpecdraftError(f"tracking.trackers names {tracker}, which is not installed: pip install "
                                 f"'specdraft[{tracker}]', or set tracking.trackers: [none] (metrics.jsonl is always "
                                 "written).")


class StopRequested:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint at the next step boundary, and ``train`` then raises
    ``StoppedBySignal`` with the signal's number (``signum``), so the whole command ends."""

    def __init__(self):
        self.requested = False
        self.signum: int | None = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True
        self.signum = self.signum or signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def flat_config(config: dict) -> dict:
    """``{"optimizer.lr": 1e-4, ...}``: trackers (tensorboard hparams) want flat scalars."""
    return {key: value if isinstance(value, (int, float, str, bool)) else str(value)
            for key, value in flatten(config).items()}


# -- host memory that does not grow (eval/bench_train_memory.py) --------------------------------------
# torch's bfloat16 matmuls on CPU run oneDNN kernels, compiled once per matrix shape and cached twice: in oneDNN's
# primitive cache and in ideep's (torch's oneDNN wrapper), 1,024 entries each by default. Packed batches change
# shape every step, and a SmolLM2 EAGLE-3 step brings about 60 new matmul shapes (its 1,800 matmuls hit the cache
# otherwise): both caches filled for some 20 steps, and their entries, interleaved with the activations, kept
# freed heap pages resident. 256 entries hold about four steps' shapes, so a step's repeated shapes still hit.
# Each cache reads its variable once, at its first use: set before a process's first bf16 matmul (``train``
# does so on entry); a value set by the user is kept. (0 is not a valid ideep capacity: it crashes.)
CPU_KERNEL_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
CPU_KERNEL_CACHE_CAPACITY = 256


def bound_cpu_kernel_caches() -> None:
    """Cap oneDNN's and ideep's per-shape kernel caches at ``CPU_KERNEL_CACHE_CAPACITY`` entries unless set."""
    for name in CPU_KERNEL_CACHES:
        os.environ.setdefault(name, str(CPU_KERNEL_CACHE_CAPACITY))


def _glibc_malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library is not glibc (macOS, musl)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _glibc_malloc_trim()


def release_freed_memory() -> None:
    """Hand the pages of the memory a step freed back to the operating system (glibc: ``malloc_trim(0)``).

    glibc serves CPU tensors under its mmap threshold (which it raises up to 32 MiB as blocks are freed) from
    its heaps, and returns a heap's free pages only from its top: a long-lived block above them (a cached
    kernel, an optimizer state) keeps them resident. Packed batches change shape every step, so each step's
    activations land at other offsets. ``malloc_trim`` releases every whole free page of every heap; elsewhere
    (no glibc) this does nothing.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
# -- host memory (end) ----------------------------------------------------------------------------


def mean_over_batches(history: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each metric's mean over this process's micro-batches, still on the device."""
    return {k: torch.stack([h[k].float() for h in history]).mean() for k in history[0]}


def mean_over_processes(accelerator, metrics: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Each metric's mean over the processes, in one collective: every process calls it, with the
    same keys (each process's means cover the same number of batches: accelerate's even_batches)."""
    keys = sorted(metrics)
    local = torch.stack([torch.as_tensor(metrics[k], dtype=torch.float32).to(accelerator.device) for k in keys])
    return dict(zip(keys, accelerator.reduce(local, reduction="mean").tolist()))


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
