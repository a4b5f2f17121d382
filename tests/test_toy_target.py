"""Toy target: corpus split, chat template, tiny end-to-end build, and the shipped checkpoint."""

import ast
import dataclasses
import json
import math
import pathlib
import random
import re
import subprocess
import sys
import sysconfig

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdraft.errors import SpecdraftError
from specdraft.toy_build.builder import (
    LOOP_KINDS,
    ToyRecipe,
    build_toy_target,
    decay_start_step,
    distinct_ngram_ratio,
    heldout_loss,
    longest_repeated_suffix,
    lr_at,
    plain_file_starts,
    render_chat,
    split_files,
    total_steps_from,
    training_texts,
)
from specdraft.toy_build.unlikelihood import (
    greedy_continuations,
    repeated_ngram_mask,
    sample_windows,
    unlikelihood_loss,
)
from specdraft.toy_target import SOURCE_LINE, is_heldout, list_source_files, source_segment, toy_target_path

STDLIB = pathlib.Path(sysconfig.get_paths()["stdlib"])
TINY = ToyRecipe(
    vocab_size=320, hidden_size=32, num_layers=7, num_heads=2, num_kv_heads=1, intermediate_size=64,
    max_position_embeddings=1024, seq_len=256, batch_size=2, warmup_steps=2, heldout_percent=20.0,
    eval_prompts=1, eval_new_tokens=8,
)


def write(root: pathlib.Path, rel: str, text: str = "x = 1\n") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# --------------------------------------------------------------------------- corpus and split


def test_source_files_exclude_tests_and_generated_tables(tmp_path):
    for rel in ["a.py", "pkg/b.py", "pkg/helper_testing.py"]:
        write(tmp_path, rel)
    for rel in ["test/test_a.py", "test/support.py", "pkg/tests/c.py", "idlelib/idle_test/d.py",
                "pkg/test_e.py", "pkg/e_test.py", "unittest/test/testmock/f.py", "site-packages/g.py",
                "config-3.11-x86_64-linux-gnu/python-config.py"]:
        write(tmp_path, rel)
    write(tmp_path, "encodings/cp9.py", '""" Python Character Mapping Codec generated from gencodec.py """\n')
    write(tmp_path, "empty.py", "\n")

    assert sorted(list_source_files(tmp_path)) == ["a.py", "pkg/b.py", "pkg/helper_testing.py"]


def test_real_stdlib_listing_has_no_test_files():
    files = list_source_files()
    assert len(files) > 300
    bad = [rel for rel in files if re.search(r"(^|/)(test|tests|idle_test)/|(^|/)test_[^/]*\.py$", rel)]
    assert bad == []


def test_split_is_file_level_deterministic_and_near_the_requested_share(tmp_path):
    files = {f"pkg{i % 7}/mod_{i}.py": f"value = {i}\n" for i in range(400)}
    train, heldout = split_files(files, heldout_percent=10.0)
    assert set(train) | set(heldout) == set(files) and not set(train) & set(heldout)
    assert 20 <= len(heldout) <= 60  # 10% of 400, allowing for hash noise
    assert split_files(dict(reversed(list(files.items()))), 10.0)[1] == heldout  # order does not matter
    assert all(is_heldout(rel, 10.0) for rel in heldout)
    assert split_files(files, 10.0)[1].keys() <= split_files(files, 20.0)[1].keys()  # nested by percent

    with pytest.raises(SpecdraftError, match="--heldout-percent"):
        split_files({"only.py": "x = 1\n"}, heldout_percent=5.0)


# --------------------------------------------------------------------------- measures and schedule


def test_distinct_ngram_ratio():
    assert distinct_ngram_ratio([1, 2, 3, 4, 5, 6]) == 1.0
    assert distinct_ngram_ratio([1, 2] * 10) == pytest.approx(2 / 17)  # 17 4-grams, 2 distinct
    assert distinct_ngram_ratio([1, 2]) == 1.0  # too short to repeat


def test_longest_repeated_suffix():
    assert longest_repeated_suffix([1, 2, 3, 4, 5]) == 0
    assert longest_repeated_suffix([1, 2, 3, 1, 2, 3, 1, 2, 3]) == 6  # loop of period 3: L - p
    assert longest_repeated_suffix([7, 1, 2, 9, 1, 2]) == 2


def test_lr_schedule_is_warmup_stable_decay():
    recipe = ToyRecipe(lr=1.0, warmup_steps=10, decay_fraction=0.25, min_lr_ratio=0.1)
    assert lr_at(0, 100, recipe) == pytest.approx(0.1)
    assert lr_at(9, 100, recipe) == pytest.approx(1.0)
    assert lr_at(74, 100, recipe) == 1.0 and lr_at(50, None, recipe) == 1.0
    assert lr_at(75, 100, recipe) == 1.0  # decay starts at step 75 of 100 ...
    assert lr_at(99, 100, recipe) == pytest.approx(1 - 0.9 * 24 / 25)  # ... and ends near 0.1
    # --minutes fixes the length when the decay is due; replaying it keeps the stable phase identical
    for step in [0, 1, 37, 300, 301, 302]:
        total = total_steps_from(step, recipe)
        assert decay_start_step(total, recipe) >= step  # no step already taken would decay on replay
        assert total == step or decay_start_step(total - 1, recipe) < step  # and it is the shortest such run


# --------------------------------------------------------------------------- tiny build


@pytest.fixture(scope="module")
def small_stdlib(tmp_path_factory):
    """20 small real stdlib modules (4 of them held out at 20%) plus a test file that must be ignored."""
    small = sorted(rel for rel, text in list_source_files().items() if 2_000 < len(text) < 8_000)
    chosen = [rel for rel in small if not is_heldout(rel, TINY.heldout_percent)][:16]
    chosen += [rel for rel in small if is_heldout(rel, TINY.heldout_percent)][:4]
    root = tmp_path_factory.mktemp("stdlib")
    for rel in chosen:
        write(root, rel, (STDLIB / rel).read_text())
    write(root, "test/test_secret.py", "SECRET_TEST_TOKEN = 1\n")
    return root


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, small_stdlib):
    out = tmp_path_factory.mktemp("toy") / "tiny"
    return build_toy_target(out, steps=3, seed=0, recipe=TINY, stdlib_dir=small_stdlib)


def test_tiny_build_is_a_normal_transformers_folder(tiny_target, small_stdlib):
    names = {p.name for p in tiny_target.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "build_record.json"} <= names
    assert not list(tiny_target.parent.glob(".tiny.tmp-*"))  # written then renamed

    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 7 and model.config.num_key_value_heads < model.config.num_attention_heads
    assert model.config.vocab_size == len(tokenizer) == 320
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|end|>")
    assert tokenizer.pad_token == "<|pad|>"

    record = json.loads((tiny_target / "build_record.json").read_text())
    assert record["steps"] == 3 and record["seed"] == 0
    assert all(is_heldout(rel, TINY.heldout_percent) for rel in record["heldout_files"])
    # The recorded held-out loss is the saved (bf16) model's, recomputable from the folder alone.
    saved = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    assert record["train_files"] == 16 and len(record["heldout_files"]) == 4  # test/ excluded
    texts = [(small_stdlib / rel).read_text() for rel in record["heldout_files"]]
    loss, tokens = heldout_loss(saved, tokenizer, texts, TINY.seq_len)
    assert tokens == record["heldout_tokens"] and loss == pytest.approx(record["heldout_loss"], abs=1e-4)
    assert 3.0 < loss < 7.0  # 3 steps from a uniform start: near ln(320) = 5.77, not yet learned
    with pytest.raises(SpecdraftError, match="--overwrite"):
        build_toy_target(tiny_target, steps=1, recipe=TINY)


def test_tiny_build_is_deterministic_given_the_seed(tiny_target, small_stdlib, tmp_path):
    again = build_toy_target(tmp_path / "again", steps=3, seed=0, recipe=TINY, stdlib_dir=small_stdlib)
    assert (again / "tokenizer.json").read_bytes() == (tiny_target / "tokenizer.json").read_bytes()
    assert (again / "model.safetensors").read_bytes() == (tiny_target / "model.safetensors").read_bytes()


def test_overwrite_replaces_an_earlier_build_and_never_a_folder_of_the_users(tiny_target, small_stdlib, tmp_path):
    import shutil

    earlier = tmp_path / "earlier"
    shutil.copytree(tiny_target, earlier)  # a build, with the owner record its build wrote
    build_toy_target(earlier, steps=1, seed=0, recipe=TINY, stdlib_dir=small_stdlib, overwrite=True)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("mine")
    with pytest.raises(SpecdraftError, match="did not write"):
        build_toy_target(mine, steps=1, seed=0, recipe=TINY, stdlib_dir=small_stdlib, overwrite=True)
    assert [p.name for p in mine.iterdir()] == ["thesis.tex"]


def test_chat_template_matches_training_text_and_marks_assistant_tokens(tiny_target):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    answer = "def area(r):\n    return 3.14 * r * r\n"
    messages = [{"role": "user", "content": "Write the function `area`."}, {"role": "assistant", "content": answer}]

    assert tokenizer.apply_chat_template(messages, tokenize=False) == render_chat(messages[0]["content"], answer)
    prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|assistant|>\n")

    out = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    masked = [t for t, keep in zip(out["input_ids"], out["assistant_masks"]) if keep]
    assert tokenizer.decode(masked) == answer + "<|end|>"  # exactly the answer and its end token
    with pytest.raises(Exception, match="roles are system, user and assistant"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


# --------------------------------------------------------------------------- shipped checkpoint


def test_shipped_checkpoint_loads_fits_and_its_recorded_loss_recomputes():
    path = toy_target_path()
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert size <= 12 * 1024 * 1024, f"shipped toy target is {size / 2**20:.1f} MiB"

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = model.config
    assert config.num_hidden_layers >= 7 and config.max_position_embeddings >= 1024
    assert config.num_key_value_heads < config.num_attention_heads
    assert len(set([2, config.num_hidden_layers // 2, config.num_hidden_layers - 3])) == 3  # EAGLE-3 taps

    record = json.loads((path / "build_record.json").read_text())
    build_md = (path / "BUILD.md").read_text()
    assert f"{record['heldout_loss']:.4f}" in build_md  # the documented figure is the recorded one
    assert record["command"] in build_md

    for check in record["check_files"]:
        assert check["path"] in record["heldout_files"] and is_heldout(check["path"], record["recipe"]["heldout_percent"])
        loss, tokens = heldout_loss(model, tokenizer, [check["text"]], record["recipe"]["seq_len"])
        assert tokens == check["tokens"]
        assert loss == pytest.approx(check["loss"], abs=0.01)


def test_shipped_checkpoint_greedy_chat_answer_replays():
    path = toy_target_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    sample = next(s for s in json.loads((path / "build_record.json").read_text())["loops"]["samples"] if s["kind"] == "chat")

    prompt_ids = tokenizer(sample["prompt"], add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(prompt_ids, max_new_tokens=24, do_sample=False)
    replay = tokenizer.decode(out[0, prompt_ids.shape[1]:])
    assert sample["greedy"].startswith(replay)


# --------------------------------------------------------------------------- unlikelihood phase

TINY_UL = dataclasses.replace(TINY, unlikelihood_steps=4, ul_batch_size=2, ul_prefix_len=16, ul_new_tokens=8)


def test_repeated_ngram_mask_marks_every_token_of_a_repeat():
    tokens = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4, 5, 0], [7, 7, 7, 7, 7, 7, 0, 0, 0, 0]])
    valid = torch.tensor([[True] * 9 + [False], [True] * 6 + [False] * 4])
    mask = repeated_ngram_mask(tokens, valid, n=4)
    assert mask[0].tolist() == [False] * 4 + [True] * 4 + [False, False]  # (1,2,3,4) again; 5 is new
    assert mask[1].tolist() == [False, True, True, True, True, True, False, False, False, False]  # 7-runs overlap
    # Tokens past the valid length never count, even if they would repeat.
    assert not repeated_ngram_mask(tokens, torch.zeros_like(valid), n=4).any()


def test_unlikelihood_loss_is_the_papers_formula_and_lowers_the_penalized_probability():
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]]], requires_grad=True)
    targets = torch.tensor([[0, 2]])
    penalize = torch.tensor([[True, False]])
    loss = unlikelihood_loss(logits, targets, penalize, normalizer=2)
    p = torch.softmax(torch.tensor([2.0, 0.0, -1.0]), -1)[0]
    assert loss.item() == pytest.approx(-math.log(1 - p.item()) / 2)  # only the penalized token counts
    loss.backward()
    stepped = logits.detach() - 1.0 * logits.grad
    assert torch.softmax(stepped[0, 0], -1)[0] < p  # gradient descent pushes p(x_t) down
    assert torch.equal(logits.grad[0, 1], torch.zeros(3))  # unpenalized positions get no gradient


def test_greedy_continuations_stop_counting_after_eos(tiny_target):
    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    prefixes = torch.randint(5, 320, (3, 6), generator=torch.Generator().manual_seed(0))
    eos = tokenizer.eos_token_id
    cont, valid = greedy_continuations(model, prefixes, 5, eos, tokenizer.pad_token_id)
    assert cont.shape == valid.shape == (3, 5)
    for row in range(3):
        ids = cont[row].tolist()
        n_valid = ids.index(eos) + 1 if eos in ids else 5
        assert valid[row].tolist() == [True] * n_valid + [False] * (5 - n_valid)


def test_sample_windows_take_file_starts_chat_prompts_and_any_position_in_turn():
    rows = torch.arange(100, 140).view(2, 20)
    rows[1, 12] = 99  # an "<|assistant|>" token
    file_starts = torch.tensor([[7, 7, 7, 7, 7, 7, 7, 8, 8]])  # one plain file's first tokens
    windows = sample_windows(rows, file_starts, 6, 5, 8, assistant_id=99, rng=random.Random(0))
    assert windows.shape == (6, 8)
    assert windows[0].tolist() == [7] * 7 + [8] == windows[3].tolist()  # a file start, cut to the window
    assert windows[1].tolist() == rows[1, 8:16].tolist() == windows[4].tolist()  # prompt ends on <|assistant|>
    assert windows[1, 4] == 99
    for window in windows[2::3]:  # anywhere: a contiguous slice of one row
        assert any(window.tolist() == row[i : i + 8].tolist() for row in rows for i in range(13))
    # No file starts long enough, and no chat marker with room for an answer: all from anywhere.
    anywhere = sample_windows(rows[:, :15], file_starts[:, :7], 3, 5, 8, assistant_id=99, rng=random.Random(0))
    assert anywhere.shape == (3, 8) and all(7 not in w.tolist() for w in anywhere)


def test_unlikelihood_file_starts_are_the_plain_files_not_chats(tiny_target, small_stdlib):
    """A third of the UL prompts are plain file starts; chats must not pass as files."""
    assert plain_file_starts([[5, 1, 2, 3], [9, 4, 4, 4, 4], [6, 6]], user_id=5, length=3).tolist() == [[9, 4, 4]]
    assert plain_file_starts([[5, 1, 2, 3]], user_id=5, length=3).shape == (0, 3)
    # On real training samples: one start per plain file, each the file's own first tokens.
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    files = list_source_files(small_stdlib)
    texts = training_texts(files, chat_fraction=0.5, rng=random.Random(0))
    plain = [t for t in texts if not t.startswith("<|user|>")]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    starts = plain_file_starts(ids, tokenizer.convert_tokens_to_ids("<|user|>"), 8)
    assert 0 < len(starts) == sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) >= 8 for t in plain)
    assert all(any(t.startswith(tokenizer.decode(row)) for t in plain) for row in starts)


def test_garbled_measure_sees_bytes_that_are_not_text(tiny_target):
    """loop_report's "garbled" is U+FFFD in the decoded greedy text: the mark a byte-level model
    leaves when it emits part of a character, as a build that escaped loops through junk did."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    euro = tokenizer("\u20ac", add_special_tokens=False)["input_ids"]
    assert "\ufffd" not in tokenizer.decode(tokenizer("price = '\u20ac'", add_special_tokens=False)["input_ids"])
    assert len(euro) > 1 and "\ufffd" in tokenizer.decode(euro[:1])
    loops = json.loads((tiny_target / "build_record.json").read_text())["loops"]
    assert all(loops[kind]["garbled_real"] == 0.0 and "garbled_greedy" in loops[kind] for kind in LOOP_KINDS)


def test_unlikelihood_build_records_both_phases_and_init_from_replays_it(tiny_target, small_stdlib, tmp_path):
    full = build_toy_target(tmp_path / "full", steps=3, seed=0, recipe=TINY_UL, stdlib_dir=small_stdlib)
    record = json.loads((full / "build_record.json").read_text())
    assert record["unlikelihood_steps"] == 4 and record["steps"] == 3
    assert record["pretrained"]["heldout_loss"] == pytest.approx(
        json.loads((tiny_target / "build_record.json").read_text())["heldout_loss"])  # measured before UL
    assert "after unlikelihood fine-tuning" in (full / "BUILD.md").read_text()

    # Starting from the saved 3-step build gives the very same weights as one command.
    again = build_toy_target(tmp_path / "again", steps=3, seed=0, recipe=TINY_UL, stdlib_dir=small_stdlib,
                             init_from=tiny_target)
    assert (again / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    assert json.loads((again / "build_record.json").read_text())["init_from"]["path"] == str(tiny_target)
    assert (again / "pretraining_log.txt").read_text() == (tiny_target / "build_log.txt").read_text()

    with pytest.raises(SpecdraftError, match="different pretraining.*--steps 3"):
        build_toy_target(tmp_path / "wrong", steps=4, seed=0, recipe=TINY_UL, stdlib_dir=small_stdlib,
                         init_from=tiny_target)
    with pytest.raises(SpecdraftError, match="already fine-tuned"):
        build_toy_target(tmp_path / "wrong", steps=3, seed=0, recipe=TINY_UL, stdlib_dir=small_stdlib, init_from=full)
    with pytest.raises(SpecdraftError, match="lr"):
        build_toy_target(tmp_path / "wrong", steps=3, seed=0, recipe=dataclasses.replace(TINY_UL, lr=1e-3),
                         stdlib_dir=small_stdlib, init_from=tiny_target)


def test_the_build_tools_stay_out_of_the_products_import_graph():
    """The product needs the shipped folder and its prompt source, never the builder or the unlikelihood
    trainer: only the `toy-target` command names `specdraft.toy_build` (and imports it when it runs)."""
    package = pathlib.Path(__file__).resolve().parents[1] / "specdraft"
    naming = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                    if re.search(r"specdraft\.toy_build|from \.+toy_build", path.read_text())
                    and path.parent.name != "toy_build")
    assert naming == ["cli.py"]
    code = ("import sys, specdraft.train, specdraft.quickstart, specdraft.export, specdraft.evaluation.run, "
            "specdraft.cli, specdraft.data.regenerate\n"
            "from specdraft.target import resolve_target_path\n"
            "from specdraft.toy_target import toy_prompts\n"
            "resolve_target_path('toy'); toy_prompts('train', 4)\n"
            "print(sorted(m for m in sys.modules if m.startswith('specdraft.toy_build')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


ODD_SOURCE = (
    "class Café:\r\n"
    "    \"\"\"ünïcode before the offsets, which count bytes\"\"\"\r\n"
    "    def m(self): return 'é'\r\n"
    "class T:\n"
    "\f\tdef tabbed(self,\r"
    "\t          x):\r"
    "\t\treturn x\n"
    "\n"
    "async def f(a,\n"
    "            b):  # ends without a newline\n"
    "    return {'ß': a}"
)


@pytest.mark.parametrize("name, text", [("odd", ODD_SOURCE), ("tokenize.py", None), ("dataclasses.py", None)])
def test_a_definitions_source_is_what_the_stdlib_cuts_from_the_file(name, text):
    """definition_prompts cuts each definition from lines split once per file (the stdlib's
    ``ast.get_source_segment`` splits the file again per node: minutes over the stdlib). The same text for every
    definition, on a source with \\r\\n, \\r and \\n endings, a form feed, tabs, multi-byte characters before the
    byte offsets and no final newline, and on two stdlib files."""
    if text is None:
        text = (STDLIB / name).read_text(encoding="utf-8")
    lines = SOURCE_LINE.findall(text)
    assert "".join(lines) == text
    nodes = [node for node in ast.walk(ast.parse(text))
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    assert len(nodes) >= 4
    for node in nodes:
        assert source_segment(lines, node) == ast.get_source_segment(text, node, padded=True), node.name
