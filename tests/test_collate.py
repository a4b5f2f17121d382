import torch
from tiny import assert_close, tiny_llama

from specdraft.data.collate import Collator, attention_mask_4d, pack, pad_token_id_of
from specdraft.target import FrozenTarget

PAD = 0
SAMPLES = [
    {"input_ids": [11, 12, 13, 14], "loss_mask": [0, 0, 1, 1]},
    {"input_ids": [21, 22], "loss_mask": [0, 1]},
    {"input_ids": [31, 32, 33, 34, 35, 36], "loss_mask": [0, 0, 0, 1, 1, 1]},
    {"input_ids": [41, 42, 43], "loss_mask": [1, 1, 1]},
]


def test_padding_layout():
    batch = Collator(PAD, max_length=5)(SAMPLES)
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask", "position_ids"}
    assert batch["input_ids"].tolist() == [
        [11, 12, 13, 14, 0],
        [21, 22, 0, 0, 0],
        [31, 32, 33, 34, 35],  # truncated to max_length
        [41, 42, 43, 0, 0],
    ]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # The first token is never a prediction target (nothing precedes it), padding never is.
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 1, 0, 0, 0], [0, 0, 0, 1, 1], [0, 1, 1, 0, 0]]
    assert batch["position_ids"].tolist() == [list(range(5))] * 4
    assert all(v.dtype == torch.long for v in batch.values())


def test_first_fit_packing():
    assert pack([4, 2, 6, 3], max_length=8) == [[0, 1], [2], [3]]
    assert pack([4, 2, 6, 3], max_length=9) == [[0, 1, 3], [2]]
    assert pack([5, 5, 3, 3], max_length=8) == [[0, 2], [1, 3]]


def test_packing_layout():
    batch = Collator(PAD, max_length=9, packing=True)(SAMPLES)
    assert batch["input_ids"].tolist() == [
        [11, 12, 13, 14, 21, 22, 41, 42, 43],
        [31, 32, 33, 34, 35, 36, 0, 0, 0],
    ]
    assert batch["seq_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, -1, -1, -1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7, 8]]
    assert batch["attention_mask"].tolist() == [[1] * 9, [1] * 6 + [0] * 3]
    # Each document's first token leaves the loss: it would be "predicted" from the previous document.
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 1, 0, 1, 1], [0, 0, 0, 1, 1, 1, 0, 0, 0]]


def test_block_causal_mask_of_a_packed_row():
    batch = Collator(PAD, max_length=9, packing=True)(SAMPLES[:2])  # one row: 4 + 2 tokens
    mask = attention_mask_4d(batch)[0, 0]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    expected[:4, :4] = torch.ones(4, 4).tril().bool()
    expected[4:, 4:] = torch.ones(2, 2).tril().bool()
    assert torch.equal(mask, expected)


def random_samples(n, vocab_size, generator):
    lengths = [5, 9, 3, 12, 7, 4][:n]
    return [
        {"input_ids": torch.randint(3, vocab_size, (k,), generator=generator).tolist(), "loss_mask": [1] * k}
        for k in lengths
    ]


def test_packed_and_padded_forwards_equal_separate_forwards():
    model = tiny_llama(vocab_size=64)
    samples = random_samples(6, 64, torch.Generator().manual_seed(0))
    alone = [model(torch.tensor([s["input_ids"]])).logits[0] for s in samples]

    packed = Collator(PAD, max_length=16, packing=True)(samples)
    assert len(packed["input_ids"]) < len(samples)  # really packed
    logits = model(packed["input_ids"], attention_mask=attention_mask_4d(packed), position_ids=packed["position_ids"]).logits
    for row in range(len(packed["input_ids"])):
        starts = {}
        for t, doc in enumerate(packed["seq_ids"][row].tolist()):
            starts.setdefault(doc, t)
        for doc, start in starts.items():
            if doc < 0:
                continue
            ids = packed["input_ids"][row, start : start + (packed["seq_ids"][row] == doc).sum()].tolist()
            i = next(i for i, s in enumerate(samples) if s["input_ids"] == ids)
            assert_close(logits[row, start : start + len(ids)], alone[i])  # rounding only: see assert_close

    padded = Collator(PAD, max_length=16)(samples)
    logits = model(padded["input_ids"], attention_mask=padded["attention_mask"], position_ids=padded["position_ids"]).logits
    for i, s in enumerate(samples):
        assert_close(logits[i, : len(s["input_ids"])], alone[i])


def test_frozen_target_forward_batch_on_a_packed_batch():
    model = tiny_llama(vocab_size=64)
    samples = random_samples(3, 64, torch.Generator().manual_seed(1))  # lengths 5, 9, 3
    target = FrozenTarget(model)
    packed = Collator(PAD, max_length=17, packing=True)(samples)
    assert packed["input_ids"].shape == (1, 17)
    out = target.forward_batch(packed)
    start = 0
    for s in samples:
        n = len(s["input_ids"])
        alone = target(torch.tensor([s["input_ids"]]))
        assert_close(out.logits[0, start : start + n], alone.logits[0])
        start += n


class _Tok:
    def __init__(self, pad, eos):
        self.pad_token_id, self.eos_token_id = pad, eos


def test_pad_token_falls_back_to_eos():
    assert pad_token_id_of(_Tok(5, 2)) == 5
    assert pad_token_id_of(_Tok(None, 2)) == 2
    assert pad_token_id_of(_Tok(0, 2)) == 0  # 0 is a real id, not "missing"
