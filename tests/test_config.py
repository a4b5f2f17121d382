"""Recipes parse into typed configs; every shipped recipe is valid; mistakes name the key."""

from pathlib import Path

import pytest
import yaml

from specdraft.config import DataConfig, apply_overrides, load_recipe, parse_dataclass, parse_recipe
from specdraft.errors import SpecdraftError

RECIPES = sorted(Path(__file__).resolve().parents[1].joinpath("recipes").glob("*.yaml"))

MINIMAL = {
    "target": {"path": "some/model"},
    "drafter": {"family": "eagle3"},
    "data": {"path": "data.jsonl"},
    "training": {"max_steps": 10},
    "checkpoint": {"output_dir": "runs/x"},
}


def test_shipped_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"toy_eagle3.yaml", "toy_eagle1.yaml", "llama3.1-8b-eagle3.yaml", "qwen3-8b-eagle3.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_parses(path):
    recipe = load_recipe(path)
    assert recipe.drafter_family in ("eagle1", "eagle3")
    assert recipe.checkpoint.output_dir
    # Round trip: the resolved recipe written into a run folder parses back to the same thing.
    assert parse_recipe(yaml.safe_load(yaml.safe_dump(recipe.to_dict()))).to_dict() == recipe.to_dict()


def test_overrides_set_nested_values_with_yaml_types():
    recipe = parse_recipe(apply_overrides(yaml.safe_load(yaml.safe_dump(MINIMAL)),
                                          ["training.max_steps=42", "optimizer.lr=3e-4", "data.packing=true",
                                           "tracking.trackers=[wandb, tensorboard]"]))
    assert recipe.training.max_steps == 42
    assert recipe.optimizer.lr == pytest.approx(3e-4)
    assert recipe.data.packing is True
    assert recipe.tracking.trackers == ["wandb", "tensorboard"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("training.max_stpes=3", "unknown key 'training.max_stpes'; did you mean 'training.max_steps'"),
        ("trainig.max_steps=3", "unknown key 'trainig'; did you mean 'training'"),
        ("training.micro_batch_size=two", "'training.micro_batch_size' must be int"),
        ("optimizer.lr=fast", "'optimizer.lr' must be float"),
        ("drafter.ttt_stesp=3", "unknown key 'drafter.ttt_stesp'; did you mean 'drafter.ttt_steps'"),
        ("training.mixed_precision=bf32", "'training.mixed_precision' must be one of"),
        ("training.epochs=2", "exactly one of 'training.max_steps' and 'training.epochs'"),
        ("drafter.family=medusa9", "unknown drafter family 'medusa9'"),
    ],
)
def test_mistakes_name_the_dotted_key(override, message):
    raw = yaml.safe_load(yaml.safe_dump(MINIMAL))
    with pytest.raises(SpecdraftError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        parse_recipe(apply_overrides(raw, [override]))


def test_missing_required_field():
    raw = yaml.safe_load(yaml.safe_dump(MINIMAL))
    del raw["data"]["path"]
    with pytest.raises(SpecdraftError, match="missing required key 'data.path'"):
        parse_recipe(raw)
    with pytest.raises(SpecdraftError, match="missing required key 'path'"):
        parse_dataclass(DataConfig, {}, "")


def test_bad_files(tmp_path):
    with pytest.raises(SpecdraftError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: [unclosed\n")
    with pytest.raises(SpecdraftError, match="not valid YAML"):
        load_recipe(bad)
    with pytest.raises(SpecdraftError, match="must look like key.sub=value"):
        apply_overrides({}, ["training.max_steps"])


def test_yaml_is_loaded_safely(tmp_path):
    evil = tmp_path / "evil.yaml"
    evil.write_text("target: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(SpecdraftError, match="not valid YAML"):
        load_recipe(evil)
