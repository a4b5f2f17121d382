"""The dtype each command decodes in when none is asked for (bf16 where the CPU computes it natively, float32 where
it would emulate it), and the record of what every eval report was measured on."""

import argparse
import json

import pytest
import torch
from tiny import save_tiny_target

from specdraft import dtypes
from specdraft.data import regenerate as regen
from specdraft.evaluation import run as eval_run
from specdraft.evaluation.provenance import describe_machine, source_commit

QUESTIONS = [{"question_id": 1, "category": "qa", "turns": ["What is the capital of France?"]},
             {"question_id": 2, "category": "qa", "turns": ["How many legs does a spider have?"]}]

AMX_CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile
"""
AVX2_CPUINFO = """processor\t: 0
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse avx2 fma
"""


def native(monkeypatch, bf16: bool) -> None:
    monkeypatch.setattr(dtypes, "cpu_computes_natively", lambda name: bf16 or name in ("float32", torch.float32))


@pytest.mark.parametrize("bf16, expected", [(True, "bfloat16"), (False, "float32")])
def test_the_default_dtype_is_bf16_where_the_cpu_has_hardware_for_it(monkeypatch, bf16, expected):
    native(monkeypatch, bf16)
    assert dtypes.default_dtype("cpu") == expected
    assert dtypes.default_dtype(torch.device("cpu")) == expected
    assert dtypes.default_dtype("cuda:0") == "bfloat16"  # whatever the host CPU has


def test_the_cpu_is_described_by_its_model_and_its_bf16_hardware(tmp_path, monkeypatch):
    native(monkeypatch, True)
    (tmp_path / "amx").write_text(AMX_CPUINFO)
    amx = dtypes.cpu_description(tmp_path / "amx")
    assert amx == {"model": "Intel(R) Xeon(R) Platinum 8480+", "amx": True, "avx512_bf16": True, "bf16_native": True}
    assert dtypes.describe_cpu(amx) == "Intel(R) Xeon(R) Platinum 8480+ (AMX, bf16 native)"
    native(monkeypatch, False)
    (tmp_path / "avx2").write_text(AVX2_CPUINFO)
    avx2 = dtypes.cpu_description(tmp_path / "avx2")
    assert avx2 == {"model": "AMD EPYC 7B12", "amx": False, "avx512_bf16": False, "bf16_native": False}
    assert dtypes.describe_cpu(avx2) == "AMD EPYC 7B12 (no AMX or AVX512-BF16, bf16 emulated)"
    assert dtypes.cpu_description(tmp_path / "missing")["amx"] is False  # not Linux: no flags, no error


def test_the_commit_is_this_checkouts_or_says_there_is_none():
    commit = source_commit()
    assert commit.startswith("specdraft ") or len(commit.removesuffix("-dirty")) == 12, commit


@pytest.mark.parametrize("bf16, expected", [(True, "bfloat16"), (False, "float32")])
def test_eval_decodes_in_the_default_dtype_and_every_report_names_the_machine(tmp_path, monkeypatch, capsys, bf16,
                                                                               expected):
    native(monkeypatch, bf16)
    target = save_tiny_target(tmp_path / "target")
    suite = tmp_path / "q.jsonl"
    suite.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    parser = argparse.ArgumentParser()
    eval_run.add_arguments(parser)
    args = parser.parse_args(["--target", str(target), "--prompts", str(suite), "--prompt-lookup", "-k", "2",
                              "--max-new-tokens", "4", "--no-progress", "--out", str(tmp_path / "out")])
    assert eval_run.run(args) == 0
    record = json.loads((tmp_path / "out" / "result.json").read_text())["measured_on"]
    assert record["dtype"] == expected and record["device"] == "cpu"
    assert record["cpu"]["bf16_native"] is bf16 and record["cpu"]["model"]
    assert record["commit"] and record["date"][:2] == "20"
    line = describe_machine(record)
    assert line.startswith(f"measured on cpu in {expected}: ") and f"bf16 {'native' if bf16 else 'emulated'}" in line
    assert line in capsys.readouterr().out  # the terminal
    assert line in (tmp_path / "out" / "report.md").read_text()  # and report.md


@pytest.mark.parametrize("bf16, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_regenerate_answers_in_the_default_dtype(tmp_path, monkeypatch, bf16, expected):
    native(monkeypatch, bf16)
    seen = []
    real = regen.regenerate
    monkeypatch.setattr(regen, "regenerate", lambda model, *a, **k: (seen.append(model.dtype), real(model, *a, **k))[1])
    target = save_tiny_target(tmp_path / "target")
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps(QUESTIONS[0]) + "\n")
    parser = argparse.ArgumentParser()
    regen.add_arguments(parser)
    assert regen.run(parser.parse_args(["--target", str(target), "--data", str(data), "--max-new-tokens", "2",
                                        "--out", str(tmp_path / "a.jsonl")])) == 0
    assert seen == [expected]
