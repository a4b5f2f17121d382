"""``specdraft selftest``: does this install work on this machine? The environment first (as DeepSpeed's
``ds_report``), then every part of specdraft on the device, on the shipped toy target (no download).

    specdraft selftest [--device cuda|cpu] [--quick] [--out DIR]

  environment  torch, CUDA, triton, transformers, accelerate, peft, deepspeed, datasets; the GPU and its bf16
               support; which verify backend runs on the device
  verify       chains and trees: the Triton kernels against the pure-torch reference on random batches (edge
               vocabularies, 0 to 15 drafts, batch 1 and 64; on a CPU in Triton's interpreter), and the
               emitted tokens' distribution against the target's (``specdraft.selftest_verify``)
  train        every family a few steps on the toy target in the device's precision (bf16 on CUDA): the
               loss falls, a resume from the middle checkpoint ends with identical weights, and each export
               reads back identical
  decode       greedy output identical to transformers' generate() for every family, chains and trees, batch
               1 and 4, and with compile_target (CUDA graphs on CUDA)
  verify cost  seconds per decode step per proposal width and batch size on this device: the curve the eval
               predicts speedups with (``specdraft.evaluation.verify_cost``)

One table (check, result, seconds), written also to OUT/selftest.md and OUT/selftest.json; exit status 1 if
any check failed. Budgets: 3 minutes on a modern GPU, 10 on a 2-core CPU; ``--quick`` (fewer cases, steps and
tokens; no compiled decoding on a CPU) 2 minutes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
import traceback
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

# Triton reads TRITON_INTERPRET when triton.language is first imported (its own @jit helpers), and peft, which the
# imports below reach through the families, imports it. Without CUDA the self-test checks the kernels' logic in
# Triton's interpreter, so the variable is set here, before that import (tests/conftest.py does the same).
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from safetensors.torch import load_file  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from .atomic import check_replaceable_output, mark_owner  # noqa: E402
from .config import parse_recipe  # noqa: E402
from .contract import FolderExporter  # noqa: E402
from .decoding.rows import fresh_sources  # noqa: E402
from .decoding.sources import static_cache_rolls_back  # noqa: E402
from .decoding.speculative import speculative_decode_batch  # noqa: E402
from .decoding.speculative import TreeDrafting, speculative_decode  # noqa: E402
from .decoding.tree_verify import verify_tree_reference, verify_tree_triton  # noqa: E402
from .decoding.trees import NAMED_TREES  # noqa: E402
from .decoding.verify import resolve_verify_backend, verify_reference, verify_triton  # noqa: E402
from .drafters import FAMILIES, load_drafter  # noqa: E402
from .dtypes import FLOAT32_OVERRIDES, cpu_computes_natively  # noqa: E402
from .errors import SpecdraftError, StoppedBySignal  # noqa: E402
from .evaluation.suites import Prompt, prompt_token_ids  # noqa: E402
from .evaluation.verify_cost import format_curve, measure_forward_costs  # noqa: E402
from .export import check_exported, export, exporters_of, load_exported  # noqa: E402
from .selftest_verify import (  # noqa: E402
    FALSE_ALARM,
    STAT_STEPS,
    agreement_grids,
    chain_exactness,
    compare,
    tree_exactness,
)
from .target import FrozenTarget, resolve_target_path  # noqa: E402
from .toy_target import definition_prompts  # noqa: E402
from .train import train  # noqa: E402

SELFTEST_OWNER = "specdraft selftest"  # atomic.mark_owner: a rerun replaces only its own report

PACKAGES = ("torch", "triton", "transformers", "accelerate", "peft", "deepspeed", "datasets", "safetensors")
K = 3  # drafts per step in the decoding checks (each family's selftest_settings drafts at least this many)
# Files of the toy target's training split (definitions of their functions are the chat data) and of its
# held-out split (the decoding checks' prompts); every Python 3 has them.
TRAIN_FILES = ("textwrap.py", "shlex.py", "string.py")
TRAIN_STEPS = 8  # 2 epochs of 16 training samples in micro-batches of 4: both epochs see every sample
PROMPT_FILES = ("fnmatch.py", "bisect.py")


@dataclass
class Check:
    name: str
    ok: bool | None  # None: does not apply on this machine (the detail says why)
    detail: str
    seconds: float

    @property
    def result(self) -> str:
        return {True: "ok", False: "FAILED", None: "n/a"}[self.ok]


@dataclass
class Setup:
    """What every check shares: the device, its precision, the size of the run and the scratch folder."""

    device: object  # torch.device
    quick: bool
    work: Path
    train_dtype: str = "float32"  # the target's, in training
    mixed_precision: str = "no"
    runs: dict = field(default_factory=dict)  # family -> its trained run folder (train -> decode)
    decoding: tuple | None = None  # (the shared float32 target, {family: drafter on it}), made once


# -- environment ----------------------------------------------------------------------------------------


def environment(device) -> dict[str, str]:
    """What ``ds_report`` shows: versions of what specdraft runs on, the device, and the verify backend."""
    info = {"python": platform.python_version(), "specdraft": _version("specdraft")}
    info.update({name: _version(name) for name in PACKAGES})
    info["torch CUDA"] = torch.version.cuda or "none (a CPU build)"
    info["device"] = str(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["GPU"] = (f"{props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability "
                       f"{props.major}.{props.minor}")
        info["bf16"] = "supported" if torch.cuda.is_bf16_supported() else "NOT supported (training uses float32)"
    else:
        info["GPU"] = "none" if not torch.cuda.is_available() else f"{torch.cuda.get_device_name()} (not used)"
        info["bf16"] = ("native on this CPU (the selftest still runs float32 here)" if cpu_computes_natively("bfloat16")
                        else "emulated on this CPU, many times slower than float32: train bf16 recipes here with "
                             + " ".join(FLOAT32_OVERRIDES))
    backend = resolve_verify_backend("auto", device)
    info["verify backend"] = {"triton": "triton (compiled kernels)",
                              "reference": "reference (pure torch)"}[backend]  # fmt: skip
    if device.type == "cpu" and _version("triton") != "not installed":
        info["verify backend"] += "; the kernels are checked here in Triton's interpreter"
    info["compiled decoding"] = ("available (compile_target, compiled draft LMs)" if static_cache_rolls_back() else
                                 "NOT available: transformers' StaticCache cannot roll back before 5.23 "
                                 "(pip install -U 'transformers>=5.23')")  # fmt: skip
    return info


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# -- verify ---------------------------------------------------------------------------------------------


def check_verify_agreement(setup: Setup, tree: bool) -> tuple[bool | None, str]:
    if _version("triton") == "not installed":
        return None, "triton is not installed: the reference verifies on this device, nothing to compare"
    if setup.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return None, "the kernels run on a CPU only in Triton's interpreter, set before triton was first used"
    grids = agreement_grids(setup.device, setup.quick)
    rows, failures = compare(grids, setup.device, tree)
    where = "compiled" if setup.device.type == "cuda" else "in Triton's interpreter"
    detail = f"kernel ({where}) == reference on {rows} random rows: " + "; ".join(
        f"V in {list(g.vocabs)}, batch {list(g.batches)}, {'nodes' if tree else 'K'} in {list(g.max_drafts)}"
        for g in grids)
    if failures:
        return False, f"{len(failures)} batches differ, e.g. {'; '.join(failures[:3])} ({detail})"
    return True, detail


def check_exactness(setup: Setup) -> tuple[bool, str]:
    triton = resolve_verify_backend("auto", setup.device) == "triton"
    steps = STAT_STEPS // 2 if setup.quick else STAT_STEPS
    p_values = {**chain_exactness(verify_triton if triton else verify_reference, setup.device, steps),
                **tree_exactness(verify_tree_triton if triton else verify_tree_reference, setup.device, steps)}
    failed = {name: p for name, p in p_values.items() if p < FALSE_ALARM}
    summary = (f"{'kernel' if triton else 'reference'}, {steps} steps per test, chi-square p-values "
               f"{', '.join(f'{p:.2g}' for p in p_values.values())} (each fails a correct sampler with "
               f"probability {FALSE_ALARM:g})")
    if failed:
        return False, "not distributed as the target: " + "; ".join(f"{n} (p={p:.2g})" for n, p in failed.items())
    return True, summary


# -- train ----------------------------------------------------------------------------------------------


def toy_chat_data(path: Path, files: tuple[str, ...], count: int) -> Path:
    """``count`` chat samples: 'Write the function f in x.py' answered with f's source (the toy target's own
    training data, cut to the first lines)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    pairs = [pair for name in files for pair in definition_prompts(name, (stdlib / name).read_text(encoding="utf-8"))]
    if len(pairs) < count:
        raise SpecdraftError(f"the standard library at {stdlib} gave {len(pairs)} definitions, fewer than {count}")
    records = [{"messages": [{"role": "user", "content": prompt},
                             {"role": "assistant", "content": "\n".join(source.splitlines()[:12]) + "\n"}]}
               for prompt, source in pairs[:count]]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def family_recipe(setup: Setup, family: str, data: Path, run_dir: Path, steps: int) -> dict:
    """A recipe for ``family`` on the toy target: its ``selftest_settings`` (small, every path it has switched on:
    EAGLE-3's reduced draft vocabulary, Medusa-2's adapters, DistillSpec's on-policy generation), 4 micro-batches an
    epoch, a checkpoint at half the steps."""
    return {
        "target": {"path": "toy", "dtype": setup.train_dtype, "taps": "auto"},
        "drafter": {"family": family, **FAMILIES[family].selftest_settings},
        "data": {"path": str(data), "format": "messages", "max_length": 128, "eval_fraction": 0.2},
        "optimizer": {"lr": 3e-3, "schedule": "cosine", "warmup_steps": 0, "min_lr_ratio": 0.5},
        "training": {"max_steps": steps, "micro_batch_size": 4, "grad_accumulation": 1,
                     "mixed_precision": setup.mixed_precision, "log_every": 1, "eval_batches": 1},
        "checkpoint": {"output_dir": str(run_dir), "save_every": steps // 2, "keep_last": 2},
        "tracking": {"trackers": ["none"]},
        "eval": {"enabled": False},
    }


def check_training(setup: Setup, family: str, data: Path) -> tuple[bool, str]:
    """Train; the loss falls (the last epoch's mean below the first's, over the same samples); resume a copy
    from the middle checkpoint: identical weights; export every format and read it back: identical weights."""
    steps = TRAIN_STEPS
    run_dir = setup.work / "runs" / family
    raw = family_recipe(setup, family, data, run_dir, steps)
    with _deterministic(setup.device):
        train(parse_recipe(raw), show_progress=False)
        losses = [m["train/loss"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                  if "train/loss" in m]
        first, last = sum(losses[: steps // 2]) / (steps // 2), sum(losses[steps // 2 :]) / (steps // 2)
        problems = [] if last < first else [f"the loss did not fall ({first:.3f} -> {last:.3f})"]

        resumed = setup.work / "runs" / f"{family}-resumed"
        shutil.copytree(run_dir, resumed)
        shutil.rmtree(resumed / "drafter")
        shutil.rmtree(resumed / "checkpoints" / f"step-{steps:07d}")
        raw["checkpoint"]["output_dir"] = str(resumed)
        train(parse_recipe(raw), resume=True, show_progress=False)
    straight = load_file(run_dir / "drafter" / "model.safetensors")
    again = load_file(resumed / "drafter" / "model.safetensors")
    differ = [name for name in straight if name not in again or not torch.equal(straight[name], again[name])]
    resume = (f"identical ({len(straight)} tensors)" if not differ and straight.keys() == again.keys()
              else f"DIFFERENT ({len(differ)} of {len(straight)} tensors, e.g. {differ[:2]})")
    if differ or straight.keys() != again.keys():
        problems.append(f"resumed from step {steps // 2}: {resume}")
    exports = check_exports(setup, family, run_dir)
    problems += [f"export {fmt}: {verdict}" for fmt, verdict in exports.items() if verdict != "identical"]
    setup.runs[family] = run_dir
    precision = "fp32" if setup.mixed_precision == "no" else setup.mixed_precision
    detail = (f"loss {first:.3f} -> {last:.3f} in {steps} {precision} steps; resume from step {steps // 2} {resume}; "
              f"exports {', '.join(f'{fmt} {verdict}' for fmt, verdict in exports.items())}")
    return (False, "; ".join(problems) + f" ({detail})") if problems else (True, detail)


def check_exports(setup: Setup, family: str, run_dir: Path) -> dict[str, str]:
    """Each format of the family, exported and read back (a whole-model export through its own check): the
    weights equal the trained drafter's, in the export's dtype."""
    target = FrozenTarget.from_pretrained(resolve_target_path("toy"), dtype="float32", device=setup.device)
    trained = load_drafter(run_dir / "drafter", target).trained_module().state_dict()
    verdicts = {}
    for fmt, exporter in sorted(exporters_of(family).items()):
        try:
            out = export(run_dir, fmt, setup.work / "exports" / family / fmt, overwrite=True)
            if isinstance(exporter, FolderExporter):
                check_exported(out, run_dir)
                verdicts[fmt] = "identical"
                continue
            back = load_exported(out, FrozenTarget.from_pretrained(resolve_target_path("toy"), dtype="float32",
                                                                   device=setup.device))
        except SpecdraftError as e:
            verdicts[fmt] = f"failed ({str(e).splitlines()[0][:200]})"
            continue
        read = back.trained_module().state_dict()
        same = read.keys() == trained.keys() and all(
            torch.equal(read[name], trained[name].to(read[name].dtype)) for name in read)
        verdicts[fmt] = "identical" if same else "DIFFERENT"
    return verdicts


class _deterministic:
    """On CUDA, deterministic kernels while training (a resume must reproduce the straight run bit for bit; an
    atomic-add backward would not); elsewhere nothing changes. Attention runs as math: flash and
    memory-efficient attention's backward split keys across atomic adds unless deterministic mode is strict
    (``warn_only=False``, which would stop on any other op without a deterministic kernel), and specdraft keeps
    cuDNN's attention off (``specdraft.sdpa``)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.before = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(True, warn_only=True)
            self.attention = sdpa_kernel([SDPBackend.MATH])
            self.attention.__enter__()

    def __exit__(self, *exc):
        if self.cuda:
            self.attention.__exit__(*exc)
            torch.use_deterministic_algorithms(self.before)


# -- decode ---------------------------------------------------------------------------------------------


def decoding_prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` chat prompts of 40 to 60 tokens asking for definitions in the toy's held-out files: similar
    lengths, so that compile_target's cache sizes (powers of two) are few and its graphs few."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    asks = [ask for name in PROMPT_FILES
            for ask, _ in definition_prompts(name, (stdlib / name).read_text(encoding="utf-8"))]
    ids = [prompt_token_ids(tokenizer, Prompt(str(i), "selftest", "code", "question", [ask]))
           for i, ask in enumerate(asks)]
    chosen = [x for x in ids if 40 <= len(x) <= 60][:count]
    if len(chosen) < count:
        raise SpecdraftError(f"the standard library's {', '.join(PROMPT_FILES)} gave {len(chosen)} prompts of 40 to 60 "
                             f"tokens, fewer than {count}")
    return chosen


def check_decoding(setup: Setup, family: str, max_new_tokens: int) -> tuple[bool | None, str]:
    """The trained drafter in the decoder, float32 target: chain and (where the family drafts one) tree, one
    prompt at a time with and without compile_target, and 4 prompts batched; every output must be what
    transformers' generate() gives greedily."""
    if family not in setup.runs:
        return None, "its training failed: nothing to decode"
    target, drafters = shared_decoding(setup)
    drafter = drafters.get(family)
    if drafter is None:  # it trains adapters inside the target (Medusa-2) or taps other layers: a target of its own
        target = FrozenTarget.from_pretrained(resolve_target_path("toy"), dtype="float32", device=setup.device)
        drafter = load_drafter(setup.runs[family] / "drafter", target).eval()
    prompts = [torch.tensor([ids], device=setup.device) for ids in decoding_prompts(target.tokenizer, 4)]
    eos = target.tokenizer.eos_token_id
    expected = [_generate(target.model, ids, max_new_tokens, eos) for ids in prompts]

    source = drafter.draft_source(target)
    methods = {"chain": source}
    if "dynamic" in source.capabilities.tree_kinds:
        methods["EAGLE-2 tree"] = TreeDrafting(source, NAMED_TREES["eagle2-small"])
    elif "static" in source.capabilities.tree_kinds:
        methods["medusa-8 tree"] = TreeDrafting(source, NAMED_TREES["medusa-8"])
    compile_modes, skipped = decoding_compile_modes(setup, drafter.needs.trains_adapters)
    wrong, accepted, drafted = [], 0, 0
    for name, method in methods.items():
        for mode in compile_modes:
            for i, ids in enumerate(prompts):
                out = speculative_decode(target, method, ids, k=K, max_new_tokens=max_new_tokens, eos_token_ids=eos,
                                         compile_target=mode)
                accepted += sum(s.num_accepted for s in out.steps)
                drafted += len(out.steps)
                if out.tokens != expected[i]:
                    wrong.append(f"{name}, batch 1{', compiled' if mode else ''}, prompt {i}")
        outs = speculative_decode_batch(target, fresh_sources(method, len(prompts)), prompts, k=K,
                                        max_new_tokens=max_new_tokens, eos_token_ids=eos)
        wrong += [f"{name}, batch {len(prompts)}, row {i}" for i, out in enumerate(outs) if out.tokens != expected[i]]
    ran = f"{', '.join(methods)}; batch 1{' eager and compiled' if len(compile_modes) > 1 else ''} and batch 4"
    detail = f"{ran}: {accepted} drafts accepted in {drafted} steps"
    if skipped:
        detail += f"; not run: {', '.join(skipped)}"
    if wrong:
        return False, f"{len(wrong)} decodes differ from generate(): {'; '.join(wrong[:4])} ({detail})"
    return True, "identical to generate(): " + detail


def decoding_compile_modes(setup: Setup, trains_adapters: bool) -> tuple[list[bool | str], list[str]]:
    """The ``compile_target`` modes the decode check runs (eager always), and what it leaves out and why."""
    if trains_adapters:
        return [False], ["compile_target (refused by design for a target that trains adapters)"]
    if not static_cache_rolls_back():  # the environment table says so too, with the fix
        return [False], [f"compile_target (needs transformers >= 5.23, this is {_version('transformers')})"]
    if setup.device.type == "cuda":
        return [False, "reduce-overhead"], []  # CUDA graphs
    if setup.quick:
        return [False], ["compile_target (CPU compiles take minutes: run without --quick)"]
    return [False, True], []


def shared_decoding(setup: Setup):
    """One float32 target with every trained drafter that leaves it frozen loaded on it, before any decodes: its
    needs (EAGLE's taps) are then final, so compile_target's graphs, one per step width, serve every family. One
    target taps one set of layers: a drafter that reads others (DFlash's beside EAGLE-3's) decodes on its own."""
    if setup.decoding is None:
        target = FrozenTarget.from_pretrained(resolve_target_path("toy"), dtype="float32", device=setup.device)
        drafters = {}
        for family, run_dir in setup.runs.items():
            # Loaded on a copy first: a drafter that puts adapters into its target (Medusa-2) keeps that copy.
            own = FrozenTarget.from_pretrained(resolve_target_path("toy"), dtype="float32", device=setup.device)
            needs = load_drafter(run_dir / "drafter", own).needs
            other_taps = needs.taps and target.needs.taps and needs.taps != target.needs.taps
            if not needs.trains_adapters and not other_taps:
                drafters[family] = load_drafter(run_dir / "drafter", target).eval()
        setup.decoding = (target, drafters)
    return setup.decoding


def _generate(model, ids, max_new_tokens: int, eos: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos)  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


# -- verify cost ----------------------------------------------------------------------------------------


def check_verify_cost(setup: Setup) -> tuple[bool, str, str]:
    """The curve on the toy target (float32) at proposal widths 1..8 and batch sizes (1, 4; on CUDA also 16, 64)."""
    target = FrozenTarget.from_pretrained(resolve_target_path("toy"), dtype="float32", device=setup.device)
    ids = decoding_prompts(target.tokenizer, 1)[0]
    widths = (1, 2, 4, 6, 8) if setup.quick else tuple(range(1, 9))
    batches = (1, 4, 16, 64) if setup.device.type == "cuda" else (1, 4)
    costs = measure_forward_costs(target, torch.tensor([ids], device=setup.device),
                                  {("chain", w, b) for w in widths for b in batches},
                                  steps=8 if setup.quick else 16)  # fmt: skip
    at = {b: costs.relative("chain", K + 1, b) for b in batches}
    return True, ("v(K+1=4) = a verify step / a plain step: "
                  + ", ".join(f"{v:.2f} at batch {b}" for b, v in at.items())), format_curve(costs)


# -- the command ----------------------------------------------------------------------------------------


def pick_device(requested: str | None):
    if requested is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as e:
        raise SpecdraftError(f"--device {requested!r} is not a device torch knows ({e}); use cuda, cuda:N or "
                             "cpu") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        build = f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, but no GPU or driver answers" \
            if torch.version.cuda else f"torch {torch.__version__} is a CPU build"
        raise SpecdraftError(f"--device {requested}: CUDA is not available ({build}). Install a CUDA build of torch "
                             "(https://pytorch.org/get-started/locally/) on a machine with an NVIDIA GPU, or run "
                             "`specdraft selftest --device cpu`.")
    if device.type not in ("cuda", "cpu"):
        raise SpecdraftError(f"--device {requested}: specdraft's selftest runs on cuda or cpu")
    return device


def writable_folder(out: Path) -> Path:
    """``out`` created and proven writable (a file written and removed), or an error that names the fix."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".selftest-probe-"):
            pass
    except OSError as e:
        raise SpecdraftError(f"selftest writes its report and scratch runs to {out.resolve()}, which cannot be "
                             f"written ({e.strerror or e}); pass --out DIR in a folder you can write to") from e
    return out


def selftest(device=None, quick: bool = False, out: str | Path = "selftest", families: tuple[str, ...] | None = None,
             show: bool = True) -> list[Check]:
    """Run every check (training and decoding for ``families``, default every registered family); print
    (``show``) and write OUT/selftest.{md,json}; return the checks."""
    families = tuple(FAMILIES) if families is None else families

    device = pick_device(device) if not isinstance(device, torch.device) else device
    check_replaceable_output(Path(out), SELFTEST_OWNER, "--out")  # an earlier self-test's report, or nothing
    out = writable_folder(Path(out))
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (the resume check)
    started = time.perf_counter()
    env = environment(device)
    if show:
        width = max(map(len, env))
        print("specdraft selftest" + (" --quick" if quick else "") + "\n" +
              "\n".join(f"  {key:<{width}}  {value}" for key, value in env.items()) + "\n", flush=True)
    work = Path(tempfile.mkdtemp(prefix="work-", dir=out))
    (out / "selftest.log").write_text("")
    (out / "selftest-errors.log").unlink(missing_ok=True)
    mark_owner(out, SELFTEST_OWNER)  # what it holds now is this self-test's (the report is added when written)
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    setup = Setup(device, quick, work, "bfloat16" if bf16 else "float32", "bf16" if bf16 else "no")
    checks: list[Check] = []
    curve = ""

    def run(name: str, fn, *args):
        nonlocal curve
        start = time.perf_counter()
        try:  # what the check's code prints (progress bars, loading messages) goes to OUT/selftest.log
            with open(out / "selftest.log", "a") as log, redirect_stdout(log), redirect_stderr(log):
                print(f"== {name}", flush=True)
                result = fn(*args)
            ok, detail = result[:2]
            curve = result[2] if len(result) > 2 else curve
        except (StoppedBySignal, KeyboardInterrupt) as stop:  # the whole self-test ends, reporting the checks done
            write_report(out, env, checks, curve, time.perf_counter() - started, quick)
            if show:
                print(f"  {name}: {str(stop) or 'SIGINT'}; the self-test stops here (report so far: "
                      f"{out / 'selftest.md'})", flush=True)
            raise
        except Exception as e:  # noqa: BLE001  a broken check is a failed check; the others still run
            ok = False
            detail = f"{type(e).__name__}: {e}".splitlines()[0][:400]
            (out / "selftest-errors.log").open("a").write(f"== {name}\n{traceback.format_exc()}\n")
        check = Check(name, ok, detail, time.perf_counter() - start)
        checks.append(check)
        if show:
            print(f"  {check.result:>6}  {name:<24} {check.seconds:6.1f} s  {detail}", flush=True)

    run("verify: chains", check_verify_agreement, setup, False)
    run("verify: trees", check_verify_agreement, setup, True)
    run("verify: exactness", check_exactness, setup)
    data = toy_chat_data(work / "chat.jsonl", TRAIN_FILES, 20)
    for family in families:
        run(f"train: {family}", check_training, setup, family, data)
    for family in families:
        run(f"decode: {family}", check_decoding, setup, family, 16 if quick else 32)
    run("verify cost", check_verify_cost, setup)

    seconds = time.perf_counter() - started
    failed = [c for c in checks if c.ok is False]
    write_report(out, env, checks, curve, seconds, quick)
    if show:
        if curve:
            print(f"\nverify cost on {device} (toy target, float32): ms per decode step (v = step / plain step)\n"
                  + curve)
        verdict = f"{len(failed)} of {len(checks)} checks FAILED" if failed else f"all {len(checks)} checks passed"
        print(f"\n{verdict} in {seconds:.0f} s; report: {out / 'selftest.md'}, {out / 'selftest.json'}; what the "
              f"checks printed: {out / 'selftest.log'}"
              + (f"; tracebacks: {out / 'selftest-errors.log'}" if failed else ""))
    if not failed:
        shutil.rmtree(work, ignore_errors=True)
    return checks


def write_report(out: Path, env: dict, checks: list[Check], curve: str, seconds: float, quick: bool) -> None:
    """OUT/selftest.md and OUT/selftest.json, each written to a temporary file and renamed into place."""
    rows = "\n".join(f"| {c.name} | {c.result} | {c.seconds:.1f} | {c.detail.replace('|', '/')} |" for c in checks)
    markdown = (f"# specdraft selftest{' --quick' if quick else ''}: "
                f"{sum(c.ok is False for c in checks)} failed of {len(checks)}, {seconds:.0f} s\n\n"
                "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in env.items())
                + "\n\n| check | result | seconds | detail |\n|---|---|---:|---|\n" + rows + "\n"
                + (f"\n## verify cost (ms per decode step, v = step / plain step)\n\n{curve}\n" if curve else ""))
    record = {"environment": env, "quick": quick, "seconds": seconds, "checks": [asdict(c) for c in checks],
              "verify_cost": curve}
    for name, text in (("selftest.md", markdown), ("selftest.json", json.dumps(record, indent=1) + "\n")):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)
    mark_owner(out, SELFTEST_OWNER)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer cases, steps and tokens (at most 2 minutes; what CI runs)")
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=None, metavar="FAMILY",
                        help="train and decode these families only (default: every registered family)")
    parser.add_argument("--out", default="selftest", metavar="DIR",
                        help="where selftest.md / selftest.json and the scratch runs go (default: ./selftest)")


def run(args: argparse.Namespace) -> int:
    checks = selftest(args.device, args.quick, args.out, tuple(args.families) if args.families else None)
    return 1 if any(c.ok is False for c in checks) else 0
