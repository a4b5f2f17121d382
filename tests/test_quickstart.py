"""`specdraft quickstart` end to end on the shipped toy target, at a tiny budget: the README's
main command must keep working (its figures come from the full-size run, not from here)."""

import json
from pathlib import Path

import pytest

from specdraft import quickstart as quickstart_module
from specdraft.config import load_recipe
from specdraft.errors import SpecdraftError
from specdraft.quickstart import quickstart
from specdraft.toy_target import heldout_prompt_sets, toy_prompts


def test_held_out_prompt_sets_are_disjoint_and_from_held_out_files():
    eval_set, answered = heldout_prompt_sets(3, 5)
    assert (len(eval_set), len(answered)) == (3, 5)
    asked = [p["turns"][0] for p in eval_set + answered]
    assert len(set(asked)) == 8
    train = {p["turns"][0] for p in toy_prompts("train", 2000)}
    assert not train.intersection(asked)


def test_asking_for_more_prompts_than_exist_says_how_many_there_are():
    with pytest.raises(SpecdraftError, match=r"only \d+ heldout prompts"):
        toy_prompts("heldout", 10**6)


def test_quickstart_trains_evaluates_exports_and_explains(tmp_path, capsys):
    report = quickstart(tmp_path, train_prompts=6, steps=2, eval_prompts=2, overwrite=False, heldout_answers=3)

    run = tmp_path / "run"
    assert report == run / "eval"
    # Training's eval set is the answers to held-out prompts, not a slice of the training answers.
    recipe_text = (run / "recipe.yaml").read_text()
    assert "heldout_answers.jsonl" in recipe_text
    assert len((tmp_path / "data" / "answers.jsonl").read_text().splitlines()) == 6
    assert len((tmp_path / "data" / "heldout_answers.jsonl").read_text().splitlines()) == 3
    final = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert "eval/acc_0" in final  # training's own eval ran on the held-out answers

    for temperature in ("0", "1"):
        result = json.loads((report / f"temperature-{temperature}" / "result.json").read_text())
        assert set(result["methods"]) >= {"eagle3", "prompt-lookup"}
        assert result["methods"]["eagle3"]["overall"]["num_decodes"] == 2
    # Greedy speculative decoding is lossless: the quickstart's drafters emit the target's own tokens.
    greedy = json.loads((report / "temperature-0" / "result.json").read_text())
    assert greedy["greedy_identical"] == {"eagle3": 1.0, "prompt-lookup": 1.0}
    for fmt in ("sglang", "vllm", "hf"):
        assert (tmp_path / "export" / fmt / "model.safetensors").is_file()
        assert (tmp_path / "export" / fmt / "config.json").is_file()
    # The closing lines read the figures of this run's own report, and say what they mean.
    closing = capsys.readouterr().out.split("[5/5] ")[-1]
    eagle3 = greedy["methods"]["eagle3"]["overall"]
    assert closing.startswith("What the numbers mean")
    assert f"tau {eagle3['acceptance_length']:.2f}:" in closing and f"speedup {eagle3['speedup']:.2f}x" in closing
    assert f"costs {eagle3['verify_cost']:.2f}x a one-token forward" in closing
    assert f"predicts {eagle3['predicted_speedup_measured_verify']:.2f}x." in closing


def test_an_unknown_quickstart_target_names_the_known_ones(tmp_path):
    with pytest.raises(SpecdraftError, match="knows the targets toy, smollm2-135m-instruct"):
        quickstart(tmp_path, 6, 2, 2, overwrite=False, target="llama-3-8b")



def test_prompts_from_a_file_split_into_disjoint_training_and_held_out_sets(tmp_path):
    from specdraft.quickstart import prompts_from_file

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [f"question {i}"]}) + "\n"
                            for i in range(10)))
    train, heldout = prompts_from_file(path, 6, 3)
    assert (len(train), len(heldout)) == (6, 3)
    assert not {p["question_id"] for p in train} & {p["question_id"] for p in heldout}
    assert prompts_from_file(path, 6, 3) == (train, heldout)  # a seeded shuffle: the same split every run
    with pytest.raises(SpecdraftError, match="has 10 prompts; .* ask for 11"):
        prompts_from_file(path, 8, 3)


@pytest.mark.parametrize("native", [False, True], ids=["emulated", "native"])
def test_the_quickstart_answers_and_trains_in_float32_on_a_cpu_that_would_emulate_bf16(monkeypatch, capsys, native):
    monkeypatch.setattr(quickstart_module, "cpu_computes_natively", lambda name: native)
    monkeypatch.setattr(quickstart_module.torch.cuda, "is_available", lambda: False)
    dtype, overrides = quickstart_module.precision_here("bfloat16")
    recipe = load_recipe(quickstart_module.RECIPES_DIR / "smollm2-135m-eagle3.yaml", overrides)
    if native:
        assert (dtype, overrides) == ("bfloat16", [])
        assert (recipe.target.dtype, recipe.training.mixed_precision) == ("bfloat16", "bf16")
    else:
        assert dtype == "float32" and "answers and trains in float32" in capsys.readouterr().out
        assert (recipe.target.dtype, recipe.training.mixed_precision) == ("float32", "no")


def test_the_toy_recipes_read_their_data_where_the_quickstart_writes_it():
    """`specdraft quickstart` then `specdraft train toy_eagle3` needs no data.path: the toy recipes default to the
    quickstart's answers file (they pointed one folder too high)."""
    import argparse

    import yaml

    from specdraft import quickstart as quickstart_module
    from specdraft.recipe_files import shipped_recipes

    parser = argparse.ArgumentParser()
    quickstart_module.add_arguments(parser)
    written = Path(parser.parse_args([]).out) / "data" / "answers.jsonl"  # what quickstart(out) writes
    toy = {name: path for name, path in shipped_recipes().items() if name.startswith("toy_")}
    assert len(toy) == 7
    for name, path in toy.items():
        assert Path(yaml.safe_load(path.read_text())["data"]["path"]) == written, name


def test_specdraft_recipes_prints_each_purpose_as_a_whole_sentence(capsys):
    """The purpose column is the opening comment's first sentence, joined across lines, never cut mid-sentence."""
    from specdraft.cli import main
    from specdraft.recipe_files import describe, first_sentence, shipped_recipes

    assert first_sentence("# Trains X for Y (a: b,\n# c d). More.\nx: 1\n") == "Trains X for Y (a: b, c d)."
    assert first_sentence("# EAGLE-3 on a model from PyPI:\n#   pip install it\n# trained on answers.\n") == \
        "EAGLE-3 on a model from PyPI."
    assert main(["recipes"]) == 0
    printed = capsys.readouterr().out
    for path in shipped_recipes().values():
        purpose = describe(path)["purpose"]
        assert purpose[-1] in ".!?" and purpose.count("(") == purpose.count(")"), (path.name, purpose)
        assert purpose in printed
    assert "no norm clipping)." in describe(shipped_recipes()["llama3.1-8b-eagle1"])["purpose"]


def test_data_sample_then_train_toy_eagle3_needs_no_data_path_and_evaluates_and_exports(tmp_path, monkeypatch, capsys):
    """The second hour's first step: `specdraft data sample` writes the file the toy recipes read, then
    `specdraft train toy_eagle3` runs with no data.path, evaluates on held-out samples, and says how to export."""
    import torch

    from specdraft.cli import main

    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    try:
        assert main(["data", "sample", "--prompts", "24"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert len((tmp_path / "quickstart" / "data" / "answers.jsonl").read_text().splitlines()) == 24
    assert "Next: specdraft train toy_eagle3\n" in capsys.readouterr().out  # the default path needs no data.path
    assert main(["train", "toy_eagle3", "training.max_steps=2", "eval.num_prompts=1", "eval.max_new_tokens=8",
                 "eval.temperatures=[0.0]", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    run = tmp_path / "runs" / "toy-eagle3"
    assert "acceptance eval: 1 held-out samples of the data" in printed
    assert (run / "eval" / "temperature-0" / "result.json").is_file()
    export_line = next(line for line in printed.splitlines() if line.strip().startswith("export:"))
    command = export_line.split("export:")[1].split("(formats")[0].split()
    assert command[:2] == ["specdraft", "export"] and main(command[1:]) == 0  # the printed command works
    assert (tmp_path / "export" / "vllm" / "config.json").is_file()
    (tmp_path / "mine.prompts.jsonl").write_text("my own prompts\n")
    assert main(["data", "sample", "--prompts", "24", "--out", "mine.jsonl"]) == 2  # a file it did not write stays
    assert (tmp_path / "mine.prompts.jsonl").read_text() == "my own prompts\n" and not (tmp_path / "mine.jsonl").exists()
