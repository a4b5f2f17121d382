"""The preallocated KV cache gives the target exactly the numbers transformers' DynamicCache does."""

import pytest
import torch
from tiny import seeded_init_, tiny_llama
from transformers import DynamicCache

from specdraft.decoding.kv_cache import preallocated_cache
from specdraft.errors import SpecdraftError
from specdraft.target import FrozenTarget


@pytest.fixture(scope="module")
def target():
    model = tiny_llama(64, hidden_size=32, intermediate_size=64, max_position_embeddings=128)
    seeded_init_(model, seed=0, std=0.4)
    return FrozenTarget(model)


def decode_with(target, cache) -> torch.Tensor:
    """A prompt, then steps of 3 tokens with the last 2 dropped again (a verify and its rollback)."""
    g = torch.Generator().manual_seed(0)
    logits = [target(torch.randint(0, 64, (2, 9), generator=g), past_key_values=cache, use_cache=True).logits]
    for _ in range(12):
        logits.append(target(torch.randint(0, 64, (2, 3), generator=g), past_key_values=cache, use_cache=True).logits)
        cache.crop(-2)
    assert cache.get_seq_length() == 9 + 12
    return torch.cat(logits, dim=1)


def test_same_logits_as_a_dynamic_cache_and_growing_keeps_them(target):
    reference = decode_with(target, DynamicCache(config=target.config))
    assert torch.equal(decode_with(target, preallocated_cache(target.config, 64)), reference)
    assert torch.equal(decode_with(target, preallocated_cache(target.config, 10)), reference)  # grows twice


def test_a_positive_crop_is_refused(target):
    cache = preallocated_cache(target.config, 16)
    target(torch.tensor([[1, 2, 3]]), past_key_values=cache, use_cache=True)
    with pytest.raises(SpecdraftError, match="negative count"):
        cache.crop(2)
    cache.crop(-1)
    assert cache.get_seq_length() == 2 and cache.layers[0].keys.shape[2] == 2
