"""Training throughput on the toy target: tokens/s, and one training step against the target forward alone.

Runs the real ``specdraft train`` path (recipes/toy_eagle3.yaml) on plain-text chunks of the
toy target's training files, then reads the run's metrics.jsonl. The loop times the target
forward inside each step, so both figures come from the same run. Host timers: on CPU that is
exact; on CUDA run with CUDA_LAUNCH_BLOCKING=1 for a meaningful split.

    python eval/bench_train.py [--steps 40] [--family eagle3|eagle1] [--micro-batch 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def text_data(path: Path, n_files: int, chars: int) -> Path:
    from specdraft.toy_target import list_source_files, toy_target_path

    heldout = set(json.loads((toy_target_path() / "build_record.json").read_text())["heldout_files"])
    files = [text for rel, text in sorted(list_source_files().items()) if rel not in heldout][:n_files]
    path.write_text("".join(json.dumps({"text": t[:chars]}) + "\n" for t in files))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="eagle3", choices=["eagle3", "eagle1"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from specdraft.config import load_recipe
    from specdraft.train import train

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = text_data(tmp / "text.jsonl", n_files=400, chars=4 * args.max_length * 4)
        recipe = load_recipe(REPO / "recipes" / f"toy_{args.family}.yaml", [
            f"data.path={data}", "data.format=text", f"data.max_length={args.max_length}",
            f"training.max_steps={args.steps}", f"training.micro_batch_size={args.micro_batch}",
            "training.grad_accumulation=1", f"training.log_every={args.steps // 2}", "training.eval_every=0",
            f"checkpoint.save_every={args.steps}", f"checkpoint.output_dir={tmp / 'run'}",
        ])
        run_dir = train(recipe, show_progress=True)
        logs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [entry for entry in logs if "train/tokens_per_s" in entry][-1]  # the second window: warm
    fraction = last["train/target_fraction"]
    print(f"\n## bench_train: {args.family} on the toy target, torch {torch.__version__}, "
          f"{args.threads} threads, micro-batch {args.micro_batch} x {args.max_length} tokens")
    print("| drafter | training tokens/s | target forward share of a step | step / target forward |")
    print("|---|---|---|---|")
    print(f"| {args.family} | {last['train/tokens_per_s']:.0f} | {fraction:.1%} | {1 / fraction:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
