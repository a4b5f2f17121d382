"""The frozen target: what its drafters need in one forward, only the logits asked for, clear errors."""

import pytest
import torch
from transformers import LlamaConfig

from specdraft.contract import TargetNeeds
from specdraft.drafters.eagle3 import eagle3_default_taps
from specdraft.drafters.eagle_export import sglang_layer_ids
from specdraft.errors import SpecdraftError
from specdraft.masks import block_causal_mask
from specdraft.target import FrozenTarget
from tiny import assert_close, seeded_init_


def tiny_config(**kw):
    base = dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=300)
    base.update(kw)
    return LlamaConfig(**base)


def random_ids(*shape, seed):
    return torch.randint(0, 300, shape, generator=torch.Generator().manual_seed(seed))


def tiny_target(taps, final_hidden=True, **config):
    needs = TargetNeeds(taps=taps, final_hidden=final_hidden)
    target = FrozenTarget.from_config(tiny_config(**config), needs=needs, device="cpu")
    seeded_init_(target.model, seed=0)
    return target


def test_taps_equal_hidden_states_inputs_of_layers():
    target = tiny_target((2, 4, 5))
    assert target.taps == (2, 4, 5)
    ids = random_ids(2, 11, seed=1)
    out = target(ids)
    with torch.no_grad():
        ref = target.model(ids, output_hidden_states=True)
    assert out.taps == (2, 4, 5)
    for i, tap in enumerate(target.taps):
        assert torch.equal(out.aux_hidden[..., i * 64:(i + 1) * 64], ref.hidden_states[tap])
    # hidden_states[-1] is the normed final state: the LM-head input.
    assert torch.equal(out.final_hidden, ref.hidden_states[-1])
    assert torch.allclose(out.logits, ref.logits.float())
    assert not any(p.requires_grad for p in target.parameters())


def test_the_target_computes_only_the_features_declared():
    target = tiny_target((), final_hidden=False)
    out = target(random_ids(1, 5, seed=1))
    assert out.final_hidden is None and out.aux_hidden is None and out.taps == ()
    target.require(TargetNeeds(final_hidden=True))  # a drafter built on it asks for more
    assert target(random_ids(1, 5, seed=1)).final_hidden is not None


def test_only_the_logits_asked_for_are_computed():
    target = tiny_target((), final_hidden=False)
    ids = random_ids(2, 9, seed=3)
    full = target(ids).logits
    assert full.shape == (2, 9, 300) and full.dtype == torch.float32

    draft_ids = torch.tensor([0, 7, 41, 299])
    calls = []
    hook = target.lm_head.register_forward_hook(lambda *a: calls.append(1))
    rows = target(ids, logits="draft_rows", rows=draft_ids)
    hook.remove()
    assert not calls, "the full LM head ran for draft rows: the V-wide logits were formed"
    assert rows.logits.shape == (2, 9, 4) and rows.vocab_rows is draft_ids
    assert_close(rows.logits, full[..., draft_ids])

    last = target(ids, logits="last")
    assert last.logits.shape == (2, 1, 300) and last.last_only
    assert_close(last.logits, full[:, -1:])
    with pytest.raises(SpecdraftError, match="last-position logits cannot be sliced"):
        last.slice(slice(0, 1))
    assert target(ids, logits="none").logits is None
    with pytest.raises(SpecdraftError, match="needs rows"):
        target(ids, logits="draft_rows")


def test_targets_taps_are_one_set_of_layers():
    target = tiny_target((1, 2, 3))
    target.require(TargetNeeds(taps=(1, 2, 3), final_hidden=True))  # the same again: nothing changes
    with pytest.raises(SpecdraftError, match=r"reads target layers \[0, 1, 2\].*already taps \[1, 2, 3\]"):
        target.require(TargetNeeds(taps=(0, 1, 2)))
    assert target.taps == (1, 2, 3)


def test_the_frozen_forward_ignores_autocast_and_grad_mode():
    """A bf16 mixed-precision training step runs prepare under autocast: the target's numbers stay its own."""
    target = tiny_target((1,))
    ids = random_ids(1, 7, seed=4)
    plain = target(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.enable_grad():
        mixed = target(ids)
    assert mixed.logits.dtype == torch.float32 and not mixed.logits.requires_grad
    assert torch.equal(mixed.final_hidden, plain.final_hidden) and torch.equal(mixed.logits, plain.logits)


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
    assert eagle3_default_taps(32) == (2, 16, 29)  # Llama-3.1-8B, vLLM default
    assert eagle3_default_taps(36) == (2, 18, 33)  # Qwen3-8B
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
        FrozenTarget.from_config(tiny_config(), needs=TargetNeeds(taps=(2, 4, 8)), device="meta")


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
        FrozenTarget.from_config(tiny_config(num_hidden_layers=6), needs=TargetNeeds(taps=eagle3_default_taps(6)),
                                 device="meta")
