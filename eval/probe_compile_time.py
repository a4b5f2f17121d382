"""Probe: how long `compile_target` takes to make one compiled verify graph of a target, per (static cache size,
step width, chain or tree), as `CompiledVerify.new_cache` makes them before a decode's clock starts.

    python eval/probe_compile_time.py --target smollm2-135m-instruct --device cpu

A compiled eval makes one graph per cache size (a power of two: each prompt's length plus its budget) and step
width (plain 1, a chain K + 1, a tree its nodes + 1; chains with and without taps apart), then more for the
verify-cost curve: the count of graphs times this figure is what a compiled eval spends before it decodes.
Prints a Markdown table (seconds per graph, in the order made: the first pays torch.compile's own start-up).

torch.compile keeps what it made in an on-disk cache (TORCHINDUCTOR_CACHE_DIR, else /tmp/torchinductor_$USER),
which any later process on the machine reads: a fresh GPU machine starts without one. For the cold figure:
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python eval/probe_compile_time.py ...
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from specdraft.decoding.compiled_verify import compiled_verify
from specdraft.target import FrozenTarget, resolve_target_path

CASES = ((300, 1, False), (300, 8, False), (300, 8, True), (700, 8, False))  # (kept positions, width, tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="toy")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    parser.add_argument("--mode", default=None, help="a torch.compile mode (reduce-overhead: CUDA graphs)")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # as every CPU figure in eval/README.md
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    target = FrozenTarget.from_pretrained(resolve_target_path(args.target, dtype), dtype=dtype, device=args.device)
    forward = compiled_verify(target, args.mode or True)
    cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "default")
    print(f"`python eval/probe_compile_time.py --target {args.target} --device {args.device}"
          f"{' --mode ' + args.mode if args.mode else ''}`: {dtype}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), inductor cache {cache_dir}\n")
    print("| cache size | width | tree | seconds to compile |\n|---:|---:|---|---:|")
    for positions, width, tree in CASES:
        start = time.perf_counter()
        forward.new_cache(positions, width, tree)
        capacity = 1 << (positions + width - 1).bit_length()  # new_cache's size for them
        print(f"| {capacity} | {width} | {'yes' if tree else 'no'} | "
              f"{time.perf_counter() - start:.1f} |", flush=True)


if __name__ == "__main__":
    main()
