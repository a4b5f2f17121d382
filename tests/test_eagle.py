"""EAGLE-1 / EAGLE-3 drafters: shapes, training, save/load, real-model sizing, bad input.

Decoding (DraftSource) and train/serve consistency live in test_eagle_decoding.py.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import GemmaConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from specdraft.chain_metrics import chain_accuracy_metrics
from specdraft.contract import Drafter, TargetNeeds, TrainingContext
from specdraft.data.vocab import DraftVocab
from specdraft.decoding.sampling import SamplingParams
from specdraft.drafters import FAMILIES, get_family, load_drafter
from specdraft.drafters.eagle1 import EAGLE1, Eagle1Config
from specdraft.drafters.eagle3 import EAGLE3, Eagle3Config
from specdraft.masks import shift_left
from specdraft.drafters.eagle_losses import (
    draft_vocab_probs,
    eagle1_loss,
    label_in_draft_vocab,
    ttt_step_weights,
)
from specdraft.errors import SpecdraftError
from specdraft.losses import smooth_l1, soft_cross_entropy
from specdraft.masks import block_causal_mask, document_lengths
from specdraft.target import FrozenTarget
from tiny import assert_close, seeded_init_

VOCAB = 256
# initializer_range 0.3 makes the random target's next-token distributions peaked, so there is
# something to learn; hidden 64 / 4 heads / 2 kv heads exercises grouped-query attention.
COMMON = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.3)
ARCHS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "qwen2": lambda: Qwen2Config(**COMMON),  # q/k/v biases
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),  # head_dim != 64 / 4, q/k norms
    "mistral": lambda: MistralConfig(**COMMON),
}


def tiny_target(arch: str = "llama", taps=(1, 2, 3)) -> FrozenTarget:
    """Weights drawn by seeded_init_, not by transformers' init, so pinned values hold across versions.
    It taps ``taps`` and computes the final hidden state: what either family's drafter reads."""
    config = ARCHS[arch]()
    target = FrozenTarget.from_config(config, needs=TargetNeeds(taps=taps, final_hidden=True), device="cpu")
    seeded_init_(target.model, seed=0, std=config.initializer_range)
    return target


def random_ids(*shape, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def make_batch(B=2, T=24, seed=1):
    ids = random_ids(B, T, seed=seed)
    ones = torch.ones(B, T, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": ones, "loss_mask": ones.clone()}


def build(family: str, target, **cfg):
    """A drafter whose own weights come from seeded_init_; EAGLE-3's head keeps the target's rows
    it was built from (what the product does, and what the pinned losses describe)."""
    torch.manual_seed(0)
    fam = get_family(family)
    drafter = fam.build(target, fam.config_cls(**cfg))
    return seeded_init_(drafter, seed=1, std=0.05, keep=("lm_head.weight",))


FAMILY_CFG = {"eagle1": {}, "eagle3": {"ttt_steps": 3}}


def trainable(drafter):
    return [p for p in drafter.trained_module().parameters() if p.requires_grad]


def test_families_are_registered():
    assert FAMILIES["eagle1"] is EAGLE1 and FAMILIES["eagle3"] is EAGLE3
    assert EAGLE3.needs_draft_vocab and not EAGLE1.needs_draft_vocab
    assert set(EAGLE1.exporters) == set(EAGLE3.exporters) == {"sglang", "vllm"}


@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
def test_drafters_fill_the_contract(family):
    target = tiny_target()
    drafter = build(family, target, **FAMILY_CFG[family])
    assert isinstance(drafter, Drafter)
    assert drafter.trained_module() is drafter  # its own weights; the target's stay borrowed
    assert all(p.requires_grad for p in trainable(drafter))


def test_family_needs_are_declared_before_anything_loads():
    """From the target's config alone: EAGLE-1 the final hidden state and full logits; EAGLE-3 its three
    layers and, with a reduced draft vocabulary, only the draft rows of the logits."""
    config = LlamaConfig(**{**COMMON, "num_hidden_layers": 32})
    assert EAGLE1.needs(Eagle1Config(), config) == TargetNeeds(logits="full", final_hidden=True)
    assert EAGLE3.needs(Eagle3Config(draft_vocab_size=100), config) == TargetNeeds(logits="draft_rows",
                                                                                   taps=(2, 16, 29))
    assert EAGLE3.needs(Eagle3Config(draft_vocab_size=None), config).logits == "full"  # the whole vocabulary


@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
def test_building_a_drafter_makes_the_target_compute_what_it_reads(family):
    target = FrozenTarget.from_config(LlamaConfig(**{**COMMON, "num_hidden_layers": 8}), device="cpu")  # computes
    seeded_init_(target.model, seed=0)  # no feature yet
    drafter = build(family, target, **FAMILY_CFG[family])
    assert target.needs.final_hidden == (family == "eagle1")
    assert target.taps == (() if family == "eagle1" else (2, 4, 5))
    batch = make_batch()
    out = drafter.prepare(batch, TrainingContext(target)).target
    assert torch.isfinite(drafter.compute_loss(batch, out).loss)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
def test_a_few_training_steps_reduce_the_loss(family, arch):
    target = tiny_target(arch)
    batch = make_batch()
    target_out = target.forward_batch(batch)
    drafter = build(family, target, **FAMILY_CFG[family])
    optimizer = torch.optim.AdamW(trainable(drafter), lr=3e-3)
    losses = []
    for _ in range(20):
        out = drafter.compute_loss(batch, target_out)
        assert out.loss.shape == () and all(v.shape == () and not v.requires_grad for v in out.metrics.values())
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.85 * losses[0]
    # The target's own weights were never touched nor handed to the optimizer.
    assert all(not p.requires_grad for p in target.parameters())
    assert not any(p is target.embed_tokens.weight for p in trainable(drafter))


def test_eagle3_metrics_have_one_entry_per_step():
    target = tiny_target()
    batch = make_batch()
    metrics = build("eagle3", target, ttt_steps=3).compute_loss(batch, target.forward_batch(batch)).metrics
    per_step = [f"{name}_{k}" for k in range(3) for name in ("loss", "acc", "cond_acc")]
    assert sorted(metrics) == sorted(per_step + ["sim_accept_len"])


def test_initial_losses_are_pinned():
    # Regression guard: fixed seeds, fixed tiny Llama, untrained drafters.
    target = tiny_target("llama")
    batch = make_batch()
    target_out = target.forward_batch(batch)
    eagle1 = build("eagle1", target).eval().compute_loss(batch, target_out)  # eval: no noise
    eagle3 = build("eagle3", target, ttt_steps=3).compute_loss(batch, target_out)
    assert eagle1.metrics["loss_reg"].item() == pytest.approx(PINNED["eagle1_reg"], rel=1e-4)
    assert eagle1.metrics["loss_cls"].item() == pytest.approx(PINNED["eagle1_cls"], rel=1e-4)
    assert [eagle3.metrics[f"loss_{k}"].item() for k in range(3)] == pytest.approx(PINNED["eagle3_steps"], rel=1e-4)


# EAGLE-3's head starts at the target's head rows (not random), hence step losses above log(V).
# The weights come from seeded_init_ (tiny.py), so these hold whatever RNG transformers' init draws.
PINNED = {"eagle1_reg": 0.4747382, "eagle1_cls": 6.0305066, "eagle3_steps": [8.3641396, 8.3722239, 8.3966112]}


def test_eagle3_head_starts_at_the_target_heads_draft_rows():
    target = tiny_target("llama")
    keep = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:40]
    drafter = EAGLE3.build(target, Eagle3Config(draft_vocab_size=40), DraftVocab.from_target_ids(keep, VOCAB))
    assert drafter.lm_head.weight.requires_grad
    assert torch.equal(drafter.lm_head.weight, target.lm_head.weight[drafter.draft_ids].float())
    assert drafter.lm_head.weight.data_ptr() != target.lm_head.weight.data_ptr()  # a copy: training leaves the target alone


def test_eagle1_uniform_noise_only_while_training():
    target = tiny_target()
    batch = make_batch()
    target_out = target.forward_batch(batch)
    drafter = build("eagle1", target)
    torch.manual_seed(0)
    a = drafter.train().compute_loss(batch, target_out).loss
    torch.manual_seed(1)
    b = drafter.compute_loss(batch, target_out).loss
    assert a.item() != b.item()  # different noise draws
    c, d = (drafter.eval().compute_loss(batch, target_out).loss for _ in range(2))
    assert c.item() == d.item()


def test_eagle1_noise_is_scaled_by_each_packed_documents_own_length(monkeypatch):
    """The reference adds U(-w/2, w/2) * 512 / L to each sample alone, L its length: in a packed row each
    document gets its own L (a 4-token document 4x the noise of a 16-token one), and padding's never matters."""
    target = tiny_target()
    ids = random_ids(1, 24, seed=3)
    attention = torch.ones(1, 24, dtype=torch.long)
    attention[0, 20:] = 0
    seq_ids = torch.tensor([[0] * 4 + [1] * 16 + [-1] * 4])  # documents of 4 and 16 tokens, then padding
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": attention.clone(), "seq_ids": seq_ids}
    assert document_lengths(attention, seq_ids).tolist() == [[4] * 4 + [16] * 16 + [0] * 4]
    assert document_lengths(attention).tolist() == [[20] * 24]  # unpacked: the row is the one document
    target_out = target.forward_batch(batch)
    drafter = build("eagle1", target).train()
    seen, real_step = [], drafter.draft_step
    monkeypatch.setattr(drafter, "draft_step", lambda features, *a, **k: seen.append(features) or
                        real_step(features, *a, **k))  # fmt: skip
    drafter.compute_loss(batch, target_out)
    noise = (seen[0] - target_out.final_hidden)[0].abs()  # [T, H]
    cfg = drafter.config
    for span, length in ((slice(0, 4), 4), (slice(4, 20), 16)):
        half_width = cfg.noise_width / 2 * cfg.noise_ref_len / length
        largest = noise[span].max().item()
        # 4 x 64 or 16 x 64 uniform draws: the largest is within a few percent of the half-width
        assert 0.9 * half_width < largest <= half_width * (1 + 1e-5), (length, largest, half_width)


def test_eagle1_follows_the_reference_layout():
    target = tiny_target("qwen2")
    drafter = build("eagle1", target)
    names = set(drafter.state_dict())
    assert {"fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight",
            "layers.0.self_attn.q_proj.bias"} <= names  # Qwen2's attention biases came along
    # No input norm on the single layer, and nothing borrowed from the target is saved.
    assert not any("input_layernorm" in n or "embed_tokens" in n or "lm_head" in n for n in names)
    assert drafter.fc.weight.shape == (64, 128)


def test_eagle3_parameter_names_are_sglangs():
    drafter = build("eagle3", tiny_target("qwen3"))
    expected = {
        "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
        "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
        *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    }
    assert set(drafter.state_dict()) == expected
    attn = drafter.midlayer.self_attn
    # Qwen3 head_dim 32 != 64 / 4; q/k/v read the 2H [embedding; hidden] input.
    assert attn.q_proj.weight.shape == (4 * 32, 128) and attn.k_proj.weight.shape == (2 * 32, 128)
    assert drafter.fc.weight.shape == (64, 3 * 64)
    assert drafter.d2t.dtype == torch.long and drafter.t2d.dtype == torch.bool


def test_eagle3_layer_matches_the_formula():
    """out = h + mlp(post_norm(h)), h = g + o_proj(attn([in_norm(e); hidden_norm(g)])), written out by hand."""
    target = tiny_target()
    drafter = build("eagle3", target)
    layer = drafter.midlayer
    for norm in (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm):
        torch.nn.init.uniform_(norm.weight, 0.5, 1.5)  # so a swapped norm would show
    B, T, H, heads, kv, d = 1, 5, 64, 4, 2, 16
    g = torch.randn(B, T, H, generator=torch.Generator().manual_seed(2))
    tokens = random_ids(B, T, seed=3)
    positions = torch.arange(T)[None]
    out = drafter.draft_step(g, tokens, positions, mask=block_causal_mask(torch.ones(B, T)))

    def rms(x, w):
        return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    embeds = target.embed_tokens(tokens)
    x = torch.cat([rms(embeds, layer.input_layernorm.weight), rms(g, layer.hidden_norm.weight)], -1)
    a = layer.self_attn
    q = (x @ a.q_proj.weight.T).view(B, T, heads, d).transpose(1, 2)
    k = (x @ a.k_proj.weight.T).view(B, T, kv, d).transpose(1, 2).repeat_interleave(2, dim=1)
    v = (x @ a.v_proj.weight.T).view(B, T, kv, d).transpose(1, 2).repeat_interleave(2, dim=1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = positions[0, :, None].float() * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rope(t):
        t1, t2 = t[..., : d // 2], t[..., d // 2 :]
        return t * cos + torch.cat([-t2, t1], -1) * sin

    scores = rope(q) @ rope(k).transpose(-1, -2) / d**0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, heads * d) @ a.o_proj.weight.T
    h = g + attn
    m = layer.mlp
    y = rms(h, layer.post_attention_layernorm.weight)
    mlp = (torch.nn.functional.silu(y @ m.gate_proj.weight.T) * (y @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    expected = h + mlp
    assert_close(out, expected, what="draft_step against the formula:")


def test_packed_rows_match_the_documents_run_alone():
    """Block-causal masks and restarting positions: a packed document sees nothing of its neighbour,
    at every training-time-test step. The same comparison without the block-causal mask must fail
    by far, so the tolerance cannot hide a leak."""
    target = tiny_target()
    doc_a, doc_b = random_ids(1, 9, seed=5), random_ids(1, 7, seed=6)
    packed = torch.cat([doc_a, doc_b], 1)
    seq_ids = torch.tensor([[0] * 9 + [1] * 7])
    positions = torch.cat([torch.arange(9), torch.arange(7)])[None]
    block_causal = block_causal_mask(torch.ones(1, 16), seq_ids)
    leaky = block_causal_mask(torch.ones(1, 16))  # plain causal: doc_b attends to doc_a
    alone_out = target(doc_b)
    alone_mask = block_causal_mask(torch.ones(1, 7))
    eagle3, eagle1 = build("eagle3", target, ttt_steps=3), build("eagle1", target)

    def packed_errors(mask):
        """Relative max error (see assert_close) of doc_b's packed rows against doc_b alone."""
        packed_out = target(packed, attention_mask=mask, position_ids=positions)
        # EAGLE-3: rows of doc_b whose TTT inputs all stay inside doc_b (step k reads token i + k + 1).
        packed_steps = eagle3.unroll(packed_out.aux_hidden, packed, positions, mask)
        alone_steps = eagle3.unroll(alone_out.aux_hidden, doc_b, torch.arange(7)[None], alone_mask)
        pairs = [(packed_steps[k][:, 9 : 15 - k], alone_steps[k][:, : 6 - k]) for k in range(3)]
        packed_pred = eagle1.draft_step(packed_out.final_hidden, shift_left(packed, 1), positions, mask=mask)
        alone_pred = eagle1.draft_step(alone_out.final_hidden, shift_left(doc_b, 1), torch.arange(7)[None],
                                       mask=alone_mask)
        pairs.append((packed_pred[:, 9:15], alone_pred[:, :6]))
        return [((a - b).abs().max() / torch.maximum(a.abs().max(), b.abs().max())).item() for a, b in pairs]

    rel = 1e-5  # float32 rounding of reductions over other shapes: see tiny.assert_close
    exact = packed_errors(block_causal)
    assert max(exact) <= rel, exact
    assert min(packed_errors(leaky)) > 100 * rel  # the check can see a leak


@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
def test_packing_mask_is_applied_to_the_loss(family):
    """Predictions that would cross into the next document are not counted."""
    target = tiny_target()
    T = 16
    batch = make_batch(B=1, T=T)
    batch["seq_ids"] = torch.tensor([[0] * 8 + [1] * 8])
    batch["position_ids"] = torch.cat([torch.arange(8), torch.arange(8)])[None]
    target_out = target.forward_batch(batch)
    drafter = build(family, target, **FAMILY_CFG[family]).eval()
    loss = drafter.compute_loss(batch, target_out).loss
    # Perturb the target's distribution exactly where a cross-document prediction would read it.
    tampered = target_out.slice(slice(0, T))
    tampered.logits = target_out.logits.clone()
    tampered.logits[:, 7] = torch.randn(VOCAB, generator=torch.Generator().manual_seed(4)) * 10  # position 7 predicts token 8, the next document's first
    assert drafter.compute_loss(batch, tampered).loss.item() == pytest.approx(loss.item(), rel=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
def test_save_load_gives_identical_logits(family, arch, tmp_path):
    target = tiny_target(arch)
    batch = make_batch()
    target_out = target.forward_batch(batch)
    drafter = build(family, target, **FAMILY_CFG[family])
    optimizer = torch.optim.AdamW(trainable(drafter), lr=3e-3)
    for _ in range(2):  # move away from the initialisation
        drafter.compute_loss(batch, target_out).loss.backward()
        optimizer.step()
    drafter.save_pretrained(tmp_path / "drafter")
    drafter.save_pretrained(tmp_path / "drafter")  # overwriting a saved drafter is fine

    loaded = load_drafter(tmp_path / "drafter", target)
    assert type(loaded) is type(drafter)
    drafter.eval(), loaded.eval()
    assert torch.equal(drafter.compute_loss(batch, target_out).loss, loaded.compute_loss(batch, target_out).loss)
    mask, positions = block_causal_mask(batch["attention_mask"]), torch.arange(24).expand(2, 24)

    def logits(d):
        hidden = d.draft_step(d.draft_input(d.target_features(target_out)), shift_left(batch["input_ids"], 1),
                              positions, mask=mask)
        return d.draft_logits(hidden)

    assert torch.equal(logits(drafter), logits(loaded))

    saved = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert saved["family"] == family
    assert saved["target_config"]["hidden_size"] == 64 and saved["target_config"]["model_type"] == arch
    assert saved["target_taps"] == (list(target.taps) if family == "eagle3" else [])
    assert saved["draft_vocab_size"] == VOCAB
    tensors = load_file(tmp_path / "drafter" / "model.safetensors")
    assert set(tensors) == set(drafter.state_dict())
    assert not any(f.name.startswith(".") for f in tmp_path.iterdir())  # no temporary folders left


def test_eagle3_with_a_reduced_vocabulary_saves_and_loads_the_map(tmp_path):
    target = tiny_target()
    keep = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:40]
    vocab = DraftVocab.from_target_ids(keep, VOCAB)
    drafter = EAGLE3.build(target, Eagle3Config(ttt_steps=2, draft_vocab_size=40), vocab)
    assert drafter.lm_head.weight.shape == (40, 64)
    assert torch.equal(drafter.draft_to_target, torch.sort(keep).values)
    batch = make_batch()
    out = drafter.compute_loss(batch, target.forward_batch(batch))
    assert torch.isfinite(out.loss)
    drafter.save_pretrained(tmp_path / "d")
    loaded = load_drafter(tmp_path / "d", target)
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
    assert json.loads((tmp_path / "d" / "config.json").read_text())["draft_vocab_size"] == 40


# -- sizing real models on the meta device ------------------------------------------------------

LLAMA_31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                   rope_theta=500000.0, max_position_embeddings=131072,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)


def _hand_count(family, H, inner, heads, kv_heads, head_dim, qk_norm=False, draft_vocab=32000):
    q, kv = heads * head_dim, kv_heads * head_dim
    mlp = 3 * H * inner
    if family == "eagle1":  # fc(2H -> H, bias) + a target layer without input norm
        attention = H * q + 2 * H * kv + q * H + (2 * head_dim if qk_norm else 0)
        return (2 * H * H + H) + attention + mlp + H
    # eagle3: fc(3H -> H) + 2H-input attention + mlp + 4 norms + lm_head over the draft vocabulary
    return 3 * H * H + (2 * H * q + 2 * (2 * H * kv) + q * H) + mlp + 4 * H + H * draft_vocab


@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
@pytest.mark.parametrize("model", ["llama-3.1-8b", "qwen3-8b"])
def test_real_model_sizes_on_meta(family, model):
    config = LlamaConfig(**LLAMA_31_8B) if model == "llama-3.1-8b" else Qwen3Config(**QWEN3_8B)
    target = FrozenTarget.from_config(config, device="meta")
    fam = get_family(family)
    drafter = fam.build(target, fam.config_cls())
    count = sum(p.numel() for p in trainable(drafter))
    expected = _hand_count(family, 4096, config.intermediate_size, 32, 8, 128, qk_norm=model == "qwen3-8b")
    assert count == expected
    assert all(p.device.type == "meta" for p in drafter.parameters())
    # Llama-3.1-8B by hand: EAGLE-1 251,666,432 and EAGLE-3 424,689,664 trainable parameters.
    if model == "llama-3.1-8b":
        assert count == {"eagle1": 251_666_432, "eagle3": 424_689_664}[family]


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
def test_unknown_target_architecture_names_the_supported_ones(family):
    gemma = GemmaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, vocab_size=VOCAB, head_dim=16)
    target = FrozenTarget.from_config(gemma, needs=TargetNeeds(taps=(1, 2, 3)), device="meta")
    with pytest.raises(SpecdraftError, match="LlamaDecoderLayer.*Qwen3DecoderLayer.*GemmaDecoderLayer"):
        get_family(family).build(target, get_family(family).config_cls())


def test_eagle3_needs_exactly_three_taps():
    with pytest.raises(SpecdraftError, match="exactly 3 target layers"):
        EAGLE3.build(tiny_target(taps=[1, 2]), Eagle3Config())


def test_draft_vocab_larger_than_the_targets_is_refused():
    target = tiny_target()
    too_big = DraftVocab(d2t=torch.zeros(VOCAB + 10, dtype=torch.long), t2d=torch.ones(VOCAB + 10, dtype=torch.bool))
    with pytest.raises(SpecdraftError, match="does not fit the target's vocabulary of 256"):
        EAGLE3.build(target, Eagle3Config(), too_big)
    with pytest.raises(SpecdraftError, match="full vocabulary"):
        EAGLE1.build(target, Eagle1Config(), DraftVocab.from_target_ids(torch.arange(10), VOCAB))


def test_reduced_vocab_without_a_map_is_refused_off_meta():
    target = tiny_target()
    with pytest.raises(SpecdraftError, match="build_draft_vocab"):
        EAGLE3.build(target, Eagle3Config(draft_vocab_size=100))
    # draft_vocab_size >= the target's vocabulary (or None) means the full vocabulary.
    assert EAGLE3.build(target, Eagle3Config(draft_vocab_size=32000)).lm_head.out_features == VOCAB
    assert EAGLE3.build(target, Eagle3Config(draft_vocab_size=None)).lm_head.out_features == VOCAB


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Eagle3Config(ttt_steps=0), "ttt_steps"),
        (lambda: Eagle3Config(step_weight_decay=0.0), "step_weight_decay"),
        (lambda: Eagle3Config(draft_vocab_size=0), "draft_vocab_size"),
        (lambda: Eagle1Config(noise="gaussian"), "noise"),
    ],
)
def test_bad_config_values(make, match):
    with pytest.raises(SpecdraftError, match=match):
        make()


def test_loading_onto_the_wrong_target_is_refused(tmp_path):
    target = tiny_target()
    build("eagle3", target, ttt_steps=1).save_pretrained(tmp_path / "d")
    wide = FrozenTarget.from_config(LlamaConfig(**{**COMMON, "hidden_size": 128}), device="cpu")
    with pytest.raises(SpecdraftError, match="hidden_size=64"):
        load_drafter(tmp_path / "d", wide)
    with pytest.raises(SpecdraftError, match=r"reads target layers \[1, 2, 3\] \(taps\).*already taps \[0, 1, 2\]"):
        load_drafter(tmp_path / "d", tiny_target(taps=(0, 1, 2)))
    with pytest.raises(SpecdraftError, match="not 'eagle1'"):
        EAGLE1.load(tmp_path / "d", target)


def test_saving_over_a_foreign_folder_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SpecdraftError, match="not a saved drafter"):
        build("eagle1", tiny_target()).save_pretrained(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_casting_the_drafter_leaves_the_target_and_rope_alone():
    target = tiny_target()
    drafter = build("eagle3", target).to(torch.bfloat16)
    assert drafter.fc.weight.dtype == torch.bfloat16
    assert target.embed_tokens.weight.dtype == torch.float32  # borrowed, not owned
    assert drafter.rotary_emb.inv_freq.dtype == torch.float32  # RoPE frequencies are not rounded


@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
def test_an_fp32_drafter_trains_and_drafts_on_a_bf16_target(family):
    target = tiny_target()
    target.model.to(torch.bfloat16)
    batch = make_batch()
    target_out = target.forward_batch(batch)
    drafter = build(family, target, **FAMILY_CFG[family])
    assert drafter.fc.weight.dtype == torch.float32
    loss = drafter.compute_loss(batch, target_out).loss
    loss.backward()
    assert torch.isfinite(loss) and drafter.fc.weight.grad is not None
    source = drafter.draft_source(target)
    source.start(batch["input_ids"][:1, :8], target(batch["input_ids"][:1, :8]))
    assert source.propose(batch["input_ids"][:1, 8:9], 3, SamplingParams(), None).tokens.shape == (1, 3)


# -- EAGLE's training objectives (specdraft/drafters/eagle_losses.py) ---------------------------------


def test_eagle1_loss_is_regression_plus_weighted_classification():
    g = torch.Generator().manual_seed(0)
    pred, feat = torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g)
    logits, probs = torch.randn(2, 4, 11, generator=g), torch.softmax(torch.randn(2, 4, 11, generator=g), -1)
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]])
    total, reg, cls = eagle1_loss(pred, feat, logits, probs, mask, cls_weight=0.1)
    assert reg.item() == pytest.approx(smooth_l1(pred, feat, mask).item())
    assert cls.item() == pytest.approx(soft_cross_entropy(logits, probs, mask).item())
    assert total.item() == pytest.approx(reg.item() + 0.1 * cls.item())


def test_draft_vocab_probs_renormalise_over_the_draft_rows_however_the_target_gave_them():
    from specdraft.contract import TargetOutputs

    # Target vocabulary of 4; the draft keeps ids 1 and 3.
    draft_ids = torch.tensor([1, 3])
    full = torch.log(torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]]]))
    expected = torch.tensor([[[0.2 / 0.6, 0.4 / 0.6], [0.5, 0.5]]])
    assert torch.allclose(draft_vocab_probs(TargetOutputs(logits=full), draft_ids), expected)
    rows_only = TargetOutputs(logits=full[..., draft_ids], vocab_rows=draft_ids)
    assert torch.allclose(draft_vocab_probs(rows_only, draft_ids), expected)
    with pytest.raises(SpecdraftError, match="cover 1 vocabulary rows.*has 2"):
        draft_vocab_probs(TargetOutputs(logits=full[..., :1], vocab_rows=torch.tensor([1])), draft_ids)


def test_positions_count_where_the_datas_next_token_is_in_the_draft_vocabulary():
    t2d = torch.tensor([False, True, False, True])
    assert label_in_draft_vocab(torch.tensor([[0, 1, 3, 2]]), t2d).tolist() == [[False, True, True, False]]


def test_eagle3_trains_on_the_draft_rows_alone_as_on_the_full_logits():
    """With a reduced vocabulary EAGLE-3 asks the target for its rows only: [B, T, N], never V wide, and
    the loss is the one the full logits give (float32 rounding of a smaller matmul apart)."""
    target = tiny_target()
    keep = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:40]
    torch.manual_seed(0)
    drafter = EAGLE3.build(target, Eagle3Config(ttt_steps=3, draft_vocab_size=40),
                           DraftVocab.from_target_ids(keep, VOCAB))
    assert drafter.needs.logits == "draft_rows"
    batch = make_batch()
    example = drafter.prepare(batch, TrainingContext(target))
    assert example.target.logits.shape == (2, 24, 40) and example.target.vocab_rows is drafter.draft_ids
    from_rows = drafter.compute_loss(example.batch, example.target)
    from_full = drafter.compute_loss(batch, target.forward_batch(batch))
    assert from_rows.loss.item() == pytest.approx(from_full.loss.item(), rel=1e-6)
    for name in ("acc_0", "acc_2", "sim_accept_len"):
        assert from_rows.metrics[name].item() == pytest.approx(from_full.metrics[name].item(), abs=1e-6), name


def test_eagle3_counts_only_positions_whose_next_token_the_draft_can_emit():
    """Tokens outside the draft vocabulary are never predicted: changing the data there (and so only
    the positions that predict it) leaves the loss where it is."""
    target = tiny_target()
    keep = torch.arange(0, VOCAB, 2)  # even ids only
    torch.manual_seed(0)
    drafter = EAGLE3.build(target, Eagle3Config(ttt_steps=2, draft_vocab_size=len(keep)),
                           DraftVocab.from_target_ids(keep, VOCAB)).eval()
    batch = make_batch(B=1, T=16)
    ids = batch["input_ids"]
    ids[0, 10] = 7  # odd: outside the draft vocabulary
    target_out = target.forward_batch(batch, "draft_rows", drafter.draft_ids)
    base = drafter.compute_loss(batch, target_out)
    # Positions 8 and 9 predict token 10 at steps 0 and 1; the target's p there is tampered with.
    tampered = target_out.slice(slice(0, 16))
    tampered.logits = target_out.logits.clone()
    tampered.logits[:, 9] = torch.randn(len(keep), generator=torch.Generator().manual_seed(1)) * 10
    assert drafter.compute_loss(batch, tampered).loss.item() == pytest.approx(base.loss.item(), rel=1e-6)
    ids[0, 10] = 8  # even: now it counts, and the tampered p moves the loss
    base = drafter.compute_loss(batch, target.forward_batch(batch, "draft_rows", drafter.draft_ids))
    assert drafter.compute_loss(batch, tampered).loss.item() != pytest.approx(base.loss.item(), rel=1e-3)


def test_ttt_step_weights_decay_geometrically():
    assert ttt_step_weights(4, 0.8) == pytest.approx([1.0, 0.8, 0.64, 0.512])


def test_chain_accuracy_metrics_by_hand():
    # 4 chains; step 1 has one row fewer (it ran out of sequence).
    correct = [torch.tensor([[True, True, False, True]]), torch.tensor([[True, False, True]])]
    counted = [torch.tensor([[True, True, True, False]]), torch.tensor([[True, True, True]])]
    m = chain_accuracy_metrics(correct, counted)
    assert m["acc_0"].item() == pytest.approx(2 / 3)  # rows 0..2 counted, rows 0 and 1 right
    assert m["cond_acc_0"].item() == pytest.approx(2 / 3)
    assert m["acc_1"].item() == pytest.approx(2 / 3)
    # Given step 0 counted and right (rows 0, 1), step 1 is right on row 0 only.
    assert m["cond_acc_1"].item() == pytest.approx(1 / 2)
    assert m["sim_accept_len"].item() == pytest.approx(2 / 3 + (2 / 3) * (2 / 3))


def test_chain_accuracy_metrics_are_zero_not_nan_when_nothing_counts():
    m = chain_accuracy_metrics([torch.ones(1, 3, dtype=torch.bool)], [torch.zeros(1, 3, dtype=torch.bool)])
    assert m["acc_0"].item() == 0.0 and m["cond_acc_0"].item() == 0.0 and m["sim_accept_len"].item() == 0.0


def extended_mask_attention(q, step_keys, step_values, mask0):
    """The references' training-time test attention, written out: step k's query over the keys of steps 0..k,
    concatenated, with the mask [mask0 | I | ... | I] (row i sees its allowed step-0 keys and its own later keys)."""
    from specdraft.drafters.eagle_common import attend

    B, _, T, _ = q.shape
    same_position = torch.eye(T, dtype=torch.bool)[None, None].expand(B, 1, T, T)
    mask = torch.cat([mask0] + [same_position] * (len(step_keys) - 1), dim=-1)
    return attend(q, torch.cat(step_keys, 2), torch.cat(step_values, 2), mask)


def test_the_training_time_tests_attention_is_the_extended_masks_softmax():
    """TrainingTimeTestKeys (one attention over the step-0 keys plus a sink per step) against the extended mask
    written out: outputs and gradients, 4 steps, grouped-query heads, two packed documents and padding."""
    from specdraft.drafters.eagle_common import TrainingTimeTestKeys

    torch.manual_seed(0)
    B, h, h_kv, T, d, steps = 2, 4, 2, 9, 8, 4
    attention = torch.ones(B, T)
    attention[1, 7:] = 0
    seq_ids = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])
    mask0 = block_causal_mask(attention, seq_ids)
    leaves = [tuple(x.requires_grad_() for x in (3 * torch.randn(B, h, T, d), torch.randn(B, h_kv, T, d),
                                                    torch.randn(B, h_kv, T, d))) for _ in range(steps)]

    def run(fast: bool):
        keys, outputs = TrainingTimeTestKeys(), []
        for k, (q, key, value) in enumerate(leaves):
            if fast:
                outputs.append(keys.attend(q, key, value, mask0))
            else:
                outputs.append(extended_mask_attention(q, [s[1] for s in leaves[: k + 1]],
                                                       [s[2] for s in leaves[: k + 1]], mask0))
        loss = sum((out * torch.linspace(-1, 1, d)).sum() * (k + 1) for k, out in enumerate(outputs))
        return torch.stack(outputs), torch.autograd.grad(loss, [x for step in leaves for x in step])

    fast, fast_grads = run(True)
    reference, reference_grads = run(False)
    assert_close(fast, reference, what="outputs")
    for got, want in zip(fast_grads, reference_grads):
        assert_close(got, want, what="gradients")


def test_the_training_time_tests_attention_in_bf16_is_as_close_as_the_extended_masks():
    """In bf16 (the SmolLM2 recipes' autocast) the sink's score keeps float32 precision (a high and a low bf16
    part): the error against float32 is the extended mask's own, where a bf16 score alone is 3-5x it."""
    from specdraft.drafters.eagle_common import TrainingTimeTestKeys

    torch.manual_seed(0)
    B, h, h_kv, T, d, steps = 2, 4, 2, 64, 64, 5
    mask0 = block_causal_mask(torch.ones(B, T))
    leaves = [tuple((scale * torch.randn(B, heads, T, d)).bfloat16() for scale, heads in ((3, h), (3, h_kv), (1, h_kv)))
              for _ in range(steps)]

    def dense(steps_in):
        return [extended_mask_attention(steps_in[k][0], [s[1] for s in steps_in[: k + 1]],
                                        [s[2] for s in steps_in[: k + 1]], mask0).float() for k in range(steps)]

    keys = TrainingTimeTestKeys()
    fast = [keys.attend(q, key, value, mask0).float() for q, key, value in leaves]
    reference = dense([tuple(x.float() for x in step) for step in leaves])
    for k, (got, bf16, want) in enumerate(zip(fast, dense(leaves), reference)):
        assert (got - want).abs().max() <= 2 * (bf16 - want).abs().max() + 1e-3, k


class RecordedOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops run inside the block, with their argument shapes."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
        self.calls.append((func.overloadpacket.__name__, shapes))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bf16", [False, True])
def test_the_borrowed_lm_head_runs_as_one_product_over_all_rows(bf16):
    # EAGLE-1 applies the target's frozen head to predicted[:, :rows], a non-contiguous slice that requires
    # grad: torch's matmul then expanded the head into a [B, H, V] batched product (a copy of the whole head
    # per row of the batch; about 2x the time on SmolLM2). The head must run as mm over [B * rows, H].
    # bf16: a bfloat16 target under autocast, as the SmolLM2 recipe trains (the slice is already bf16).
    target = tiny_target("llama")
    drafter = build("eagle1", target)
    if bf16:
        target.model.to(torch.bfloat16)
    batch = make_batch(B=3, T=24)
    target_out = target.forward_batch(batch)
    with RecordedOps() as ops, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        drafter.compute_loss(batch, target_out).loss.backward()
    vocab, hidden = target.vocab_size, target.hidden_size
    head_products = [(name, shapes) for name, shapes in ops.calls
                     if name in ("mm", "bmm", "addmm", "matmul") and any(vocab in s for s in shapes)]
    assert head_products, "the LM head's product was not seen"
    assert all(name != "bmm" for name, _ in head_products), head_products
    assert not any(name in ("copy_", "clone", "expand", "contiguous") and any(len(s) == 3 and vocab in s
               and hidden in s for s in shapes) for name, shapes in ops.calls), "the head was copied per row"


def saved_for_backward(compute) -> list[torch.Tensor]:
    """The tensors autograd keeps for the backward while ``compute()`` runs (outside any checkpoint)."""
    kept = []

    def pack(tensor):
        kept.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = compute()
    return result, kept


def test_eagle3_checkpoint_logits_keeps_no_draft_logits_and_changes_nothing():
    # drafter.checkpoint_logits recomputes each step's draft logits and loss in the backward: the same loss,
    # metrics and gradients, and no [.., draft vocab] float tensor of the draft's kept between forward and
    # backward (the target's p, an input, is kept either way).
    target = tiny_target("llama")
    batch = make_batch(B=2, T=20)
    target_out = target.forward_batch(batch)
    results = {}
    for flag in (False, True):
        drafter = build("eagle3", target, ttt_steps=3, checkpoint_logits=flag)
        out, kept = saved_for_backward(lambda: drafter.compute_loss(batch, target_out))
        out.loss.backward()
        vocab = drafter.draft_vocab_size
        logits_kept = [t for t in kept if t.dim() >= 2 and t.shape[-1] == vocab and t.is_floating_point()
                       and t.requires_grad]
        results[flag] = (out, {n: p.grad.clone() for n, p in drafter.trained_module().named_parameters()
                               if p.grad is not None}, logits_kept)
    (plain, plain_grads, plain_kept), (ckpt, ckpt_grads, ckpt_kept) = results[False], results[True]
    assert plain_kept, "without checkpointing the loss keeps the draft's log-probabilities"
    assert not ckpt_kept, [tuple(t.shape) for t in ckpt_kept]
    assert torch.equal(plain.loss, ckpt.loss)
    assert {k: v.item() for k, v in plain.metrics.items()} == {k: v.item() for k, v in ckpt.metrics.items()}
    assert plain_grads.keys() == ckpt_grads.keys()
    for name in plain_grads:
        assert torch.equal(plain_grads[name], ckpt_grads[name]), name


def test_eagle3_checkpoint_logits_must_be_a_bool():
    with pytest.raises(SpecdraftError, match="checkpoint_logits must be true or false"):
        Eagle3Config(checkpoint_logits="yes")


def packed_chat_batch():
    """Two packed rows of 24: row 0 holds two conversations (prompts of 5 and 3 tokens, answers of 7), then
    padding; row 1 one conversation (a 7-token prompt, an 11-token answer), then padding."""
    layout = [[(5, 7), (3, 7)], [(7, 11)]]
    T = 24
    ids = random_ids(2, T, seed=5)
    attention, loss_mask = torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.long)
    seq_ids, positions = torch.full((2, T), -1), torch.zeros(2, T, dtype=torch.long)
    for b, docs in enumerate(layout):
        start = 0
        for d, (prompt, answer) in enumerate(docs):
            end = start + prompt + answer
            attention[b, start:end], loss_mask[b, start + prompt:end], seq_ids[b, start:end] = 1, 1, d
            positions[b, start:end] = torch.arange(end - start)
            start = end
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask, "seq_ids": seq_ids,
            "position_ids": positions}


def dense_eagle_loss(family, drafter, batch, target_out):
    """The loss written over every row of [B, rows], weighted by the counted mask (what compute_loss did before
    it gathered the counted rows): the reference the gathered loss must equal."""
    ids, attention, seq_ids = batch["input_ids"], batch["attention_mask"].bool(), batch["seq_ids"]
    loss_mask, positions = batch["loss_mask"].bool(), batch["position_ids"]
    B, T = ids.shape
    mask0 = block_causal_mask(attention, seq_ids)
    if family == "eagle1":
        features = target_out.final_hidden
        predicted = drafter.draft_step(features, shift_left(ids, 1), positions, mask=mask0)
        rows = T - 2
        weight = loss_mask[:, 2:] & attention[:, :rows] & attention[:, 2:] & (seq_ids[:, :rows] == seq_ids[:, 2:])
        p = torch.softmax(target_out.logits[:, 1 : rows + 1].float(), -1)
        return eagle1_loss(predicted[:, :rows], features[:, 1 : rows + 1], drafter.draft_logits(predicted[:, :rows]),
                           p, weight, drafter.config.cls_weight)[0]
    target_probs = draft_vocab_probs(target_out, drafter.draft_ids)
    in_vocab = label_in_draft_vocab(ids, drafter.t2d)
    losses = []
    for k, hidden in enumerate(drafter.unroll(drafter.target_features(target_out), ids, positions, mask0)):
        rows = T - k - 2
        weight = (loss_mask[:, k + 2 :] & in_vocab[:, k + 2 :] & attention[:, :rows] & attention[:, k + 2 :]
                  & (seq_ids[:, :rows] == seq_ids[:, k + 2 :]))
        losses.append(soft_cross_entropy(drafter.draft_logits(hidden[:, :rows]),
                                         target_probs[:, k + 1 : k + 1 + rows], weight))
    weights = ttt_step_weights(len(losses), drafter.config.step_weight_decay)
    return sum(w * step_loss for w, step_loss in zip(weights, losses))


@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
def test_the_lm_head_runs_over_the_counted_rows_only_and_the_loss_is_unchanged(family):
    # The LM head and the vocabulary-wide loss used to run over every position of [B, T - k - 2], the prompts'
    # tokens and the packing's padding included, and then mask them out. They now run over the counted rows:
    # the same loss and gradients, with the head fed exactly as many rows as the loss counts.
    target = tiny_target()
    drafter = build(family, target, **FAMILY_CFG[family], **({"noise": "none"} if family == "eagle1" else {}))
    batch = packed_chat_batch()
    target_out = target.forward_batch(batch)
    head = drafter.target_lm_head if family == "eagle1" else drafter.lm_head
    fed = []
    hook = head.register_forward_hook(lambda module, args, out: fed.append(args[0].numel() // args[0].shape[-1]))
    try:
        out = drafter.compute_loss(batch, target_out)
    finally:
        hook.remove()
    out.loss.backward()
    gathered = {n: p.grad.clone() for n, p in drafter.trained_module().named_parameters() if p.grad is not None}
    drafter.zero_grad()

    steps = 1 if family == "eagle1" else FAMILY_CFG[family]["ttt_steps"]
    answer_rows = [int(batch["loss_mask"][:, k + 2 :].sum()) for k in range(steps)]  # the counted rows, at most
    assert len(fed) == steps
    assert all(0 < n <= rows for n, rows in zip(fed, answer_rows)), (fed, answer_rows)
    assert sum(fed) < 0.6 * steps * 2 * 24  # far fewer than every row of the two packed rows

    dense = dense_eagle_loss(family, drafter, batch, target_out)
    dense.backward()
    assert_close(out.loss, dense)
    assert gathered.keys() == {n for n, p in drafter.trained_module().named_parameters() if p.grad is not None}
    for name, grad in gathered.items():
        assert_close(grad, drafter.trained_module().get_parameter(name).grad, what=name)


def test_eagle3_runs_its_later_ttt_steps_only_where_a_later_step_counts():
    # Issue 35: steps 1.. of the training-time test ran the draft layer over every position of the packed rows.
    # Row i's later steps read only its own earlier steps and the step-0 keys, so they now run at the positions
    # where some later step's loss counts (the same loss and gradients: the test above).
    target = tiny_target()
    drafter = build("eagle3", target, **FAMILY_CFG["eagle3"])
    batch = packed_chat_batch()
    seen = []
    hook = drafter.midlayer.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape[:2])))
    try:
        drafter.compute_loss(batch, target.forward_batch(batch))
    finally:
        hook.remove()
    ids, loss_mask, seq_ids = batch["input_ids"], batch["loss_mask"].bool(), batch["seq_ids"]
    B, T = ids.shape
    steps = FAMILY_CFG["eagle3"]["ttt_steps"]
    later = [sum(any(i + k + 2 < T and loss_mask[b, i + k + 2] and seq_ids[b, i] == seq_ids[b, i + k + 2]
                     for k in range(1, steps)) for i in range(T)) for b in range(B)]
    assert seen == [(B, T)] + [(B, max(later))] * (steps - 1), (seen, later)
    assert max(later) < 0.7 * T
