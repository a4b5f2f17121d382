"""``specdraft COMMAND``: one subcommand per module, each with ``add_arguments`` and ``run``.

Modules are imported only when their command runs, so ``specdraft --help`` is instant.
A ``SpecdraftError`` is the user's to fix: it is printed without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import SpecdraftError

COMMANDS = {
    "quickstart": ("specdraft.quickstart", "toy target -> EAGLE-3 drafter -> export -> acceptance report"),
    "train": ("specdraft.cli_train", "train the drafter a recipe describes (also under `accelerate launch -m specdraft`)"),
    "cache-features": ("specdraft.cli_train", "offline mode: write the target's tapped features to disk once"),
    "eval": ("specdraft.evaluation.run", "acceptance length, acceptance rate and speedup of drafters"),
    "export": ("specdraft.export", "write a trained drafter in the format vLLM or SGLang loads"),
    "regenerate": ("specdraft.data.regenerate", "rewrite a dataset's assistant turns with the target itself"),
    "toy-target": ("specdraft.toy_build.builder", "build the small stand-in target (no download needed)"),
    "selftest": ("specdraft.selftest", "check this install on this machine: environment, kernels, training, decoding"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="specdraft", description="Train speculative-decoding drafters against a frozen target LLM.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv or ["--help"])  # prints help, or names the unknown command; exits
        return 2
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    cmd_parser = argparse.ArgumentParser(prog=f"specdraft {name}", description=COMMANDS[name][1])
    if module.__name__ == "specdraft.cli_train":
        module.add_arguments(cmd_parser, name)
    else:
        module.add_arguments(cmd_parser)
    args = cmd_parser.parse_args(argv[1:])
    args.command = name
    try:
        return int(module.run(args) or 0)
    except SpecdraftError as e:
        print(f"specdraft {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
