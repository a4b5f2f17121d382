import json
import logging

import pytest
from tiny import CHAT_TEMPLATE, CHAT_TEMPLATE_NO_MARKERS, tiny_tokenizer

from specdraft.config import DataConfig
from specdraft.data.pipeline import build_datasets, vocab_cache_key_parts
from specdraft.errors import SpecdraftError


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def dialogue(i):
    return {
        "id": i,
        "conversations": [
            {"from": "human", "value": f"What is {i} + {i}?"},
            {"from": "gpt", "value": f"{i} + {i} = {2 * i}."},
            {"from": "human", "value": "Thanks"},
            {"from": "gpt", "value": "You are welcome."},
        ],
    }


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def masked_text(tokenizer, sample):
    return tokenizer.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m])


def test_sharegpt_to_tokenized_train_and_eval(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [dialogue(i) for i in range(20)])
    train, eval_ = build_datasets(DataConfig(path=path, eval_fraction=0.1), tokenizer)
    assert (len(train), len(eval_)) == (18, 2)
    assert train.column_names == ["input_ids", "loss_mask"]
    # Every answer of every turn is in the loss, nothing else.
    texts = {masked_text(tokenizer, s) for s in list(train) + list(eval_)}
    assert texts == {f"{i} + {i} = {2 * i}.<|eos|>You are welcome.<|eos|>" for i in range(20)}


def test_split_is_deterministic_by_seed(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [dialogue(i) for i in range(30)])

    def eval_answers(seed):
        _, eval_ = build_datasets(DataConfig(path=path, eval_fraction=0.2, seed=seed), tokenizer)
        return sorted(masked_text(tokenizer, s) for s in eval_)

    assert len(eval_answers(0)) == 6
    assert eval_answers(0) == eval_answers(0)
    assert eval_answers(0) != eval_answers(1)


def test_max_samples_and_no_eval(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [dialogue(i) for i in range(10)])
    train, eval_ = build_datasets(DataConfig(path=path, max_samples=4, eval_fraction=0.0), tokenizer)
    assert (len(train), len(eval_)) == (4, 0)


def test_eval_path_is_the_eval_set_and_path_is_all_train(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [dialogue(i) for i in range(10)])
    eval_path = write_jsonl(tmp_path / "heldout.jsonl", [dialogue(i) for i in range(100, 103)])
    cfg = DataConfig(path=path, eval_path=eval_path, eval_fraction=0.5)  # eval_fraction is then unused
    train, eval_ = build_datasets(cfg, tokenizer)
    assert (len(train), len(eval_)) == (10, 3)
    assert sorted(masked_text(tokenizer, s).split(" + ")[0] for s in eval_) == ["100", "101", "102"]
    # The train split changed (all of path), so a draft vocabulary built on the split must not be reused.
    assert vocab_cache_key_parts(cfg, tokenizer) != vocab_cache_key_parts(DataConfig(path=path, eval_fraction=0.5),
                                                                          tokenizer)


def test_plain_text_is_all_loss(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "text.jsonl", [{"body": "The sea is wide."}, {"body": "The cat sleeps."}])
    train, _ = build_datasets(DataConfig(path=path, text_field="body", eval_fraction=0.0), tokenizer)
    assert [tokenizer.decode(s["input_ids"]) for s in train] == ["The sea is wide.", "The cat sleeps."]
    assert all(set(s["loss_mask"]) == {1} for s in train)


def test_dialogues_without_answers_are_skipped_and_counted(tmp_path, tokenizer, caplog):
    records = [dialogue(i) for i in range(5)] + [{"id": 9, "conversations": [{"from": "human", "value": "Hi"}]}] * 2
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    with caplog.at_level(logging.WARNING, logger="specdraft.data.pipeline"):
        train, _ = build_datasets(DataConfig(path=path, eval_fraction=0.0), tokenizer)
    assert len(train) == 5
    assert f"skipped 2 of 7 samples of {path}: no assistant turn (records 5, 6, counting from 0)" in caplog.text


def test_an_answer_before_any_question_is_skipped_and_its_record_named(tmp_path, tokenizer, caplog):
    """assistant -> user -> assistant: the first answer answers nothing; the record is named, not trained on."""
    answer_first = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "gpt", "value": "Hello!"},
                                      {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yes?"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [dialogue(0), answer_first, dialogue(2)])
    with caplog.at_level(logging.WARNING, logger="specdraft.data.pipeline"):
        train, _ = build_datasets(DataConfig(path=path, eval_fraction=0.0), tokenizer)
    assert len(train) == 2
    assert "skipped 1 of 3 samples" in caplog.text and "an assistant message before any user message" in caplog.text
    assert "(records 1, counting from 0)" in caplog.text


def test_prompt_only_data_points_to_regenerate(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "questions.jsonl", [{"question_id": 1, "turns": ["Write a poem.", "Shorter."]}])
    with pytest.raises(SpecdraftError, match="none of the 1 dialogues .* has an assistant turn.*specdraft regenerate"):
        build_datasets(DataConfig(path=path), tokenizer)


def test_long_samples_are_truncated_with_a_warning(tmp_path, tokenizer, caplog):
    long = dialogue(1)
    long["conversations"][1]["value"] = "The quick brown fox jumps over the lazy dog. " * 20
    path = write_jsonl(tmp_path / "chat.jsonl", [long] + [dialogue(i) for i in range(3)])
    with caplog.at_level(logging.WARNING, logger="specdraft.data.pipeline"):
        train, _ = build_datasets(DataConfig(path=path, max_length=64, eval_fraction=0.0), tokenizer)
    assert max(len(s["input_ids"]) for s in train) == 64
    assert "truncated 1 of 4 samples to data.max_length=64" in caplog.text


def test_every_sample_over_max_length_names_max_length(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [dialogue(i) for i in range(3)])
    with pytest.raises(SpecdraftError, match="longer than data.max_length=8 tokens.*Raise data.max_length"):
        build_datasets(DataConfig(path=path, max_length=8), tokenizer)


def test_tokenizer_without_chat_template(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [dialogue(i) for i in range(3)])
    with pytest.raises(SpecdraftError, match="no chat template.*data.chat_template"):
        build_datasets(DataConfig(path=path), tiny_tokenizer(chat_template=None))
    # The recipe's template fixes it, through the prefix fallback (no generation markers).
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE_NO_MARKERS)
    train, _ = build_datasets(DataConfig(path=path, chat_template=str(template), eval_fraction=0.0), tiny_tokenizer(chat_template=None))
    assert masked_text(tiny_tokenizer(), train[0]) == "0 + 0 = 0.<|eos|>You are welcome.<|eos|>"


def test_template_errors_skip_the_sample(tmp_path, tokenizer, caplog):
    strict = "{% if messages[0]['content'] == 'BAD' %}{{ raise_exception('roles must alternate') }}{% endif %}" + CHAT_TEMPLATE
    bad = {"conversations": [{"from": "human", "value": "BAD"}, {"from": "gpt", "value": "x"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [dialogue(1), bad])
    with caplog.at_level(logging.WARNING, logger="specdraft.data.pipeline"):
        train, _ = build_datasets(DataConfig(path=path, chat_template=strict, eval_fraction=0.0), tokenizer)
    assert len(train) == 1
    assert f"skipped 1 of 2 samples of {path}: chat template failed (records 1, counting from 0)" in caplog.text


def test_vocab_cache_key_follows_data_content(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [dialogue(i) for i in range(3)])
    cfg = DataConfig(path=path)
    before = vocab_cache_key_parts(cfg, tokenizer)
    assert vocab_cache_key_parts(cfg, tokenizer) == before
    write_jsonl(tmp_path / "chat.jsonl", [dialogue(i) for i in range(4)])
    assert vocab_cache_key_parts(cfg, tokenizer) != before
    assert vocab_cache_key_parts(cfg, tiny_tokenizer(vocab_size=290)) != vocab_cache_key_parts(cfg, tokenizer)


def test_vocab_cache_key_follows_the_template_file(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [dialogue(0)])
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    cfg = DataConfig(path=path, chat_template=str(template))
    before = vocab_cache_key_parts(cfg, tokenizer)
    template.write_text(CHAT_TEMPLATE_NO_MARKERS)
    assert vocab_cache_key_parts(cfg, tokenizer) != before
