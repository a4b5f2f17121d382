"""Recipes parse into typed configs; every shipped recipe is valid; mistakes name the key."""

import re
from pathlib import Path

import pytest
import yaml

from specdraft.config import (
    DataConfig,
    apply_overrides,
    load_recipe,
    parse_dataclass,
    parse_recipe,
)
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
    assert recipe.drafter_family == yaml.safe_load(path.read_text())["drafter"]["family"]
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
        ("eval.verify_backend=cuda", "'eval.verify_backend' must be one of auto, triton, reference; got 'cuda'"),
        ("training.mixed_precision=no", "YAML reads no, yes, on and off as booleans, so quote the word"),
        ("training.epochs=2", "exactly one of 'training.max_steps' and 'training.epochs'"),
        ("drafter.family=medusa9", "unknown drafter family 'medusa9'"),
        ("x.y=[", "the value is not valid YAML"),
        ("optimizer.betas=[", "quote a string (key='text') or close the list"),
    ],
)
def test_mistakes_name_the_dotted_key(override, message):
    raw = yaml.safe_load(yaml.safe_dump(MINIMAL))
    with pytest.raises(SpecdraftError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        parse_recipe(apply_overrides(raw, [override]))


@pytest.mark.parametrize("overrides, message", [
    (["data.tokens_per_micro_batch=2048"], "fills packed rows: set data.packing: true"),
    (["data.packing=true", "data.max_length=1024", "data.tokens_per_micro_batch=3000"],
     "must be a whole number of rows of data.max_length (1024 tokens): e.g. 2048"),
    (["data.packing=true", "data.max_length=1024", "data.tokens_per_micro_batch=512"],
     "must be a whole number of rows of data.max_length (1024 tokens): e.g. 1024"),
    (["data.packing=true", "data.max_length=512", "data.tokens_per_micro_batch=1024", "training.feature_cache=f"],
     "a feature cache (training.feature_cache, stored per sample) does not hold"),
])
def test_a_token_budget_the_loop_cannot_fill_is_refused(overrides, message):
    raw = yaml.safe_load(yaml.safe_dump(MINIMAL))
    with pytest.raises(SpecdraftError, match=re.escape(message)):
        parse_recipe(apply_overrides(raw, overrides))


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


# Real target dimensions (from the models' config.json on the hub), so recipes are checked
# against the shapes they will meet without downloading anything.
REAL_TARGETS = {
    "meta-llama/Llama-3.1-8B-Instruct": ("llama", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "Qwen/Qwen3-8B": ("qwen3", dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "smollm2-135m-instruct": ("llama", dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True)),
}


def target_config_for(path):
    from transformers import AutoConfig

    if path == "toy":
        from specdraft.toy_target import toy_target_path

        return AutoConfig.from_pretrained(toy_target_path())
    model_type, dims = REAL_TARGETS[path]
    return AutoConfig.for_model(model_type, **dims)


def recipe_on_meta(path, family: str):
    """A shipped recipe of ``family``, checked to survive a YAML round trip, and a meta-device target of its
    real dimensions computing what the recipe needs: (recipe, target config, target)."""
    from specdraft.config import parse_recipe
    from specdraft.target import FrozenTarget
    from specdraft.recipe_target import recipe_needs

    recipe = load_recipe(path)
    assert recipe.drafter_family == family
    assert parse_recipe(yaml.safe_load(yaml.safe_dump(recipe.to_dict()))).to_dict() == recipe.to_dict()
    config = target_config_for(recipe.target.path)
    return recipe, config, FrozenTarget.from_config(config, needs=recipe_needs(recipe, config), device="meta")


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_builds_its_drafter_on_meta_with_real_dims(path):
    import torch

    from specdraft.data.vocab import DraftVocab
    from specdraft.drafters import get_family
    from specdraft.target import FrozenTarget
    from specdraft.recipe_target import recipe_needs

    recipe = load_recipe(path)
    config = target_config_for(recipe.target.path)
    target = FrozenTarget.from_config(config, needs=recipe_needs(recipe, config), device="meta")
    family = get_family(recipe.drafter_family)
    vocab = None
    if family.needs_draft_vocab and recipe.drafter.draft_vocab_size:  # null: the whole vocabulary (as the loop)
        vocab = DraftVocab.from_target_ids(torch.arange(recipe.drafter.draft_vocab_size), config.vocab_size)
    drafter = family.build(target, recipe.drafter, vocab)
    trainable = sum(p.numel() for p in drafter.trained_module().parameters())
    H, I = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or H // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    if recipe.drafter_family == "eagle3":
        N = recipe.drafter.draft_vocab_size
        # fc 3H->H; attention on the 2H [embedding; hidden] input; MLP; 4 norms; own LM head over N
        expected = 3 * H * H + 2 * H * (q + 2 * kv) + q * H + 3 * H * I + 4 * H + N * H
    elif recipe.drafter_family == "eagle1":
        # fc 2H->H with bias; one target-architecture decoder layer (EAGLE-1 drops its input norm)
        expected = 2 * H * H + H * recipe.drafter.fc_bias + H * (q + 2 * kv) + q * H + 3 * H * I + H
    # The toy's arch flags, and other families' counts, are checked in the drafters' own tests.
    if recipe.target.path != "toy" and recipe.drafter_family in ("eagle1", "eagle3"):
        assert trainable == expected, (trainable, expected)
    assert all(p.device.type == "meta" for p in drafter.trained_module().parameters())


def test_the_eagle1_reference_recipe_clips_by_value_only():
    """The EAGLE-1 reference clips gradients by value at 0.5 and never by norm (eagle/train/main.py): a norm limit
    of 0.5 over a Llama-8B-sized layer would bind on nearly every step."""
    (path,) = [p for p in RECIPES if p.name == "llama3.1-8b-eagle1.yaml"]
    recipe = parse_recipe(yaml.safe_load(path.read_text()))
    assert (recipe.training.clip_grad_value, recipe.training.max_grad_norm) == (0.5, 0)


def test_family_paper_defaults_fill_what_the_recipe_leaves_unset():
    raw = yaml.safe_load(yaml.safe_dump(MINIMAL))
    raw["drafter"] = {"family": "eagle1"}
    eagle1 = parse_recipe(raw)
    # EAGLE-1 reference: AdamW(lr 3e-5, betas 0.9/0.95), clip_grad_value_(0.5)
    assert eagle1.optimizer.lr == pytest.approx(3e-5) and eagle1.optimizer.betas == [0.9, 0.95]
    assert eagle1.training.clip_grad_value == 0.5 and eagle1.training.max_grad_norm == 0.0
    eagle3 = parse_recipe(yaml.safe_load(yaml.safe_dump(MINIMAL)))
    assert eagle3.optimizer.lr == pytest.approx(5e-5) and eagle3.training.max_grad_norm == 0.5
    assert eagle3.training.clip_grad_value is None
    # EAGLE-3 reference (ds_config.json): WarmupDecayLR, 12000 warmup steps, then linear to 0
    assert (eagle3.optimizer.schedule, eagle3.optimizer.warmup_steps, eagle3.optimizer.min_lr_ratio) == \
        ("linear", 12000, 0.0)
    raw = apply_overrides(yaml.safe_load(yaml.safe_dump(MINIMAL)), ["optimizer.lr=1e-3"])
    assert parse_recipe(raw).optimizer.lr == pytest.approx(1e-3)  # the recipe wins


def test_a_path_under_home_is_expanded_as_a_shell_would(monkeypatch, tmp_path):
    """`checkpoint.output_dir=~/runs/x` is the home folder's runs/x, not a folder named "~" here."""
    monkeypatch.setenv("HOME", str(tmp_path))
    recipe = parse_recipe(apply_overrides(yaml.safe_load(yaml.safe_dump(MINIMAL)), [
        "checkpoint.output_dir=~/runs/x", "data.path=~/d.jsonl", "eval.prompts=~/q.jsonl", "target.path=~/model"]))
    assert recipe.checkpoint.output_dir == str(tmp_path / "runs" / "x")
    assert recipe.data.path == str(tmp_path / "d.jsonl") and recipe.eval.prompts == str(tmp_path / "q.jsonl")
    assert recipe.target.path == str(tmp_path / "model")
    inline = parse_recipe({**MINIMAL, "data": {"path": "d.jsonl", "chat_template": "{{ '~/' }}"}})
    assert inline.data.chat_template == "{{ '~/' }}"  # an inline template is not a path


def test_a_folder_given_as_a_recipe_is_named_as_a_folder(tmp_path):
    (tmp_path / "exp1").mkdir()
    (tmp_path / "exp1" / "recipe.yaml").write_text(yaml.safe_dump(MINIMAL))
    with pytest.raises(SpecdraftError, match=r"is a folder, not a recipe file: it holds recipe.yaml"):
        load_recipe(tmp_path / "exp1")


def test_the_trackers_are_extras_and_a_missing_one_names_its_extra(monkeypatch):
    """`pip install specdraft` pulls neither wandb nor tensorboard; a recipe naming one that is missing is refused
    before anything loads, naming `specdraft[wandb]`; the test extra installs both, so CI covers them."""
    import importlib.util
    import tomllib

    from specdraft import train_parts

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith(("wandb", "tensorboard"))]
    extras = project["optional-dependencies"]
    assert extras["wandb"] == ["wandb>=0.18"] and extras["tensorboard"] == ["tensorboard>=2.15"]
    assert {"wandb>=0.18", "tensorboard>=2.15"} <= set(extras["test"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    train_parts.check_trackers_installed(["tensorboard", "none"])
    with pytest.raises(SpecdraftError, match=r"names wandb, which is not installed: pip install 'specdraft\[wandb\]'"):
        train_parts.check_trackers_installed(["wandb"])
