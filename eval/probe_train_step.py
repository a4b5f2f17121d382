"""Profile warm SmolLM2 EAGLE-3 training steps, eager or compiled (issue 55; eval/notes/2026-12-08-compiled-
training-step.md): plain text, 4 packed rows of 512 tokens (data.tokens_per_micro_batch=2048), the recipe's bf16.

    python eval/probe_train_step.py eager
    python eval/probe_train_step.py compiled

Trains 3 steps, times 3 more (the step, and the target forward inside it as the loop times it), then prints
torch.profiler's table of 2 more (self CPU time, summed over both)."""
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import text_data  # noqa: E402

from specdraft import train as loop  # noqa: E402
from specdraft.config import load_recipe  # noqa: E402

torch.set_num_threads(1)
compile_ = sys.argv[1] == "compiled"
tmp = Path(tempfile.mkdtemp())
data = text_data(tmp / "text.jsonl", n_files=400, chars=16 * 512)
recipe = load_recipe("smollm2-135m-eagle3", [f"data.path={data}", "data.format=text", "data.max_length=512",
    "data.packing=true", "data.tokens_per_micro_batch=2048", "training.max_steps=100", "eval.enabled=false",
    f"checkpoint.output_dir={tmp/'run'}", f"training.compile={str(compile_).lower()}"])
run = loop.build_run(recipe, False, False, loop.check_before_loading(recipe, False, False))
it = iter(run.loader)
inner = run.accelerator.unwrap_model(run.step_module)


def step():
    batch = next(it)
    return loop.train_micro_batch(run, batch)


for _ in range(3):
    step()
t = time.perf_counter(); n = 3; p0 = inner.prepare_seconds
for _ in range(n):
    step()
el = (time.perf_counter() - t) / n
tf = (inner.prepare_seconds - p0) / n
print(f"step {el:.3f} s, target forward {tf:.3f} s, ratio {el/tf:.2f}")
from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CPU]) as prof:
    step(); step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
