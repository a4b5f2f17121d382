"""eval/bench_families.py's per-family overrides and bench_medusa2_drift.py's variants (the logic, not the figures)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
from bench_families import overrides_for


def test_a_family_prefixed_override_reaches_that_family_alone():
    given = ["training.max_steps=250", "medusa2:drafter.joint_from_step=75",
             "mlp_speculator:drafter.stage2_start_step=175", "data.path=/a:b/answers.jsonl"]
    assert overrides_for("medusa2", given) == ["training.max_steps=250", "drafter.joint_from_step=75",
                                               "data.path=/a:b/answers.jsonl"]
    assert overrides_for("mlp_speculator", given) == ["training.max_steps=250", "drafter.stage2_start_step=175",
                                                      "data.path=/a:b/answers.jsonl"]
    assert overrides_for("eagle3", given) == ["training.max_steps=250", "data.path=/a:b/answers.jsonl"]


def test_an_unknown_family_prefix_is_refused_with_the_known_ones():
    with pytest.raises(SystemExit, match="'medusa3' is not a family; known: .*medusa2"):
        overrides_for("eagle3", ["medusa3:drafter.joint_from_step=75"])


def test_a_medusa2_drift_variant_is_a_name_and_its_overrides():
    from bench_medusa2_drift import parse_variant

    assert parse_variant("low lr:optimizer.lr=5e-5,drafter.head_lr_multiplier=20") == (
        "low lr", ["optimizer.lr=5e-5", "drafter.head_lr_multiplier=20"])
    assert parse_variant("the recipe:") == ("the recipe", [])
    with pytest.raises(SystemExit, match="NAME:KEY=VALUE"):
        parse_variant("optimizer.lr=5e-5")
