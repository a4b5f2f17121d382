"""Benchmark: one training step's time and peak memory against the sample length (EAGLE-3 and DFlash).

    python eval/bench_long_context.py --target smollm2-135m-instruct --families eagle3 dflash \
        --lengths 1024 2048 4096 8192
    python eval/bench_long_context.py --target toy --lengths 256 512 1024     # a quick look

Long samples are where the anchors' users run out of memory (SpecForge #466, #112). This times one
micro-batch of one row, ``length`` tokens long, with the family's SmolLM2 (or toy) recipe: the frozen
target's forward, then the drafter's forward and backward (the recipe's precision), and measures the
memory each adds above the resting state (target and drafter loaded). Each (family, length) runs in a
fresh process, one at a time, so one cell's allocations do not hide in another's.

Memory is the peak above the state before the phase: on CPU the process's resident high-water mark
(VmHWM, reset through /proc/self/clear_refs before each phase); on CUDA ``torch.cuda.max_memory_allocated``.
"Step peak" is measured with the target's outputs alive, as in training. If memory is linear in the
length, the bytes per token stay flat down each family's column; a [T, T] tensor per layer or per TTT
step would double them with each doubling of the length.

The rows are plain-text chunks of the standard library (as eval/bench_train.py), packed to the length.
Minimum of the timed repeats after one warm-up. Host timers; on CUDA each phase ends in a synchronize.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import RECIPE_PREFIX, text_data  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


class PeakMemory:
    """The peak bytes a phase adds above the memory in use when it starts (CPU: resident set; CUDA: allocated)."""

    def __init__(self, device: torch.device):
        self.device = device

    def _status_kib(self, key: str) -> int:
        return int(re.search(key + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1))

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self.start = self._status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.start
        else:
            self.peak = self._status_kib("VmHWM") * 1024 - self.start
        return False


def one_cell(target_name: str, family_name: str, length: int, repeats: int, device: torch.device,
             overrides: list[str]) -> dict:
    from specdraft.config import load_recipe
    from specdraft.contract import TrainingContext
    from specdraft.data.collate import Collator, pad_token_id_of
    from specdraft.data.pipeline import build_datasets
    from specdraft.data.vocab import build_draft_vocab
    from specdraft.drafters import get_family
    from specdraft.recipe_target import load_target, recipe_needs

    with tempfile.TemporaryDirectory() as tmp:
        data = text_data(Path(tmp) / "text.jsonl", n_files=64, chars=16 * length)
        recipe = load_recipe(REPO / "recipes" / f"{RECIPE_PREFIX[target_name]}{family_name}.yaml",
                             [f"data.path={data}", "data.format=text", f"data.max_length={length}",
                              "data.packing=true", "data.eval_fraction=0"] + overrides)
        target = load_target(recipe, device, recipe_needs(recipe))
        train_ds, _ = build_datasets(recipe.data, target.tokenizer)
        family = get_family(family_name)
        size = recipe.drafter.draft_vocab_size if family.needs_draft_vocab else None
        vocab = build_draft_vocab(train_ds, target.vocab_size, size, None, []) \
            if size and size < target.vocab_size else None
        torch.manual_seed(0)
        drafter = family.build(target, recipe.drafter, vocab).to(device)
        collate = Collator(pad_token_id_of(target.tokenizer), length, recipe.data.packing)
        rows = collate([train_ds[i] for i in range(len(train_ds))])
        longest = int(rows["attention_mask"].sum(1).argmax())
        batch = {key: value[longest:longest + 1].to(device) for key, value in rows.items()}
    bf16 = recipe.training.mixed_precision == "bf16"
    memory = PeakMemory(device)

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = {"target": [], "step": []}
    peaks = {"target": 0, "step": 0}
    for _ in range(repeats + 1):  # the first round warms up
        with memory, torch.no_grad():
            started = time.perf_counter()
            example = drafter.prepare(batch, TrainingContext(target))
            synchronize()
            times["target"].append(time.perf_counter() - started)
        peaks["target"] = max(peaks["target"], memory.peak)
        with memory:
            started = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                out = drafter.compute_loss(example.batch, example.target)
            out.loss.backward()
            synchronize()
            times["step"].append(time.perf_counter() - started)
        peaks["step"] = max(peaks["step"], memory.peak)
        drafter.zero_grad(set_to_none=True)
        del example, out
    return {"family": family_name, "length": length, "tokens": int(batch["attention_mask"].sum()),
            "target_s": min(times["target"][1:]), "step_s": min(times["step"][1:]),
            "target_peak": peaks["target"], "step_peak": peaks["step"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="toy", choices=sorted(RECIPE_PREFIX))
    parser.add_argument("--families", nargs="+", default=["eagle3", "dflash"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=1, help="timed repeats after one warm-up")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for every family (e.g. drafter.checkpoint_logits=true)")
    parser.add_argument("--one", nargs=2, metavar=("FAMILY", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        cell = one_cell(args.target, args.one[0], int(args.one[1]), args.repeats, torch.device(args.device), args.set)
        print("CELL " + json.dumps(cell))
        return 0

    cells = []
    for family in args.families:
        for length in args.lengths:
            command = [sys.executable, __file__, "--target", args.target, "--repeats", str(args.repeats),
                       "--threads", str(args.threads), "--device", args.device, "--one", family, str(length)]
            command += [f"--set={override}" for override in args.set]
            done = subprocess.run(command, capture_output=True, text=True)
            line = [x for x in done.stdout.splitlines() if x.startswith("CELL ")]
            if done.returncode != 0 or not line:
                print(f"{family} at {length}: failed (rc {done.returncode})\n{done.stderr[-3000:]}", file=sys.stderr)
                cells.append({"family": family, "length": length, "failed": done.returncode})
                continue
            cells.append(json.loads(line[0][5:]))
            c = cells[-1]
            print(f"{family} {length}: step {c['step_s']:.2f} s, peak {c['step_peak'] / GIB:.2f} GiB", file=sys.stderr,
                  flush=True)

    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"\n## bench_long_context: {args.target} on {device}, torch {torch.__version__}, {args.threads} thread(s), "
          f"one row per micro-batch, min of {args.repeats} repeat(s) after a warm-up"
          + (f", overrides {' '.join(args.set)}" if args.set else ""))
    print(f"`python eval/bench_long_context.py {' '.join(sys.argv[1:])}`\n")
    print("| family | tokens | target forward s | drafter step s | step / target | target peak GiB | "
          "step peak GiB | step peak KiB per token | × previous length's |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    previous = {}
    for c in cells:
        if "failed" in c:
            print(f"| {c['family']} | {c['length']} | failed (rc {c['failed']}) | | | | | | |")
            continue
        per_token = c["step_peak"] / c["tokens"] / 1024
        growth = f"{per_token / previous[c['family']]:.2f}" if c["family"] in previous else "–"
        previous[c["family"]] = per_token
        print(f"| {c['family']} | {c['tokens']} | {c['target_s']:.2f} | {c['step_s']:.2f} | "
              f"{c['step_s'] / c['target_s']:.2f} | {c['target_peak'] / GIB:.2f} | {c['step_peak'] / GIB:.2f} | "
              f"{per_token:.0f} | {growth} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
