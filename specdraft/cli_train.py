"""``specdraft train`` and ``specdraft cache-features``: a recipe plus ``key.sub=value`` overrides."""

from __future__ import annotations

import argparse
from pathlib import Path

from .config import load_recipe
from .errors import SpecdraftError
from .export import exporters_of
from .features import cache_features
from .recipe_files import resolve_recipe
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
    if not args.resume:  # (a resume may read the run's own recipe.yaml)
        check_recipe_outside_run(resolve_recipe(args.recipe), Path(recipe.checkpoint.output_dir))
    run_dir = train(recipe, resume=args.resume, overwrite=args.overwrite, show_progress=not args.no_progress)
    print(f"run folder: {run_dir}")
    print(next_steps(run_dir, recipe.drafter_family))
    return 0


def next_steps(run_dir: Path, family: str) -> str:
    """Where the drafter and its report are, and the command that exports it for an engine."""
    formats = sorted(exporters_of(family))
    engine = next((f for f in ("vllm", "sglang") if f in formats), formats[0])
    lines = [f"  drafter: {run_dir / 'drafter'}"]
    if (run_dir / "eval").is_dir():
        lines.append(f"  report:  {run_dir / 'eval'} (report.md, result.json and plots per temperature)")
    lines.append(f"  export:  specdraft export {run_dir} --format {engine} --out export/{engine}   "
                 f"(formats: {', '.join(formats)})")
    return "\n".join(lines)


def check_recipe_outside_run(recipe_file: Path, run_dir: Path) -> None:
    """A new run's recipe is an input: never inside the run folder, where the run writes its own ``recipe.yaml``
    (and ``--overwrite`` would replace the folder)."""
    if run_dir.resolve() in recipe_file.resolve().parents:
        raise SpecdraftError(
            f"the recipe {recipe_file} is inside checkpoint.output_dir {run_dir}, where the run writes its own "
            f"recipe.yaml: keep your recipe outside the run folder (e.g. {run_dir.name}.yaml beside it), or set "
            "checkpoint.output_dir to another folder.")
