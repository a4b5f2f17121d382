import argparse
import json

import pytest
import torch
from tiny import save_tiny_target, tiny_llama, tiny_tokenizer

from specdraft import dtypes
from specdraft.data import regenerate as regen
from specdraft.data.chat import render
from specdraft.data.regenerate import generate_batch, read_done, regenerate, sidecar_of
from specdraft.errors import SpecdraftError
from specdraft.evaluation.suites import load_suite

MAX_NEW = 6


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    # float64 so left padding cannot flip a greedy argmax through rounding noise.
    return tiny_llama(len(tokenizer)).double()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def greedy_alone(model, tokenizer, messages):
    """The answer the target gives to this dialogue prefix on its own (batch of one, no padding)."""
    prompt = render(messages, tokenizer, tokenizer.chat_template, add_generation_prompt=True)
    return generate_batch(model, tokenizer, [prompt], temperature=0.0, max_new_tokens=MAX_NEW)[0]


def test_turns_become_messages_answered_turn_by_turn(tmp_path, model, tokenizer):
    questions = [
        {"question_id": 81, "category": "writing", "turns": ["Write a short poem about the sea.", "Shorter."]},
        {"question_id": 82, "category": "math", "turns": ["1 + 1 = ?"]},
        {"question_id": 83, "category": "qa", "turns": ["What is the capital of France?", "And of Spain?", "Thanks"]},
    ]
    out = tmp_path / "answers.jsonl"
    assert regenerate(model, tokenizer, write_jsonl(tmp_path / "q.jsonl", questions), out,
                      max_new_tokens=MAX_NEW, batch_size=3) == 3
    records = read_jsonl(out)
    assert [(r["question_id"], r["category"]) for r in records] == [(81, "writing"), (82, "math"), (83, "qa")]
    assert all("turns" not in r for r in records)
    for question, record in zip(questions, records):
        messages = record["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"] * len(question["turns"])
        assert [m["content"] for m in messages[::2]] == question["turns"]
        # Each answer is what the target says given the *regenerated* earlier answers,
        # and batching (left padding) does not change it.
        for j in range(1, len(messages), 2):
            assert messages[j]["content"] == greedy_alone(model, tokenizer, messages[:j])


def test_sharegpt_stays_sharegpt(tmp_path, model, tokenizer):
    record = {
        "id": "x1",
        "source": "sharegpt",
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hello"},
            {"from": "gpt", "value": "OLD ANSWER"},
            {"from": "human", "value": "Tell me a story about a cat."},
            {"from": "gpt", "value": "OLD ANSWER"},
        ],
    }
    out = tmp_path / "out.jsonl"
    regenerate(model, tokenizer, write_jsonl(tmp_path / "in.jsonl", [record]), out, max_new_tokens=MAX_NEW)
    [new] = read_jsonl(out)
    assert new["id"] == "x1" and new["source"] == "sharegpt"
    assert [t["from"] for t in new["conversations"]] == ["system", "human", "gpt", "human", "gpt"]
    assert [t["value"] for t in new["conversations"]][:2] == ["Be brief.", "Hello"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": new["conversations"][2]["value"]},
        {"role": "user", "content": "Tell me a story about a cat."},
    ]
    assert new["conversations"][2]["value"] == greedy_alone(model, tokenizer, messages[:2])
    assert new["conversations"][4]["value"] == greedy_alone(model, tokenizer, messages)
    assert "OLD ANSWER" not in json.dumps(new)


def test_messages_stay_messages(tmp_path, model, tokenizer):
    record = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "OLD"}]}
    out = tmp_path / "out.jsonl"
    regenerate(model, tokenizer, write_jsonl(tmp_path / "in.jsonl", [record]), out, max_new_tokens=MAX_NEW)
    [new] = read_jsonl(out)
    assert list(new) == ["messages"]
    assert new["messages"][1] == {"role": "assistant", "content": greedy_alone(model, tokenizer, record["messages"][:1])}


@pytest.mark.parametrize("with_ids", [True, False], ids=["keyed-by-id", "keyed-by-index"])
def test_resume_after_a_kill_mid_write(tmp_path, model, tokenizer, with_ids):
    prompts = [{"turns": [f"Question number {i}?"]} for i in range(5)]
    if with_ids:
        prompts = [dict(p, question_id=100 + i) for i, p in enumerate(prompts)]
    data = write_jsonl(tmp_path / "q.jsonl", prompts)
    full = tmp_path / "full.jsonl"
    regenerate(model, tokenizer, data, full, max_new_tokens=MAX_NEW, batch_size=2)
    expected = full.read_text()
    lines = expected.splitlines(keepends=True)
    assert len(lines) == 5

    # Killed while writing the 4th record: 3 whole lines and half of the next (and the sidecar that says
    # regenerate writes this file, as the killed run left it).
    partial = tmp_path / "partial.jsonl"
    partial.write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    sidecar_of(partial).write_text(sidecar_of(full).read_text())
    assert len(read_done(partial)) == 3
    assert partial.read_text() == "".join(lines[:3])  # the partial line was cut off
    assert regenerate(model, tokenizer, data, partial, max_new_tokens=MAX_NEW, batch_size=2) == 2
    assert partial.read_text() == expected
    assert regenerate(model, tokenizer, data, partial, max_new_tokens=MAX_NEW, batch_size=2) == 0  # nothing left
    assert partial.read_text() == expected


def test_a_line_separator_inside_a_record_does_not_split_it(tmp_path):
    """regenerate writes JSON with ensure_ascii=False, so U+2028 (a line boundary to str.splitlines)
    reaches the file raw; one record in the shared training prompts holds one."""
    out = tmp_path / "out.jsonl"
    records = [{"id": 1, "text": "one\u2028two\x85three"}, {"id": 2, "text": "plain"}]
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    assert read_done(out) == records
    suite = tmp_path / "suite.jsonl"
    suite.write_text(json.dumps({"question_id": 1, "category": "c", "turns": ["a\u2028b"]}, ensure_ascii=False) + "\n",
                     encoding="utf-8")
    assert load_suite(suite)[0].turns == ["a\u2028b"]


def test_corrupt_complete_line_refuses_to_resume(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"a": 1}\nnot json\n')
    with pytest.raises(SpecdraftError, match="out.jsonl:2 is corrupt"):
        read_done(out)


def test_sampling_with_temperature_is_seeded(tmp_path, model, tokenizer):
    data = write_jsonl(tmp_path / "q.jsonl", [{"turns": ["Hello"]}, {"turns": ["Tell me a story."]}])
    outputs = []
    for name in ("a", "b"):
        regenerate(model, tokenizer, data, tmp_path / f"{name}.jsonl", temperature=1.0, max_new_tokens=MAX_NEW, seed=3)
        outputs.append((tmp_path / f"{name}.jsonl").read_text())
    assert outputs[0] == outputs[1]
    greedy = tmp_path / "greedy.jsonl"
    regenerate(model, tokenizer, data, greedy, max_new_tokens=MAX_NEW)
    assert greedy.read_text() != outputs[0]


def test_plain_text_is_refused(tmp_path, model, tokenizer):
    with pytest.raises(SpecdraftError, match="plain text; regenerate needs chat data"):
        regenerate(model, tokenizer, write_jsonl(tmp_path / "t.jsonl", [{"text": "hi"}]), tmp_path / "o.jsonl")


def test_cli(tmp_path):
    target = save_tiny_target(tmp_path / "target")
    data = write_jsonl(tmp_path / "q.jsonl", [{"question_id": i, "turns": [f"Hi {i}", "More"]} for i in range(3)])
    parser = argparse.ArgumentParser()
    regen.add_arguments(parser)
    args = parser.parse_args([
        "--target", str(target), "--data", str(data), "--out", str(tmp_path / "out" / "a.jsonl"),
        "--max-new-tokens", "4", "--batch-size", "2", "--max-samples", "2", "--dtype", "float32",
    ])
    assert regen.run(args) == 0
    records = read_jsonl(tmp_path / "out" / "a.jsonl")
    assert [r["question_id"] for r in records] == [0, 1]
    assert all(len(r["messages"]) == 4 for r in records)


def test_cli_bad_target(tmp_path):
    parser = argparse.ArgumentParser()
    regen.add_arguments(parser)
    args = parser.parse_args(["--target", str(tmp_path / "nothing"), "--data", "x.jsonl", "--out", "o.jsonl"])
    with pytest.raises(SpecdraftError, match="could not load the target"):
        regen.run(args)


def test_left_padding_matches_unpadded_generation(model, tokenizer):
    prompts = ["<|bos|><|user|>\nHi<|end|>\n<|assistant|>\n",
               "<|bos|><|user|>\nA much longer question about the sea?<|end|>\n<|assistant|>\n"]
    together = generate_batch(model, tokenizer, prompts, temperature=0.0, max_new_tokens=MAX_NEW)
    alone = [generate_batch(model, tokenizer, [p], temperature=0.0, max_new_tokens=MAX_NEW)[0] for p in prompts]
    assert together == alone
    assert torch.get_default_dtype() == torch.float32  # the float64 model did not leak a global setting


def test_cli_warns_when_the_cpu_would_emulate_the_dtype_asked_for(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(dtypes, "cpu_computes_natively", lambda name: name in ("float32", torch.float32))
    target = save_tiny_target(tmp_path / "target")
    data = write_jsonl(tmp_path / "q.jsonl", [{"question_id": 0, "turns": ["Hi"]}])
    parser = argparse.ArgumentParser()
    regen.add_arguments(parser)
    for dtype, warned in (("bfloat16", True), ("float32", False)):
        caplog.clear()
        args = parser.parse_args(["--target", str(target), "--data", str(data), "--max-new-tokens", "2",
                                  "--out", str(tmp_path / f"{dtype}.jsonl"), "--dtype", dtype])
        assert regen.run(args) == 0
        warnings = [r.getMessage() for r in caplog.records if "no hardware" in r.getMessage()]
        assert len(warnings) == warned, (dtype, warnings)
        if warned:
            assert warnings[0].startswith("--dtype bfloat16: this CPU has no hardware for bfloat16 matmuls")
            assert warnings[0].endswith("Use float32 here: --dtype float32 (or auto)")
