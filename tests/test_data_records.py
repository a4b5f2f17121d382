"""Training without the optional packages: `datasets` (local files are read into Records), wandb, deepspeed.

The GPU machine the project is checked on has none of the three. Local data reads the same records
and tokenizes to the same samples on both paths, and a run trains from a local JSONL in a process
where importing any of them fails.
"""

import json
import subprocess
import sys

import pytest
from spine import TESTS, make_chat_data, make_recipe, write_recipe
from tiny import save_tiny_target, tiny_tokenizer

from specdraft.config import DataConfig
from specdraft.data import formats
from specdraft.data.pipeline import build_datasets
from specdraft.data.records import Records
from specdraft.data.vocab import count_assistant_tokens
from specdraft.errors import SpecdraftError


def write_lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def mixed_records():
    """ShareGPT records whose turns and records carry optional fields some others lack, and one
    record without an answer (dropped on both paths)."""
    records = []
    for i in range(12):
        turns = [{"from": "human", "value": f"What is {i} times {i}?"},
                 {"from": "gpt", "value": f"{i} times {i} is {i * i}." + " Yes." * (10 * (i % 2))}]
        if i % 3 == 0:
            turns[0]["name"] = "asker"  # a field only some turns have
        record = {"id": i, "conversations": turns}
        if i % 4 == 0:
            record["source"] = "odd"  # a field only some records have
        records.append(record)
    records.append({"id": 99, "conversations": [{"from": "human", "value": "Hi"}]})
    return records


@pytest.mark.parametrize("suffix,write", [
    (".jsonl", lambda path, records: write_lines(path, records)),
    (".json", lambda path, records: path.write_text(json.dumps(records))),
])
def test_records_tokenize_to_the_same_samples_as_datasets(tmp_path, monkeypatch, suffix, write):
    path = tmp_path / f"chat{suffix}"
    write(path, mixed_records())
    tokenizer = tiny_tokenizer()
    cfg = DataConfig(path=str(path), eval_fraction=0.25, max_length=40)  # the odd ones truncated
    with_datasets = build_datasets(cfg, tokenizer)
    monkeypatch.setattr(formats, "datasets", None)
    with_records = build_datasets(cfg, tokenizer)
    assert all(isinstance(split, Records) for split in with_records)
    for a, b in zip(with_datasets, with_records):
        assert a.column_names == b.column_names == ["input_ids", "loss_mask"]
        assert [dict(row) for row in a] == b.to_list()
    assert len(with_records[0]) == 9 and len(with_records[1]) == 3
    # The draft vocabulary counts the same tokens from either.
    assert count_assistant_tokens(with_datasets[0], len(tokenizer)).tolist() == \
        count_assistant_tokens(with_records[0], len(tokenizer)).tolist()


def test_without_datasets_a_folder_or_hub_id_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "datasets", None)
    folder = tmp_path / "data"
    folder.mkdir()
    write_lines(folder / "train.jsonl", mixed_records())
    for path in (str(folder), "someone/some-dataset"):
        with pytest.raises(SpecdraftError, match="needs the datasets package: pip install datasets"):
            formats.load_raw(path)


def test_without_datasets_a_bad_line_names_the_line(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "datasets", None)
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(mixed_records()[0]) + "\n{not json\n")
    with pytest.raises(SpecdraftError, match=r"chat.jsonl:2 is not valid JSON"):
        formats.load_raw(str(path))


HIDE_AND_TRAIN = """
import importlib.machinery
import sys

HIDDEN = {"datasets", "wandb", "deepspeed"}


class PathFinderWithout(importlib.machinery.PathFinder):
    # As if never installed: find_spec finds nothing (import raises ModuleNotFoundError) and
    # importlib.metadata lists no distribution (the availability checks of transformers and accelerate).
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] in HIDDEN else super().find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        return (d for d in super().find_distributions(*args, **kwargs) if d.metadata["Name"].lower() not in HIDDEN)


sys.meta_path = [PathFinderWithout if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
import importlib.util  # noqa: E402
assert all(importlib.util.find_spec(name) is None for name in HIDDEN)

from specdraft.cli import main
code = main(["train", sys.argv[1], "--no-progress"])
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"datasets", "wandb", "deepspeed"})
print("LOADED", loaded)
sys.exit(code)
"""


def test_trains_from_a_local_jsonl_without_datasets_wandb_or_deepspeed(tmp_path):
    """EAGLE-3 with a reduced draft vocabulary (counted from the data), 2 steps, a checkpoint and the final
    drafter, in a process where importing datasets, wandb or deepspeed raises."""
    target = save_tiny_target(tmp_path / "target", num_hidden_layers=3)
    data = make_chat_data(tmp_path / "chat.jsonl", n=16)
    recipe = make_recipe(tmp_path, target, data, drafter={"family": "eagle3", "draft_vocab_size": 128},
                         training={"max_steps": 2, "grad_accumulation": 1},
                         checkpoint={"save_every": 2})
    recipe["target"]["taps"] = [0, 1, 2]
    path = write_recipe(tmp_path / "recipe.yaml", recipe)
    done = subprocess.run([sys.executable, "-c", HIDE_AND_TRAIN, str(path)], capture_output=True, text=True,
                          timeout=600, env={"PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1",
                                            "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-4000:]
    assert "LOADED []" in done.stdout
    run = tmp_path / "run"
    assert (run / "drafter" / "model.safetensors").is_file()
    assert (run / "checkpoints" / "step-0000002").is_dir()
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if "train/loss" in line] == [1, 2]
