"""Prompt suites, ``evaluate`` end to end, and the ``specdraft eval`` command on tiny models."""

import argparse
import json

import pytest
from tiny import save_tiny_target, tiny_llama, tiny_tokenizer

from specdraft.decoding.sampling import SamplingParams
from specdraft.decoding.sources import DraftLMSource, PromptLookupSource
from specdraft.decoding.speculative import TreeDrafting
from specdraft.errors import SpecdraftError
from specdraft.evaluation import run as eval_run
from specdraft.evaluation.suites import Prompt, load_suite, prompt_token_ids
from specdraft.target import FrozenTarget

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a short poem about the sea.", "Now make it shorter."]},
    {"question_id": 82, "category": "qa", "turns": ["What is the capital of France?"]},
    {"question_id": 83, "category": "qa", "turns": ["How many legs does a spider have?"]},
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# -- suites -----------------------------------------------------------------------------------


def test_question_file(tmp_path):
    prompts = load_suite(write_jsonl(tmp_path / "bench.jsonl", QUESTIONS))
    assert [(p.id, p.category, p.kind, p.suite) for p in prompts] == [
        ("81", "writing", "question", "bench"), ("82", "qa", "question", "bench"), ("83", "qa", "question", "bench"),
    ]  # fmt: skip
    assert prompts[0].turns == QUESTIONS[0]["turns"]


def test_prompt_and_text_records_and_code_folder(tmp_path):
    records = [{"prompt": "Tell me a story."}, {"text": "def f(x):", "category": "py"}]
    path = write_jsonl(tmp_path / "mixed.jsonl", records)
    prompt, text = load_suite(path)
    assert (prompt.kind, prompt.category, prompt.turns) == ("prompt", "prompt", ["Tell me a story."])
    assert (text.kind, text.category) == ("text", "py")
    (tmp_path / "code" / "pkg").mkdir(parents=True)
    (tmp_path / "code" / "a.py").write_text("import os\n")
    (tmp_path / "code" / "pkg" / "b.py").write_text("x = 1\n")
    (tmp_path / "code" / "empty.py").write_text("\n")
    (tmp_path / "code" / "notes.txt").write_text("not code")
    code = load_suite(tmp_path / "code")
    assert [(p.id, p.kind, p.category, p.suite) for p in code] == [("a.py", "text", "code", "code"),
                                                                  ("pkg/b.py", "text", "code", "code")]  # fmt: skip


def test_num_prompts_spreads_over_the_file(tmp_path):
    records = [{"question_id": i, "category": f"c{i // 10}", "turns": ["q"]} for i in range(40)]
    prompts = load_suite(write_jsonl(tmp_path / "q.jsonl", records), num_prompts=4)
    assert [p.category for p in prompts] == ["c0", "c1", "c2", "c3"]


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "is empty"),
        ("\n\n", "is empty"),
        ('{"question_id": 1, "turns": ["hi"]}\n', "lacks \\['category'\\]"),
        ('{"question_id": 1, "category": "x", "turns": "hi"}\n', "non-empty list"),
        ('{"question_id": 1, "category": "x", "turns": []}\n', "non-empty list"),
        ('{"question": "hi"}\n', "expected a question"),
        ('{"prompt": ""}\n', "non-empty string"),
        ("[1, 2]\n", "not a JSON object"),
        ('{"prompt": "a"\n', "not valid JSON"),
    ],
)
def test_bad_suite_files(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(SpecdraftError, match=message):
        load_suite(path)


def test_missing_suite_and_empty_folder(tmp_path):
    with pytest.raises(SpecdraftError, match="does not exist"):
        load_suite(tmp_path / "nope.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecdraftError, match="is empty"):
        load_suite(tmp_path / "empty")


def test_prompt_token_ids_multi_turn_and_prefixes():
    tok = tiny_tokenizer()
    question = Prompt("1", "s", "writing", "question", ["Write a poem.", "Shorter."])
    first = prompt_token_ids(tok, question)
    second = prompt_token_ids(tok, question, answers=["The sea is wide."])
    assert tok.decode(first) == "<|bos|><|user|>\nWrite a poem.<|end|>\n<|assistant|>\n"
    assert tok.decode(second) == (
        "<|bos|><|user|>\nWrite a poem.<|end|>\n<|assistant|>\nThe sea is wide.<|eos|>"
        "<|user|>\nShorter.<|end|>\n<|assistant|>\n"
    )
    text = Prompt("t", "s", "text", "text", ["The quick brown fox jumps over the lazy dog. " * 20])
    assert prompt_token_ids(tok, text, prefix_tokens=10) == tok(text.turns[0])["input_ids"][:10]
    # A `prompt` record is a chat turn when there is a template, raw text otherwise.
    plain = Prompt("p", "s", "prompt", "prompt", ["Hello!"])
    assert prompt_token_ids(tok, plain)[0] == tok.bos_token_id
    no_template = tiny_tokenizer(chat_template=None)
    assert prompt_token_ids(no_template, plain) == no_template("Hello!")["input_ids"]
    with pytest.raises(SpecdraftError, match="no chat template"):
        prompt_token_ids(no_template, question)


# -- evaluate ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target():
    tok = tiny_tokenizer()
    return FrozenTarget(tiny_llama(len(tok), seed=0), tokenizer=tok)


def test_evaluate_compares_methods_on_the_same_prompts(tmp_path, tiny_target):
    suite = write_jsonl(tmp_path / "bench.jsonl", QUESTIONS)
    code = tmp_path / "held_out"
    code.mkdir()
    (code / "mod.py").write_text("import os\nimport sys\n\n\ndef main():\n    return os.getcwd()\n" * 5)
    draft = tiny_llama(len(tiny_target.tokenizer), seed=0)  # the target's own weights: everything accepted
    result = eval_run.evaluate(
        tiny_target, {"same": DraftLMSource(draft), "lookup": PromptLookupSource}, [suite, code],
        eval_run.EvalSettings(k=3, max_new_tokens=12, show_progress=False), tmp_path / "out",
    )  # fmt: skip
    methods = result["methods"]
    assert list(methods) == ["plain", "same", "lookup"]
    assert result["config"]["suites"] == ["bench", "held_out"]
    # Greedy is lossless: every method emits exactly plain decoding's tokens.
    assert result["greedy_identical"] == {"same": 1.0, "lookup": 1.0}
    for name, groups in methods.items():
        assert groups["overall"]["num_decodes"] == 5  # 4 question turns + 1 code prefix
        assert set(groups["by_suite"]) == {"bench", "held_out"}
        assert set(groups["by_category"]) == {"writing", "qa", "code"}
        assert groups["by_category"]["writing"]["num_decodes"] == 2  # both turns answered
    same = methods["same"]["overall"]
    assert same["alpha_measured"] == 1.0 and same["alpha_predicted"] == 1.0
    assert same["position_acceptance"] == [1.0, 1.0, 1.0]
    assert same["acceptance_length"] == 4.0  # K + 1 tokens per target forward
    # Speedup is each method's tokens/s over plain decoding's on the same prompts, in every group.
    for name, groups in methods.items():
        for group, summary in [("overall", groups["overall"]), *groups["by_category"].items()]:
            plain = methods["plain"]["by_category"][group] if group != "overall" else methods["plain"]["overall"]
            assert summary["tokens_per_second"] == pytest.approx(summary["num_tokens"] / summary["seconds"])
            assert summary["speedup"] == pytest.approx(summary["tokens_per_second"] / plain["tokens_per_second"])
    for key in ("json", "markdown", "acceptance_plot", "speedup_heatmap"):
        assert (tmp_path / "out").joinpath(result["files"][key].split("/")[-1]).is_file()
    saved = json.loads((tmp_path / "out" / "result.json").read_text())
    assert saved["methods"]["same"]["overall"]["acceptance_length"] == 4.0


def test_evaluate_sampling_and_lossy_flags(tmp_path, tiny_target):
    suite = write_jsonl(tmp_path / "q.jsonl", QUESTIONS[1:])
    result = eval_run.evaluate(
        tiny_target, {"lookup": PromptLookupSource()}, suite,
        eval_run.EvalSettings(SamplingParams(temperature=1.0, top_p=0.9), k=2, max_new_tokens=6, lenience=0.5,
                              show_progress=False),
    )  # fmt: skip
    assert result["config"]["lossy"] is True and "greedy_identical" not in result
    assert result["methods"]["lookup"]["overall"]["num_tokens"] <= 12


def test_evaluate_bad_input(tmp_path, tiny_target):
    suite = write_jsonl(tmp_path / "q.jsonl", QUESTIONS[1:])
    with pytest.raises(SpecdraftError, match="k \\(drafts per step\\)"):
        eval_run.evaluate(tiny_target, {"lookup": PromptLookupSource()}, suite,
                          eval_run.EvalSettings(k=0, show_progress=False))
    with pytest.raises(SpecdraftError, match="baseline"):
        eval_run.evaluate(tiny_target, {"plain": PromptLookupSource()}, suite,
                          eval_run.EvalSettings(show_progress=False))
    long_prompt = write_jsonl(tmp_path / "long.jsonl", [{"text": "the cat " * 600}])
    with pytest.raises(SpecdraftError, match="max_position_embeddings"):
        eval_run.evaluate(tiny_target, {}, long_prompt,
                          eval_run.EvalSettings(prefix_tokens=2000, show_progress=False))
    small_vocab_draft = DraftLMSource(tiny_llama(len(tiny_target.tokenizer) - 10))
    with pytest.raises(SpecdraftError, match="vocab"):
        eval_run.evaluate(tiny_target, {"draft": small_vocab_draft}, suite,
                          eval_run.EvalSettings(show_progress=False))


def test_evaluate_hands_its_verify_backend_to_the_decoders(tmp_path, tiny_target, monkeypatch):
    suite = write_jsonl(tmp_path / "q.jsonl", QUESTIONS[1:3])
    with pytest.raises(SpecdraftError, match="must be one of auto, triton, reference; got 'gpu'"):
        eval_run.evaluate(tiny_target, {}, suite, eval_run.EvalSettings(verify_backend="gpu", show_progress=False))
    seen = []
    real = eval_run.speculative_decode_batch  # the one decoder: one prompt is a batch of one
    monkeypatch.setattr(eval_run, "speculative_decode_batch",
                        lambda *a, **k: seen.append(k["verify_backend"]) or real(*a, **k))  # fmt: skip
    for batch_size in (1, 2):
        result = eval_run.evaluate(tiny_target, {"lookup": PromptLookupSource()}, suite,
                                   eval_run.EvalSettings(SamplingParams(temperature=1.0), k=2, max_new_tokens=4,
                                                         batch_size=batch_size, verify_backend="reference",
                                                         show_progress=False))  # fmt: skip
        assert result["config"]["verify_backend"] == "reference"
    assert len(seen) >= 2 and set(seen) == {"reference"}


# -- CLI --------------------------------------------------------------------------------------


def cli_args(argv):
    parser = argparse.ArgumentParser()
    eval_run.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_end_to_end(tmp_path, capsys):
    target_dir = save_tiny_target(tmp_path / "target")
    suite = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    args = cli_args([
        "--target", str(target_dir), "--draft-model", str(target_dir), "--prompt-lookup", "--prompts", str(suite),
        "--num-prompts", "2", "-k", "3", "--max-new-tokens", "8", "--dtype", "float32", "--out", str(tmp_path / "out"),
        "--no-progress", "--compile-draft",  # the draft LM's steps compiled (eager draft LMs: test_distillspec)
        "--compile-target",  # and the target's steps, plain and verify (eager ones: every other eval test)
    ])  # fmt: skip
    assert eval_run.run(args) == 0
    printed = capsys.readouterr().out
    assert "plain" in printed and "prompt-lookup" in printed and "target" in printed
    assert "identical to plain decoding: target 100%, prompt-lookup 100%" in printed
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["config"]["num_prompts"] == 2 and result["config"]["compile_target"] is True
    assert (tmp_path / "out" / "speedup_heatmap.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_bad_input(tmp_path):
    target_dir = save_tiny_target(tmp_path / "target")
    other_dir = tmp_path / "other"
    tiny_tokenizer(280).save_pretrained(other_dir)
    tiny_llama(len(tiny_tokenizer(280))).save_pretrained(other_dir)
    suite = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    base = ["--target", str(target_dir), "--dtype", "float32", "--no-progress", "--max-new-tokens", "4"]
    cases = [
        (["--prompts", str(suite), "--temperature", "-1"], "temperature"),
        (["--prompts", str(suite), "-k", "0"], "-k must be"),
        (["--prompts", str(empty), "--prompt-lookup"], "is empty"),
        (["--prompts", str(suite), "--draft-model", str(other_dir)], "--map-draft-vocab"),
        (["--prompts", str(suite), "--drafter", str(tmp_path)], "is not a drafter .*Give a run folder"),
        (["--prompts", str(suite), "--prompt-lookup", "--batch-size", "2", "--compile-target"], "batches run eager"),
    ]
    for extra, message in cases:
        with pytest.raises(SpecdraftError, match=message):
            eval_run.run(cli_args(base + extra))
    # With the mapping allowed, a draft with a different tokenizer works (and stays lossless).
    args = cli_args(base + ["--prompts", str(suite), "--num-prompts", "1", "--draft-model", str(other_dir),
                            "--map-draft-vocab"])  # fmt: skip
    assert eval_run.run(args) == 0


def test_cli_verify_backend_reaches_evaluate(tmp_path, monkeypatch):
    with pytest.raises(SystemExit):  # argparse lists the choices
        cli_args(["--target", "toy", "--prompts", "q.jsonl", "--verify-backend", "gpu"])
    target_dir = save_tiny_target(tmp_path / "target")
    suite = write_jsonl(tmp_path / "q.jsonl", QUESTIONS[1:2])
    seen = {}
    real = eval_run.evaluate
    monkeypatch.setattr(eval_run, "evaluate", lambda *a, **k: seen.update(settings=a[3]) or real(*a, **k))
    assert eval_run.run(cli_args(["--target", str(target_dir), "--prompts", str(suite), "--dtype", "float32",
                                  "--max-new-tokens", "4", "--no-progress", "--verify-backend", "reference"])) == 0
    assert seen["settings"].verify_backend == "reference" and seen["settings"].max_new_tokens == 4


def test_cli_command_is_wired():
    from specdraft.cli import COMMANDS

    assert COMMANDS["eval"][0] == "specdraft.evaluation.run"


def test_evaluate_in_batches_matches_one_at_a_time(tmp_path, tiny_target):
    """--batch-size 3: prompts decoded together, turn by turn (two of the four questions have a second turn);
    every method still emits plain decoding's tokens, and throughput counts each batch's wall clock once."""
    suite = write_jsonl(tmp_path / "bench.jsonl", QUESTIONS)
    draft = tiny_llama(len(tiny_target.tokenizer), seed=0)
    one = eval_run.evaluate(tiny_target, {"same": DraftLMSource(draft), "lookup": PromptLookupSource}, suite,
                            eval_run.EvalSettings(k=3, max_new_tokens=10, show_progress=False))  # fmt: skip
    batched = eval_run.evaluate(tiny_target, {"same": DraftLMSource(draft), "lookup": PromptLookupSource}, suite,
                                eval_run.EvalSettings(k=3, max_new_tokens=10, batch_size=3,
                                                      show_progress=False))  # fmt: skip
    assert batched["config"]["batch_size"] == 3 and batched["greedy_identical"] == {"same": 1.0, "lookup": 1.0}
    for name in ("plain", "same", "lookup"):
        a, b = one["methods"][name]["overall"], batched["methods"][name]["overall"]
        assert a["num_tokens"] == b["num_tokens"] and a["acceptance_length"] == b["acceptance_length"]
        assert b["total_tokens_per_second"] > b["tokens_per_second"]  # rows share each batch's clock
        assert a["total_tokens_per_second"] == pytest.approx(a["tokens_per_second"])
    # One decoder: batches take the lossy modes too (greedy, they keep exactly the greedy tokens).
    lossy = eval_run.evaluate(tiny_target, {"same": DraftLMSource(draft)}, suite,
                              eval_run.EvalSettings(k=3, max_new_tokens=10, lenience=0.5, typical_acceptance=True,
                                                    batch_size=3, show_progress=False))  # fmt: skip
    a, b = one["methods"]["same"]["overall"], lossy["methods"]["same"]["overall"]
    assert lossy["config"]["lossy"] and (a["num_tokens"], a["acceptance_length"]) == (b["num_tokens"],
                                                                                      b["acceptance_length"])
    with pytest.raises(SpecdraftError, match="batch_size must be >= 1"):
        eval_run.evaluate(tiny_target, {}, suite, eval_run.EvalSettings(batch_size=0, show_progress=False))


def test_a_runs_drafter_goes_by_the_runs_name(tmp_path):
    """Two runs' drafters (``runs/eagle3/drafter``, ``runs/medusa1/drafter``) are told apart in tables by their
    runs, not called "drafter" and "drafter-2"; any other folder by its own name."""
    assert eval_run.drafter_name("runs/eagle3/drafter") == "eagle3"
    assert eval_run.drafter_name(tmp_path / "runs" / "medusa1" / "drafter" / "") == "medusa1"
    assert eval_run.drafter_name(tmp_path / "exports" / "eagle3-vllm") == "eagle3-vllm"
    assert eval_run.drafter_name("export/hf", "eagle3") == "eagle3 (hf)"  # the family first, the folder beside
    assert eval_run.drafter_name("runs/eagle3/drafter", "eagle3") == "eagle3"


def test_cli_tree_methods(tmp_path, capsys, monkeypatch):
    """--tree adds a tree method for each drafter that can draft it, and says which cannot."""
    from specdraft.drafters import get_family

    target_dir = save_tiny_target(tmp_path / "target")
    target = FrozenTarget.from_pretrained(target_dir, dtype="float32")
    fam = get_family("medusa1")
    fam.build(target, fam.config_cls(num_heads=3)).save_pretrained(tmp_path / "heads")
    suite = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    args = cli_args(["--target", str(target_dir), "--drafter", str(tmp_path / "heads"), "--tree", "medusa-8",
                     "--tree", "eagle2-small", "--prompts", str(suite), "--num-prompts", "1", "--max-new-tokens", "8",
                     "--dtype", "float32", "--no-progress", "--out", str(tmp_path / "out")])  # fmt: skip
    assert eval_run.run(args) == 0
    printed = capsys.readouterr().out
    assert "medusa1 (heads) cannot draft a dynamic tree (eagle2-small)" in printed  # its family, its folder beside
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert list(result["methods"]) == ["plain", "medusa1 (heads)", "medusa1 (heads) tree:medusa-8"]
    assert result["greedy_identical"] == {"medusa1 (heads)": 1.0, "medusa1 (heads) tree:medusa-8": 1.0}
    # Trees in batches: two prompts decoded together, each tree as deep as the tree (medusa-8: 3), not -k.
    depths, batched = [], eval_run.speculative_decode_batch
    monkeypatch.setattr(eval_run, "speculative_decode_batch", lambda target, sources, prompts, k, **kw:
                        depths.append((sources is not None and isinstance(sources[0], TreeDrafting), k))
                        or batched(target, sources, prompts, k=k, **kw))  # fmt: skip
    args = cli_args(["--target", str(target_dir), "--drafter", str(tmp_path / "heads"), "--tree", "medusa-8",
                     "--prompts", str(suite), "--num-prompts", "2", "--batch-size", "2", "-k", "1", "--max-new-tokens",
                     "8", "--dtype", "float32", "--no-progress", "--out", str(tmp_path / "batch")])  # fmt: skip
    assert eval_run.run(args) == 0
    result = json.loads((tmp_path / "batch" / "result.json").read_text())
    assert result["config"]["batch_size"] == 2 and set(depths) == {(False, 1), (True, 3)}
    assert result["greedy_identical"] == {"medusa1 (heads)": 1.0, "medusa1 (heads) tree:medusa-8": 1.0}


def test_eval_reads_every_folder_export_reads_or_writes(tmp_path):
    """A run (its final drafter), a drafter folder, and an export: eval loads what export accepts and writes."""
    import yaml

    from specdraft.drafters import get_family
    from specdraft.export import export

    target_dir = save_tiny_target(tmp_path / "target")
    target = FrozenTarget.from_pretrained(target_dir, dtype="float32")
    fam = get_family("medusa1")
    fam.build(target, fam.config_cls(num_heads=2)).save_pretrained(tmp_path / "run" / "drafter")
    (tmp_path / "run" / "recipe.yaml").write_text(yaml.safe_dump({"target": {"path": str(target_dir)}}))
    export(tmp_path / "run", "vllm", tmp_path / "vllm")
    suite = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    args = cli_args(["--target", str(target_dir), "--drafter", str(tmp_path / "run"), "--drafter",
                     str(tmp_path / "vllm"), "--drafter", str(tmp_path / "run" / "drafter"), "--prompts", str(suite),
                     "--num-prompts", "1", "-k", "2", "--max-new-tokens", "6", "--dtype", "float32", "--no-progress",
                     "--out", str(tmp_path / "out")])  # fmt: skip
    assert eval_run.run(args) == 0
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    names = ["medusa1 (run)", "medusa1 (vllm)", "medusa1 (run)-2"]  # each by its family, its folder beside
    assert list(result["methods"]) == ["plain", *names]
    assert result["greedy_identical"] == dict.fromkeys(names, 1.0)
    tau = {m: result["methods"][m]["overall"]["acceptance_length"] for m in names}
    assert len(set(tau.values())) == 1, tau  # the same heads, however they were read


def test_several_temperatures_in_one_run_each_with_its_heading_and_report(tmp_path, capsys):
    target_dir = save_tiny_target(tmp_path / "target")
    suite = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    args = cli_args(["--target", str(target_dir), "--prompt-lookup", "--prompts", str(suite), "--num-prompts", "1",
                     "--max-new-tokens", "6", "--dtype", "float32", "--no-progress", "--temperature", "0", "1",
                     "--out", str(tmp_path / "out")])  # fmt: skip
    assert eval_run.run(args) == 0
    printed = capsys.readouterr().out
    headings = [line for line in printed.splitlines() if line.startswith("== temperature")]
    assert [h.split(",")[0] for h in headings] == ["== temperature 0 (greedy)", "== temperature 1 (sampled)"]
    assert printed.count("tau = tokens per target forward") == 1  # the legend once, under the last table
    for t in ("0", "1"):
        result = json.loads((tmp_path / "out" / f"temperature-{t}" / "result.json").read_text())
        assert result["config"]["temperature"] == float(t) and list(result["methods"]) == ["plain", "prompt-lookup"]
    assert "greedy_identical" in json.loads((tmp_path / "out" / "temperature-0" / "result.json").read_text())


def test_eval_wandb_without_wandb_names_the_extra_before_loading(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    suite = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    with pytest.raises(SpecdraftError, match=r"pip install 'specdraft\[wandb\]'"):
        eval_run.run(cli_args(["--target", str(tmp_path / "no-target"), "--prompts", str(suite), "--wandb"]))
