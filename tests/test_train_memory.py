"""Host memory that does not grow with the steps (specdraft.train_parts, eval/bench_train_memory.py): oneDNN's
per-shape kernel caches bounded, freed heap pages released after every step, and the loop doing both.

The first two run in a fresh interpreter each: the caches read their capacity once per process, and a heap's
layout depends on everything the process allocated before.
"""

import ctypes
import os
import platform
import subprocess
import sys
from pathlib import Path

import probe_family  # noqa: F401  (registers the "probe" family)
import pytest
from spine import make_chat_data, make_recipe
from tiny import save_tiny_target

from specdraft import train as train_module
from specdraft.config import parse_recipe
from specdraft.train_parts import CPU_KERNEL_CACHE_CAPACITY, CPU_KERNEL_CACHES

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
needs_glibc = pytest.mark.skipif(not GLIBC or not hasattr(ctypes.CDLL(None), "mallinfo2"),
                                 reason="reads glibc's mallinfo2 (Linux, glibc >= 2.33)")

MALLINFO = """
import ctypes
class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
def heap_used_mib():
    return libc.mallinfo2().uordblks / 2**20
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
"""

CHANGING_SHAPES = MALLINFO + """
import torch
from specdraft.train_parts import CPU_KERNEL_CACHE_CAPACITY, bound_cpu_kernel_caches
bound_cpu_kernel_caches()
torch.set_num_threads(1)
w = torch.randn(64, 48, dtype=torch.bfloat16)
marks = {}
full, twice = CPU_KERNEL_CACHE_CAPACITY * 5 // 4, 2 * CPU_KERNEL_CACHE_CAPACITY
for rows in range(1, twice + 1):  # every matmul a shape not seen before
    torch.randn(rows, 64, dtype=torch.bfloat16) @ w
    if rows in (full, twice):
        marks[rows] = heap_used_mib()
print(marks[twice] - marks[full])
"""


def run_python(code: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in CPU_KERNEL_CACHES:  # the product's own setting, not one inherited from the caller
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


@needs_glibc
def test_bf16_matmuls_of_ever_new_shapes_stop_growing_the_heap_once_the_kernel_caches_are_full():
    """Past the caches' capacity (256 shapes), new shapes evict old kernels: 192 more add (almost) nothing. With
    oneDNN's and ideep's default 1,024 entries (no bound) the same 192 shapes added 102 MiB here (AVX-512 bf16)."""
    growth = float(run_python(CHANGING_SHAPES))
    assert growth < 2.0, f"the heap grew {growth:.1f} MiB over {3 * CPU_KERNEL_CACHE_CAPACITY // 4} new matmul shapes"


RELEASE = MALLINFO + """
import torch
from specdraft.train_parts import release_freed_memory
kept, freed = [], []
for i in range(3000):  # 96 KiB blocks (under glibc's mmap threshold: served from the heap) ...
    (kept if i % 100 == 99 else freed).append(torch.ones(24 * 1024))
del freed  # ... of which every 100th stays: the heap cannot shrink from its top
before = rss_mib()
release_freed_memory()
print(before - rss_mib())
"""


@needs_glibc
def test_releasing_freed_memory_returns_the_free_pages_between_live_blocks():
    """~280 MiB of freed blocks lie between live ones; without the release the resident memory keeps them."""
    returned = float(run_python(RELEASE))
    assert returned > 200, f"only {returned:.0f} MiB of ~280 MiB freed went back to the system"


def test_the_loop_bounds_the_caches_on_entry_and_releases_after_every_optimizer_step(tmp_path, monkeypatch):
    for name in CPU_KERNEL_CACHES:  # absent, and absent again after the test (setenv records the original)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    steps = []
    monkeypatch.setattr(train_module, "release_freed_memory", lambda: steps.append(len(steps)))
    target, data = save_tiny_target(tmp_path / "tiny"), make_chat_data(tmp_path / "chat.jsonl")
    recipe = make_recipe(tmp_path, target, data, training={"max_steps": 3, "grad_accumulation": 2})
    train_module.train(parse_recipe(recipe), show_progress=False)
    assert len(steps) == 3  # once per optimizer step, not per micro-batch
    assert all(os.environ[name] == str(CPU_KERNEL_CACHE_CAPACITY) for name in CPU_KERNEL_CACHES)


def test_the_memory_benchmark_sets_the_variables_the_loop_bounds():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
    from bench_train_memory import CACHE_VARIABLES

    assert CACHE_VARIABLES == CPU_KERNEL_CACHES
