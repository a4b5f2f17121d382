"""Training memory against step: does a run's resident memory grow, and where does it go?

    python eval/bench_train_memory.py --target smollm2-135m-instruct --family eagle3 --steps 24 \
        --data bench-families/data/answers.jsonl --eval-data bench-families/data/heldout_answers.jsonl \
        --set training.micro_batch_size=4 --set training.eval_every=8 --set checkpoint.save_every=12
    python eval/bench_train_memory.py --target smollm2-135m-instruct --family medusa2 --steps 2 --variants product \
        --data ... --set training.micro_batch_size=4 --set drafter.joint_from_step=0 --set training.eval_every=0
    python eval/bench_train_memory.py --target toy --family eagle3 --steps 30      # seconds, the toy's own text

Each variant (--variants) trains the family's recipe (recipes/<target>-<family>.yaml) for --steps steps
through `specdraft.train.train`, in a fresh one-thread process of its own, so its memory is its own. Around
every micro-batch the benchmark reads, from /proc/self/status, the peak resident memory since the previous
one (VmHWM, reset through /proc/self/clear_refs: the peak covers the step and what follows it, the log
line, held-out eval and checkpoint) and the resident memory at the next one's start; and, as the step's
backward and optimizer step end, from glibc's mallinfo2 the bytes malloc's heaps hold in use and free
(held but unused: fragmentation, until released), and how many are mapped on their own. The batch's
packed shape [rows, width] is printed beside them, and the summary says whether every variant trained to
the same loss at every step (they change memory, not numbers).

Variants (--variants), each the loop as it ships with parts of its memory handling taken out:
  product            as it ships: oneDNN's kernel caches bounded (``bound_cpu_kernel_caches``) and the freed
                     pages released after every step (``release_freed_memory``)
  before             neither: the caches at their default 1,024 entries, no release (the loop before them)
  no-release         bounded caches only
  unbounded-caches   the release only
The table puts them side by side.
Writes WORK/memory.json and, with matplotlib, WORK/memory.png.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RECIPE_PREFIX = {"smollm2-135m-instruct": "smollm2-135m-", "toy": "toy_"}
# variant -> (caches bounded, freed pages released)
VARIANTS = {"product": (True, True), "before": (False, False), "no-release": (True, False),
            "unbounded-caches": (False, True)}
DEFAULT_CACHE_CAPACITY = "1024"  # oneDNN's and ideep's own default
# specdraft.train_parts.CPU_KERNEL_CACHES, spelled out so that the benchmark runs on code from before them too
CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def malloc_figures() -> dict[str, float]:
    """glibc's view, in GiB: heap bytes in use, heap bytes free (held, not returned), and mmapped bytes."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Mallinfo2
    info = libc.mallinfo2()
    return {"heap_used_gib": info.uordblks / 2**30, "heap_free_gib": info.fordblks / 2**30,
            "mmapped_gib": info.hblkhd / 2**30}


def status_gib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def toy_text(path: Path, max_length: int) -> Path:
    from specdraft.toy_target import list_source_files, toy_target_path

    heldout = set(json.loads((toy_target_path() / "build_record.json").read_text())["heldout_files"])
    files = [text for rel, text in sorted(list_source_files().items()) if rel not in heldout][:400]
    path.write_text("".join(json.dumps({"text": t[: 4 * max_length]}) + "\n" for t in files))
    return path


def one_variant(config: dict) -> list[dict]:
    """Train in this (fresh) process, recording each micro-batch's memory; returns one row per step."""
    import specdraft.train as loop
    from specdraft.config import load_recipe

    torch.set_num_threads(1)
    bounded, released = VARIANTS[config["variant"]]
    if not bounded:  # set first: the loop's bound keeps a value already set
        for name in CACHE_VARIABLES:
            os.environ[name] = DEFAULT_CACHE_CAPACITY
    if not released:
        loop.release_freed_memory = lambda: None
    rows: list[dict] = []
    train_micro_batch = loop.train_micro_batch
    started = time.perf_counter()

    def close_previous_row() -> None:
        if rows:  # the peak since the previous micro-batch began: its step, log line, eval and save
            rows[-1].update(peak_rss_gib=status_gib("VmHWM"), rss_after_gib=status_gib("VmRSS"),
                            seconds=time.perf_counter() - rows[-1]["seconds"])
            print(json.dumps({"variant": config["variant"], **rows[-1]}), flush=True)

    def recorded(run, batch):
        close_previous_row()
        reset_peak()
        rows.append({"step": run.state.step + 1, "shape": list(batch["input_ids"].shape), "seconds": time.perf_counter()})
        out = train_micro_batch(run, batch)
        rows[-1]["loss"] = out[0]["loss"].item()  # the variants change no number: their losses must agree
        rows[-1].update(malloc_figures())  # before the loop's release: what malloc holds at the step's end
        return out

    loop.train_micro_batch = recorded
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"training.max_steps={config['steps']}", "training.grad_accumulation=1",
                     f"checkpoint.output_dir={Path(tmp) / 'run'}", "eval.enabled=false", *config["overrides"]]
        if config["data"] is None:  # the toy: its own training text
            overrides += [f"data.path={toy_text(Path(tmp) / 'text.jsonl', config['max_length'])}", "data.format=text"]
        else:
            overrides += [f"data.path={config['data']}"]
            if config["eval_data"]:
                overrides.append(f"data.eval_path={config['eval_data']}")
        loop.train(load_recipe(config["recipe"], overrides), overwrite=True, show_progress=False)
    close_previous_row()
    print(f"{config['variant']}: {len(rows)} steps in {time.perf_counter() - started:.0f} s", flush=True)
    return rows


def table(results: dict[str, list[dict]], every: int) -> str:
    names = list(results)
    head = "| step | shape | " + " | ".join(f"{n}: peak RSS | {n}: RSS after | {n}: heap in use | {n}: heap free"
                                           for n in names) + " |"
    lines = [head, "|---|---|" + "---:|" * (4 * len(names))]
    steps = len(results[names[0]])
    for i in range(steps):
        if (i + 1) % every and i != steps - 1 and i > 2:
            continue
        shape = "x".join(map(str, results[names[0]][i]["shape"]))
        cells = []
        for n in names:
            r = results[n][i]
            cells.append(f"{r['peak_rss_gib']:.2f} | {r['rss_after_gib']:.2f} | {r['heap_used_gib']:.2f} | "
                         f"{r['heap_free_gib']:.2f}")
        lines.append(f"| {i + 1} | {shape} | " + " | ".join(cells) + " |")
    summary = []
    for n in names:
        peaks = [r["peak_rss_gib"] for r in results[n]]
        half = len(peaks) // 2
        summary.append(f"{n}: peak RSS {max(peaks):.2f} GiB (steps 1-{half}: {max(peaks[:half]):.2f}, "
                       f"steps {half + 1}-{len(peaks)}: {max(peaks[half:]):.2f}); "
                       f"mean step {sum(r['seconds'] for r in results[n][1:]) / max(1, len(peaks) - 1):.1f} s")
    losses = {n: [r["loss"] for r in results[n]] for n in names}
    same = all(value == losses[names[0]] for value in losses.values())
    summary.append(f"training losses {'identical' if same else 'DIFFERENT'} across {', '.join(names)} at every step")
    return "\n".join(lines + [""] + summary)


def plot(results: dict[str, list[dict]], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in results.items():
        ax.plot([r["step"] for r in rows], [r["peak_rss_gib"] for r in rows], label=f"{name}: peak RSS")
        ax.plot([r["step"] for r in rows], [r["heap_used_gib"] for r in rows], "--", label=f"{name}: heap in use")
    ax.set_xlabel("step")
    ax.set_ylabel("GiB")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="toy", choices=sorted(RECIPE_PREFIX))
    parser.add_argument("--family", default="eagle3")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--data", default=None, help="answers JSONL (messages); the toy default: its own text")
    parser.add_argument("--eval-data", default=None, help="held-out answers JSONL (data.eval_path)")
    parser.add_argument("--variants", nargs="+", default=["before", "product"], choices=list(VARIANTS))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override")
    parser.add_argument("--every", type=int, default=5, help="print every N-th step (and the first three)")
    parser.add_argument("--work", default="bench-train-memory")
    args = parser.parse_args()
    if args.target != "toy" and args.data is None:
        sys.exit("--data: the target's answers (e.g. bench-families/data/answers.jsonl from eval/bench_families.py)")
    recipe = REPO / "recipes" / f"{RECIPE_PREFIX[args.target]}{args.family}.yaml"
    overrides = list(args.set)
    if args.target != "toy":
        overrides.insert(0, "data.format=messages")
    max_length = next((int(o.split("=")[1]) for o in args.set if o.startswith("data.max_length=")), 256)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    context = multiprocessing.get_context("spawn")
    for variant in args.variants:  # one after the other: never two large processes at once
        config = {"variant": variant, "recipe": str(recipe), "steps": args.steps, "overrides": overrides,
                  "data": args.data, "eval_data": args.eval_data, "max_length": max_length}
        with context.Pool(1, maxtasksperchild=1) as pool:
            results[variant] = pool.apply(one_variant, (config,))
    (work / "memory.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"\n{args.family} on {args.target}, {args.steps} steps, one thread; {' '.join(args.set)}; GiB\n")
    print(table(results, args.every))
    plot(results, work / "memory.png", f"{args.family} on {args.target}: memory against step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
