"""The verify kernels compile for real GPUs (sm_80, sm_90) at the signatures their launchers produce, with IEEE
division, no fma contraction, no spills and no local memory: eval/compile_kernels.py, which needs no GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
from compile_kernels import problems, ptxas_usage

SCRIPT = Path(__file__).resolve().parents[1] / "eval" / "compile_kernels.py"
KERNELS = {"rejection_partials_kernel", "rejection_combine_kernel", "tree_partials_kernel", "tree_combine_kernel"}


def test_every_kernel_compiles_for_sm80_and_sm90_at_the_launchers_signatures(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    runs = {arch: subprocess.Popen([sys.executable, str(SCRIPT), "--arch", str(arch), "--json", str(tmp_path / f"{arch}.json")],
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for arch in (80, 90)}  # one process per arch: half the wall time where two cores are free
    rows = []
    for arch, run in runs.items():
        output = run.communicate()[0]
        assert run.returncode == 0, output[-4000:]
        rows += json.loads((tmp_path / f"{arch}.json").read_text())
    assert {(r["kernel"], r["arch"]) for r in rows} == {(k, a) for k in KERNELS for a in ("sm_80", "sm_90")}
    partials = [r for r in rows if "partials" in r["kernel"]]
    for dtype in ("fp32", "bf16", "fp16"):  # every probability dtype, with and without draft probs, was captured
        for no_draft_probs in (True, False):
            assert any(f"target_probs=*{dtype}" in r["variant"] and f"NO_DRAFT_PROBS={no_draft_probs}" in r["variant"]
                       for r in partials), (dtype, no_draft_probs)
    assert not [r for r in rows if r["problems"]]
    assert all(r["spill_store_bytes"] == r["spill_load_bytes"] == r["stack_bytes"] == 0 for r in rows)


PTXAS_LOG = """ptxas info    : Compiling entry function 'k' for 'sm_80'
ptxas info    : Function properties for k
    {stack} bytes stack frame, {spills} bytes spill stores, {spills} bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 384 bytes smem, 400 bytes cmem[0]
"""


def test_the_checks_catch_what_would_change_the_results_or_spill():
    clean = ptxas_usage(PTXAS_LOG.format(stack=0, spills=0))
    assert clean == {"registers": 40, "stack_bytes": 0, "spill_store_bytes": 0, "spill_load_bytes": 0}
    assert problems("div.rn.f32 %f1, %f2, %f3;", clean, divides=True) == []
    assert problems("div.full.f32 %f1, %f2, %f3;", clean, divides=True)
    assert problems("div.approx.f32 %f1, %f2, %f3;", clean, divides=False)
    assert problems("mul.f32 %f1, %f2, %f3;", clean, divides=True)  # the race's division went missing
    assert problems("div.rn.f32 %f1, %f2, %f3; fma.rn.f32 %f4, %f1, %f2, %f3;", clean, divides=True)
    assert problems(".local .align 4 .b8 __local_depot0[16];", clean, divides=False)
    assert problems("", ptxas_usage(PTXAS_LOG.format(stack=16, spills=8)), divides=False)
