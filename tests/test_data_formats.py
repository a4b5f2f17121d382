import json

import datasets
import pytest

from specdraft.data import formats
from specdraft.data.formats import detect_format, from_messages, load_raw, normalize, resolve_format, to_messages
from specdraft.errors import SpecdraftError

SHAREGPT = {
    "id": "a1",
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello!"},
        {"from": "human", "value": "Bye"},
        {"from": "gpt", "value": "Goodbye."},
    ],
}
MESSAGES = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": [{"type": "text", "text": "4"}]}]}
TURNS = {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    "columns, expected",
    [
        (["id", "conversations"], "sharegpt"),
        (["messages", "source"], "messages"),
        (["question_id", "category", "turns"], "turns"),
        (["text"], "text"),
    ],
)
def test_detect_format(columns, expected):
    assert detect_format(columns) == expected


def test_detect_format_plain_text_in_another_column():
    assert detect_format(["body"], text_field="body") == "text"


def test_columns_that_fit_no_format_name_the_fix():
    with pytest.raises(SpecdraftError, match="data.text_field"):
        detect_format(["prompt", "completion"])


def test_unknown_format_and_missing_column():
    with pytest.raises(SpecdraftError, match="unknown data.format 'alpaca'"):
        resolve_format("alpaca", ["text"])
    with pytest.raises(SpecdraftError, match="needs a 'conversations' column"):
        resolve_format("sharegpt", ["messages"])


def test_sharegpt_roles_are_mapped():
    assert to_messages(SHAREGPT, "sharegpt") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye."},
    ]


def test_messages_content_parts_are_joined():
    assert to_messages(MESSAGES, "messages") == [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]


def test_turns_are_user_messages():
    assert to_messages(TURNS, "turns") == [
        {"role": "user", "content": "Write a poem."},
        {"role": "user", "content": "Shorter."},
    ]


def test_unknown_speaker_is_an_error():
    with pytest.raises(SpecdraftError, match="unknown speaker 'narrator'"):
        to_messages({"conversations": [{"from": "narrator", "value": "..."}]}, "sharegpt")


def test_from_messages_keeps_the_format_and_other_fields():
    new = [dict(m, content=m["content"].upper()) for m in to_messages(SHAREGPT, "sharegpt")]
    out = from_messages(SHAREGPT, "sharegpt", new)
    assert out["id"] == "a1"
    assert out["conversations"][2] == {"from": "gpt", "value": "HELLO!"}
    assert [t["from"] for t in out["conversations"]] == ["system", "human", "gpt", "human", "gpt"]

    answered = to_messages(TURNS, "turns")
    answered = [answered[0], {"role": "assistant", "content": "A poem."}, answered[1], {"role": "assistant", "content": "Poem."}]
    out = from_messages(TURNS, "turns", answered)
    assert out == {"question_id": 81, "category": "writing", "messages": answered}


def test_load_jsonl_json_and_parquet(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [SHAREGPT, SHAREGPT])
    (tmp_path / "b.json").write_text(json.dumps([TURNS]))
    datasets.Dataset.from_list([{"text": "hello"}, {"text": "world"}, {"text": "!"}]).to_parquet(str(tmp_path / "c.parquet"))
    assert len(load_raw(str(tmp_path / "a.jsonl"))) == 2
    assert load_raw(str(tmp_path / "b.json"))[0]["turns"] == TURNS["turns"]
    assert load_raw(str(tmp_path / "c.parquet"))["text"] == ["hello", "world", "!"]


def test_load_folder_picks_the_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"text": "a"}, {"text": "b"}])
    write_jsonl(tmp_path / "test.jsonl", [{"text": "c"}])
    assert list(load_raw(str(tmp_path), split="train")["text"]) == ["a", "b"]
    assert list(load_raw(str(tmp_path), split="test")["text"]) == ["c"]
    with pytest.raises(SpecdraftError, match="data.split"):
        load_raw(str(tmp_path), split="validation")


def test_missing_file(tmp_path):
    with pytest.raises(SpecdraftError, match="does not exist. Fix data.path"):
        load_raw(str(tmp_path / "nope.jsonl"))


def test_empty_file(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(SpecdraftError, match="is empty. Point data.path at a file with records"):
        load_raw(str(tmp_path / "empty.jsonl"))
    datasets.Dataset.from_list([{"text": "x"}]).select([]).to_parquet(str(tmp_path / "empty.parquet"))
    with pytest.raises(SpecdraftError, match="is empty"):
        load_raw(str(tmp_path / "empty.parquet"))


def test_unsupported_suffix(tmp_path):
    (tmp_path / "data.csv").write_text("text\nhello\n")
    with pytest.raises(SpecdraftError, match="must be .json / .jsonl / .parquet"):
        load_raw(str(tmp_path / "data.csv"))


def test_hub_ids_go_to_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(path, split=None, **kwargs):
        calls.append((path, split, kwargs))
        return datasets.Dataset.from_list([{"text": "from the hub"}])

    monkeypatch.setattr(formats.datasets, "load_dataset", fake_load_dataset)
    assert load_raw("someorg/somedata", split="train_sft")["text"] == ["from the hub"]
    assert calls == [("someorg/somedata", "train_sft", {})]


def test_unreachable_hub_id_names_the_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SpecdraftError, match="(?s)could not load data 'someorg/does-not-exist'.*reachable hub dataset id"):
        load_raw("someorg/does-not-exist")


def test_normalize(tmp_path):
    raw = datasets.Dataset.from_list([SHAREGPT, {"id": "b", "conversations": [{"from": "human", "value": "x"}]}])
    out = normalize(raw, "sharegpt")
    assert out.column_names == ["messages"]
    assert out[0]["messages"] == to_messages(SHAREGPT, "sharegpt")
    assert out[1]["messages"] == [{"role": "user", "content": "x"}]

    text = normalize(datasets.Dataset.from_list([{"body": "hi", "n": 1}]), "text", text_field="body")
    assert text.column_names == ["text"] and text[0]["text"] == "hi"


def test_a_line_that_is_not_utf8_or_not_json_is_named_with_its_number(tmp_path):
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(good.encode() + b"\n" + good.replace("hi", "caf\xe9").encode("latin-1") + b"\n")
    with pytest.raises(SpecdraftError, match=r"latin1.jsonl:2 is not UTF-8 text \(byte 0xe9 at column"):
        load_raw(str(latin1))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(good + "\n" + good + "\n" + good[:-3] + "\n")
    with pytest.raises(SpecdraftError, match=r"broken.jsonl:3 is not valid JSON"):
        load_raw(str(broken))
