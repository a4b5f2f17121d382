"""eval/bench_train.py at a tiny size on the toy target: each configuration trains in its own process, eager and
compiled alternated (--compare), at a token budget (one shape); the table gives tokens/s, the step against the
target forward, MFU where the device's peak is known, and the shapes met."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "eval"))
import bench_train  # noqa: E402


def test_tiny_compared_run_prints_one_row_per_variant_with_one_shape_and_no_mfu_on_a_cpu():
    out = subprocess.run([sys.executable, str(REPO / "eval" / "bench_train.py"), "--target", "toy", "--families",
                          "eagle3", "--modes", "online", "--steps", "4", "--max-length", "64", "--device",
                          "cpu", "--set", "data.packing=true", "--set", "data.tokens_per_micro_batch=128",
                          "--compare", "training.compile=true"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| eagle")]
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| eagle3", "this tree"], ["| eagle3", "this tree + training.compile=true"]]
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        tokens_per_s, mfu, shapes = float(cells[3]), cells[6], cells[7]
        assert tokens_per_s > 0 and mfu == "-" and shapes == "1", row  # a CPU has no bf16 peak in PEAK_BF16
    assert "## bench_train: toy on cpu" in out.stdout


class Config:  # a Llama-3.1-8B-shaped config, for the count alone
    hidden_size, intermediate_size, num_hidden_layers = 4096, 14336, 32
    num_attention_heads, num_key_value_heads, head_dim, vocab_size = 32, 8, 128, 128256


class Drafter:
    draft_vocab_size, ttt_steps = 32000, 7


def test_flops_per_token_follow_the_docstrings_formula():
    H, I, L, kv, c, N, S, V = 4096, 14336, 32, 1024, 1024, 32000, 7, 128256
    E = 2 * H * H + 2 * H * kv + 3 * H * I
    target3 = 2 * L * E + 4 * L * c * H + 2 * N * H
    drafter3 = 3 * (6 * H * H + S * (2 * (E + H * H + 2 * H * kv) + 2 * N * H + 4 * c * H))
    assert bench_train.flops_per_token("eagle3", Config, Drafter, 2048) == target3 + drafter3
    target1 = 2 * L * E + 4 * L * c * H + 2 * V * H
    assert bench_train.flops_per_token("eagle1", Config, Drafter, 2048) == target1 + 3 * (
        4 * H * H + 2 * E + 4 * c * H) + 4 * V * H
    assert bench_train.flops_per_token("medusa1", Config, Drafter, 2048) is None
    # 2 E L is the Llama-3.1-8B layers' 6.98B matmul weights, twice: the count sees the right model
    assert L * E == pytest.approx(6.98e9, rel=0.01)


def test_a_llama_3_1_8b_shaped_target_of_random_weights_trains_without_a_download():
    """The 8B recipe on a target built from Llama-3.1-8B's config (shrunk but for its vocabulary and RoPE, for a
    CPU), random bf16 weights and the toy's tokenizer: what `--target llama3.1-8b-random` runs on a GPU."""
    out = subprocess.run([sys.executable, str(REPO / "eval" / "bench_train.py"), "--target", "llama3.1-8b-random-tiny",
                          "--families", "eagle3", "--modes", "online", "--steps", "4", "--max-length", "64",
                          "--device", "cpu", "--set", "data.packing=true", "--set", "data.tokens_per_micro_batch=128"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("| eagle3")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert float(cells[3]) > 0 and cells[7] == "1", row
