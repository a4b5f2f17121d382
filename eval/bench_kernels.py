"""Time the Triton verify kernels against the pure-torch reference (and vLLM's rejection sampler when vllm
imports), chains and trees, and check on every cell that they emit the same tokens.

    python eval/bench_kernels.py --out DIR            # CUDA: the full grid (about 90 s); CPU: the reduced check
    python eval/bench_kernels.py --out DIR --quick    # a smaller grid

Grid on CUDA: batch 1, 8, 64, 256; V = 32000, 128256, 152064; K = 1, 4, 7 (--quick: batch 1 and 64,
V = 128256, K = 7). A chain cell is K drafts per row with draft probs (q a noisy copy of p, random rows: the
vocabulary-wide residual race runs); a tree cell is a tree of depth K per row with deterministic children
(q one-hot, as every specdraft tree source drafts): 4 children under the root, then 3 under the top child
at each level (4 + 3 (K - 1) nodes).

GPU goals: a chain verify of at most 20 us at batch 1, V = 128256, K = 7, and the kernels at least 1.5x
faster than the reference at batch 64. Both are printed as met or missed, for each timing below.

Timing (/work/.library/device/METHOD.md): median of --iters calls after --warmup, each call between CUDA
events. "eager" times the call as the decoder makes it (``verify_triton`` / ``verify_tree_triton`` with
check=False: Python, allocations and launches included). "graph" replays the same call captured in a CUDA
graph (the kernels' device time, without the Python and launch overhead). The reference syncs with the host
and cannot be captured: eager only. Inputs rotate over enough copies to exceed twice the L2 cache, so a
small cell is not timed from the cache.

On a CPU (no CUDA): the kernels run under the Triton interpreter, with the vocabulary split across 3
programs, against the reference on a reduced grid (batch 1 and 3, V = 300 and 1000, K = 1, 4, 7); timings
need a GPU and are not taken.

Also reported, on either machine: the host side of one call (batch 1, V = 128256, K = 7) with the kernel
launches replaced by no-ops, the part of the eager time that no kernel change can remove.

Writes DIR/bench_kernels.md (a Markdown table) and DIR/bench_kernels.json; refuses to replace them
without --overwrite.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import fields
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before anything imports triton: interpret the kernels on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specdraft.decoding.sampling import draw_exponentials, draw_uniforms, sample  # noqa: E402
from specdraft.decoding import tree_verify, verify  # noqa: E402
from specdraft.decoding.trees import StaticTree  # noqa: E402


def by_keywords(fn, metadata):
    """``fn`` (a verify taking one metadata object) called with its inputs as keywords, as this benchmark builds
    them and vLLM's adapter takes them; keywords that are not the metadata's fields (num_splits) go to ``fn``."""
    names = {f.name for f in fields(metadata)}
    return lambda **kw: fn(metadata(**{k: v for k, v in kw.items() if k in names}),
                           **{k: v for k, v in kw.items() if k not in names})  # fmt: skip


verify_reference = by_keywords(verify.verify_reference, verify.VerifyInputs)
verify_triton = by_keywords(verify.verify_triton, verify.VerifyInputs)
verify_tree_reference = by_keywords(tree_verify.verify_tree_reference, tree_verify.TreeVerifyInputs)
verify_tree_triton = by_keywords(tree_verify.verify_tree_triton, tree_verify.TreeVerifyInputs)

GPU_GRID = dict(batch=[1, 8, 64, 256], vocab=[32000, 128256, 152064], k=[1, 4, 7])
GPU_QUICK = dict(batch=[1, 64], vocab=[128256], k=[7])
CPU_GRID = dict(batch=[1, 3], vocab=[300, 1000], k=[1, 4, 7])
CPU_QUICK = dict(batch=[1, 3], vocab=[300], k=[1, 4])
CPU_SPLITS = 3  # under the interpreter the default is 1 split; force several so the combine runs
GOAL_LATENCY_US = 20.0  # chain, batch 1, V = 128256, K = 7
GOAL_SPEEDUP = 1.5  # at batch 64


def bench_tree(depth: int) -> StaticTree:
    """4 children under the root, then 3 under the top child at each level down to ``depth``."""
    paths = [(r,) for r in range(4)]
    for d in range(2, depth + 1):
        paths += [(0,) * (d - 1) + (r,) for r in range(3)]
    return StaticTree(tuple(paths))


def chain_inputs(batch: int, k: int, vocab: int, device: str, seed: int) -> dict:
    """One chain verify step: each row drafts k tokens from q, a noisy copy of p (both float32)."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(batch * k, vocab, generator=g, device=device) * 3
    target_probs = logits.softmax(-1)
    draft_probs = (logits + torch.randn(batch * k, vocab, generator=g, device=device)).softmax(-1)
    return dict(
        draft_token_ids=sample(draft_probs, g), cu_num_draft_tokens=torch.arange(1, batch + 1, device=device) * k,
        draft_probs=draft_probs, target_probs=target_probs,
        bonus_token_ids=torch.randint(0, vocab, (batch,), generator=g, device=device),
        uniforms=draw_uniforms(batch * k, g, device), exponentials=draw_exponentials(batch, vocab, g, device),
        greedy=torch.zeros(batch, dtype=torch.bool, device=device), max_spec_len=k, check=False,
    )  # fmt: skip


def tree_inputs(batch: int, depth: int, vocab: int, device: str, seed: int) -> dict:
    """One tree verify step: each row's node of rank r under a parent is the parent's (r+1)-th likeliest token
    under a noisy copy of the target; q one-hot (no draft probs)."""
    tree = bench_tree(depth)
    n = tree.num_nodes
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(batch, n + 1, vocab, generator=g, device=device) * 3  # per row: root, then each node
    noisy = logits + torch.randn(batch, n + 1, vocab, generator=g, device=device)
    top = noisy.topk(max(tree.ranks) + 1, dim=-1).indices
    parent_rows = torch.tensor(tree.parents, device=device) + 1
    return dict(
        node_token_ids=top[:, parent_rows, torch.tensor(tree.ranks, device=device)].flatten(),
        node_parents=torch.tensor(tree.parents, device=device).repeat(batch),
        cu_num_nodes=torch.arange(1, batch + 1, device=device) * n, draft_probs=None,
        target_probs=logits.softmax(-1).reshape(-1, vocab), uniforms=draw_uniforms(batch * n, g, device),
        exponentials=draw_exponentials(batch, vocab, g, device),
        greedy=torch.zeros(batch, dtype=torch.bool, device=device), max_depth=tree.depth, check=False,
    )  # fmt: skip


def input_bytes(inputs: dict) -> int:
    return sum(t.numel() * t.element_size() for t in inputs.values() if isinstance(t, torch.Tensor))


def vllm_chain():
    """vLLM's v1 rejection sampler as a chain verify, or (None, why not). Best effort: its signature changes
    between versions, and no vllm was installed where this was written, so this adapter has never run."""
    try:
        from vllm.v1.sample.metadata import SamplingMetadata
        from vllm.v1.sample.rejection_sampler import rejection_sample
    except Exception as err:  # ImportError, or a vllm that fails to import on this machine
        return None, f"vllm not importable ({type(err).__name__})"

    def run(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, bonus_token_ids, max_spec_len,
            **_):  # fmt: skip
        batch = cu_num_draft_tokens.shape[0]
        metadata = SamplingMetadata(
            temperature=torch.ones(batch, device=target_probs.device), all_greedy=False, all_random=True,
            top_p=None, top_k=None, generators={}, max_num_logprobs=None, no_penalties=True,
            prompt_token_ids=None, frequency_penalties=None, presence_penalties=None, repetition_penalties=None,
            output_token_ids=[[] for _ in range(batch)], allowed_token_ids_mask=None, bad_words_token_ids={},
            logitsprocs=None,
        )  # fmt: skip
        num_draft_tokens = [max_spec_len] * batch
        return rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                                target_probs, bonus_token_ids[:, None], metadata)  # fmt: skip

    return run, None


def median_us(fn, input_sets: list[dict], warmup: int, iters: int) -> float:
    """Median microseconds of fn(**inputs) between CUDA events, rotating over the input sets."""
    for i in range(warmup):
        fn(**input_sets[i % len(input_sets)])
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i, (start, end) in enumerate(events):
        inputs = input_sets[i % len(input_sets)]
        start.record()
        fn(**inputs)
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) * 1e3 for start, end in events)


def graph_median_us(fn, input_sets: list[dict], warmup: int, iters: int) -> float:
    """Median microseconds of one replay of fn(**inputs) captured in a CUDA graph (one graph per input set)."""
    graphs = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for inputs in input_sets:
            fn(**inputs)  # compiled and allocated outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    for inputs in input_sets:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(**inputs)
        graphs.append(graph)
    return median_us(lambda graph: graph.replay(), [dict(graph=g) for g in graphs], warmup, iters)


class _NoLaunch:
    """Stands in for a kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def host_us(cuda: bool, iters: int = 2000) -> dict:
    """Median microseconds of the host side of one verify_triton / verify_tree_triton call (batch 1, V = 128256,
    K = 7) with the kernel launches replaced by no-ops: argument handling and allocations, the floor under the
    eager column (Triton's own launch cost comes on top)."""
    from specdraft.kernels import rejection_sampler, tree_sampler

    kernels = [(rejection_sampler, "rejection_partials_kernel"), (rejection_sampler, "rejection_combine_kernel"),
               (tree_sampler, "tree_partials_kernel"), (tree_sampler, "tree_combine_kernel")]  # fmt: skip
    saved = [getattr(module, name) for module, name in kernels]
    device = "cuda" if cuda else "cpu"
    cases = {"chain": (verify_triton, chain_inputs(1, 7, 128256, device, 0)),
             "tree": (verify_tree_triton, tree_inputs(1, 7, 128256, device, 0))}  # fmt: skip
    try:
        for module, name in kernels:
            setattr(module, name, _NoLaunch())
        out = {}
        for kind, (fn, inputs) in cases.items():
            for _ in range(100):
                fn(**inputs)
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                fn(**inputs)
                times.append(time.perf_counter() - start)
            out[kind] = statistics.median(times) * 1e6
    finally:
        for (module, name), kernel in zip(kernels, saved):
            setattr(module, name, kernel)
    return out


def same_tokens(kind: str, inputs: dict) -> bool:
    """The kernel and the reference emit the same tokens (and accepted nodes) on these inputs."""
    kernel, reference = (verify_triton, verify_reference) if kind == "chain" else (verify_tree_triton,
                                                                                    verify_tree_reference)
    splits = {} if torch.cuda.is_available() else {"num_splits": CPU_SPLITS}
    return all(torch.equal(a, b) for a, b in zip(kernel(**inputs, **splits), reference(**inputs)))


def run_grid(grid: dict, cuda: bool, warmup: int, iters: int) -> list[dict]:
    device = "cuda" if cuda else "cpu"
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size if cuda else 0
    vllm_run, vllm_missing = vllm_chain() if cuda else (None, "not timed on CPU")
    rows = []
    cells = [(kind, b, v, k) for kind in ("chain", "tree") for b in grid["batch"] for v in grid["vocab"]
             for k in grid["k"]]  # fmt: skip
    for i, (kind, batch, vocab, k) in enumerate(cells):
        make = chain_inputs if kind == "chain" else tree_inputs
        first = make(batch, k, vocab, device, seed=i)
        copies = max(1, min(32, -(-2 * l2_bytes // input_bytes(first)))) if cuda else 1
        input_sets = [first] + [make(batch, k, vocab, device, seed=1000 * i + c) for c in range(1, copies)]
        row = {"kind": kind, "batch": batch, "vocab": vocab, "k": k, "same_tokens": same_tokens(kind, first),
               "input_sets": copies}  # fmt: skip
        if cuda:
            kernel, reference = (verify_triton, verify_reference) if kind == "chain" else (verify_tree_triton,
                                                                                            verify_tree_reference)
            row["kernel_us"] = median_us(kernel, input_sets, warmup, iters)
            row["kernel_graph_us"] = graph_median_us(kernel, input_sets, warmup, iters)
            row["reference_us"] = median_us(reference, input_sets, warmup, iters)
            row["speedup"] = row["reference_us"] / row["kernel_us"]
            if kind == "chain" and vllm_run is not None:
                try:
                    row["vllm_us"] = median_us(vllm_run, input_sets, warmup, iters)
                except Exception as err:  # an untested adapter (see vllm_chain): say so, time the rest
                    vllm_missing = f"vllm call failed: {type(err).__name__}: {err}"[:200]
                    vllm_run = None
        rows.append(row)
        del input_sets, first
        print(f"  {kind:<5} batch {batch:>3} V {vocab:>6} K {k}: same tokens {row['same_tokens']}"
              + (f", kernel {row['kernel_us']:.1f} us (graph {row['kernel_graph_us']:.1f}), reference "
                 f"{row['reference_us']:.1f} us" if cuda else ""), flush=True)
    if cuda and vllm_missing:
        print(f"vLLM: {vllm_missing}")
    return rows


def goals(rows: list[dict]) -> list[str]:
    """The docstring's two GPU goals, checked against the rows that measure them."""
    lines = []
    for row in rows:
        if (row["kind"], row["batch"], row["vocab"], row["k"]) == ("chain", 1, 128256, 7):
            for column in ("kernel_us", "kernel_graph_us"):
                verdict = "met" if row[column] <= GOAL_LATENCY_US else "MISSED"
                lines.append(f"chain verify at batch 1, V 128256, K 7 <= {GOAL_LATENCY_US:g} us ({column}): "
                             f"{row[column]:.1f} us, {verdict}")
    at_64 = [row for row in rows if row["batch"] == 64]
    if at_64:
        worst = min(at_64, key=lambda row: row["speedup"])
        verdict = "met" if worst["speedup"] >= GOAL_SPEEDUP else "MISSED"
        lines.append(f">= {GOAL_SPEEDUP:g}x faster than the reference at batch 64 (eager, every cell): worst "
                     f"{worst['speedup']:.2f}x ({worst['kind']}, V {worst['vocab']}, K {worst['k']}), {verdict}")
    return lines


def markdown(rows: list[dict], header: str, cuda: bool) -> str:
    if cuda:
        columns = ["kind", "batch", "vocab", "k", "kernel_us", "kernel_graph_us", "reference_us", "speedup",
                   "vllm_us", "same_tokens"]  # fmt: skip
    else:
        columns = ["kind", "batch", "vocab", "k", "same_tokens"]
    out = [header, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [f"{row[c]:.1f}" if isinstance(row.get(c), float) else str(row.get(c, "-")) for c in columns]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, metavar="DIR", help="write bench_kernels.md and .json here")
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20, help="timed calls per cell (the median is reported)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier bench_kernels.md / .json")
    args = parser.parse_args(argv)
    out = Path(args.out)
    files = {"md": out / "bench_kernels.md", "json": out / "bench_kernels.json"}
    if not args.overwrite and any(f.exists() for f in files.values()):
        sys.exit(f"{out} already holds bench_kernels results; pass --overwrite to replace them")
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)

    cuda = torch.cuda.is_available()
    grid = (GPU_QUICK if args.quick else GPU_GRID) if cuda else (CPU_QUICK if args.quick else CPU_GRID)
    import triton

    device = torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or platform.machine()})"
    header = (f"verify kernels vs reference on {device}: torch {torch.__version__}, triton {triton.__version__}"
              + ("" if cuda else f"; TRITON_INTERPRET=1, {CPU_SPLITS} vocabulary splits; correctness only"))
    print(header)
    start = time.perf_counter()
    rows = run_grid(grid, cuda, args.warmup, args.iters)
    summary = goals(rows) if cuda else ["timings need a GPU: on this CPU the kernels ran under the Triton "
                                        "interpreter and were checked against the reference only"]  # fmt: skip
    host = host_us(cuda, iters=200 if args.quick else 2000)
    summary.append(f"host side of one call at batch 1, V 128256, K 7, kernel launches excluded: chain "
                   f"{host['chain']:.1f} us, tree {host['tree']:.1f} us ({'this GPU host' if cuda else 'this CPU'})")
    mismatches = [row for row in rows if not row["same_tokens"]]
    summary.append(f"{len(rows) - len(mismatches)} of {len(rows)} cells: kernel tokens == reference tokens")
    text = markdown(rows, f"`python eval/bench_kernels.py --out DIR{' --quick' if args.quick else ''}`\n\n{header}",
                    cuda) + "\n" + "\n".join(f"- {line}" for line in summary) + "\n"  # fmt: skip
    write_atomic(files["md"], text)
    write_atomic(files["json"], json.dumps({"device": device, "header": header, "rows": rows, "host_us": host,
                                            "summary": summary, "seconds": time.perf_counter() - start}, indent=1))
    print(text)
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
