"""``specdraft train`` and ``specdraft cache-features``: a recipe plus ``key.sub=value`` overrides."""

from __future__ import annotations

import argparse

from .config import load_recipe
from .features import cache_features
from .train import train


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("recipe", help="a recipe file, or a shipped recipe's name (`specdraft recipes` lists them)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value, e.g. training.max_steps=100")
    if command == "train":
        parser.add_argument("--resume", action="store_true", help="continue the run from its newest checkpoint")
        parser.add_argument("--overwrite", action="store_true", help="replace an existing run folder")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    if args.command == "cache-features":
        print(f"feature cache written to {cache_features(recipe)}")
        return 0
    run_dir = train(recipe, resume=args.resume, overwrite=args.overwrite, show_progress=not args.no_progress)
    print(f"run folder: {run_dir}")
    return 0
