import json
import threading

import datasets
import pytest
import torch
from tiny import tiny_tokenizer

from specdraft.atomic import current_umask
from specdraft.config import DataConfig
from specdraft.data import vocab as vocab_module
from specdraft.data.pipeline import build_datasets, vocab_cache_key_parts
from specdraft.data.vocab import (
    DraftVocab,
    build_draft_vocab,
    count_assistant_tokens,
    load_draft_vocab,
    save_draft_vocab,
    top_tokens,
)
from specdraft.errors import SpecdraftError


def tokenized(rows):
    return datasets.Dataset.from_list([{"input_ids": ids, "loss_mask": mask} for ids, mask in rows])


# Assistant counts: 7 -> 3, 2 -> 2, 5 -> 2, 9 -> 1. Token 1 is frequent but only in prompts.
DATA = tokenized([
    ([1, 1, 1, 7, 7, 2], [0, 0, 0, 1, 1, 1]),
    ([1, 1, 5, 7, 9, 2, 5], [0, 0, 1, 1, 1, 1, 1]),
])


def test_counts_only_assistant_tokens():
    assert count_assistant_tokens(DATA, 12).tolist() == [0, 0, 2, 0, 0, 2, 0, 3, 0, 1, 0, 0]


def test_top_tokens_break_ties_by_id_and_fill_in_id_order():
    counts = torch.tensor([0, 0, 2, 0, 0, 2, 0, 3, 0, 1, 0, 0])
    assert top_tokens(counts, 3).tolist() == [7, 2, 5]
    # Only 4 distinct tokens seen: the rest are the lowest unseen ids.
    assert top_tokens(counts, 7).tolist() == [7, 2, 5, 9, 0, 1, 3]


def test_build_draft_vocab_convention():
    vocab = build_draft_vocab(DATA, target_vocab_size=12, draft_vocab_size=3, cache_dir=None, cache_key_parts=[])
    # vLLM / SGLang: draft ids are the kept target ids in increasing order,
    # d2t[i] = target_id - i (an offset) and t2d a [V] boolean mask.
    assert vocab.draft_to_target.tolist() == [2, 5, 7]
    assert vocab.d2t.tolist() == [2, 4, 5]
    assert vocab.t2d.tolist() == [i in (2, 5, 7) for i in range(12)]
    assert vocab.d2t.dtype == torch.long and vocab.t2d.dtype == torch.bool


def test_size_is_exactly_n_even_with_few_distinct_tokens():
    vocab = build_draft_vocab(DATA, target_vocab_size=12, draft_vocab_size=6, cache_dir=None, cache_key_parts=[])
    assert vocab.size == 6
    assert vocab.draft_to_target.tolist() == [0, 1, 2, 5, 7, 9]
    assert int(vocab.t2d.sum()) == 6


def test_bad_sizes_and_ids():
    with pytest.raises(SpecdraftError, match="draft vocabulary size 13 must be between 1 and the target vocabulary size 12"):
        build_draft_vocab(DATA, 12, 13, None, [])
    with pytest.raises(SpecdraftError, match="token id 9, outside the target's vocabulary of 8"):
        build_draft_vocab(DATA, 8, 4, None, [])


def test_save_and_load_round_trip(tmp_path):
    vocab = DraftVocab.from_target_ids(torch.tensor([9, 3, 4]), 10)
    save_draft_vocab(vocab, tmp_path / "v.safetensors")
    loaded = load_draft_vocab(tmp_path / "v.safetensors")
    assert torch.equal(loaded.d2t, vocab.d2t) and torch.equal(loaded.t2d, vocab.t2d)


def test_cache_is_reused_for_the_same_key(tmp_path, monkeypatch):
    first = build_draft_vocab(DATA, 12, 3, tmp_path, ["data-hash", "tokenizer-hash"])
    assert len(list(tmp_path.glob("draft_vocab_*.safetensors"))) == 1

    def no_counting(*args, **kwargs):
        raise AssertionError("the cached map should have been loaded")

    monkeypatch.setattr(vocab_module, "count_assistant_tokens", no_counting)
    again = build_draft_vocab(DATA, 12, 3, tmp_path, ["data-hash", "tokenizer-hash"])
    assert torch.equal(again.d2t, first.d2t)
    with pytest.raises(AssertionError, match="cached map"):
        build_draft_vocab(DATA, 12, 4, tmp_path, ["data-hash", "tokenizer-hash"])  # another N: another key


def test_changed_data_gives_a_new_map(tmp_path):
    tokenizer = tiny_tokenizer()
    path = tmp_path / "chat.jsonl"
    cfg = DataConfig(path=str(path), eval_fraction=0.0)

    def cached_and_fresh(answer):
        record = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": answer}]}
        path.write_text(json.dumps(record) + "\n")
        train, _ = build_datasets(cfg, tokenizer)
        cached = build_draft_vocab(train, len(tokenizer), 4, tmp_path / "cache", vocab_cache_key_parts(cfg, tokenizer))
        return cached, build_draft_vocab(train, len(tokenizer), 4, None, [])

    cats, fresh_cats = cached_and_fresh("cat cat cat cat")
    dogs, fresh_dogs = cached_and_fresh("dog dog dog dog")
    assert len(list((tmp_path / "cache").iterdir())) == 2
    assert torch.equal(cats.t2d, fresh_cats.t2d) and torch.equal(dogs.t2d, fresh_dogs.t2d)
    assert not torch.equal(cats.t2d, dogs.t2d)
    assert tokenizer.eos_token_id in dogs.draft_to_target.tolist()  # every answer ends with it
    assert set(tokenizer(" dog")["input_ids"]) <= set(dogs.draft_to_target.tolist())


def test_writers_of_the_same_draft_vocab_cache_at_once_do_not_collide(tmp_path, monkeypatch):
    # The processes of one node build the same cache file at once. With one shared temporary name, the second
    # writer overwrote the first one's temporary file and moved it into place, and the first then failed on
    # os.replace (FileNotFoundError). Writer A is held between writing and renaming while B writes.
    vocab = DraftVocab.from_target_ids(torch.tensor([5, 1, 3]), 8)
    path = tmp_path / "cache" / "draft_vocab_x.safetensors"
    real_save, a_written, b_done, errors = vocab_module.save_file, threading.Event(), threading.Event(), []

    def held_save(tensors, filename):
        real_save(tensors, filename)
        if threading.current_thread().name == "A":
            a_written.set()
            b_done.wait(10)

    def write():
        try:
            save_draft_vocab(vocab, path)
        except Exception as e:  # noqa: BLE001  reported by the assertion below
            errors.append(e)

    monkeypatch.setattr(vocab_module, "save_file", held_save)
    writer_a = threading.Thread(target=write, name="A")
    writer_a.start()
    assert a_written.wait(10)
    save_draft_vocab(vocab, path)  # B, while A holds its temporary file
    b_done.set()
    writer_a.join(10)
    assert not errors, errors
    loaded = load_draft_vocab(path)
    assert torch.equal(loaded.d2t, vocab.d2t) and torch.equal(loaded.t2d, vocab.t2d)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    assert path.stat().st_mode & 0o777 == 0o666 & ~current_umask()
