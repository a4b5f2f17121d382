"""``specdraft COMMAND``: one subcommand per module, each with ``add_arguments`` and ``run``.

Modules are imported only when their command runs, so ``specdraft --help`` is instant.
A ``SpecdraftError`` is the user's to fix: it is printed without a traceback. SIGINT and SIGTERM end
every command with the shell's code for them (130, 143); training inside one stops after a checkpoint.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import signal
import sys
import warnings
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version

from .atomic import disk_full_reason
from .errors import SpecdraftError, StoppedBySignal

COMMANDS = {
    "quickstart": ("specdraft.quickstart", "toy target -> EAGLE-3 drafter -> export -> acceptance report"),
    "recipes": ("specdraft.recipe_files", "list the shipped recipes, or copy one to edit"),
    "train": ("specdraft.cli_train", "train the drafter a recipe describes (also under `accelerate launch -m specdraft`)"),
    "cache-features": ("specdraft.cli_train", "offline mode: write the target's tapped features to disk once"),
    "eval": ("specdraft.evaluation.run", "acceptance length, acceptance rate and speedup of drafters"),
    "export": ("specdraft.export", "write a trained drafter in the format vLLM or SGLang loads"),
    "regenerate": ("specdraft.data.regenerate", "rewrite a dataset's assistant turns with the target itself"),
    "data": ("specdraft.data.sample", "data sample: a first training file, the toy target's own answers"),
    "toy-target": ("specdraft.toy_build.builder", "build the small stand-in target (no download needed)"),
    "selftest": ("specdraft.selftest", "check this install on this machine: environment, kernels, training, decoding"),
}

# Shown at the end of each command's --help: real command lines.
EXAMPLES = {
    "quickstart": ["specdraft quickstart", "specdraft quickstart --target smollm2-135m-instruct --out qs-smollm2"],
    "recipes": ["specdraft recipes", "specdraft recipes copy toy_eagle3 my_recipe.yaml"],
    "train": ["specdraft train toy_eagle3 data.path=answers.jsonl checkpoint.output_dir=runs/toy",
              "accelerate launch --config_file recipes/accelerate/ddp_8gpu.yaml -m specdraft train "
              "llama3.1-8b-eagle3 --resume"],
    "cache-features": ["specdraft cache-features llama3.1-8b-eagle3 training.feature_cache=cache/llama-eagle3"],
    "eval": ["specdraft eval --target toy --drafter runs/toy/drafter --prompt-lookup --prompts questions.jsonl",
             "specdraft eval --target MODEL --drafter export/hf --tree eagle2 --batch-size 16 --prompts spec_bench.jsonl"],
    "export": ["specdraft export runs/toy --format sglang --out export/sglang",
               "specdraft export runs/llama-eagle3 --format vllm --out export/vllm --num-speculative-tokens 5"],
    "regenerate": ["specdraft regenerate --target toy --data prompts.jsonl --out data/answers.jsonl",
                   "specdraft regenerate --target Qwen/Qwen3-8B --data HuggingFaceH4/ultrachat_200k --out "
                   "data/ultrachat_qwen3.jsonl --batch-size 64"],
    "data": ["specdraft data sample   (then: specdraft train toy_eagle3)",
             "specdraft data sample --out data/toy_answers.jsonl --prompts 1200"],
    "toy-target": ["specdraft toy-target --help"],
    "selftest": ["specdraft selftest --quick", "specdraft selftest --device cuda --out selftest-report"],
}


def _epilog(name: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in EXAMPLES.get(name, []))


def version() -> str:
    try:
        return installed_version("specdraft")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


# Errors a filesystem gives for a write or a rename that the user, not specdraft, must fix: a device error, a
# read-only mount, a folder they may not write. Printed in one line, as a full disk is; any other error is a bug's,
# and keeps its traceback.
FILESYSTEM_REFUSALS = (errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="specdraft", description="Train speculative-decoding drafters against a frozen target LLM.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  specdraft quickstart\n  specdraft recipes\n  specdraft train toy_eagle3 "
               "data.path=answers.jsonl checkpoint.output_dir=runs/toy\n\n`specdraft COMMAND --help` for each.")
    parser.add_argument("--version", action="version", version=f"specdraft {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv or ["--help"])  # prints help or the version, or names the unknown command; exits
        return 2
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    cmd_parser = argparse.ArgumentParser(prog=f"specdraft {name}", description=COMMANDS[name][1],
                                         formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_epilog(name))
    if module.__name__ == "specdraft.cli_train":
        module.add_arguments(cmd_parser, name)
        # RECIPE [OVERRIDES ...] with options anywhere: `specdraft train r.yaml --overwrite k=v` as well
        args = cmd_parser.parse_intermixed_args(argv[1:])
    else:
        module.add_arguments(cmd_parser)
        args = cmd_parser.parse_args(argv[1:])
    args.command = name
    shown, warnings.formatwarning = warnings.formatwarning, _warning_line
    try:
        with sigterm_raises():
            return int(module.run(args) or 0)
    except SpecdraftError as e:
        print(f"specdraft {name}: error: {e}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as e:  # a write that found no room, wherever it was: the user's to fix
        reason = disk_full_reason(e)
        where = f" at {e.filename}" if isinstance(e, OSError) and e.filename else ""
        if reason is not None:
            print(f"specdraft {name}: error: {reason}{where}. Free space (or raise the limit), then run the command "
                  "again: what it finished is kept, and a run resumes with --resume.", file=sys.stderr)
            return 1
        if isinstance(e, OSError) and e.errno in FILESYSTEM_REFUSALS:  # the filesystem's fault, not a bug's
            print(f"specdraft {name}: error: the filesystem refused{where}: {e.strerror} "
                  f"({errno.errorcode[e.errno]}). Check the disk and the folder's permissions, then run the command "
                  "again: what it finished is kept, and a run resumes with --resume.", file=sys.stderr)
            return 1
        raise
    except StoppedBySignal as stop:
        print(f"specdraft {name}: {stop}", file=sys.stderr)
        return stop.code
    except KeyboardInterrupt:
        print(f"specdraft {name}: SIGINT: stopped before it finished", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        warnings.formatwarning = shown


def _warning_line(message, category, filename, lineno, line=None) -> str:
    """A warning as one line for the command's user: its category and text, without the source line that
    Python's default format prints (specdraft's own code, or a library's, is not the user's to read)."""
    return f"{category.__name__}: {message}\n"


@contextmanager
def sigterm_raises():
    """SIGTERM raises ``StoppedBySignal`` as SIGINT raises KeyboardInterrupt: the command's ``finally`` blocks and
    temporary-file cleanups run, and training (which handles both itself) saves a checkpoint first."""

    def stop(signum, frame):
        raise StoppedBySignal(signum, "stopped before it finished")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
