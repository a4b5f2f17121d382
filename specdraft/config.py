"""Recipes: one YAML file, parsed into typed dataclasses that map one-to-one onto code.

Every section below is a YAML mapping of the same name. ``key.sub=value`` on the
command line overrides a field (the value is parsed as YAML). Mistakes stop here,
before anything loads, naming the dotted key and the nearest valid name.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .decoding.verify import VERIFY_BACKENDS
from .drafters import get_family
from .errors import SpecdraftError
from .recipe_files import resolve_recipe

# Drafts per step, at most: a step holds each draft's [V] probabilities, and a draft at depth 64 is accepted
# with probability alpha^64 (about 1e-6 at alpha 0.8). 4-8 is typical.
MAX_DRAFTS_PER_STEP = 64


@dataclass
class TargetConfig:
    path: str  # local transformers folder or hub id; "toy" = the shipped toy target
    dtype: str = "bfloat16"
    # Layers whose *inputs* are tapped (vLLM convention). "auto": the layers the drafter family reads
    # by default (EAGLE-3: 2, N//2, N-3; EAGLE-1: none); "eagle3" is auto's older name. A list replaces
    # the family's layers one for one.
    taps: list[int] | str = "auto"
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    # Recompute the target's layer activations in the backward pass instead of keeping them, for a family that
    # backpropagates through the target (Medusa-2's adapters): about one more target forward per step.
    gradient_checkpointing: bool = False


@dataclass
class DataConfig:
    path: str  # local .json/.jsonl/.parquet file or folder, or a datasets hub id
    format: str = "auto"  # auto | sharegpt | messages | turns | text
    split: str = "train"
    text_field: str = "text"
    chat_template: str | None = None  # jinja file or inline template; None = the tokenizer's
    max_length: int = 2048
    packing: bool = False
    # The shapes batches take: dynamic = as wide as each batch's longest row (no compute on padding, the CPU's
    # choice); buckets = micro_batch_size rows of one of 4 widths (max_length / 8, / 4, / 2, max_length), so a
    # GPU meets 4 shapes a run, not a new one every step (plans, compiled graphs); auto = buckets on CUDA.
    shapes: str = "auto"
    # A token budget per micro-batch (the GPU recipes'): each batch is tokens_per_micro_batch / max_length packed
    # rows of max_length, filled with as many samples as fit, whatever their lengths: one shape a run, and the
    # same work every step. Needs packing: true; training.micro_batch_size is then not used.
    tokens_per_micro_batch: int | None = None
    eval_fraction: float = 0.02  # ignored when eval_path is set
    # A separate eval file (same format), e.g. answers to prompts from held-out sources: the eval
    # metrics then measure generalisation, as decoding on new prompts will, not memory of the training set.
    eval_path: str | None = None
    max_samples: int | None = None
    seed: int = 0
    num_proc: int = 1


@dataclass
class OptimizerConfig:
    lr: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    eps: float = 1e-8
    schedule: str = "cosine"  # cosine | linear | constant
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0


@dataclass
class TrainingConfig:
    max_steps: int | None = None  # optimizer steps; or give epochs
    epochs: float | None = None
    micro_batch_size: int = 1
    grad_accumulation: int = 1
    max_grad_norm: float = 0.5  # 0 = off
    clip_grad_value: float | None = None  # element-wise clipping (the EAGLE-1 reference's choice)
    mixed_precision: str = "no"  # no | bf16 | fp16
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0  # 0 = only at the end
    eval_batches: int = 20
    feature_cache: str | None = None  # offline mode: folder written by `specdraft cache-features`
    num_workers: int = 0
    # torch.compile the drafter's forward and loss at fixed shapes (needs data.tokens_per_micro_batch or
    # data.shapes: buckets); families whose loss cannot run at fixed shapes are refused, with the reason.
    compile: bool = False


@dataclass
class CheckpointConfig:
    output_dir: str
    save_every: int = 500
    keep_last: int = 2


@dataclass
class TrackingConfig:
    trackers: list[str] = field(default_factory=lambda: ["none"])  # wandb | tensorboard | none
    project: str = "specdraft"
    run_name: str | None = None


@dataclass
class EvalConfig:
    enabled: bool = True
    prompts: str | None = None  # prompt/question file; None = held-out samples of the data
    num_prompts: int = 16
    k: int = 5
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    max_new_tokens: int = 64
    prompt_lookup_baseline: bool = True
    # The target's dtype in this eval. auto: the dtype training used, except on a CPU without hardware for it
    # (bf16 on an AVX2-only CPU), which decodes in float32. As `specdraft eval --dtype`.
    dtype: str = "auto"
    # The verify step: auto = the Triton kernels on CUDA when triton imports, else the pure-torch reference;
    # triton or reference to force one. As `specdraft eval --verify-backend`.
    verify_backend: str = "auto"


@dataclass
class Recipe:
    target: TargetConfig
    drafter: Any  # the family's own config dataclass (see specdraft.drafters.FAMILIES)
    data: DataConfig
    checkpoint: CheckpointConfig
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    drafter_family: str = ""

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["drafter"] = {"family": self.drafter_family, **dataclasses.asdict(self.drafter)}
        del out["drafter_family"]
        return out


# -- parsing ------------------------------------------------------------------------------------
def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def parse_dataclass(cls: type, data: Any, path: str) -> Any:
    """Build ``cls`` from a mapping, checking keys and types; errors name the dotted path."""
    if not isinstance(data, dict):
        raise SpecdraftError(f"{path or 'recipe'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean '{_join(path, near[0])}'?" if near else f"; valid keys: {', '.join(fields)}"
            raise SpecdraftError(f"unknown key '{_join(path, key)}'{hint}")
    kwargs = {}
    for name, f in fields.items():
        dotted = _join(path, name)
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SpecdraftError(f"missing required key '{dotted}'")
            continue
        value, tp = data[name], hints[name]
        if dataclasses.is_dataclass(tp):
            value = parse_dataclass(tp, value, dotted)
        elif not _type_ok(value, tp) and _type_ok(1.0, tp) and _as_float(value) is not None:
            value = _as_float(value)  # 3 -> 3.0, and PyYAML reads "3e-4" (no dot) as a string
        elif isinstance(value, bool) and not _type_ok(value, tp) and _type_ok("", tp):
            # YAML 1.1 reads no/yes/on/off as booleans: `mixed_precision: no` arrives as False.
            raise SpecdraftError(f"'{dotted}' must be {_type_name(tp)}, got {value!r}: YAML reads no, yes, on and "
                                 f"off as booleans, so quote the word ({dotted}: \"no\", or {dotted}='no' on the "
                                 "command line)")
        elif not _type_ok(value, tp):
            raise SpecdraftError(f"'{dotted}' must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")
        kwargs[name] = value
    return cls(**kwargs)


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else str(key)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """``a.b=value`` sets raw["a"]["b"] = yaml(value). Unknown keys are caught later by parsing."""
    for item in overrides:
        if "=" not in item:
            raise SpecdraftError(f"override {item!r} must look like key.sub=value (e.g. training.max_steps=100)")
        key, value = item.split("=", 1)
        node = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SpecdraftError(f"override {item!r}: '{part}' is not a section")
        try:
            node[parts[-1]] = yaml.safe_load(value) if value != "" else None
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise SpecdraftError(f"override {item!r}: the value is not valid YAML ({problem}); quote a string "
                                 f"(key='text') or close the list (key=[a, b])") from e
    return raw


def parse_recipe(raw: dict) -> Recipe:
    raw = dict(raw)
    drafter_raw = raw.get("drafter")
    if not isinstance(drafter_raw, dict) or "family" not in drafter_raw:
        raise SpecdraftError("missing required key 'drafter.family' (e.g. eagle3)")
    drafter_raw = dict(drafter_raw)
    family = get_family(drafter_raw.pop("family"))
    raw["drafter"] = parse_dataclass(family.config_cls, drafter_raw, "drafter")
    # The family's paper defaults (lr, betas, clipping, ...) fill what the recipe leaves unset.
    family_defaults = dict(getattr(family.config_cls, "optimizer_defaults", {}))
    training_keys = ("max_grad_norm", "clip_grad_value")
    fills = {
        "training": {k: v for k, v in family_defaults.items() if k in training_keys},
        "optimizer": {k: list(v) if isinstance(v, tuple) else v for k, v in family_defaults.items()
                      if k not in training_keys},
    }
    for section, fill in fills.items():
        given = raw.get(section) or {}
        if fill and isinstance(given, dict):  # a non-mapping is reported by parse_dataclass
            raw[section] = {**fill, **given}  # a new dict: the caller's mapping is left as it was
    hints = typing.get_type_hints(Recipe)
    hints["drafter"] = Any
    recipe_fields = {f.name for f in dataclasses.fields(Recipe)} - {"drafter_family"}
    required = {f.name for f in dataclasses.fields(Recipe) if f.default_factory is dataclasses.MISSING
                and f.default is dataclasses.MISSING}
    for key in raw:
        if key not in recipe_fields:
            near = difflib.get_close_matches(str(key), list(recipe_fields), n=1)
            hint = f"; did you mean '{near[0]}'?" if near else f"; valid sections: {', '.join(sorted(recipe_fields))}"
            raise SpecdraftError(f"unknown key '{key}'{hint}")
    kwargs: dict[str, Any] = {"drafter": raw["drafter"], "drafter_family": family.name}
    for name in recipe_fields - {"drafter"}:
        tp = hints[name]
        if name in raw:
            kwargs[name] = parse_dataclass(tp, raw[name] or {}, name)
        elif name in required:
            raise SpecdraftError(f"missing required section '{name}'")
    recipe = Recipe(**kwargs)
    _expand_home(recipe)
    _check_values(recipe)
    return recipe


# Recipe fields that name local paths: "~/x" means the home folder's x, as in a shell (not a folder named "~").
HOME_PATH_FIELDS = (("target", "path"), ("data", "path"), ("data", "eval_path"), ("data", "chat_template"),
                    ("checkpoint", "output_dir"), ("training", "feature_cache"), ("eval", "prompts"))


def _expand_home(recipe: Recipe) -> None:
    for section, key in HOME_PATH_FIELDS:
        value = getattr(getattr(recipe, section), key)
        if isinstance(value, str) and (value == "~" or value.startswith("~/")):
            setattr(getattr(recipe, section), key, str(Path(value).expanduser()))


def _check_token_budget(r: Recipe) -> None:
    budget, width = r.data.tokens_per_micro_batch, r.data.max_length
    if budget is None:
        return
    if not r.data.packing:
        raise SpecdraftError("'data.tokens_per_micro_batch' fills packed rows: set data.packing: true (or drop the "
                             "token budget and use training.micro_batch_size)")
    if width < 1 or budget < width or budget % width:
        raise SpecdraftError(f"'data.tokens_per_micro_batch' ({budget}) must be a whole number of rows of "
                             f"data.max_length ({width} tokens): e.g. {max(1, budget // max(width, 1)) * width}")
    if r.training.feature_cache:
        raise SpecdraftError("'data.tokens_per_micro_batch' packs samples into rows, whose features a feature cache "
                             "(training.feature_cache, stored per sample) does not hold: drop one of the two")


def _check_values(r: Recipe) -> None:
    t = r.training
    if (t.max_steps is None) == (t.epochs is None):
        raise SpecdraftError("set exactly one of 'training.max_steps' and 'training.epochs'")
    if r.data.shapes == "buckets" and r.training.feature_cache:
        raise SpecdraftError("'data.shapes' buckets needs the target's features at each batch's shape, which a "
                             "feature cache (training.feature_cache) does not store: use data.shapes: dynamic")
    _check_token_budget(r)
    choices = {
        "training.mixed_precision": (t.mixed_precision, ("no", "bf16", "fp16")),
        "optimizer.schedule": (r.optimizer.schedule, ("cosine", "linear", "constant")),
        "target.dtype": (r.target.dtype, ("bfloat16", "float16", "float32")),
        "eval.dtype": (r.eval.dtype, ("auto", "bfloat16", "float16", "float32")),
        "eval.verify_backend": (r.eval.verify_backend, VERIFY_BACKENDS),
        "data.format": (r.data.format, ("auto", "sharegpt", "messages", "turns", "text")),
        "data.shapes": (r.data.shapes, ("auto", "dynamic", "buckets")),
    }
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise SpecdraftError(f"'{key}' must be one of {', '.join(allowed)}; got {value!r}")
    for tracker in r.tracking.trackers:
        if tracker not in ("wandb", "tensorboard", "none"):
            raise SpecdraftError(f"'tracking.trackers' entries must be wandb, tensorboard or none; got {tracker!r}")
    if isinstance(r.target.taps, str) and r.target.taps not in ("auto", "eagle3"):
        raise SpecdraftError(f"'target.taps' must be a list of layer indices or 'auto'; got {r.target.taps!r}")
    o, e = r.optimizer, r.eval
    at_least_one = {
        "training.micro_batch_size": t.micro_batch_size,
        "training.grad_accumulation": t.grad_accumulation,
        "training.max_steps": t.max_steps,
        "training.log_every": t.log_every,
        "training.eval_batches": t.eval_batches,
        "data.max_length": r.data.max_length,
        "data.num_proc": r.data.num_proc,
        "data.max_samples": r.data.max_samples,
        "checkpoint.save_every": r.checkpoint.save_every,
        "checkpoint.keep_last": r.checkpoint.keep_last,
        "eval.num_prompts": e.num_prompts,
        "eval.max_new_tokens": e.max_new_tokens,
    }
    for key, value in at_least_one.items():
        if value is not None and value < 1:
            raise SpecdraftError(f"'{key}' must be >= 1; got {value}")
    at_least_zero = {"optimizer.warmup_steps": o.warmup_steps, "optimizer.weight_decay": o.weight_decay,
                     "training.max_grad_norm": t.max_grad_norm, "training.eval_every": t.eval_every,
                     "training.num_workers": t.num_workers}
    for key, value in at_least_zero.items():
        if not value >= 0:  # `not >=` also catches NaN
            raise SpecdraftError(f"'{key}' must be >= 0; got {value}")
    # (key, value, low, high, what the range means): floats whose range is open at 0
    ranges = [
        ("optimizer.lr", o.lr, "> 0", o.lr > 0 and math.isfinite(o.lr), "a peak learning rate such as 1e-4"),
        ("optimizer.eps", o.eps, "> 0", o.eps > 0, "AdamW's epsilon, 1e-8 by default"),
        ("optimizer.min_lr_ratio", o.min_lr_ratio, "in [0, 1]", 0 <= o.min_lr_ratio <= 1,
         "the floor of the decay as a fraction of optimizer.lr"),
        ("training.epochs", t.epochs, "> 0", t.epochs is None or t.epochs > 0, "passes over the data"),
        ("training.clip_grad_value", t.clip_grad_value, "> 0 (or null for off)",
         t.clip_grad_value is None or t.clip_grad_value > 0, "element-wise gradient clipping"),
        ("data.eval_fraction", r.data.eval_fraction, "in [0, 1)", 0 <= r.data.eval_fraction < 1,
         "the share of the data held out for the eval metrics"),
        ("eval.k", e.k, f"between 1 and {MAX_DRAFTS_PER_STEP}", 1 <= e.k <= MAX_DRAFTS_PER_STEP,
         "drafts per step; 4-8 is typical"),
    ]
    for key, value, valid, ok, meaning in ranges:
        if not ok:
            raise SpecdraftError(f"'{key}' must be {valid}; got {value} ({meaning})")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise SpecdraftError(f"'optimizer.betas' must be two numbers in [0, 1), e.g. [0.9, 0.95]; got {o.betas}")
    for temperature in e.temperatures:
        if not (temperature >= 0 and math.isfinite(temperature)):
            raise SpecdraftError(f"'eval.temperatures' must hold numbers >= 0 (0 = greedy); got {temperature}")
    if t.max_steps is not None and o.warmup_steps > t.max_steps:
        warnings.warn(f"optimizer.warmup_steps ({o.warmup_steps}) > training.max_steps ({t.max_steps}): the learning "
                      f"rate never reaches optimizer.lr ({o.lr}); it stops at {o.lr * t.max_steps / o.warmup_steps:.3g}",
                      stacklevel=3)


def flatten(config: dict, prefix: str = "") -> dict:
    """``{"optimizer": {"lr": 1e-4}}`` -> ``{"optimizer.lr": 1e-4}``: a recipe dict by dotted key."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """A recipe file, or a shipped recipe's name (``toy_eagle3``), with ``key.sub=value`` overrides."""
    path = resolve_recipe(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise SpecdraftError(f"recipe {path} is not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise SpecdraftError(f"recipe {path} must be a YAML mapping of sections (target, drafter, data, ...)")
    return parse_recipe(apply_overrides(raw, overrides or []))
