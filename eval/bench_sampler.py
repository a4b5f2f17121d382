"""Benchmark the verify step (rejection sampler) over batch x K x vocab grids, and tree verify.

    python eval/bench_sampler.py            # full grid, up to vocab 152064
    python eval/bench_sampler.py --quick    # a small grid (seconds)
    python eval/bench_sampler.py --trees "" # chain verify only

Tree verify (specdraft.decoding.tree_verify) is timed over batch x tree x vocab, for --trees
(default: Medusa's 63-node tree, its 16-node prefix, and a chain of 5 for comparison with the
chain verify), with deterministic children (each node a top-k token of a noisy copy of p at
its parent; q one-hot, so no draft_probs), as Medusa and EAGLE trees have.

Times the pure-torch reference on CPU, and on a CUDA machine also the reference and
the Triton kernel on the GPU. Under TRITON_INTERPRET the kernel is never timed (the
interpreter is a correctness tool, its speed means nothing). Figures: milliseconds
per call (median over --iters after --warmup calls, time.perf_counter) and an
effective bandwidth, bytes of target_probs + draft_probs + exponentials / time.
That byte count is what a verify step *may* touch; the sampler reads far less when
drafts are accepted early, so treat it as a yardstick, not a measured traffic.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

import torch
from tqdm import tqdm

from specdraft.decoding.sampling import draw_exponentials, draw_uniforms, sample
from specdraft.decoding.tree_verify import TreeVerifyInputs, verify_tree_reference, verify_tree_triton
from specdraft.decoding.trees import parse_tree
from specdraft.decoding.verify import VerifyInputs, verify_reference, verify_triton

FULL_GRID = dict(batch=[1, 8, 32], k=[1, 4, 8], vocab=[32000, 128256, 152064])
QUICK_GRID = dict(batch=[1, 8], k=[1, 4], vocab=[32000])


def greedy_rows(batch: int, mode: str, device: str) -> torch.Tensor:
    """verify's per-row greedy flags for --mode: all sampled, all greedy, or alternating."""
    return {
        "random": torch.zeros(batch, dtype=torch.bool, device=device),
        "greedy": torch.ones(batch, dtype=torch.bool, device=device),
        "mixed": torch.arange(batch, device=device) % 2 == 1,
    }[mode]


def make_inputs(batch: int, k: int, vocab: int, mode: str, device: str, seed: int = 0):
    """One verify step: every row drafts k tokens from a q that is a noisy copy of p."""
    g = torch.Generator(device=device).manual_seed(seed)
    num_tokens = batch * k
    logits = torch.randn(num_tokens, vocab, generator=g, device=device) * 3
    target_probs = logits.softmax(-1)
    draft_probs = (logits + torch.randn(num_tokens, vocab, generator=g, device=device)).softmax(-1)
    drafts = sample(draft_probs, g)
    greedy = greedy_rows(batch, mode, device)
    return dict(
        draft_token_ids=drafts,
        cu_num_draft_tokens=torch.arange(1, batch + 1, device=device) * k,
        draft_probs=draft_probs,
        target_probs=target_probs,
        bonus_token_ids=sample(target_probs[:batch], g),  # any valid ids will do
        uniforms=draw_uniforms(num_tokens, g, device),
        exponentials=draw_exponentials(batch, vocab, g, device),
        greedy=greedy,
        max_spec_len=k,
    )


def make_tree_inputs(batch: int, tree_spec: str, vocab: int, mode: str, device: str, seed: int = 0):
    """One tree verify step: every row holds the same static tree, its node of rank k under a parent
    being the parent's (k+1)-th likeliest token under a noisy copy of the target."""
    tree = parse_tree(tree_spec)
    n = tree.num_nodes
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(batch, n + 1, vocab, generator=g, device=device) * 3  # per row: root, then each node
    draft_logits = logits + torch.randn(batch, n + 1, vocab, generator=g, device=device)
    top = draft_logits.topk(max(tree.ranks) + 1, dim=-1).indices  # [batch, n + 1, K]
    parent_rows = torch.tensor(tree.parents, device=device) + 1  # row of each node's parent in its block
    tokens = top[:, parent_rows, torch.tensor(tree.ranks, device=device)]  # [batch, n]
    greedy = greedy_rows(batch, mode, device)
    return dict(
        node_token_ids=tokens.flatten(),
        node_parents=torch.tensor(tree.parents, device=device).repeat(batch),
        cu_num_nodes=torch.arange(1, batch + 1, device=device) * n,
        draft_probs=None,
        target_probs=logits.softmax(-1).reshape(-1, vocab),
        uniforms=draw_uniforms(batch * n, g, device),
        exponentials=draw_exponentials(batch, vocab, g, device),
        greedy=greedy,
        max_depth=tree.depth,
        check=False,  # as the decoder calls it after checking a source's first tree
    )


def time_call(fn, inputs: dict, warmup: int, iters: int, cuda: bool) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn(**inputs)
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(**inputs)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bytes_read(inputs: dict) -> int:
    tensors = [inputs["target_probs"], inputs["draft_probs"], inputs["exponentials"]]  # chain and tree inputs alike
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small grid (batch {1,8}, K {1,4}, vocab 32000)")
    parser.add_argument("--mode", choices=["random", "greedy", "mixed"], default="random", help="verify rows' mode")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the CI box is shared)")
    parser.add_argument("--trees", default="medusa-63,medusa-16,chain-5",
                        help="comma-separated static trees for tree verify (names as in --tree of the decoder; "
                             "'' skips tree verify)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    runs = [("reference", "cpu", verify_reference)]
    if torch.cuda.is_available():
        runs.append(("reference", "cuda", verify_reference))
        if not interpreted:
            runs.append(("triton", "cuda", verify_triton))
    print(f"mode={args.mode}  torch {torch.__version__}  threads={args.threads}  "
          f"cuda={'yes' if torch.cuda.is_available() else 'no'}  TRITON_INTERPRET={'1' if interpreted else '0'}")
    if not any(name == "triton" for name, _, _ in runs):
        print("(Triton kernel not timed: needs CUDA and no TRITON_INTERPRET)")

    grid = QUICK_GRID if args.quick else FULL_GRID
    shapes = list(itertools.product(grid["batch"], grid["k"], grid["vocab"]))
    rows = []
    for (batch, k, vocab), (name, device, fn) in tqdm(list(itertools.product(shapes, runs)), desc="bench"):
        inputs = make_inputs(batch, k, vocab, args.mode, device)
        seconds = time_call(lambda **kw: fn(VerifyInputs(**kw)), inputs, args.warmup, args.iters, cuda=device == "cuda")
        rows.append((name, device, batch, k, vocab, seconds * 1e3, bytes_read(inputs) / seconds / 1e9))
        del inputs

    print(f"{'impl':<10} {'device':<6} {'batch':>5} {'K':>3} {'vocab':>7} {'ms/call':>9} {'eff GB/s':>9}")
    for name, device, batch, k, vocab, ms, gbps in rows:
        print(f"{name:<10} {device:<6} {batch:>5} {k:>3} {vocab:>7} {ms:>9.3f} {gbps:>9.2f}")

    trees = [t for t in args.trees.split(",") if t]
    if trees:
        tree_runs = [("reference", "cpu", verify_tree_reference)]
        if torch.cuda.is_available():
            tree_runs.append(("reference", "cuda", verify_tree_reference))
            if not interpreted:
                tree_runs.append(("triton", "cuda", verify_tree_triton))
        tree_shapes = list(itertools.product(grid["batch"], trees, grid["vocab"]))
        tree_rows = []
        for (batch, tree, vocab), (name, device, fn) in tqdm(
            list(itertools.product(tree_shapes, tree_runs)), desc="bench trees"
        ):
            inputs = make_tree_inputs(batch, tree, vocab, args.mode, device)
            seconds = time_call(lambda check, **kw: fn(TreeVerifyInputs(**kw), check=check), inputs, args.warmup,
                                args.iters, cuda=device == "cuda")  # fmt: skip
            nodes = inputs["node_token_ids"].numel() // batch
            gbps = bytes_read(inputs) / seconds / 1e9
            tree_rows.append((name, device, batch, tree, nodes, vocab, seconds * 1e3, gbps))
            del inputs

        print(f"\ntree verify (deterministic children, draft_probs None; {args.mode} rows)")
        print(f"{'impl':<10} {'device':<6} {'batch':>5} {'tree':>10} {'nodes':>5} {'vocab':>7} {'ms/call':>9} "
              f"{'eff GB/s':>9}")
        for name, device, batch, tree, nodes, vocab, ms, gbps in tree_rows:
            print(f"{name:<10} {device:<6} {batch:>5} {tree:>10} {nodes:>5} {vocab:>7} {ms:>9.3f} {gbps:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
