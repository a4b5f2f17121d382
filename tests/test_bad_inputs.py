"""A user's mistake ends in an error that names the fix, never in a traceback, and never costs a file.

``test_no_bad_input_ends_in_a_traceback`` runs every subcommand's documented bad inputs through the
CLI's own entry point: a ``SpecdraftError`` is printed and exits 2; any other exception fails the test.
The other tests look closer at what each refusal leaves on disk.
"""

import json
import os
import shutil
from pathlib import Path

import probe_family  # noqa: F401  (registers the "probe" family)
import pytest
import torch
from safetensors import SafetensorError

from specdraft import export as export_module
from specdraft import target as target_module
from specdraft.cli import main
from specdraft.config import parse_recipe
from specdraft.contract import TargetNeeds
from specdraft.data.regenerate import regenerate, sidecar_of
from specdraft.drafters import load_drafter
from specdraft.drafters.eagle3 import Eagle3Config, eagle3_needs
from specdraft.errors import SpecdraftError
from specdraft.evaluation.run import EvalSettings, evaluate
from specdraft.export import export
from specdraft.features import check_feature_cache
from specdraft.target import FrozenTarget
from specdraft.train import train
from spine import make_chat_data, make_recipe, write_recipe
from tiny import save_tiny_target, tiny_llama, tiny_tokenizer


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Two tiny targets of the same shapes (other weights), chat data, questions, and a trained probe run
    with two checkpoints (steps 2 and 3) and a final drafter."""
    root = tmp_path_factory.mktemp("bad-inputs")
    target = save_tiny_target(root / "target")
    other = save_tiny_target(root / "other-target", seed=1)
    data = make_chat_data(root / "chat.jsonl", n=16)
    questions = root / "questions.jsonl"
    questions.write_text(json.dumps({"question_id": 0, "category": "a", "turns": ["Tell me a story."]}) + "\n")
    raw = make_recipe(root, target, data, training={"max_steps": 3}, checkpoint={"save_every": 2, "keep_last": 3})
    train(parse_recipe(raw), show_progress=False)
    return {"root": root, "target": target, "other": other, "data": data, "questions": questions, "raw": raw,
            "run": root / "run"}


@pytest.fixture
def run_copy(world, tmp_path):
    shutil.copytree(world["run"], tmp_path / "run")
    return tmp_path / "run"


def cli(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


def no_target_load(*args, **kwargs):
    raise AssertionError("the target loaded before a cheap check refused the input")


# -- every subcommand: an error that names the fix, exit 2, no traceback ------------------------------


def recipe_with(world, tmp_path, **sections) -> str:
    raw = json.loads(json.dumps(world["raw"]))
    raw["checkpoint"]["output_dir"] = str(tmp_path / "new-run")
    for name, values in sections.items():
        raw[name].update(values)
    return str(write_recipe(tmp_path / "recipe.yaml", raw))


BAD_INPUTS = {
    # train: values no check used to reach
    "lr-negative": (lambda w, t: ["train", recipe_with(w, t, optimizer={"lr": -1e-3})], "'optimizer.lr' must be > 0"),
    "lr-zero": (lambda w, t: ["train", recipe_with(w, t, optimizer={"lr": 0})], "'optimizer.lr' must be > 0"),
    "max-steps-0": (lambda w, t: ["train", recipe_with(w, t, training={"max_steps": 0})],
                    "'training.max_steps' must be >= 1"),
    "max-steps-negative": (lambda w, t: ["train", recipe_with(w, t, training={"max_steps": -5})],
                           "'training.max_steps' must be >= 1"),
    "warmup-negative": (lambda w, t: ["train", recipe_with(w, t, optimizer={"warmup_steps": -10})],
                        "'optimizer.warmup_steps' must be >= 0"),
    "eval-k-huge": (lambda w, t: ["train", recipe_with(w, t, eval={"k": 10000})], "'eval.k' must be between 1 and 64"),
    "eval-temperature-negative": (lambda w, t: ["train", recipe_with(w, t, eval={"temperatures": [-2.0]})],
                                  "'eval.temperatures' must hold numbers >= 0"),
    "betas": (lambda w, t: ["train", recipe_with(w, t, optimizer={"betas": [1.5, 0.9]})],
              "'optimizer.betas' must be two numbers in [0, 1)"),
    "resume-and-overwrite": (lambda w, t: ["train", recipe_with(w, t), "--resume", "--overwrite"],
                             "--resume and --overwrite contradict each other"),
    "output-dir-is-a-file": (lambda w, t: ["train", recipe_with(w, t, checkpoint={"output_dir": str(w["data"])})],
                             "is a file; give a folder path"),
    # cache-features: nowhere to write
    "cache-features-no-folder": (lambda w, t: ["cache-features", recipe_with(w, t)], "set training.feature_cache"),
    # regenerate: refused before the target loads
    "regenerate-temperature": (lambda w, t: ["regenerate", "--target", "nowhere", "--data", str(w["data"]),
                                             "--out", str(t / "o.jsonl"), "--temperature", "-2"],
                               "--temperature must be a number >= 0"),
    "regenerate-max-new-tokens": (lambda w, t: ["regenerate", "--target", "nowhere", "--data", str(w["data"]),
                                                "--out", str(t / "o.jsonl"), "--max-new-tokens", "0"],
                                  "--max-new-tokens must be >= 1"),
    "regenerate-batch-size": (lambda w, t: ["regenerate", "--target", "nowhere", "--data", str(w["data"]),
                                            "--out", str(t / "o.jsonl"), "--batch-size", "0"],
                              "--batch-size must be >= 1"),
    "regenerate-out-is-data": (lambda w, t: ["regenerate", "--target", "nowhere", "--data", str(w["data"]),
                                             "--out", str(w["data"])], "is the --data file itself"),
    # eval: refused before the target loads
    "eval-k": (lambda w, t: ["eval", "--target", str(w["target"]), "--prompts", str(w["questions"]), "-k", "10000"],
               "-k must be between 1 and 64"),
    "eval-max-new-tokens": (lambda w, t: ["eval", "--target", str(w["target"]), "--prompts", str(w["questions"]),
                                          "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    "eval-out-is-a-file": (lambda w, t: ["eval", "--target", str(w["target"]), "--prompts", str(w["questions"]),
                                         "--out", str(w["data"])], "is a file; give a folder for the report"),
    "eval-num-prompts": (lambda w, t: ["eval", "--target", str(w["target"]), "--prompts", str(w["questions"]),
                                       "--num-prompts", "-1"], "--num-prompts must be >= 1"),
    # quickstart: refused before a folder is made
    "quickstart-eval-prompts": (lambda w, t: ["quickstart", "--out", str(t / "qs"), "--eval-prompts", "-2"],
                                "--eval-prompts must be >= 1"),
    # recipes: names that are not shipped, and a copy onto an existing file
    "recipe-unknown-name": (lambda w, t: ["train", "toy_eagl"], "neither a file nor a shipped recipe (closest shipped "
                                                                "recipes: toy_eagle3"),
    "recipes-copy-unknown": (lambda w, t: ["recipes", "copy", "llama_eagle", str(t / "x.yaml")],
                             "no shipped recipe 'llama_eagle'; did you mean"),
    "recipes-copy-onto-a-file": (lambda w, t: ["recipes", "copy", "toy_eagle3", str(w["data"])],
                                 "already exists; pass --overwrite"),
    # export: a damaged or missing source
    "export-no-run": (lambda w, t: ["export", str(t / "nothing"), "--format", "hf", "--out", str(t / "x")],
                      "no drafter checkpoint in"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_no_bad_input_ends_in_a_traceback(world, tmp_path, monkeypatch, capsys, case):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(target_module.FrozenTarget, "from_pretrained", no_target_load)
    argv, message = BAD_INPUTS[case]
    code, err = cli(argv(world, tmp_path), capsys)
    assert code == 2 and message in err, err
    assert not (tmp_path / "qs").exists() and not (tmp_path / "new-run").exists()


# -- export -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage, file", [
    (lambda run: (run / "drafter" / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}"),
     "model.safetensors"),
    (lambda run: (run / "drafter" / "config.json").write_text('{"family": "probe", "hid'), "config.json"),
], ids=["truncated-weights", "corrupt-config"])
def test_export_of_a_damaged_drafter_names_the_file_and_a_good_checkpoint(run_copy, tmp_path, capsys, damage, file):
    damage(run_copy)
    code, err = cli(["export", str(run_copy), "--format", "hf", "--out", str(tmp_path / "export")], capsys)
    assert code == 2, err
    assert f"{run_copy / 'drafter' / file} is damaged" in err
    assert f"Checkpoint {run_copy / 'checkpoints' / 'step-0000003'} still holds readable weights" in err
    assert not (tmp_path / "export").exists()
    # and the checkpoint it names does export
    assert cli(["export", str(run_copy / "checkpoints" / "step-0000003"), "--format", "hf", "--out",
                str(tmp_path / "export")], capsys)[0] == 0


def test_a_full_disk_during_export_keeps_the_existing_export(world, tmp_path, monkeypatch):
    out = export(world["run"], "hf", tmp_path / "export")
    before = snapshot(out)

    def full(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                              'message: "No space left on device" })')

    monkeypatch.setattr(export_module, "save_file", full)
    with pytest.raises(SpecdraftError, match=r"could not write the export .* \(the disk is full \(ENOSPC\)\).*needs about "
                                             r"[\d.]+ KiB; an existing .*export is left as it was"):
        export(world["run"], "hf", out, overwrite=True)
    assert snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temporary folder left behind


def test_an_export_that_cannot_fit_is_refused_before_writing(world, tmp_path, monkeypatch):
    monkeypatch.setattr(export_module.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1, 1, 10))
    with pytest.raises(SpecdraftError, match=r"not enough disk for the export: it needs about [\d.]+ KiB and 10 B"):
        export(world["run"], "hf", tmp_path / "export")
    assert list(tmp_path.iterdir()) == []


def test_exports_get_the_users_umask_not_a_private_folder(world, tmp_path):
    old = os.umask(0o022)
    try:
        out = export(world["run"], "hf", tmp_path / "export")
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o755


# -- the wrong target with the same shapes ------------------------------------------------------------


def test_export_with_another_target_of_the_same_shapes_is_refused(world, tmp_path):
    with pytest.raises(SpecdraftError, match="was trained for another target.*--allow-other-target"):
        export(world["run"], "hf", tmp_path / "export", verifier=str(world["other"]))
    assert not (tmp_path / "export").exists()
    export(world["run"], "hf", tmp_path / "export", verifier=str(world["other"]), allow_other_target=True)
    export(world["run"], "hf", tmp_path / "same", verifier=str(world["target"]))  # its own target passes


def test_a_drafter_loaded_on_another_target_of_the_same_shapes_is_refused(world):
    other = FrozenTarget.from_pretrained(str(world["other"]), dtype="float32")
    with pytest.raises(SpecdraftError, match="was trained for another target"):
        load_drafter(world["run"] / "drafter", other)
    load_drafter(world["run"] / "drafter", other, allow_other_target=True)
    # its own target, loaded in another dtype, is the same target
    load_drafter(world["run"] / "drafter", FrozenTarget.from_pretrained(str(world["target"]), dtype="bfloat16"))


# -- regenerate ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    tokenizer = tiny_tokenizer()
    return tiny_llama(len(tokenizer)).double(), tokenizer


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_regenerate_never_writes_into_its_prompts_or_a_file_it_did_not_write(tmp_path, tiny_model):
    model, tokenizer = tiny_model
    data = write_jsonl(tmp_path / "q.jsonl", [{"question_id": i, "turns": [f"Q{i}?"]} for i in range(3)])
    pretty = tmp_path / "my.json"
    pretty.write_text(json.dumps([{"a": 1}, {"b": 2}], indent=2))
    before = snapshot(tmp_path)
    with pytest.raises(SpecdraftError, match="is the --data file itself"):
        regenerate(model, tokenizer, data, data, max_new_tokens=4)
    with pytest.raises(SpecdraftError, match="was not written by specdraft regenerate.*--overwrite"):
        regenerate(model, tokenizer, data, pretty, max_new_tokens=4)
    assert snapshot(tmp_path) == before
    assert regenerate(model, tokenizer, data, pretty, max_new_tokens=4, overwrite=True) == 3
    assert len(pretty.read_text().splitlines()) == 3


def test_regenerate_resumes_only_the_same_prompts_and_settings(tmp_path, tiny_model):
    model, tokenizer = tiny_model
    data = write_jsonl(tmp_path / "q.jsonl", [{"question_id": i, "turns": [f"Q{i}?"]} for i in range(3)])
    out = tmp_path / "a.jsonl"
    assert regenerate(model, tokenizer, data, out, max_new_tokens=4) == 3
    written = out.read_bytes()
    other_turns = write_jsonl(tmp_path / "q2.jsonl", [{"question_id": i, "turns": [f"Other {i}?"]} for i in range(3)])
    with pytest.raises(SpecdraftError, match="answers other prompts under the same question_id"):
        regenerate(model, tokenizer, other_turns, out, max_new_tokens=4)
    with pytest.raises(SpecdraftError, match="written with other settings \\(max_new_tokens 4 -> 5\\)"):
        regenerate(model, tokenizer, data, out, max_new_tokens=5)
    assert out.read_bytes() == written
    more = write_jsonl(tmp_path / "q3.jsonl", [{"question_id": i, "turns": [f"Q{i}?"]} for i in range(5)])
    assert regenerate(model, tokenizer, more, out, max_new_tokens=4) == 2  # a resume answers only the new ones
    assert out.read_bytes().startswith(written)
    assert json.loads(sidecar_of(out).read_text())["settings"]["max_new_tokens"] == 4


def test_two_regenerates_cannot_write_one_file(tmp_path, tiny_model):
    import fcntl

    model, tokenizer = tiny_model
    data = write_jsonl(tmp_path / "q.jsonl", [{"turns": ["Hi"]}])
    out = tmp_path / "a.jsonl"
    with open(out, "a") as other_run:
        fcntl.flock(other_run, fcntl.LOCK_EX)
        with pytest.raises(SpecdraftError, match="another specdraft regenerate is writing"):
            regenerate(model, tokenizer, data, out, max_new_tokens=4)
    assert out.read_text() == ""


def test_regenerate_accepts_null_answers_it_is_asked_to_write(tmp_path, tiny_model):
    model, tokenizer = tiny_model
    data = write_jsonl(tmp_path / "q.jsonl", [{"messages": [{"role": "user", "content": "Hi"},
                                                            {"role": "assistant", "content": None}]}])
    assert regenerate(model, tokenizer, data, tmp_path / "a.jsonl", max_new_tokens=4) == 1


# -- recipes, data and the eval: values that make no sense ---------------------------------------------


def test_warmup_longer_than_training_warns_with_the_lr_it_reaches(world, tmp_path):
    raw = make_recipe(tmp_path, world["target"], world["data"], training={"max_steps": 4},
                      optimizer={"lr": 1e-2, "warmup_steps": 8})
    with pytest.warns(UserWarning, match=r"never reaches optimizer.lr \(0.01\); it stops at 0.005"):
        parse_recipe(raw)


def test_a_draft_vocabulary_larger_than_the_targets_warns_what_it_does():
    class Config:
        vocab_size, num_hidden_layers = 2048, 8

    with pytest.warns(UserWarning, match="draft_vocab_size 99999 is above the target's vocabulary of 2048 tokens: "
                                         "drafting over the whole vocabulary"):
        needs = eagle3_needs(Eagle3Config(draft_vocab_size=99999), Config())
    assert needs.logits == "full"


def test_an_incomplete_feature_cache_is_refused_before_anything_loads(world, tmp_path):
    cache = tmp_path / "features"
    cache.mkdir()
    (cache / "manifest.json").write_text(json.dumps({"key": "k", "shard_size": 4, "sizes": {"train": 9, "eval": 2}}))
    for name in ("train-00000", "train-00001", "eval-00000"):
        (cache / f"{name}.safetensors").write_bytes(b"")
    recipe = parse_recipe(make_recipe(tmp_path, world["target"], world["data"], training={"feature_cache": str(cache)}))
    with pytest.raises(SpecdraftError, match=r"incomplete: 1 shard\(s\) are missing \(train-00002.safetensors"):
        check_feature_cache(recipe, TargetNeeds(final_hidden=True))


def test_max_new_tokens_past_the_context_warns_once(tmp_path):
    target_dir = save_tiny_target(tmp_path / "target", max_position_embeddings=48)
    target = FrozenTarget.from_pretrained(str(target_dir), dtype="float32")
    with pytest.warns(UserWarning, match=r"max_new_tokens 60 does not fit the target's context of 48 tokens after the "
                                         r"longest prompt \(\d+ tokens\)"):
        result = evaluate(target, {}, [str(_questions(tmp_path))],
                          EvalSettings(max_new_tokens=60, show_progress=False))  # fmt: skip
    assert result["methods"]["plain"]["overall"]["num_tokens"] < 60  # it did stop at the context's end


def _questions(tmp_path: Path) -> Path:
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question_id": 0, "category": "a", "turns": ["Hi"]}) + "\n")
    return path


def test_a_null_message_in_training_data_names_its_record(world, tmp_path):
    data = tmp_path / "chat.jsonl"
    lines = world["data"].read_text().splitlines()
    lines[5] = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]})
    data.write_text("\n".join(lines) + "\n")
    with pytest.raises(SpecdraftError, match=r"data record 5 \(counting from 0\): a assistant message has no content"):
        train(parse_recipe(make_recipe(tmp_path, world["target"], data)), show_progress=False)
    assert not (tmp_path / "run").exists()


def test_eval_out_is_checked_before_the_eval_runs(world, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(target_module.FrozenTarget, "from_pretrained", no_target_load)
    code, err = cli(["eval", "--target", str(world["target"]), "--prompts", str(world["questions"]), "--out",
                     str(world["data"] / "report")], capsys)  # under a file: no folder can be made there
    assert code == 2 and "cannot be written" in err, err


def test_a_drafter_records_the_target_it_trained_for(world):
    config = json.loads((world["run"] / "drafter" / "config.json").read_text())
    embedding = FrozenTarget.from_pretrained(str(world["target"]), dtype="float32").embed_tokens.weight
    assert config["target_embedding_probe"]["shape"] == list(embedding.shape)
    assert torch.allclose(torch.tensor(config["target_embedding_probe"]["values"]), embedding.reshape(-1)[
        torch.linspace(0, embedding.numel() - 1, 64).long()])


def test_the_probe_of_an_embedding_of_2_to_the_24_or_more_values_ends_at_its_last():
    """SmolLM2's embedding (49152 x 576, 28M values): float32 positions rounded past its end (an IndexError)."""
    from specdraft.target_fingerprint import embedding_probe

    weight = torch.zeros(49152, 576, dtype=torch.uint8)
    weight.view(-1)[-1] = 7
    values = embedding_probe(weight)["values"]
    assert len(values) == 64 and values[-1] == 7.0 and values[0] == 0.0


def test_a_null_message_names_its_record_without_datasets_too():
    """The same refusal when local data is read into Records (the GPU machine has no `datasets`)."""
    from specdraft.data.formats import normalize
    from specdraft.data.records import Records

    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "hello"}]}]
    with pytest.raises(SpecdraftError, match=r"data record 1 \(counting from 0\): a user message has no content"):
        normalize(Records(rows), "messages")
    assert normalize(Records(rows[:1]), "messages").to_list() == [{"messages": rows[0]["messages"]}]


def test_a_commands_warnings_print_as_one_line_without_the_source_line(monkeypatch, capsys):
    """Python prints a warning with the line of source that raised it; a command prints its category and text."""
    import sys
    import types
    import warnings

    from specdraft import cli

    command = types.ModuleType("specdraft_warning_command")
    command.add_arguments = lambda parser: None
    command.run = lambda args: print(warnings.formatwarning("the lr never reaches its peak", UserWarning,
                                                           "/site-packages/specdraft/train.py", 7,
                                                           "    warnings.warn(message, stacklevel=2)"))
    monkeypatch.setitem(sys.modules, command.__name__, command)
    monkeypatch.setitem(cli.COMMANDS, "warns", (command.__name__, "prints a warning"))
    before = warnings.formatwarning
    assert cli.main(["warns"]) == 0
    assert capsys.readouterr().out == "UserWarning: the lr never reaches its peak\n\n"
    assert warnings.formatwarning is before  # a library caller's warnings keep Python's format
