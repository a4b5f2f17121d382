"""Offline mode: cached target features read back bit-identical to online, resumable, disk-checked."""

from collections import namedtuple

import pytest
import torch
from safetensors.torch import load_file

from specdraft import features as features_module
from specdraft.config import parse_recipe
from specdraft.contract import TargetNeeds
from specdraft.errors import SpecdraftError
from specdraft.features import cache_features
from specdraft.target import FrozenTarget
from specdraft.train import train
from spine import make_chat_data, make_recipe
from tiny import save_tiny_target


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("t") / "tiny", num_hidden_layers=8)


def recipe_for(tmp_path, target_dir, data, cache=True, **training):
    raw = make_recipe(tmp_path, target_dir, data,
                      training={"max_steps": 4, "micro_batch_size": 1, "grad_accumulation": 2, **training})
    raw["target"]["taps"] = "eagle3"
    raw["drafter"] = {"family": "eagle3", "ttt_steps": 2, "draft_vocab_size": 64}
    if cache:
        raw["training"]["feature_cache"] = str(tmp_path / "features")
    return parse_recipe(raw)


def test_cache_reads_back_bit_identical_to_online(tmp_path, target_dir, capsys):
    data = make_chat_data(tmp_path / "chat.jsonl", n=24)
    recipe = recipe_for(tmp_path, target_dir, data)
    folder = cache_features(recipe, show_progress=False)
    assert "GiB needed" in capsys.readouterr().out
    target = FrozenTarget.from_pretrained(target_dir, dtype="float32", needs=TargetNeeds(taps=(2, 4, 5),
                                                                                          final_hidden=True))
    from specdraft.data.pipeline import build_datasets

    train_ds, _ = build_datasets(recipe.data, target.tokenizer)
    shard = load_file(folder / "train-00000.safetensors")
    for i in (0, len(train_ds) - 1):
        online = target(torch.tensor(train_ds[i]["input_ids"])[None])
        assert torch.equal(shard[f"{i}.last"], online.final_hidden[0])
        assert torch.equal(shard[f"{i}.aux"], online.aux_hidden[0])


def test_offline_training_equals_online_training(tmp_path, target_dir):
    data = make_chat_data(tmp_path / "chat.jsonl", n=24)
    offline = recipe_for(tmp_path / "off", target_dir, data)
    cache_features(offline, show_progress=False)
    online = recipe_for(tmp_path / "on", target_dir, data, cache=False)
    a = load_file(train(offline, show_progress=False) / "drafter" / "model.safetensors")
    b = load_file(train(online, show_progress=False) / "drafter" / "model.safetensors")
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_partial_cache_resumes_and_stale_cache_is_refused(tmp_path, target_dir, monkeypatch):
    monkeypatch.setattr(features_module, "SHARD_SIZE", 4)
    data = make_chat_data(tmp_path / "chat.jsonl", n=24)
    recipe = recipe_for(tmp_path, target_dir, data)
    folder = cache_features(recipe, show_progress=False)
    shards = sorted(folder.glob("train-*.safetensors"))
    assert len(shards) > 2
    before = {p: p.stat().st_mtime_ns for p in shards}
    shards[1].unlink()  # an interrupted run: one shard missing
    cache_features(recipe, show_progress=False)
    assert shards[1].is_file()
    assert all(p.stat().st_mtime_ns == t for p, t in before.items() if p != shards[1])

    make_chat_data(tmp_path / "chat.jsonl", n=20)  # the data changed under the cache
    with pytest.raises(SpecdraftError, match="different recipe/data/target"):
        cache_features(recipe_for(tmp_path, target_dir, data), show_progress=False)


def check_a_cache_of_another_target_is_refused(tmp_path):
    target = save_tiny_target(tmp_path / "target", num_hidden_layers=8)
    recipe = recipe_for(tmp_path, target, make_chat_data(tmp_path / "chat.jsonl", n=8))
    cache_features(recipe, show_progress=False)
    # Another model in the same folder (retrained, another revision): same path, same shapes,
    # other weights, so other features.
    save_tiny_target(tmp_path / "target", num_hidden_layers=8, seed=1)
    with pytest.raises(SpecdraftError, match="different recipe/data/target"):
        train(recipe, show_progress=False)
    with pytest.raises(SpecdraftError, match="different recipe/data/target"):
        cache_features(recipe, show_progress=False)


def test_a_cache_of_another_target_is_refused(tmp_path):
    check_a_cache_of_another_target_is_refused(tmp_path)


def test_refuses_when_the_disk_is_short(tmp_path, target_dir, monkeypatch):
    data = make_chat_data(tmp_path / "chat.jsonl", n=8)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(features_module.shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 100, 100))
    with pytest.raises(SpecdraftError, match="not enough disk for the feature cache"):
        cache_features(recipe_for(tmp_path, target_dir, data), show_progress=False)
    assert not list((tmp_path / "features").glob("*.safetensors"))


def test_cache_features_never_writes_into_a_folder_that_is_not_a_feature_cache(tmp_path, target_dir, monkeypatch):
    data = make_chat_data(tmp_path / "chat.jsonl", n=8)
    recipe = recipe_for(tmp_path, target_dir, data)
    mine = tmp_path / "features"
    mine.mkdir()
    (mine / "train-00000.safetensors").write_text("my own file with a cache's name")
    with pytest.raises(SpecdraftError, match="not a feature cache"):
        cache_features(recipe, show_progress=False)
    assert [p.name for p in mine.iterdir()] == ["train-00000.safetensors"]
    monkeypatch.chdir(tmp_path)
    for folder in (".", str(tmp_path.parent)):  # the working directory, and a folder above it
        raw_cache = recipe_for(tmp_path, target_dir, data)
        raw_cache.training.feature_cache = folder
        with pytest.raises(SpecdraftError, match="folder of its own"):
            cache_features(raw_cache, show_progress=False)
