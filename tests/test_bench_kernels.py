"""eval/bench_kernels.py in its quick mode: on a CPU the interpreted kernels against the reference on a tiny grid
(timings need a GPU), on a GPU its quick timed grid; the tables are written and never silently replaced."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import bench_kernels  # noqa: E402


def test_quick_run_checks_every_cell_and_writes_its_tables(tmp_path, capsys):
    assert bench_kernels.main(["--out", str(tmp_path), "--quick", "--iters", "3"]) == 0
    result = json.loads((tmp_path / "bench_kernels.json").read_text())
    grid = bench_kernels.GPU_QUICK if torch.cuda.is_available() else bench_kernels.CPU_QUICK
    cells = {(r["kind"], r["batch"], r["vocab"], r["k"]) for r in result["rows"]}
    assert cells == {(kind, b, v, k) for kind in ("chain", "tree") for b in grid["batch"] for v in grid["vocab"]
                     for k in grid["k"]}
    assert all(r["same_tokens"] for r in result["rows"])
    assert result["host_us"]["chain"] > 0 and result["host_us"]["tree"] > 0
    table = (tmp_path / "bench_kernels.md").read_text()
    assert table.count("\n| chain |") + table.count("\n| tree |") == len(cells)
    if torch.cuda.is_available():
        assert all(r["kernel_us"] > 0 and r["reference_us"] > 0 for r in result["rows"])
    else:
        assert "timings need a GPU" in capsys.readouterr().out and "kernel_us" not in result["rows"][0]
    with pytest.raises(SystemExit, match="--overwrite"):
        bench_kernels.main(["--out", str(tmp_path), "--quick"])


def test_the_bench_tree_has_the_documented_shape():
    tree = bench_kernels.bench_tree(7)
    assert tree.depth == 7 and tree.num_nodes == 4 + 3 * 6
    assert bench_kernels.bench_tree(1).num_nodes == 4
