"""eval/bench_batch_size.py's table of what packed steps hold (the logic, not the figures)."""

import argparse
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
from bench_batch_size import packed_steps

from specdraft.config import load_recipe
from specdraft.data.pipeline import build_datasets
from specdraft.recipe_files import resolve_recipe
from specdraft.target import resolve_target_path


def test_packed_steps_count_padding_and_attention_pairs_as_by_hand(tmp_path):
    answers = tmp_path / "answers.jsonl"
    texts = ["def f(x): return x", "print('hello world' * 3)", "import os\nos.getcwd()", "a = [i for i in range(9)]"]
    answers.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Write line {i}."},
                                                        {"role": "assistant", "content": text}]}) + "\n"
                               for i, text in enumerate(texts)))
    overrides = ["data.max_length=384", "data.packing=true", "data.eval_fraction=0"]
    args = argparse.Namespace(recipe="toy_eagle3", answers=answers, set=overrides, sizes=[1, 4], answers_per_run=4)
    totals = packed_steps(args)

    recipe = load_recipe(resolve_recipe("toy_eagle3"), [f"data.path={answers}", *overrides])
    tokenizer = AutoTokenizer.from_pretrained(resolve_target_path("toy"))
    samples, _ = build_datasets(recipe.data, tokenizer)
    lengths = [len(s["input_ids"]) for s in samples]
    answer_tokens = sum(sum(s["loss_mask"][1:]) for s in samples)  # the collator never counts a first token
    assert len(lengths) == 4 and sum(lengths) <= 384 and len(set(lengths)) > 1
    pairs = sum(n * (n + 1) // 2 for n in lengths)

    # one answer a step: a row each, nothing padded, each row's scores its own length squared
    one = totals[1]
    assert (one["steps"], one["rows"], one["positions"], one["tokens"]) == (4, 4, sum(lengths), sum(lengths))
    assert one["scores"] == sum(n * n for n in lengths)
    assert one["causal_pairs"] == pairs
    # all four in one step: packed into one row as wide as all of them, scoring every pair across documents
    four = totals[4]
    assert (four["steps"], four["rows"], four["positions"], four["tokens"]) == (1, 1, sum(lengths), sum(lengths))
    assert four["scores"] == sum(lengths) ** 2
    assert four["causal_pairs"] == pairs
    assert one["answer_tokens"] == four["answer_tokens"] == answer_tokens

    # without packing, four rows padded to the longest
    unpacked = packed_steps(argparse.Namespace(**{**vars(args), "set": [*overrides, "data.packing=false"],
                                                  "sizes": [4]}))[4]
    assert (unpacked["rows"], unpacked["positions"], unpacked["tokens"]) == (4, 4 * max(lengths), sum(lengths))
    assert unpacked["scores"] == 4 * max(lengths) ** 2
    assert unpacked["causal_pairs"] == pairs


def test_a_learning_curve_reads_tokens_and_time_from_the_logs_and_allows_a_family_without_a_chain(tmp_path):
    from bench_batch_size import learning_curve, markdown

    run = tmp_path / "mb2"
    run.mkdir()
    (run / "recipe.yaml").write_text("training:\n  micro_batch_size: 2\n")
    rows = [{"step": 10, "train/tokens_seen": 1000, "train/tokens_per_s": 100.0},
            {"step": 10, "eval/acc_0": 0.1, "eval/acc_1": 0.05},
            {"step": 20, "train/tokens_seen": 4000, "train/tokens_per_s": 50.0},
            {"step": 20, "eval/acc_0": 0.2, "eval/acc_1": 0.125}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    curve = learning_curve(run)
    # 1000 tokens in 10 s, then 3000 more in 60 s
    assert curve["tokens"] == 4000 and abs(curve["minutes"] - 70 / 60) < 1e-9
    assert abs(curve["tokens_per_s"] - 4000 / 70) < 1e-9
    assert [(e["tokens"], e["acc_0"], e["sim_accept_len"]) for e in curve["evals"]] == [(1000, 0.1, None),
                                                                                      (4000, 0.2, None)]
    assert [e["acc_by_position"] for e in curve["evals"]] == [[0.1, 0.05], [0.2, 0.125]]
    table = markdown({"mb2": curve}).splitlines()
    assert table[2] == "| 2 | 20 | 0.100 | 0.200 | - | 1.2 | 57 |"
    assert table[-2:] == ["| 2 | 1k | .100 .050 | - |", "| 2 | 4k | .200 .125 | - |"]



def test_a_stage_boundary_falls_after_the_same_answers_at_every_size(tmp_path):
    import pytest
    import yaml
    from bench_batch_size import run_overrides

    recipe = yaml.safe_load(resolve_recipe("toy_mlp_speculator").read_text())
    recipe["training"]["max_steps"] = 1000
    recipe["drafter"]["stage2_start_step"] = 700
    path = tmp_path / "two_stages.yaml"
    path.write_text(yaml.safe_dump(recipe))
    args = argparse.Namespace(recipe=str(path), answers="A", heldout="H", sizes=[8, 2], answers_per_run=192,
                              warmup_answers=16, evals=2, set=[], stage_field=["drafter.stage2_start_step"])
    # 70% of 192 answers is 134.4: 136, the nearest multiple of both sizes, so step 17 at 8 and step 68 at 2
    assert "drafter.stage2_start_step=17" in run_overrides(args, 8)
    assert "drafter.stage2_start_step=68" in run_overrides(args, 2)
    without = run_overrides(argparse.Namespace(**{**vars(args), "stage_field": []}), 2)
    assert not any(o.startswith("drafter.stage2_start_step=") for o in without)

    with pytest.raises(SystemExit, match="both a --stage-field and a --set"):
        run_overrides(argparse.Namespace(**{**vars(args), "set": ["drafter.stage2_start_step=5"]}), 2)
    with pytest.raises(SystemExit, match="not a step count"):
        run_overrides(argparse.Namespace(**{**vars(args), "stage_field": ["drafter.no_such_field"]}), 2)
    recipe["training"]["max_steps"] = None
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(SystemExit, match="needs the recipe's training.max_steps"):
        run_overrides(args, 2)
