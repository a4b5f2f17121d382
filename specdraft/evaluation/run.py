"""``specdraft eval``: acceptance length, acceptance rate and measured speedup of drafters.

Every method (each drafter, a draft LM, prompt lookup) and plain decoding run on the
same prompts in one process, prompt by prompt, so the speedups compare like with like.
``evaluate(...)`` is the Python API (the quickstart calls it); ``add_arguments``/``run``
are the CLI.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdraft.config import MAX_DRAFTS_PER_STEP
from specdraft.atomic import OWNER_FILE, check_replaceable_output, mark_owner
from specdraft.checkpoint import find_drafter_dir
from specdraft.contract import DraftSource
from specdraft.decoding.rows import fresh_sources
from specdraft.decoding.compiled_verify import compiled_verify
from specdraft.decoding.sampling import SamplingParams
from specdraft.decoding.sources import (
    DraftLMSource,
    PromptLookupSource,
    vocab_map_from_tokenizers,
)
from specdraft.decoding.speculative import (
    DecodeOutput,
    TreeDrafting,
    check_decode_args,
    most_drafts,
    speculative_decode_batch,
)
from specdraft.decoding.trees import NAMED_TREES, parse_tree
from specdraft.decoding.verify import VERIFY_BACKENDS, resolve_verify_backend
from specdraft.drafters import get_family, load_drafter
from specdraft.dtypes import default_dtype, resolve_dtype
from specdraft.errors import SpecdraftError
from specdraft.evaluation import mismatch, report
from specdraft.evaluation.metrics import summarize
from specdraft.evaluation.provenance import measured_on
from specdraft.evaluation.suites import Prompt, load_suite, prompt_token_ids
from specdraft.evaluation.verify_cost import forward_keys, measure_forward_costs
from specdraft.export import SIDE_FILE, load_exported
from specdraft.target import FrozenTarget, resolve_target_path, stop_token_ids
from specdraft.target_fingerprint import check_target

PLAIN = "plain"
PROMPT_LOOKUP = "prompt-lookup"  # the baseline's one name, in every table (the CLI's and training's eval)
EVAL_OWNER = "specdraft eval"  # atomic.mark_owner's record: --overwrite replaces only an earlier eval's report


@dataclass(frozen=True)
class EvalSettings:
    """How ``evaluate`` decodes every method and measures it (``specdraft eval``'s flags fill it,
    ``EvalSettings.from_args``; a recipe's ``eval:`` section fills it in training)."""

    params: SamplingParams = SamplingParams()
    k: int = 5  # drafts per step of a chain (a tree method drafts its tree's depth)
    max_new_tokens: int = 128
    num_prompts: int | None = None  # the first N prompts (None: all)
    prefix_tokens: int = 128  # a code prompt's prefix length
    seed: int = 0
    lenience: float = 1.0  # LOSSY below 1 (``verify``)
    typical_acceptance: bool = False  # LOSSY: Medusa's typical acceptance
    batch_size: int = 1  # prompts decoded together
    compile_target: bool | str = False  # the target's decode forwards compiled
    verify_backend: str = "auto"  # auto | triton | reference (``verify.resolve_verify_backend``)
    forward_costs: bool = True  # measure each step width's cost and predict each method's speedup from it
    show_progress: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace, params: SamplingParams) -> EvalSettings:
        """The settings ``specdraft eval``'s flags ask for."""
        return cls(params=params, k=args.k, max_new_tokens=args.max_new_tokens, num_prompts=args.num_prompts,
                   prefix_tokens=args.prefix_tokens, seed=args.seed, lenience=args.lenience,
                   typical_acceptance=args.typical_acceptance, batch_size=args.batch_size,
                   compile_target=args.compile_target, verify_backend=args.verify_backend,
                   show_progress=not args.no_progress)


def evaluate(
    target,  # FrozenTarget (with .tokenizer, or pass tokenizer=)
    sources: dict[str, DraftSource | Callable[[], DraftSource]],
    prompts: list[Prompt] | str | Path | list[str | Path],  # Prompts, or suite file(s)/folder(s)
    settings: EvalSettings = EvalSettings(),
    out_dir: str | Path | None = None,
    *,
    tokenizer=None,
    wandb_run=None,
) -> dict:
    """Decode every prompt with plain decoding and with each source; return (and write) the report dict.

    ``batch_size`` > 1 decodes that many prompts together (``speculative_decode_batch``: chains or trees,
    exact verification); tokens/s is then per request, and ``total_tokens_per_second`` the batch's throughput.
    ``compile_target`` compiles the target's decode forwards, plain decoding's and the verifies' alike.
    ``verify_backend``: auto | triton | reference (``specdraft.decoding.verify.resolve_verify_backend``).
    ``forward_costs`` then measures the device's cost of each step width the decodes used
    (``verify_cost.measure_forward_costs``, on the first prompt) and predicts each method's speedup from them."""
    params, k, max_new_tokens, seed = settings.params, settings.k, settings.max_new_tokens, settings.seed
    prefix_tokens, batch_size, lenience = settings.prefix_tokens, settings.batch_size, settings.lenience
    typical_acceptance, compile_target = settings.typical_acceptance, settings.compile_target
    tokenizer = tokenizer or getattr(target, "tokenizer", None)
    if tokenizer is None:
        raise SpecdraftError(
            "evaluate needs the target's tokenizer: load the target with from_pretrained, or pass tokenizer=."
        )
    if PLAIN in sources:
        raise SpecdraftError(f"{PLAIN!r} names the plain-decoding baseline, which always runs; rename that source.")
    check_decoding_sizes(k, max_new_tokens)
    prompts = _as_prompts(prompts, settings.num_prompts)
    methods = {PLAIN: None, **{name: _instantiate(s) for name, s in sources.items()}}
    device = target.device
    stop_ids = _stop_ids(target, tokenizer)
    verify_backend = resolve_verify_backend(settings.verify_backend, device)  # a bad choice fails before any decode
    machine = measured_on(device, target.lm_head.weight.dtype)  # the code and date it starts with

    def drafts_per_step(source) -> int:  # a tree method drafts its tree's whole depth; k is the chains' length
        return source.depth if isinstance(source, TreeDrafting) else k

    _check_prompt_lengths(target, tokenizer, prompts, prefix_tokens, max_new_tokens)
    if batch_size < 1:
        raise SpecdraftError(f"batch_size must be >= 1, got {batch_size}")
    if batch_size > 1 and compile_target:
        raise SpecdraftError("compile_target compiles one prompt's decode; batches run eager: drop --compile-target, "
                             "or decode with --batch-size 1")

    # Warm up every method (lazy initialisation, allocator) so the first timed decode is not penalised.
    warmup_ids = prompt_token_ids(tokenizer, prompts[0], prefix_tokens=prefix_tokens)
    if compile_target:  # and compile the verify for every cache size the first turns need, not while timing them
        first_turns = [len(prompt_token_ids(tokenizer, p, prefix_tokens=prefix_tokens)) for p in prompts]
        widths = {(1, False) if s is None else (1 + most_drafts(s, drafts_per_step(s)), isinstance(s, TreeDrafting))
                  for s in methods.values()}  # the steps' width (plain: 1), and whether they verify trees
        precompile(target, compile_target, first_turns, max_new_tokens, widths)
    def decode_rows(source, rows: list[list[int]], generator_seed: int, max_new: int) -> list[DecodeOutput]:
        """The rows decoded together (one row: the method's own source, else a copy per row)."""
        sources = None if source is None else [source] if len(rows) == 1 else fresh_sources(source, len(rows))
        return speculative_decode_batch(
            target, sources, [torch.tensor(ids, device=device) for ids in rows], k=drafts_per_step(source),
            params=params, max_new_tokens=max_new, eos_token_ids=stop_ids,
            generator=torch.Generator(device=device).manual_seed(generator_seed), lenience=lenience,
            typical_acceptance=typical_acceptance, compile_target=compile_target, verify_backend=verify_backend,
        )  # fmt: skip

    for source in methods.values():
        decode_rows(source, [warmup_ids], seed, min(8, max_new_tokens))

    # records[method] = [(prompt, output), ...]; every method sees the same prompts and seeds, in groups of
    # batch_size decoded together (turn by turn: a later turn's context is the method's own earlier answer).
    records: dict[str, list[tuple[Prompt, DecodeOutput]]] = {name: [] for name in methods}
    contexts: dict[str, list[list[int]]] = {name: [] for name in methods}  # each decode's prompt ids
    bar = tqdm(total=sum(len(p.turns) for p in prompts) * len(methods), desc="eval", unit="decode",
               disable=not settings.show_progress)  # fmt: skip
    for first in range(0, len(prompts), batch_size):
        group = list(enumerate(prompts))[first : first + batch_size]
        for name, source in methods.items():
            answers = {index: [] for index, _ in group}
            for turn in range(max(len(prompt.turns) for _, prompt in group)):
                rows = [(index, prompt) for index, prompt in group if turn < len(prompt.turns)]
                ids = [prompt_token_ids(tokenizer, prompt, answers[index], prefix_tokens) for index, prompt in rows]
                try:
                    outs = decode_rows(source, ids, seed + 1000 * rows[0][0] + turn, max_new_tokens)
                except SpecdraftError as e:  # e.g. a later turn outgrew the context: say which
                    where = ", ".join(f"{prompt.suite}/{prompt.id}" for _, prompt in rows)
                    raise SpecdraftError(f"{name} on {where}, turn {turn + 1}: {e}") from e
                for (index, prompt), row_ids, out in zip(rows, ids, outs):
                    records[name].append((prompt, out))
                    contexts[name].append(row_ids)
                    # Multi-turn: this method's own answer is the context of the next turn.
                    answers[index].append(tokenizer.decode([t for t in out.tokens if t not in stop_ids],
                                                           skip_special_tokens=True))  # fmt: skip
                    bar.update(1)
    bar.close()

    costs = None
    if settings.forward_costs:
        outputs = [out for name in methods for _, out in records[name]]
        costs = measure_forward_costs(target, torch.tensor([warmup_ids], device=device), forward_keys(outputs),
                                      compile_target=compile_target, params=params, verify_backend=verify_backend)
    result = {"config": _config(params, k, max_new_tokens, seed, lenience, typical_acceptance, prompts, device,
                                batch_size, compile_target, verify_backend),
              "methods": {name: _summaries(records[name], records[PLAIN], k, costs) for name in methods},
              "measured_on": machine}  # fmt: skip
    if costs is not None:
        result["forward_costs"] = costs.to_json()
    if params.is_greedy and not (lenience < 1.0 or typical_acceptance):
        plain_tokens = [out.tokens for _, out in records[PLAIN]]
        result["greedy_identical"] = {
            name: sum(out.tokens == ref for (_, out), ref in zip(records[name], plain_tokens)) / len(plain_tokens)
            for name in methods if name != PLAIN
        }  # fmt: skip
        result["greedy_mismatches"] = {name: _mismatches(target, contexts, records, name, k)
                                       for name in methods if name != PLAIN}  # fmt: skip
    if out_dir is not None:
        result["files"] = {key: str(path) for key, path in report.write_report(result, out_dir).items()}
    if wandb_run is not None:
        report.log_wandb(result, wandb_run)
    return result


def precompile(target, mode: bool | str, prompt_lengths: list[int], max_new_tokens: int,
               widths: set[tuple[int, bool]]) -> None:
    """``compile_target``'s graphs for every (cache size, step width, tree) these prompts will decode with, made by
    ``CompiledVerify.new_cache`` as a decode makes them, but before the clock starts (a later turn's longer
    context may still meet a new cache size)."""
    forward = compiled_verify(target, mode)
    for length in sorted(set(prompt_lengths)):
        budget = check_decode_args(target, torch.zeros(1, length, dtype=torch.long), max_new_tokens)
        for width, tree in sorted(widths):
            forward.new_cache(length + budget, width, tree)


def _mismatches(target, contexts, records, name, k) -> list[dict]:
    """Each decode of ``name`` that left plain decoding's tokens, explained (``mismatch.explain``).
    A later turn whose context already differs (the method's own earlier answer) is only listed."""
    found = []
    for index, ((prompt, out), (_, ref)) in enumerate(zip(records[name], records[PLAIN])):
        if out.tokens == ref.tokens:
            continue
        where = {"prompt": f"{prompt.suite}/{prompt.id}", "category": prompt.category}
        if contexts[name][index] != contexts[PLAIN][index]:
            found.append({**where, "verdict": "follows an earlier mismatch"})
        else:
            found.append({**where, **mismatch.explain(target, contexts[PLAIN][index], ref.tokens, out.tokens, k)})
    return found


def _summaries(records, plain_records, k, costs=None) -> dict:
    """Overall, per suite and per category; plain decoding of the same prompts gives the speedup."""

    def group(key):
        out = {}
        for value in dict.fromkeys(key(p) for p, _ in records):
            outputs = [o for p, o in records if key(p) == value]
            plain = [o for p, o in plain_records if key(p) == value]
            out[value] = summarize(outputs, k, plain, costs)
        return out

    return {
        "overall": summarize([o for _, o in records], k, [o for _, o in plain_records], costs),
        "by_suite": group(lambda p: p.suite),
        "by_category": group(lambda p: p.category),
    }


def family_report(name: str, target, drafter, prompts, max_new_tokens: int, out_dir: str | Path | None = None,
                  num_prompts: int | None = None, prefix_tokens: int = 128) -> dict | None:
    """The drafter family's own figures (``Family.eval_report``) on the prompts' first turns, printed and
    written to OUT/family_report.json; None for a family without any."""
    report_fn = get_family(drafter.family).eval_report
    if report_fn is None:
        return None
    tokenizer = target.tokenizer
    prompt_ids = [torch.tensor([prompt_token_ids(tokenizer, p, prefix_tokens=prefix_tokens)], device=target.device)
                  for p in _as_prompts(prompts, num_prompts)]
    figures = report_fn(target, drafter, prompt_ids, max_new_tokens)
    label = name if name.split(" ")[0] == drafter.family else f"{name} ({drafter.family})"  # names carry it now
    print(f"{label}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                       for k, v in figures.items()))
    if out_dir is not None:
        path = Path(out_dir) / "family_report.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({name: figures}, indent=1) + "\n")
        tmp.replace(path)  # write-then-rename: never half a report
    return figures


def _as_prompts(prompts, num_prompts) -> list[Prompt]:
    if isinstance(prompts, (str, Path)):
        prompts = [prompts]
    if prompts and all(isinstance(p, Prompt) for p in prompts):
        return list(prompts[:num_prompts] if num_prompts else prompts)
    loaded = [p for path in prompts for p in load_suite(path, num_prompts)]
    if not loaded:
        raise SpecdraftError("no prompts to evaluate: pass --prompts FILE (a JSONL suite or a folder of .py files).")
    return loaded


def _check_prompt_lengths(target, tokenizer, prompts: list[Prompt], prefix_tokens: int, max_new_tokens: int) -> None:
    """Fail before decoding anything if a first turn does not fit the target's context, and say once when
    ``max_new_tokens`` does not fit after the longest one (decodes then stop at the context's end)."""
    context = getattr(target.config, "max_position_embeddings", None)
    if context is None:
        return
    lengths = [(p, len(prompt_token_ids(tokenizer, p, prefix_tokens=prefix_tokens))) for p in prompts]
    longest = max(n for _, n in lengths)
    if longest < context <= longest + max_new_tokens:
        warnings.warn(f"max_new_tokens {max_new_tokens} does not fit the target's context of {context} tokens after "
                      f"the longest prompt ({longest} tokens): its decodes stop at the context's end, after "
                      f"{context - longest} new tokens (later turns, whose context is longer, sooner).", stacklevel=3)
    too_long = [(p, n) for p, n in lengths if n >= context]
    if too_long:
        listed = ", ".join(f"{p.suite}/{p.id} ({n} tokens)" for p, n in too_long[:5])
        raise SpecdraftError(
            f"{len(too_long)} prompt(s) do not fit the target's context of {context} tokens "
            f"(max_position_embeddings): {listed}{' ...' if len(too_long) > 5 else ''}; remove them from the "
            "suite, use a target with a longer context, or (for text prefixes) a smaller --prefix-tokens."
        )


def _instantiate(source):
    """A DraftSource, or a zero-argument factory (or class) returning one."""
    if isinstance(source, DraftSource) and not isinstance(source, type):  # a class passes the Protocol check too
        return source
    if callable(source):
        return source()
    raise SpecdraftError(f"sources must map names to DraftSource objects or factories, got {type(source).__name__} "
                         "(a DraftSource has start, propose and commit, and its class declares `capabilities = "
                         "DraftCapabilities(...)`, specdraft.contract).")


def _stop_ids(target, tokenizer) -> list[int]:
    """EOS from the tokenizer and the target's generation config (which may list several)."""
    return stop_token_ids(getattr(target, "model", None), tokenizer)


def _config(params, k, max_new_tokens, seed, lenience, typical_acceptance, prompts, device, batch_size,
            compile_target, verify_backend) -> dict:  # fmt: skip
    return {
        "batch_size": batch_size, "compile_target": compile_target, "verify_backend": verify_backend,
        "k": k, "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
        "max_new_tokens": max_new_tokens, "seed": seed, "lenience": lenience,
        "typical_acceptance": typical_acceptance, "lossy": lenience < 1.0 or typical_acceptance,
        "num_prompts": len(prompts), "suites": list(dict.fromkeys(p.suite for p in prompts)), "device": str(device),
    }  # fmt: skip


# -- CLI ------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True,
                        help="target model folder or hub id ('toy' = the shipped toy target)")
    parser.add_argument("--drafter", action="append", default=[], metavar="DIR",
                        help="a trained drafter folder (repeatable)")
    parser.add_argument("--draft-model", action="append", default=[], metavar="PATH",
                        help="an independent draft LM (e.g. a DistillSpec student; repeatable)")
    parser.add_argument("--map-draft-vocab", action="store_true",
                        help="allow a --draft-model whose tokenizer differs from the target's "
                             "(tokens are mapped by their strings)")
    parser.add_argument("--compile-draft", action="store_true",
                        help="compile each --draft-model's decode step (torch.compile over a static cache): "
                             "faster steps after a one-time compile of seconds to a minute")
    parser.add_argument("--compile-target", action="store_true",
                        help="compile the target's decode forwards (plain steps, chain and tree verifies, over a "
                             "static cache): frozen targets (not Medusa-2's adapted one), batch size 1")
    parser.add_argument("--prompt-lookup", action="store_true", help="also evaluate n-gram prompt lookup (no model)")
    parser.add_argument("--verify-backend", default="auto", choices=VERIFY_BACKENDS,
                        help="the verify step: auto = the Triton kernels on CUDA when triton imports, else the "
                             "pure-torch reference; triton or reference to force one")
    parser.add_argument("--prompts", required=True, nargs="+", metavar="FILE",
                        help="suite(s): Spec-Bench/MT-bench question JSONL, JSONL with `prompt` or `text`, "
                             "or a folder of .py files")
    parser.add_argument("--num-prompts", type=int, default=None, help="per suite, spread evenly over the file")
    parser.add_argument("--prefix-tokens", type=int, default=128, help="length of `text` / code prefixes")
    parser.add_argument("-k", "--k", type=int, default=5, help="drafts per step")
    parser.add_argument("--tree", action="append", default=[], metavar="TREE",
                        help="also decode each drafter that can draft it with this tree (repeatable): "
                             f"{', '.join(NAMED_TREES)}, chain-N or eagle2:total_tokens=T,depth=D,top_k=K")
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0], metavar="T",
                        help="0 = greedy; several (--temperature 0 1) decode at each in the same run, each into "
                             "OUT/temperature-T (default: 0)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1,
                        help="decode this many prompts together (tokens/s per request and in total)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="write result.json, report.md and PNG plots here (a new or empty folder)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the report an earlier eval wrote in --out (a folder holding anything else is "
                             "kept)")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                        help="default: bfloat16 on CUDA and on a CPU with hardware for it (AMX, AVX512-BF16); "
                             "float32 on other CPUs, which emulate bf16 many times slower")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lenience", type=float, default=1.0,
                        help="LOSSY below 1: accept drafts while u < p / (lenience q) (default 1.0 = exact)")
    parser.add_argument("--typical-acceptance", action="store_true",
                        help="LOSSY: Medusa's typical acceptance instead of exact speculative sampling")
    parser.add_argument("--wandb", action="store_true",
                        help="log the table to Weights & Biases (WANDB_MODE=offline works)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (on a busy CPU, 1 avoids oversubscription stalls)")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--allow-other-target", action="store_true",
                        help="evaluate a drafter on a target other than the one it was trained for (same shapes, "
                             "other weights), which is refused otherwise")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    temperatures = list(dict.fromkeys(args.temperature))
    samplings = [SamplingParams(temperature=t, top_k=args.top_k, top_p=args.top_p) for t in temperatures]
    check_decoding_sizes(args.k, args.max_new_tokens, "-k", "--max-new-tokens")
    for flag, value in (("--num-prompts", args.num_prompts), ("--batch-size", args.batch_size),
                        ("--prefix-tokens", args.prefix_tokens), ("--threads", args.threads)):
        if value is not None and value < 1:
            raise SpecdraftError(f"{flag} must be >= 1, got {value}")
    if args.wandb and importlib.util.find_spec("wandb") is None:
        raise SpecdraftError("--wandb needs wandb, which is not installed: pip install 'specdraft[wandb]'")
    if args.out:  # before anything runs: an eval whose report cannot be written is time thrown away
        args.out = str(Path(args.out).expanduser())
        check_report_folder(Path(args.out), args.overwrite)
        check_writable_folder(Path(args.out), "--out")
        # marked before anything is written: a report cut short is still this command's to replace
        mark_owner(Path(args.out), EVAL_OWNER, tuple(report.REPORT_FILES.values()) if len(samplings) == 1 else
                   tuple(f"temperature-{params.temperature:g}" for params in samplings))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or default_dtype(device)
    folders = [drafter_folder(path) for path in args.drafter]  # a wrong folder fails before the target loads
    target = FrozenTarget.from_pretrained(
        resolve_target_path(args.target, args.dtype), dtype=args.dtype,
        trust_remote_code=args.trust_remote_code, device=device,
    )  # fmt: skip

    sources: dict[str, Callable[[], DraftSource]] = {}
    drafters = {}
    for path in folders:
        # Each loaded drafter declares what it reads, and the target computes that from then on.
        loaded = load_exported(path, target) if (path / SIDE_FILE).is_file() else \
            load_drafter(path, target, args.allow_other_target)
        name = _unique_name(sources, drafter_name(path, loaded.family))
        drafters[name] = loaded.eval()
        sources[name] = drafters[name].draft_source(target)
        for method, source in tree_methods(name, drafters[name], target, args.tree).items():
            sources[_unique_name(sources, method)] = source
    if args.out:  # and each drafter's family report
        mark_owner(Path(args.out), EVAL_OWNER, tuple(map(folder_name, drafters)))
    adapting = [name for name, d in drafters.items() if d.needs.trains_adapters]
    if adapting and len(drafters) + len(args.draft_model) > 1:
        # Its adapters now live inside the target: every other method would be verified by the adapted model.
        raise SpecdraftError(
            f"--drafter {adapting[0]} trained adapters inside the target (Medusa-2), so loading it changes the target "
            "that plain decoding and every other drafter use: evaluate it in a run of its own (prompt lookup may "
            "stay)."
        )
    for path in args.draft_model:
        saved = json.loads((Path(path) / "config.json").read_text()) if (Path(path) / "config.json").is_file() else {}
        check_target(saved, target.embed_tokens.weight, path, args.target, args.allow_other_target)
        draft_tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(args.dtype),
                                                     trust_remote_code=args.trust_remote_code).to(device)  # fmt: skip
        vocab_map = None
        if draft_tokenizer.get_vocab() != target.tokenizer.get_vocab():
            if not args.map_draft_vocab:
                raise SpecdraftError(
                    f"the draft model {path} has a different tokenizer from the target; use a draft from the "
                    "target's family, or pass --map-draft-vocab to map tokens by their strings."
                )
            vocab_map = vocab_map_from_tokenizers(draft_tokenizer, target.tokenizer,
                                                  model.get_output_embeddings().weight.shape[0])  # fmt: skip
        sources[_unique_name(sources, Path(path).name)] = DraftLMSource(model, vocab_map, compile=args.compile_draft)
    if args.prompt_lookup:
        sources[PROMPT_LOOKUP] = PromptLookupSource()

    wandb_run = None
    if args.wandb:
        import wandb  # optional at run time: only with --wandb

        wandb_run = wandb.init(project="specdraft", job_type="eval", config=vars(args))
    written = []
    for params in samplings:  # one report per temperature, in OUT itself when there is one
        out = args.out and (Path(args.out) / f"temperature-{params.temperature:g}" if len(samplings) > 1 else args.out)
        result = evaluate(target, sources, args.prompts, EvalSettings.from_args(args, params), out,
                          wandb_run=wandb_run)  # fmt: skip
        print(report.format_table(result, legend=params is samplings[-1]) + "\n")
        written += result.get("files", {}).values()
    if wandb_run is not None:
        wandb_run.finish()
    for name, drafter in drafters.items():
        family_report(name, target, drafter, args.prompts, args.max_new_tokens,
                      args.out and Path(args.out) / folder_name(name), args.num_prompts, args.prefix_tokens)
    if args.out:
        mark_owner(Path(args.out), EVAL_OWNER)
        print(f"\nwrote {', '.join(written)}")
    return 0


def check_report_folder(out: Path, overwrite: bool) -> None:
    """``--out`` is new or empty, or (with ``--overwrite``) an earlier eval's report and nothing else."""
    if out.is_dir() and any(p.name != OWNER_FILE and not p.name.startswith(".owner-") for p in out.iterdir()) \
            and not overwrite:
        raise SpecdraftError(f"--out {out} already holds files; pass --overwrite to replace an earlier eval's report "
                             "there, or choose a new --out")
    check_replaceable_output(out, EVAL_OWNER, "--out")


def check_decoding_sizes(k: int, max_new_tokens: int, k_name: str = "k (drafts per step)",
                         max_new_tokens_name: str = "max_new_tokens") -> None:
    """Drafts per step and new tokens per decode within their ranges (the CLI's and the recipe's ``eval:``)."""
    if not 1 <= k <= MAX_DRAFTS_PER_STEP:
        raise SpecdraftError(f"{k_name} must be between 1 and {MAX_DRAFTS_PER_STEP}, got {k}; "
                             "4-8 drafts per step is typical.")
    if max_new_tokens < 1:
        raise SpecdraftError(f"{max_new_tokens_name} must be >= 1, got {max_new_tokens}")


def check_writable_folder(folder: Path, name: str) -> None:
    """``folder`` can hold the report: it is a folder (or can be made one) that this process can write."""
    if folder.exists() and not folder.is_dir():
        raise SpecdraftError(f"{name} {folder} is a file; give a folder for the report (result.json, report.md, "
                             "plots), e.g. {name} reports/eval")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise SpecdraftError(f"{name} {folder} cannot be written ({e.strerror or e}); choose a folder you can "
                             "write to") from e


def drafter_folder(path: str) -> Path:
    """The folder ``--drafter`` names, to load: an export (``specdraft export`` wrote it), a drafter folder, or a
    run (its final drafter, else its newest checkpoint's), as ``specdraft export`` reads them."""
    folder = Path(path).expanduser()
    if (folder / SIDE_FILE).is_file():
        return folder
    try:
        return find_drafter_dir(folder)
    except SpecdraftError as e:
        raise SpecdraftError(f"--drafter {path} is not a drafter ({e}). Give a run folder (RUN), a drafter folder "
                             "(RUN/drafter, RUN/checkpoints/step-N/drafter) or a folder `specdraft export` wrote.") from e


def drafter_name(path, family: str | None = None) -> str:
    """What a drafter folder is called in tables and reports: its family, with the folder beside it (a run's
    ``RUN/drafter`` by its run) unless the folder is named after the family."""
    path = Path(path).resolve()
    folder = path.parent.name if path.name == "drafter" and path.parent.name else path.name
    return folder if family in (None, folder) else f"{family} ({folder})"


def folder_name(method: str) -> str:
    """A method's name as a folder name a shell takes without quotes: "medusa2 (run)" -> "medusa2-run"."""
    return "-".join(method.replace("(", " ").replace(")", " ").split())


def tree_methods(name: str, drafter, target, specs: list[str]) -> dict:
    """``NAME tree:SPEC`` -> the drafter drafting that tree each step, for every spec it can draft (and a line
    saying which it cannot: those it decodes as a chain only)."""
    methods = {}
    for spec in specs:
        tree, source = parse_tree(spec), drafter.draft_source(target)
        if tree.kind in source.capabilities.tree_kinds:
            methods[f"{name} tree:{spec}"] = TreeDrafting(source, tree)
        else:
            print(f"[eval] {name} cannot draft a {tree.kind} tree ({spec}); it is decoded as a chain only")
    return methods


def _unique_name(existing: dict, name: str) -> str:
    candidate, i = name, 2
    while candidate in existing or candidate == PLAIN:
        candidate, i = f"{name}-{i}", i + 1
    return candidate
