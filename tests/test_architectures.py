"""Targets beyond Llama: Llama-3 RoPE scaling, Qwen3, Qwen3-MoE, Mixtral, Gemma-3, Mistral, Qwen2, gpt-oss, DeepSeek-V3,
Llama-4, GLM-4 and GLM-4-MoE, with every family.

Each (architecture, family) cell of tests/arch_matrix.py trains 3 steps, resumes bit-exactly, exports to every
engine format, passes the engines' re-implemented loaders, reads back, and decodes greedy-identically to
``generate()``; where a family cannot serve on a target, it is refused naming the engine's limit. Then what MoE
and Gemma targets change in the frozen target, and the bad input this brings.
"""

import json
import re

import pytest
import torch
import transformers as tf
from arch_matrix import ARCHITECTURES, DRAFTERS, run_cell, target_config, target_folder
from safetensors.torch import load_file
from spine import make_chat_data, make_recipe
from test_export import rope_frequencies

from specdraft.config import parse_recipe
from specdraft.contract import TargetNeeds
from specdraft.drafters.eagle_common import check_target_architecture, make_rotary
from specdraft.drafters.eagle_export import _rope_fields
from specdraft.drafters.folder import target_config_dict
from specdraft.errors import SpecdraftError
from specdraft.target import FrozenTarget
from specdraft.train import train

# Cells where training is refused, and the limit the message must name.
REFUSED = {
    **{(arch, "eagle1"): "a copy of the target's own decoder layer: .*vLLM 0.33 and SGLang 0.5.23 have EAGLE-1 "
                         "models for dense Llama and Qwen2 layers only"
       for arch in ("qwen3_moe", "mixtral", "gemma3", "gpt_oss", "deepseek_v3", "llama4", "glm4", "glm4_moe")},
    ("gemma3", "eagle3"): "Gemma3ForCausalLM .* does not implement SupportsEagle3",
    ("gemma3", "eagle3-qk"): "Gemma3ForCausalLM .* does not implement SupportsEagle3",
    ("gemma3", "dflash"): "Gemma3ForCausalLM .* does not implement SupportsEagle3",
}
# Cells that train but some of whose engine exports are refused: format -> what the refusal says.
SGLANG_HAS_NO_QK_NORM = {"sglang": "LlamaForCausalLMEagle3 .* without QK-norm"}
NOT_CAPTURED = "serves {} drafts only on targets whose model captures the tapped layers"
EXPORT_REFUSED = {
    ("mixtral", "eagle3"): {fmt: NOT_CAPTURED.format("EAGLE-3") for fmt in ("sglang", "vllm")},
    ("mixtral", "eagle3-qk"): {"sglang": "without QK-norm", "vllm": NOT_CAPTURED.format("EAGLE-3")},
    ("mixtral", "dflash"): {fmt: NOT_CAPTURED.format("DFlash") for fmt in ("sglang", "vllm")},
    ("qwen3", "eagle1"): {fmt: "EAGLE-1 models for .* only; this drafter's layer is a qwen3 layer"
                          for fmt in ("sglang", "vllm")},
    **{(arch, "eagle3-qk"): SGLANG_HAS_NO_QK_NORM for arch in ("llama3", "qwen3", "qwen3_moe", "mistral", "qwen2")},
    ("qwen2", "eagle1"): {"vllm": "vLLM has EAGLE-1 models for LlamaForCausalLM .* only; this drafter's layer is a "
                                  "qwen2 layer"},
    ("qwen2", "dflash"): {"sglang": NOT_CAPTURED.format("DFlash")},
    **{(arch, "eagle3-qk"): SGLANG_HAS_NO_QK_NORM for arch in ("gpt_oss", "deepseek_v3", "llama4")},
    # taps [1, 2, 3] are SGLang ids [0, 1, 2], which DeepseekV3ForCausalLM does not shift
    ("deepseek_v3", "eagle3"): {"sglang": r"DeepseekV3ForCausalLM .* adds 1 .* only when the first id is 1"},
    ("glm4", "eagle3"): {fmt: NOT_CAPTURED.format("EAGLE-3") for fmt in ("sglang", "vllm")},
    ("glm4", "dflash"): {fmt: NOT_CAPTURED.format("DFlash") for fmt in ("sglang", "vllm")},
    ("glm4_moe", "eagle3"): {"vllm": NOT_CAPTURED.format("EAGLE-3")},
    ("glm4_moe", "dflash"): {fmt: NOT_CAPTURED.format("DFlash") for fmt in ("sglang", "vllm")},
    **{(arch, "eagle3-qk"): {"sglang": "without QK-norm", "vllm": NOT_CAPTURED.format("EAGLE-3")}
       for arch in ("glm4", "glm4_moe")},
}


@pytest.mark.parametrize("family", list(DRAFTERS))
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_family_on_every_architecture(arch, family, tmp_path_factory):
    cell = run_cell(arch, family, tmp_path_factory.mktemp("cells") / f"{arch}-{family}")
    if (arch, family) in REFUSED:
        assert cell.refusal is not None, "trained where the engines cannot serve it"
        assert re.search(REFUSED[arch, family], cell.refusal), cell.refusal
        return
    assert cell.refusal is None, cell.refusal
    assert cell.trains.startswith("yes") and cell.greedy.startswith("yes")
    refused = EXPORT_REFUSED.get((arch, family), {})
    assert cell.notes.keys() == refused.keys(), cell.notes
    for fmt, pattern in refused.items():
        assert re.search(pattern, cell.notes[fmt]), cell.notes[fmt]
    assert (cell.engines == "none") == (len(refused) == len(cell.exports.split(", ")))


# -- what the frozen target does on these architectures -------------------------------------------------------


def random_target(arch: str, needs: TargetNeeds = TargetNeeds(final_hidden=True)) -> FrozenTarget:
    torch.manual_seed(0)
    return FrozenTarget(tf.AutoModelForCausalLM.from_config(target_config(arch, 300)).eval(), needs)


IDS = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(0))


def test_gemma_target_logits_are_the_models_own_soft_capped_logits():
    """Gemma's forward soft-caps its logits (cap * tanh(x / cap)): the target hands drafters and the verifier
    those, not the bare LM head's; the same for the draft vocabulary's rows and the last position."""
    target = random_target("gemma3")
    with torch.no_grad():
        expected = target.model(IDS).logits.float()
    assert expected.abs().max() < 5.0  # capped at 5 (tiny_config's final_logit_softcapping)
    torch.testing.assert_close(target(IDS).logits, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(target(IDS, logits="last").logits, expected[:, -1:], rtol=1e-5, atol=1e-5)
    rows = torch.arange(0, 300, 7)
    torch.testing.assert_close(target(IDS, logits="draft_rows", rows=rows).logits, expected[..., rows],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_taps_ignore_the_router_and_no_router_logits_are_kept(arch):
    """The configs ask for router logits (output_router_logits: true): the frozen target turns that off, so its
    forward collects none, and the tapped layer inputs are the hidden states transformers reports."""
    target = random_target(arch, TargetNeeds(taps=(1, 2, 3), final_hidden=True))
    kept = []
    target.base.register_forward_hook(lambda module, args, out: kept.append(out))
    with torch.no_grad():
        out = target(IDS)
        reported = target.model(IDS, output_hidden_states=True, output_router_logits=False)
    assert getattr(kept[0], "router_logits", None) is None
    assert target.model.config.output_router_logits is False
    torch.testing.assert_close(out.aux_hidden, torch.cat([reported.hidden_states[t] for t in (1, 2, 3)], -1))


def test_the_feature_cache_of_a_moe_target_stores_what_it_says_it_needs(tmp_path, monkeypatch):
    """``cache-features`` on Qwen3-MoE: the shards hold the taps and the final hidden state (nothing of the router),
    and the size printed before writing is the bytes the shards' tensors hold."""
    from specdraft import features

    target_dir = target_folder("qwen3_moe", str(tmp_path / "targets"))
    recipe = make_recipe(tmp_path, target_dir, make_chat_data(tmp_path / "chat.jsonl", n=12),
                         training={"feature_cache": str(tmp_path / "cache")})
    recipe["drafter"] = dict(DRAFTERS["eagle3"])
    recipe["target"]["taps"] = [1, 2, 3]
    printed, real = [], features._bytes_needed
    monkeypatch.setattr(features, "_bytes_needed", lambda *a: printed.append(real(*a)) or printed[-1])
    out = features.cache_features(parse_recipe(recipe), show_progress=False)
    stored = [(name, t) for shard in out.glob("*.safetensors") for name, t in load_file(shard).items()]
    widths = {name.split(".")[1]: t.shape[-1] for name, t in stored}
    assert widths == {"aux": 3 * 64, "last": 64}  # the taps, and the final hidden the logits are computed from
    assert printed == [sum(t.numel() * t.element_size() for _, t in stored)]


# -- bad input -----------------------------------------------------------------------------------------------


class NoLayers(torch.nn.Module):
    """A causal LM that exposes no decoder layers (a custom or remote-code model)."""

    def __init__(self):
        super().__init__()
        self.config = tf.LlamaConfig(vocab_size=32, hidden_size=8, num_attention_heads=2)
        self.body = torch.nn.Embedding(32, 8)


def test_a_target_without_decoder_layers_is_refused_naming_what_it_lacks():
    with pytest.raises(SpecdraftError, match=r"NoLayers does not expose `.model.layers` and `.model.norm`"):
        FrozenTarget(NoLayers())


def test_the_gpt_oss_draft_rope_is_the_yarn_the_engines_build_from_the_export():
    """vLLM's EAGLE-3 draft (llama_eagle3.py, its LlamaAttention in llama.py) builds its RoPE with get_rope from the
    draft config's rope_parameters, not from the target's model: the export carries gpt-oss's yarn with its
    truncate: false, and the draft trains on that RoPE (neox-style, full width), not on gpt-oss's own rotary module
    (half-width cos/sin)."""
    target = random_target("gpt_oss")
    rope = _rope_fields(target_config_dict(target.config))["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["truncate"] is False and rope["factor"] == 8.0
    positions = torch.arange(200)[None]
    cos, sin = make_rotary(target)(torch.zeros(1), positions)
    inv_freq, scale = rope_frequencies(16, rope)  # vLLM's YaRNScalingRotaryEmbedding, re-implemented
    angles = torch.cat([positions[0, :, None] * inv_freq] * 2, -1)
    assert scale > 1.2  # yarn's attention factor, 0.1 ln(8) + 1
    torch.testing.assert_close(cos[0], angles.cos() * scale)
    torch.testing.assert_close(sin[0], angles.sin() * scale)


class CustomDecoderLayer(tf.models.llama.modeling_llama.LlamaDecoderLayer):
    """A decoder layer specdraft does not know (a remote-code model's, say)."""


@pytest.mark.parametrize("family", ["EAGLE-1", "EAGLE-3", "DFlash"])
def test_a_target_whose_layers_no_family_can_tap_is_refused_naming_the_layer(family):
    target = random_target("qwen2")
    for layer in target.layers:
        layer.__class__ = CustomDecoderLayer
    with pytest.raises(SpecdraftError, match=r"this target \(qwen2\) uses CustomDecoderLayer.*medusa1, medusa2, "
                                             r"mlp_speculator (or|and) distillspec"):
        check_target_architecture(target, family)


def test_samples_longer_than_the_targets_context_are_refused_before_it_loads(tmp_path, monkeypatch):
    target_dir = target_folder("qwen3", str(tmp_path / "targets"))  # max_position_embeddings 512
    recipe = make_recipe(tmp_path, target_dir, make_chat_data(tmp_path / "chat.jsonl"))
    recipe["data"]["max_length"] = 513
    recipe["drafter"] = dict(DRAFTERS["medusa1"])
    monkeypatch.setattr(FrozenTarget, "from_pretrained", lambda *a, **k: pytest.fail("the target loaded"))
    with pytest.raises(SpecdraftError, match=r"data.max_length is 513 tokens, longer than the target's context of "
                                             r"512 \(max_position_embeddings\).*at most 512"):
        train(parse_recipe(recipe), show_progress=False)
    assert json.loads((target_dir / "config.json").read_text())["max_position_embeddings"] == 512
