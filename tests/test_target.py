"""The frozen target: taps in one forward, the vLLM/SGLang layer-id conventions, clear errors."""

import pytest
import torch
from transformers import LlamaConfig

from specdraft.errors import SpecdraftError
from specdraft.masks import block_causal_mask
from specdraft.target import FrozenTarget, eagle3_default_taps, sglang_layer_ids
from tiny import assert_close, seeded_init_


def tiny_config(**kw):
    base = dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=300)
    base.update(kw)
    return LlamaConfig(**base)


def random_ids(*shape, seed):
    return torch.randint(0, 300, shape, generator=torch.Generator().manual_seed(seed))


def tiny_target(taps, **config):
    target = FrozenTarget.from_config(tiny_config(**config), taps=taps, device="cpu")
    seeded_init_(target.model, seed=0)
    return target


def test_taps_equal_hidden_states_inputs_of_layers():
    target = tiny_target("eagle3")
    assert target.taps == [2, 4, 5]
    ids = random_ids(2, 11, seed=1)
    out = target(ids)
    with torch.no_grad():
        ref = target.model(ids, output_hidden_states=True)
    for i, tap in enumerate(target.taps):
        assert torch.equal(out.aux_hidden[..., i * 64:(i + 1) * 64], ref.hidden_states[tap])
    # hidden_states[-1] is the normed final state: the LM-head input.
    assert torch.equal(out.last_hidden, ref.hidden_states[-1])
    assert torch.allclose(out.logits, ref.logits.float())
    assert not any(p.requires_grad for p in target.parameters())


def hooks_per_layer(target):
    return [len(layer._forward_pre_hooks) for layer in target.layers]


def forwards_and_leftover_hooks(target, calls=2):
    """Run the target `calls` times; return how often the decoder stack ran, and the pre-hooks
    each layer holds afterwards beyond those it held before (the counting hook excepted)."""
    before = hooks_per_layer(target)
    passes = []
    counter = target.layers[0].register_forward_pre_hook(lambda *a: passes.append(1))
    for i in range(calls):
        target(random_ids(1, 5, seed=i))
    counter.remove()
    return len(passes), [after - b for after, b in zip(hooks_per_layer(target), before)]


def test_one_forward_per_call_and_no_hook_left_behind():
    target = tiny_target([0, 1, 3])  # a tap on layer 0 too, beside the counting hook
    passes, leftover = forwards_and_leftover_hooks(target)
    assert passes == 2  # one decoder pass per call, never a second one for the taps
    assert leftover == [0] * 8  # every tap hook is removed after its forward: nothing leaks


def test_a_target_that_leaks_its_tap_hooks_is_caught(monkeypatch):
    """Mutant: tap hooks that are never removed. The check above must see them."""
    monkeypatch.setattr(torch.utils.hooks.RemovableHandle, "remove", lambda self: None)
    target = tiny_target([0, 1, 3])
    _, leftover = forwards_and_leftover_hooks(target)
    # the counting hook is not removed either under this mutant: layer 0 shows it too
    assert leftover == [3, 2, 0, 2, 0, 0, 0, 0]


def test_layer_id_conventions():
    assert eagle3_default_taps(32) == [2, 16, 29]  # Llama-3.1-8B, vLLM default
    assert eagle3_default_taps(36) == [2, 18, 33]  # Qwen3-8B
    assert sglang_layer_ids([2, 16, 29]) == [1, 15, 28]


def test_packed_forward_matches_separate_forwards():
    target = tiny_target([1], num_hidden_layers=2)
    a, b = random_ids(1, 4, seed=1), random_ids(1, 6, seed=2)
    batch = {"input_ids": torch.cat([a, b], 1), "attention_mask": torch.ones(1, 10, dtype=torch.long),
             "seq_ids": torch.tensor([[0] * 4 + [1] * 6]),
             "position_ids": torch.tensor([list(range(4)) + list(range(6))])}
    packed = target.forward_batch(batch)
    assert_close(packed.logits[:, :4], target(a).logits)  # float32 rounding only: see assert_close
    assert_close(packed.logits[:, 4:], target(b).logits)
    mask = block_causal_mask(batch["attention_mask"], batch["seq_ids"])
    assert not mask[0, 0, 5, 3] and mask[0, 0, 5, 4] and not mask[0, 0, 4, 5]


def test_tap_out_of_range_is_a_clear_error():
    with pytest.raises(SpecdraftError, match="tap layer 8 is out of range.*0..7"):
        FrozenTarget.from_config(tiny_config(), taps=[2, 4, 8], device="meta")


def test_unknown_architecture_is_a_clear_error():
    class NotADecoder(torch.nn.Module):
        config = tiny_config()

    with pytest.raises(SpecdraftError, match="Llama-style decoders"):
        FrozenTarget(NotADecoder())


def test_missing_target_path_is_a_clear_error(tmp_path):
    with pytest.raises(SpecdraftError, match="could not load the target config"):
        FrozenTarget.from_pretrained(tmp_path / "missing")


def test_repeated_taps_are_a_clear_error():
    with pytest.raises(SpecdraftError, match=r"repeat a layer.*distinct"):
        FrozenTarget.from_config(tiny_config(num_hidden_layers=6), taps="eagle3", device="meta")
