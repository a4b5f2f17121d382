"""``specdraft data sample``: a first training file with no download, the toy target's own answers.

The toy recipes read ``quickstart/data/answers.jsonl`` (where ``specdraft quickstart`` writes its answers),
so after this command ``specdraft train toy_eagle3`` runs with no other argument. The answers are
``regenerate``'s, at the quickstart's settings: a file it did not write is refused, never replaced, and
one it wrote with the same settings is resumed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdraft.data.regenerate import regenerate, write_prompts
from specdraft.dtypes import resolve_dtype
from specdraft.errors import SpecdraftError
from specdraft.quickstart import QUICKSTART_TARGETS, RECIPES_DIR, precision_here
from specdraft.target import resolve_target_path
from specdraft.toy_target import toy_prompts

DEFAULT_OUT = Path("quickstart") / "data" / "answers.jsonl"  # the toy recipes' data.path
DEFAULT_PROMPTS = 400


def sample(out: Path = DEFAULT_OUT, prompts: int = DEFAULT_PROMPTS) -> Path:
    """The toy target's greedy answers to ``prompts`` of its training prompts, in ``out`` (messages JSONL);
    the prompts are written beside it (``NAME.prompts.jsonl``)."""
    setup = QUICKSTART_TARGETS["toy"]
    dtype, _ = precision_here(yaml.safe_load((RECIPES_DIR / setup.recipe).read_text())["target"]["dtype"])
    target_dir = Path(resolve_target_path("toy", dtype))
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # a 3.5M model decodes fastest on one thread (see quickstart)
    prompts_path = write_prompts(out.with_name(out.stem + ".prompts.jsonl"), toy_prompts("train", prompts), out)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=resolve_dtype(dtype))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    regenerate(model, tokenizer, prompts_path, out, temperature=0.0, max_new_tokens=setup.answer_tokens,
               batch_size=setup.answer_batch)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    make = sub.add_parser("sample", help="the toy target's own answers to its training prompts: a first data file")
    make.add_argument("--out", default=str(DEFAULT_OUT),
                      help=f"the JSONL to write (default: {DEFAULT_OUT}, the toy recipes' data.path)")
    make.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS,
                      help=f"how many prompts the toy target answers (default: {DEFAULT_PROMPTS})")


def run(args: argparse.Namespace) -> int:
    if args.prompts < 1:
        raise SpecdraftError(f"--prompts must be >= 1, got {args.prompts}")
    out = sample(Path(args.out).expanduser(), args.prompts)
    where = "" if out == DEFAULT_OUT else f" data.path={out}"  # the toy recipes read DEFAULT_OUT
    print(f"wrote {out}: the toy target's answers to {args.prompts} prompts. Next: specdraft train toy_eagle3{where}")
    return 0
