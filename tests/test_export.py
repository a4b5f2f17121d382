"""specdraft export: every format loads in its engine, and reads back into the same drafter.

vLLM and SGLang are not installed here, so the ``*_loads`` helpers below re-implement what each
engine does with an exported folder, citing the file each rule was read from: check the config the
way the engine's config class does, build the engine's parameter table from it the way the model's
``__init__`` does, route every tensor the way its ``load_weights`` does, and require every
parameter the engine does not take from the target to be filled, with the right shape.
"""

import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaConfig, Qwen2Config, Qwen3Config

from specdraft.cli import main
from specdraft.data.vocab import DraftVocab
from specdraft.drafters import FAMILIES
from specdraft.errors import SpecdraftError
from specdraft.export import _rope_fields, export, load_exported
from specdraft.target import FrozenTarget
from tiny import seeded_init_

TINY = dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False)


def tiny_target(config_cls=LlamaConfig, taps=None, **overrides):
    config = config_cls(**{**TINY, **overrides})
    config.architectures = [config_cls.__name__.replace("Config", "ForCausalLM")]
    target = FrozenTarget.from_config(config, taps=taps, device="cpu")
    seeded_init_(target.model, seed=0, std=config.initializer_range)
    return target


def randomize(drafter, seed=1):
    """Every trained tensor distinct (norm weights too), so a dropped or swapped tensor changes the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return drafter


def make_run(tmp_path, drafter, target_path="org/tiny-target", k=4):
    run = tmp_path / "run"
    drafter.save_pretrained(run / "drafter")
    (run / "recipe.yaml").write_text(yaml.safe_dump({"target": {"path": target_path}, "eval": {"k": k}}))
    return run


def eagle3(target, vocab_size=64):
    vocab = DraftVocab.from_target_ids(torch.arange(0, TINY["vocab_size"], TINY["vocab_size"] // vocab_size),
                                       TINY["vocab_size"])
    family = FAMILIES["eagle3"]
    drafter = family.build(target, family.config_cls(draft_vocab_size=vocab_size), vocab)
    randomize(drafter)
    return drafter


def eagle1(target, **cfg):
    family = FAMILIES["eagle1"]
    drafter = family.build(target, family.config_cls(**cfg))
    randomize(drafter)
    return drafter


def draft_logits(drafter, target, ids):
    """Draft logits at every position of ``ids``, read from real target features."""
    T = ids.shape[1] - 1
    hidden = drafter.draft_input(drafter.target_features(target(ids)))[:, :T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        return drafter.draft_logits(drafter.draft_step(hidden, ids[:, 1:], torch.arange(T)[None], None, causal))


def read(folder):
    return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


# -- engine loaders, re-implemented -----------------------------------------------------------------

# Every load_weights below fuses these (vLLM and SGLang alike): a q/k/v or gate/up tensor is one shard
# of a QKVParallelLinear / MergedColumnParallelLinear parameter.
STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]


def layer_params(prefix, c, qkv_in, qkv_bias=False, o_bias=False, input_norm=True, hidden_norm=False):
    """LlamaAttention + LlamaMLP + norms as both engines build them (llama.py); shard -> shape."""
    H, I = c["hidden_size"], c["intermediate_size"]
    hd = c.get("head_dim") or H // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    params = {
        f"{prefix}.self_attn.qkv_proj.weight": {"q": (q, qkv_in), "k": (kv, qkv_in), "v": (kv, qkv_in)},
        f"{prefix}.self_attn.o_proj.weight": {None: (H, q)},
        f"{prefix}.mlp.gate_up_proj.weight": {0: (I, H), 1: (I, H)},
        f"{prefix}.mlp.down_proj.weight": {None: (H, I)},
        f"{prefix}.post_attention_layernorm.weight": {None: (H,)},
    }
    if c.get("mlp_bias", False):  # LlamaMLP(bias=mlp_bias) in vLLM; SGLang never has one
        params[f"{prefix}.mlp.gate_up_proj.bias"] = {0: (I,), 1: (I,)}
        params[f"{prefix}.mlp.down_proj.bias"] = {None: (H,)}
    if qkv_bias:
        params[f"{prefix}.self_attn.qkv_proj.bias"] = {"q": (q,), "k": (kv,), "v": (kv,)}
    if o_bias:
        params[f"{prefix}.self_attn.o_proj.bias"] = {None: (H,)}
    for norm, present in (("input_layernorm", input_norm), ("hidden_norm", hidden_norm)):
        if present:
            params[f"{prefix}.{norm}.weight"] = {None: (H,)}
    return params


def fuse(name):
    for fused, part, shard in STACKED:
        if part in name:
            return name.replace(part, fused), shard
    return name, None


def fill(params, filled, name, shard, tensor):
    assert name in params, f"the engine has no parameter {name}"
    assert shard in params[name], f"{name} has no shard {shard}"
    assert tuple(tensor.shape) == params[name][shard], f"{name}[{shard}]: {tuple(tensor.shape)} != {params[name][shard]}"
    assert shard not in filled.setdefault(name, set()), f"{name}[{shard}] loaded twice"
    filled[name].add(shard)


def assert_all_filled(params, filled, from_target):
    for name, shards in params.items():
        if name not in from_target:
            assert filled.get(name) == set(shards), f"{name} left uninitialized (filled {filled.get(name)})"


def captured_layers(ids, num_layers):
    """vllm/model_executor/models/llama.py and sgl-project/sglang python/sglang/srt/models/llama.py:
    ``for i in layers: if i in capture: aux.append(hidden_states + residual)`` -- each layer once, and
    layer 0 has no residual yet."""
    captured = [i for i in range(num_layers) if i in ids]
    assert 0 not in captured, "layer 0's input has no residual to add in either engine"
    return captured


def sglang_eagle3_loads(folder, num_target_layers):
    """sgl-project/sglang python/sglang/srt/models/llama_eagle3.py (LlamaForCausalLMEagle3),
    model_executor/model_runner.py (eagle_config ids), models/llama.py (set_eagle3_layers_to_capture)."""
    c, tensors = read(folder)
    assert c["architectures"] == ["LlamaForCausalLMEagle3"]  # EntryClass
    assert c["model_type"] == "llama"  # AutoConfig -> LlamaConfig; "llama4_text" switches intermediate size
    assert c["hidden_act"] == "silu"  # llama.py LlamaMLP raises otherwise
    assert c["tie_word_embeddings"] is False  # True: lm_head = embed_tokens
    assert isinstance(c["draft_vocab_size"], int)  # None: vocab_size-wide head loaded from the target
    H = c["hidden_size"]
    attention_bias = c.get("attention_bias", False) or c.get("bias", False)  # llama.py LlamaDecoderLayer
    params = {
        "model.embed_tokens.weight": {None: (c["vocab_size"], H)},
        "model.fc.weight": {None: (H, 3 * c.get("target_hidden_size", H))},
        "model.norm.weight": {None: (H,)},
        "lm_head.weight": {None: (c["draft_vocab_size"], H)},
        # LlamaDecoderLayer override: qkv_proj reads 2H, bias=False; o_proj keeps llama.py's bias
        **layer_params("model.midlayer", c, qkv_in=2 * H, o_bias=attention_bias, hidden_norm=True),
    }
    if c.get("bias", False):
        params["model.fc.bias"] = {None: (H,)}
    filled, hot_token_id = {}, None
    for name, tensor in tensors.items():
        if "d2t" in name:
            hot_token_id = tensor + torch.arange(tensor.shape[0])
            continue
        if "t2d" in name:
            continue
        name, shard = fuse(name)
        name = name if name in params else f"model.{name}"  # unmatched names are dropped silently
        fill(params, filled, name, shard, tensor)
    assert_all_filled(params, filled, from_target={"model.embed_tokens.weight"})  # eagle_worker: set_embed
    ids = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    taps = captured_layers([i + 1 for i in ids], num_target_layers)  # "we plus 1 here" (llama.py)
    assert len(taps) * c.get("target_hidden_size", H) == params["model.fc.weight"][None][1]
    return taps, hot_token_id


def vllm_eagle3_loads(folder, num_target_layers):
    """vllm-project/vllm vllm/transformers_utils/configs/speculators/{base,algos}.py (config),
    vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM), gpu_model_runner.py (layer ids);
    field types from vllm-project/speculators src/speculators/config.py, models/eagle3/config.py,
    proposals/greedy.py."""
    d, tensors = read(folder)
    # speculators' pydantic schema (the fields this export uses)
    assert d["speculators_model_type"] == "eagle3" and isinstance(d["speculators_version"], str)
    assert d["architectures"] == ["Eagle3Speculator"]
    spec = d["speculators_config"]
    assert spec["algorithm"] == "eagle3"
    method = spec["proposal_methods"][0]
    assert method["proposal_type"] == spec["default_proposal_method"] == "greedy"
    assert isinstance(method["speculative_tokens"], int) and method["speculative_tokens"] >= 1
    assert method["verifier_accept_k"] >= 1 and method["accept_tolerance"] >= 0.0
    assert isinstance(spec["verifier"]["name_or_path"], str) and isinstance(spec["verifier"]["architectures"], list)
    assert isinstance(d["draft_vocab_size"], int) and isinstance(d["target_hidden_size"], int)
    assert all(isinstance(i, int) for i in d["eagle_aux_hidden_state_layer_ids"])
    AutoConfig.for_model(**d["transformer_layer_config"])  # speculators: config_class(**value)

    # base.py extract_transformers_pre_trained_config + algos.py update_eagle3
    c = dict(d["transformer_layer_config"])
    c["draft_vocab_size"] = d.get("draft_vocab_size")
    if d.get("target_hidden_size") is not None:
        c["target_hidden_size"] = d["target_hidden_size"]
    assert "norm_before_residual" in d, "vLLM would read a missing norm_before_residual as True"
    c["norm_before_residual"] = d.get("norm_before_residual", True)
    assert c["model_type"] == "llama"  # _select_eagle3_architecture -> Eagle3LlamaForCausalLM
    c["eagle_aux_hidden_state_layer_ids"] = d["eagle_aux_hidden_state_layer_ids"]

    H = c["hidden_size"]
    assert c.get("eagle_config", {}).get("use_aux_hidden_state", True)  # else there is no fc
    attention_bias = c.get("attention_bias", False) or c.get("bias", False)
    params = {
        "model.embed_tokens.weight": {None: (c["vocab_size"], H)},
        "model.fc.weight": {None: (H, 3 * c.get("target_hidden_size", H))},  # ReplicatedLinear, bias=False
        "model.norm.weight": {None: (H,)},
        "lm_head.weight": {None: (c["draft_vocab_size"], H)},
        "draft_id_to_target_id": {None: (c["draft_vocab_size"],)},
        **layer_params("model.layers.0", c, qkv_in=2 * H, qkv_bias=c.get("attention_bias", False),
                       o_bias=attention_bias, hidden_norm=True),
    }
    filled = {}
    for name, tensor in tensors.items():  # Eagle3LlamaForCausalLM.load_weights + LlamaModel.load_weights
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        name, shard = fuse(name.replace("midlayer.", "layers.0."))
        fill(params, filled, name, shard, tensor)  # unknown names: KeyError in params_dict
    # no embed_tokens tensor: skipped, and the proposer shares the target's
    assert_all_filled(params, filled, from_target={"model.embed_tokens.weight"})
    taps = captured_layers(c["eagle_aux_hidden_state_layer_ids"], num_target_layers)
    assert len(taps) * c.get("target_hidden_size", H) == params["model.fc.weight"][None][1]
    return c, taps, tensors["d2t"], method["speculative_tokens"], spec["verifier"]["name_or_path"]


def sglang_eagle1_loads(folder):
    """sgl-project/sglang python/sglang/srt/models/llama_eagle.py (LlamaForCausalLMEagle),
    qwen2_eagle.py (Qwen2ForCausalLMEagle), llama.py / qwen2.py (layers, load_weights),
    speculative/eagle_worker.py (set_embed_and_head)."""
    c, tensors = read(folder)
    kind = {"LlamaForCausalLMEagle": "llama", "Qwen2ForCausalLMEagle": "qwen2"}[c["architectures"][0]]
    assert c["model_type"] == kind and c["hidden_act"] == "silu" and c["tie_word_embeddings"] is False
    H = c["hidden_size"]
    if kind == "llama":  # llama.py: attention bias = attention_bias or bias, on qkv and o_proj
        qkv_bias = o_bias = c.get("attention_bias", False) or c.get("bias", False)
        c = {**c, "mlp_bias": False}  # SGLang's LlamaMLP has no bias
    else:  # qwen2.py Qwen2Attention: qkv bias always, o_proj never
        qkv_bias, o_bias = True, False
    params = {
        "model.embed_tokens.weight": {None: (c["vocab_size"], H)},
        "lm_head.weight": {None: (c["vocab_size"], H)},
        "model.fc.weight": {None: (H, 2 * H)},  # torch.nn.Linear(2H, H): bias always
        "model.fc.bias": {None: (H,)},
        # layer 0's input_layernorm is deleted (identity)
        **layer_params("model.layers.0", c, qkv_in=H, qkv_bias=qkv_bias, o_bias=o_bias, input_norm=False),
    }
    filled = {}
    for name, tensor in tensors.items():
        assert "lm_head" not in name, "LlamaForCausalLMEagle.load_weights skips lm_head tensors"
        name, shard = fuse("model." + name)
        # llama.py load_weights drops unknown *.bias silently and warns on other unknown names
        fill(params, filled, name, shard, tensor)
    assert_all_filled(params, filled, from_target={"model.embed_tokens.weight", "lm_head.weight"})
    return kind


def vllm_eagle1_loads(folder):
    """vllm-project/vllm vllm/transformers_utils/configs/eagle.py (EAGLEConfig, method "eagle"),
    model_executor/models/registry.py, llama_eagle.py (EagleLlamaForCausalLM), llama.py (layer)."""
    c, tensors = read(folder)
    archs = [a if a.startswith("Eagle") else f"Eagle{a}" for a in c["architectures"]]  # EAGLEConfig
    assert archs == ["EagleLlamaForCausalLM"]  # the registry's EAGLE-1 Llama entry
    AutoConfig.for_model(**c)  # AutoConfig.for_model(**model) inside EAGLEConfig
    H = c["hidden_size"]
    attention_bias = c.get("attention_bias", False) or c.get("bias", False)  # llama.py LlamaDecoderLayer
    params = {
        "model.embed_tokens.weight": {None: (c["vocab_size"], H)},
        "model.fc.weight": {None: (H, 2 * H)},  # torch.nn.Linear(2H, H, bias=False)
        **layer_params("model.layers.0", c, qkv_in=H, qkv_bias=attention_bias, o_bias=attention_bias,
                       input_norm=False),  # layer 0: nn.Identity
    }
    filled = {}
    for name, tensor in tensors.items():
        assert "lm_head" not in name, "EagleLlamaForCausalLM has no lm_head parameter (the target's is used)"
        name, shard = fuse("model." + name)
        fill(params, filled, name, shard, tensor)  # params_dict[name]: unknown names raise
    assert_all_filled(params, filled, from_target={"model.embed_tokens.weight"})


# -- EAGLE-3 ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def e3(tmp_path_factory):
    target = tiny_target(taps="eagle3", rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    drafter = eagle3(target)
    return target, drafter, make_run(tmp_path_factory.mktemp("e3"), drafter)


def test_sglang_eagle3_loads_and_captures_the_trained_layers(e3, tmp_path):
    target, drafter, run = e3
    assert target.taps == [2, 4, 5]
    out = export(run, "sglang", tmp_path / "sglang")
    taps, hot_token_id = sglang_eagle3_loads(out, target.num_layers)
    assert taps == target.taps
    assert torch.equal(hot_token_id, drafter.draft_to_target)


def test_sglang_eagle3_config_pinned(e3, tmp_path):
    config, tensors = read(export(e3[2], "sglang", tmp_path / "sglang"))
    assert config == {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-06,
        "max_position_embeddings": 512, "rope_theta": 50000.0, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
        "vocab_size": 256, "tie_word_embeddings": False, "torch_dtype": "float32", "dtype": "float32",
        "draft_vocab_size": 64, "target_hidden_size": 64, "bias": False, "attention_bias": False, "mlp_bias": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True},
    }
    assert set(tensors) == set(e3[1].state_dict())  # SGLang's names are ours: a copy
    # transformers 5 reads the same RoPE (newer engines use rope_parameters)
    assert AutoConfig.for_model(**config).rope_parameters["rope_theta"] == 50000.0


def test_vllm_eagle3_loads_as_speculators(e3, tmp_path):
    target, drafter, run = e3
    out = export(run, "vllm", tmp_path / "vllm")
    c, taps, d2t, k, verifier = vllm_eagle3_loads(out, target.num_layers)
    assert taps == target.taps  # vLLM's ids are our taps
    assert torch.equal(d2t, drafter.d2t)
    assert (k, verifier) == (4, "org/tiny-target")  # from the run's recipe
    assert c["norm_before_residual"] is False  # our layer keeps the un-normed hidden as residual
    assert c["target_hidden_size"] == 64 and c["rope_parameters"]["rope_theta"] == 50000.0
    assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["architectures"] == [
        "LlamaForCausalLM"]


def test_vllm_options_override_the_recipe(e3, tmp_path):
    out = export(e3[2], "vllm", tmp_path / "vllm", verifier="/models/llama", num_speculative_tokens=7)
    _, _, _, k, verifier = vllm_eagle3_loads(out, e3[0].num_layers)
    assert (k, verifier) == (7, "/models/llama")


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "hf"])
def test_eagle3_export_reads_back_to_identical_logits(e3, tmp_path, fmt):
    target, drafter, run = e3
    loaded = load_exported(export(run, fmt, tmp_path / fmt), target)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    want = draft_logits(drafter, target, ids)
    assert torch.equal(draft_logits(loaded, target, ids), want)
    # a drafter that did not load the trained weights would differ
    assert not torch.allclose(draft_logits(randomize(eagle3(target), seed=2), target, ids), want)


def test_edited_export_is_refused_on_read_back(e3, tmp_path):
    out = export(e3[2], "sglang", tmp_path / "sglang")
    config = json.loads((out / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdraftError, match="changed after export.*eagle_config"):
        load_exported(out, e3[0])


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_taps_the_engines_cannot_capture_are_refused(tmp_path, fmt):
    # (2, 6//2, 6-3) takes layer 3 twice: refused when the target is built, before any training
    with pytest.raises(SpecdraftError, match=r"repeat a layer"):
        tiny_target(taps="eagle3", num_hidden_layers=6)
    target = tiny_target(taps=[0, 3, 5])  # layer 0's input: hidden + residual does not exist yet
    with pytest.raises(SpecdraftError, match="three distinct layers"):
        export(make_run(tmp_path / "b", eagle3(target)), fmt, tmp_path / "out")


# -- EAGLE-1 ----------------------------------------------------------------------------------------


def test_sglang_eagle1_loads_in_the_reference_layout(tmp_path):
    target = tiny_target()
    drafter = eagle1(target)  # fc with a bias, the reference default
    out = export(make_run(tmp_path, drafter), "sglang", tmp_path / "sglang")
    assert sglang_eagle1_loads(out) == "llama"
    config, tensors = read(out)
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["bias"] is False
    assert "layers.0.input_layernorm.weight" not in tensors and torch.equal(tensors["fc.bias"], drafter.fc.bias)


def test_sglang_eagle1_gets_a_zero_fc_bias_when_trained_without(tmp_path):
    target = tiny_target()
    out = export(make_run(tmp_path, eagle1(target, fc_bias=False)), "sglang", tmp_path / "sglang")
    sglang_eagle1_loads(out)  # SGLang's fc always has a bias: it must be loaded, with zeros
    assert torch.equal(read(out)[1]["fc.bias"], torch.zeros(64))


def test_sglang_eagle1_qwen2_target(tmp_path):
    target = tiny_target(Qwen2Config, num_hidden_layers=2)
    drafter = eagle1(target)
    assert "layers.0.self_attn.q_proj.bias" in drafter.state_dict()
    out = export(make_run(tmp_path, drafter), "sglang", tmp_path / "sglang")
    assert sglang_eagle1_loads(out) == "qwen2"
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    assert torch.equal(draft_logits(load_exported(out, target), target, ids), draft_logits(drafter, target, ids))


def test_vllm_eagle1_loads_without_fc_bias(tmp_path):
    target = tiny_target()
    out = export(make_run(tmp_path, eagle1(target, fc_bias=False)), "vllm", tmp_path / "vllm")
    vllm_eagle1_loads(out)
    config, tensors = read(out)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["bias"] is False
    assert "fc.bias" not in tensors


def test_vllm_eagle1_refuses_a_learned_fc_bias(tmp_path):
    target = tiny_target()
    with pytest.raises(SpecdraftError, match="no bias on fc.*fc_bias: false"):
        export(make_run(tmp_path, eagle1(target)), "vllm", tmp_path / "vllm")
    zero_bias = eagle1(target)
    with torch.no_grad():
        zero_bias.fc.bias.zero_()  # exactly zero: nothing is lost by dropping it
    out = export(make_run(tmp_path / "b", zero_bias), "vllm", tmp_path / "vllm")
    vllm_eagle1_loads(out)
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    assert torch.equal(draft_logits(load_exported(out, target), target, ids), draft_logits(zero_bias, target, ids))


@pytest.mark.parametrize("fmt,fc_bias", [("sglang", True), ("sglang", False), ("vllm", False), ("hf", True)])
def test_eagle1_export_reads_back_to_identical_logits(tmp_path, fmt, fc_bias):
    target = tiny_target()
    drafter = eagle1(target, fc_bias=fc_bias)
    loaded = load_exported(export(make_run(tmp_path, drafter), fmt, tmp_path / fmt), target)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    want = draft_logits(drafter, target, ids)
    assert torch.equal(draft_logits(loaded, target, ids), want)
    assert not torch.allclose(draft_logits(randomize(eagle1(target, fc_bias=fc_bias), seed=2), target, ids), want)


@pytest.mark.parametrize("config_cls,fmt", [(Qwen3Config, "sglang"), (Qwen3Config, "vllm"), (Qwen2Config, "vllm")])
def test_eagle1_layers_without_an_engine_model_are_refused(tmp_path, config_cls, fmt):
    target = tiny_target(config_cls, num_hidden_layers=2)
    with pytest.raises(SpecdraftError, match="EAGLE-1 models for .* only.*--format hf"):
        export(make_run(tmp_path, eagle1(target, fc_bias=False)), fmt, tmp_path / "out")


# -- the command and its errors ---------------------------------------------------------------------


def test_no_checkpoint(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(SpecdraftError, match="no drafter checkpoint"):
        export(tmp_path / "run", "sglang", tmp_path / "out")


def test_unknown_format(e3, tmp_path):
    with pytest.raises(SpecdraftError, match="unknown export format 'onnx'; choose one of hf, sglang, vllm"):
        export(e3[2], "onnx", tmp_path / "out")


def test_format_that_does_not_fit_the_family(tmp_path):
    drafter = tmp_path / "run" / "drafter"  # a family with no engine exporter (e.g. Medusa)
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text(json.dumps({"family": "medusa", "config": {}, "target_config": {}}))
    save_file({"heads.0.weight": torch.ones(2, 2)}, str(drafter / "model.safetensors"))
    with pytest.raises(SpecdraftError, match="medusa drafter cannot be exported as sglang.*Formats for medusa: hf"):
        export(tmp_path / "run", "sglang", tmp_path / "out")
    out = export(tmp_path / "run", "hf", tmp_path / "out")  # hf fits every family
    assert torch.equal(read(out)[1]["heads.0.weight"], torch.ones(2, 2))


def test_output_is_never_overwritten_without_the_flag(e3, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SpecdraftError, match="already exists; pass --overwrite"):
        export(e3[2], "sglang", out)
    assert (out / "keep.txt").read_text() == "mine"
    export(e3[2], "sglang", out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "specdraft.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folders left
    with pytest.raises(SpecdraftError, match="holds the drafter being exported"):
        export(e3[2], "hf", e3[2], overwrite=True)


def test_newest_checkpoint_is_exported_when_the_run_has_no_final_drafter(e3, tmp_path):
    run = tmp_path / "run"
    for step in (5, 10):
        drafter = eagle3(e3[0])
        with torch.no_grad():
            drafter.fc.weight.fill_(step)
        ckpt = run / "checkpoints" / f"step-{step:07d}"
        drafter.save_pretrained(ckpt / "drafter")
        (ckpt / "trainer_state.json").write_text("{}")  # marks the checkpoint complete
    (run / "recipe.yaml").write_text(yaml.safe_dump({"target": {"path": "org/from-recipe"}}))
    config, tensors = read(export(run, "vllm", tmp_path / "vllm"))
    assert torch.equal(tensors["fc.weight"], torch.full((64, 192), 10.0))
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/from-recipe"


def test_rope_is_written_in_both_transformers_spellings():
    v4 = {"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}  # old "type" key
    assert _rope_fields(v4) == {
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0, "rope_type": "linear"},
        "rope_parameters": {"type": "linear", "factor": 2.0, "rope_type": "linear", "rope_theta": 500000.0},
    }
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    v5 = {"rope_parameters": {**llama3, "rope_theta": 500000.0}}
    assert _rope_fields(v5) == {"rope_theta": 500000.0, "rope_scaling": llama3,
                                "rope_parameters": {**llama3, "rope_theta": 500000.0}}
    assert _rope_fields({"rope_theta": 10000.0, "rope_scaling": None})["rope_scaling"] is None


def test_vllm_needs_a_verifier(e3, tmp_path):
    bare = tmp_path / "drafter"
    shutil.copytree(e3[2] / "drafter", bare)  # no recipe next to it, and a from_config target has no path
    with pytest.raises(SpecdraftError, match="--verifier"):
        export(bare, "vllm", tmp_path / "out")
    assert export(bare, "sglang", tmp_path / "out").is_dir()  # SGLang's config does not name the target


def test_cli(e3, tmp_path, capsys):
    assert main(["export", str(e3[2]), "--format", "sglang", "--out", str(tmp_path / "out")]) == 0
    assert "--speculative-algorithm EAGLE3" in capsys.readouterr().out
    assert main(["export", str(e3[2]), "--format", "sglang", "--out", str(tmp_path / "out")]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
