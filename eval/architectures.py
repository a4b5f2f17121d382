"""The architecture x family table: every drafter family on tiny seeded targets of twelve architectures.

    python eval/architectures.py                      # the whole table (about 4 minutes on one CPU thread)
    python eval/architectures.py --arch gemma3 --family medusa1 eagle3

Runs tests/arch_matrix.py's cells (the same code tests/test_architectures.py checks): per (architecture, family),
3 training steps with an exact resume, every engine export with the engines' loaders as tests/ re-implements
them, and greedy speculative decoding against transformers' generate(). Prints a Markdown table, and under it
each refusal's message. The targets are random (4 layers, hidden 64): acceptance counts say only that drafts
were made and verified, not how good a drafter is.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("SPECDRAFT_CACHE", tempfile.mkdtemp(prefix="specdraft-cache-"))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py: the verify kernels on CPU
torch.set_num_threads(1)

from arch_matrix import ARCHITECTURES, DRAFTERS, run_cell  # noqa: E402

HEADER = ["target", "family", "trains", "exports", "engines load", "greedy identical"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="+", default=list(ARCHITECTURES), choices=list(ARCHITECTURES))
    parser.add_argument("--family", nargs="+", default=list(DRAFTERS), choices=list(DRAFTERS))
    args = parser.parse_args(argv)
    import transformers

    start = time.time()
    rows, refusals = [], []
    with tempfile.TemporaryDirectory() as work:
        for arch in args.arch:
            for family in args.family:
                with contextlib.redirect_stdout(sys.stderr):  # training's own prints ("resumed from ...")
                    cell = run_cell(arch, family, Path(work) / "cells" / f"{arch}-{family}")
                rows.append(cell.row())
                if cell.refusal:
                    refusals.append(f"- {arch} / {family}: {cell.refusal}")
                refusals += [f"- {arch} / {family} / export {fmt}: {text}" for fmt, text in cell.notes.items()]
                print(f"{arch} {family}: done", file=sys.stderr, flush=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{time.time() - start:.0f} s on {torch.get_num_threads()} CPU thread(s)\n")
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if refusals:
        print("\nRefusals (the SpecdraftError each one raises):\n")
        print("\n".join(refusals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
