"""The recipes shipped in the package, and ``specdraft recipes`` to list and copy them.

The repository's ``recipes/`` folder is the one source: it installs as the package data of
``specdraft.recipes`` (see pyproject.toml), so a wheel carries it and an editable install reads it in
place. Wherever a recipe path is taken (``train``, ``cache-features``), a file that exists is used;
otherwise a bare shipped name (``toy_eagle3``, or ``toy_eagle3.yaml``) names the shipped recipe.

    specdraft recipes                          name, family, target, and what each is for
    specdraft recipes copy toy_eagle3 my.yaml  a copy to edit
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
from importlib import resources
from pathlib import Path

import yaml

from .errors import SpecdraftError


def shipped_recipes_dir() -> Path:
    """The shipped recipes' folder (the repository's recipes/, installed as ``specdraft.recipes``)."""
    return Path(str(resources.files("specdraft.recipes")))


def shipped_recipes() -> dict[str, Path]:
    """Shipped recipe name (the file name without .yaml) -> its file."""
    return {path.stem: path for path in sorted(shipped_recipes_dir().glob("*.yaml"))}


def resolve_recipe(name_or_path: str | Path) -> Path:
    """A recipe file: ``name_or_path`` itself if it exists, else the shipped recipe of that name."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.yaml"))
        hint = f": it holds {', '.join(inside[:3])}" if inside else ""
        raise SpecdraftError(f"recipe {name_or_path} is a folder, not a recipe file{hint}. Give the .yaml file "
                             f"(e.g. {path / (inside[0] if inside else 'recipe.yaml')}).")
    shipped = shipped_recipes()
    name = path.name.removesuffix(".yaml")
    if path.parent == Path(".") or path.parent.name == "recipes":  # `toy_eagle3` or `recipes/toy_eagle3.yaml`
        if name in shipped:
            return shipped[name]
    near = difflib.get_close_matches(name, list(shipped), n=3, cutoff=0.4)
    hint = f"closest shipped recipes: {', '.join(near)}" if near else f"shipped recipes: {', '.join(shipped)}"
    raise SpecdraftError(f"recipe {name_or_path} not found: it is neither a file nor a shipped recipe ({hint}). "
                         "`specdraft recipes` lists them.")


def describe(path: Path) -> dict[str, str]:
    """A recipe's family, target and purpose: the first sentence of its opening comment, whole."""
    text = path.read_text()
    raw = yaml.safe_load(text) or {}
    return {"name": path.stem, "family": str((raw.get("drafter") or {}).get("family", "?")),
            "target": str((raw.get("target") or {}).get("path", "?")), "purpose": first_sentence(text)}


def first_sentence(text: str) -> str:
    """The opening comment's first sentence, joined across lines; an indented line (a command) ends it."""
    words = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        body = line[1:]
        if body.startswith("   ") and words:  # a command the sentence introduces with a colon
            break
        words.append(body.strip())
    prose = " ".join(w for w in words if w)
    end = re.search(r"[.!?](\s|$)", prose)
    return prose[: end.start() + 1] if end else prose.rstrip(":") + "."


def copy_recipe(name: str, dest: str | Path, overwrite: bool = False) -> Path:
    """Copy shipped recipe ``name`` to ``dest`` (a file, or a folder to put NAME.yaml in)."""
    shipped = shipped_recipes()
    source = shipped.get(name.removesuffix(".yaml"))
    if source is None:
        near = difflib.get_close_matches(name, list(shipped), n=3, cutoff=0.4)
        raise SpecdraftError(f"no shipped recipe {name!r}" + (f"; did you mean {', '.join(near)}?" if near else "")
                             + " `specdraft recipes` lists them.")
    dest = Path(dest)
    if dest.is_dir():
        dest = dest / source.name
    if dest.exists() and not overwrite:
        raise SpecdraftError(f"{dest} already exists; pass --overwrite to replace it, or choose another DEST")
    if dest.exists() and dest.read_bytes() not in {path.read_bytes() for path in shipped.values()}:
        # --overwrite replaces a copy as it was shipped, never a file holding the user's edits or their own text
        raise SpecdraftError(f"{dest} is not a shipped recipe as shipped (it holds edits, or is a file of yours), "
                             "so --overwrite leaves it: move it, or choose another DEST")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.copyfile(source, tmp)
    tmp.replace(dest)
    return dest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    copy = sub.add_parser("copy", help="copy a shipped recipe to edit it")
    copy.add_argument("name", help="a shipped recipe's name, e.g. toy_eagle3")
    copy.add_argument("dest", help="the file to write, or a folder to put NAME.yaml in")
    copy.add_argument("--overwrite", action="store_true",
                      help="replace DEST if it is an unedited copy of a shipped recipe")


def run(args: argparse.Namespace) -> int:
    if args.action == "copy":
        print(f"wrote {copy_recipe(args.name, args.dest, args.overwrite)}")
        return 0
    rows = [describe(path) for path in shipped_recipes().values()]
    widths = {key: max(len(key), *(len(row[key]) for row in rows)) for key in ("name", "family", "target")}
    print("  ".join(key.ljust(widths[key]) for key in widths) + "  purpose")
    for row in rows:
        print("  ".join(row[key].ljust(widths[key]) for key in widths) + "  " + row["purpose"])
    print(f"\n{len(rows)} recipes in {shipped_recipes_dir()}. Train one by name (specdraft train toy_eagle3 "
          "data.path=...), or copy it to edit: specdraft recipes copy toy_eagle3 my_recipe.yaml")
    return 0
