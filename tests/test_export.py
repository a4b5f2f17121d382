"""specdraft export: every format loads in every consumer that reads it, runs the trained drafter
there, and reads back into the same drafter.

The consumers are not installed here, so the ``*_loads`` helpers below re-implement what each one
does with an exported folder, citing the file each rule was read from: vLLM 0.33.0, sglang 0.5.23
and speculators 0.9.0 as their PyPI wheels ship them, and SafeAILab/EAGLE (main, cb7e084), whose
EaModel reads the sglang-format folders. Each helper checks the config the way the consumer's
config class does, builds the consumer's parameter table from it the way the model's ``__init__``
does, routes every tensor the way its loader does (keeping the values), and requires every
parameter the consumer does not take from the target to be filled, with the right shape. Loaders
that pass over unknown or missing names silently (``strict=False``, SGLang's unmatched names,
transformers' ignored missing keys) are held to the same: a parameter nobody fills runs on its
initial value. Each helper returns the weights the consumer ends up running, with the config values
it reads; ``eagle3_logits`` / ``eagle1_logits`` compute the draft logits from those, mapped into
the target's vocabulary the consumer's way, for comparison with specdraft's own forward.
"""

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaConfig, Qwen2Config, Qwen3Config

from specdraft.cli import main
from specdraft.data.vocab import DraftVocab
from specdraft.drafters import FAMILIES
from specdraft.errors import SpecdraftError
from specdraft.contract import TargetNeeds
from specdraft.drafters.eagle3 import eagle3_default_taps
from specdraft.drafters.eagle_export import _rope_fields
from specdraft.export import export, load_exported, read_target_embedding
from specdraft.target import FrozenTarget
from tiny import seeded_init_

TINY = dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False)

# Consumer logits against specdraft's: both float32 from the same weights, but through different
# operations (fused q/k/v and gate/up matmuls, an explicit softmax attention against SDPA, RoPE
# tables built here), so they agree only to float32 rounding. These logits are O(1) and differ by
# < 1e-6; a wrong RoPE base moves them by ~1e-2 and a wrong tensor or embedding by O(1)
# (test_the_checks_see_a_wrong_tensor_and_a_wrong_rope), so 1e-4 separates the two with margin on both sides.
RTOL, ATOL = 1e-4, 1e-4


def tiny_target(config_cls=LlamaConfig, taps=None, seed=0, **overrides):
    """taps: "eagle3" (EAGLE-3's default layers for this depth), a list, or None."""
    config = config_cls(**{**TINY, **overrides})
    config.architectures = [config_cls.__name__.replace("Config", "ForCausalLM")]
    if taps == "eagle3":
        taps = eagle3_default_taps(config.num_hidden_layers)
    target = FrozenTarget.from_config(config, needs=TargetNeeds(taps=taps or (), final_hidden=True), device="cpu")
    seeded_init_(target.model, seed=seed, std=config.initializer_range)
    return target


def save_target(target, folder, sharded=False):
    """The target as a checkpoint folder; sharded: many files and a model.safetensors.index.json."""
    target.model.save_pretrained(folder, max_shard_size="100KB" if sharded else "1GB")
    assert (folder / "model.safetensors.index.json").is_file() == sharded
    return folder


def randomize(drafter, seed=1):
    """Every trained tensor distinct (norm weights too), so a dropped or swapped tensor changes the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return drafter


def make_run(tmp_path, drafter, target_path, k=4):
    run = tmp_path / "run"
    drafter.save_pretrained(run / "drafter")
    (run / "recipe.yaml").write_text(yaml.safe_dump({"target": {"path": str(target_path)}, "eval": {"k": k}}))
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


IDS = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))


def draft_logits(drafter, target, ids=IDS):
    """Draft logits at every position of ``ids``, read from real target features."""
    T = ids.shape[1] - 1
    hidden = drafter.draft_input(drafter.target_features(target(ids)))[:, :T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        return drafter.draft_logits(drafter.draft_step(hidden, ids[:, 1:], torch.arange(T)[None], None, causal))


def in_target_vocab(logits, draft_to_target, vocab_size):
    """Draft-vocabulary logits at their target ids, -inf elsewhere (vLLM's compute_logits)."""
    if draft_to_target is None:
        assert logits.shape[-1] == vocab_size
        return logits
    out = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    out[..., draft_to_target] = logits
    return out


def specdraft_logits(drafter, target, ids=IDS):
    return in_target_vocab(draft_logits(drafter, target, ids), drafter.draft_to_target, target.vocab_size)


def read(folder):
    return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def target_embedding(target):
    return target.embed_tokens.weight.detach()


# -- parameter tables, as the consumers build and fill them ----------------------------------------

# vLLM's and SGLang's load_weights fuse these: a q/k/v or gate/up tensor is one shard of a
# QKVParallelLinear / MergedColumnParallelLinear parameter.
STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]


def layer_params(prefix, c, qkv_in, qkv_bias=False, o_bias=False, mlp_bias=False, input_norm=True,
                 hidden_norm=False, fused=True, head_dim=None, qk_norm=False):
    """A Llama attention + MLP + norms as the consumer builds them; name -> {shard: shape}.
    fused: vLLM/SGLang (qkv_proj, gate_up_proj); else transformers-style separate projections.
    qk_norm: a Qwen3 layer's q_norm / k_norm (over head_dim)."""
    H, I = c["hidden_size"], c["intermediate_size"]
    hd = head_dim or c.get("head_dim") or H // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    if fused:
        params = {
            f"{prefix}.self_attn.qkv_proj.weight": {"q": (q, qkv_in), "k": (kv, qkv_in), "v": (kv, qkv_in)},
            f"{prefix}.mlp.gate_up_proj.weight": {0: (I, H), 1: (I, H)},
        }
        if qkv_bias:
            params[f"{prefix}.self_attn.qkv_proj.bias"] = {"q": (q,), "k": (kv,), "v": (kv,)}
        if mlp_bias:
            params[f"{prefix}.mlp.gate_up_proj.bias"] = {0: (I,), 1: (I,)}
    else:
        sizes = (("q", q), ("k", kv), ("v", kv))
        params = {f"{prefix}.self_attn.{p}_proj.weight": {None: (n, qkv_in)} for p, n in sizes}
        params |= {f"{prefix}.mlp.{p}_proj.weight": {None: (I, H)} for p in ("gate", "up")}
        if qkv_bias:
            params |= {f"{prefix}.self_attn.{p}_proj.bias": {None: (n,)} for p, n in sizes}
        if mlp_bias:
            params |= {f"{prefix}.mlp.{p}_proj.bias": {None: (I,)} for p in ("gate", "up")}
    params[f"{prefix}.self_attn.o_proj.weight"] = {None: (H, q)}
    params[f"{prefix}.mlp.down_proj.weight"] = {None: (H, I)}
    params[f"{prefix}.post_attention_layernorm.weight"] = {None: (H,)}
    if o_bias:
        params[f"{prefix}.self_attn.o_proj.bias"] = {None: (H,)}
    if mlp_bias:
        params[f"{prefix}.mlp.down_proj.bias"] = {None: (H,)}
    for norm, present in (("input_layernorm", input_norm), ("hidden_norm", hidden_norm)):
        if present:
            params[f"{prefix}.{norm}.weight"] = {None: (H,)}
    if qk_norm:
        params |= {f"{prefix}.self_attn.{n}.weight": {None: (hd,)} for n in ("q_norm", "k_norm")}
    return params


def fuse(name):
    for fused, part, shard in STACKED:
        if part in name:
            return name.replace(part, fused), shard
    return name, None


def fill(params, loaded, name, shard, tensor):
    assert name in params, f"the consumer has no parameter {name}"
    assert shard in params[name], f"{name} has no shard {shard}"
    want = params[name][shard]
    assert tuple(tensor.shape) == want, f"{name}[{shard}]: {tuple(tensor.shape)} != {want}"
    assert shard not in loaded.setdefault(name, {}), f"{name}[{shard}] loaded twice"
    loaded[name][shard] = tensor


def assert_all_filled(params, loaded, from_target):
    """Every parameter (and persistent buffer) the consumer has is loaded, or is one it takes from the target."""
    for name, shards in params.items():
        if name not in from_target:
            filled = set(loaded.get(name, {}))
            assert filled == set(shards), f"{name} left uninitialized (filled {filled})"


def value(loaded, name, order=(None,)):
    """A parameter as the consumer holds it: fused shards stacked in the order its layer splits them."""
    return torch.cat([loaded[name][s] for s in order]) if len(order) > 1 else loaded[name][order[0]]


def qk_norms(loaded, prefix):
    """A Qwen3 layer's q_norm / k_norm weights, where the consumer has them."""
    names = {"q_norm": f"{prefix}.self_attn.q_norm.weight", "k_norm": f"{prefix}.self_attn.k_norm.weight"}
    return {key: value(loaded, name) for key, name in names.items() if name in loaded}


def fused_layer(loaded, prefix, bias=False, o_bias=False):
    """q/k/v and gate/up of a vLLM/SGLang layer, in the fused layout its forward splits."""
    w = {**qk_norms(loaded, prefix),"qkv": value(loaded, f"{prefix}.self_attn.qkv_proj.weight", "qkv"),
         "o": value(loaded, f"{prefix}.self_attn.o_proj.weight"),
         "gate_up": value(loaded, f"{prefix}.mlp.gate_up_proj.weight", (0, 1)),
         "down": value(loaded, f"{prefix}.mlp.down_proj.weight"),
         "post_norm": value(loaded, f"{prefix}.post_attention_layernorm.weight")}
    if bias:
        w["qkv_bias"] = value(loaded, f"{prefix}.self_attn.qkv_proj.bias", "qkv")
    if o_bias:
        w["o_bias"] = value(loaded, f"{prefix}.self_attn.o_proj.bias")
    return w


def split_layer(loaded, prefix, qkv_bias=False):
    """The same from separate projections (speculators, EaModel), stacked as a fused layer would be."""
    w = {**qk_norms(loaded, prefix),"qkv": torch.cat([value(loaded, f"{prefix}.self_attn.{p}_proj.weight") for p in "qkv"]),
         "o": value(loaded, f"{prefix}.self_attn.o_proj.weight"),
         "gate_up": torch.cat([value(loaded, f"{prefix}.mlp.{p}_proj.weight") for p in ("gate", "up")]),
         "down": value(loaded, f"{prefix}.mlp.down_proj.weight"),
         "post_norm": value(loaded, f"{prefix}.post_attention_layernorm.weight")}
    if qkv_bias:
        w["qkv_bias"] = torch.cat([value(loaded, f"{prefix}.self_attn.{p}_proj.bias") for p in "qkv"])
    return w


def dims(c, theta, head_dim=None):
    return {"heads": c["num_attention_heads"], "kv_heads": c.get("num_key_value_heads") or c["num_attention_heads"],
            "head_dim": head_dim or c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            "eps": c["rms_norm_eps"], "theta": theta}


def rope_theta(c):
    """The RoPE base a transformers-5 config object carries (vLLM, SGLang, speculators build from it)."""
    return AutoConfig.for_model(**c).rope_parameters["rope_theta"]


def rope_of(c):
    """The RoPE parameters (type, base, scaling) a transformers-5 config object carries: the engines' get_rope
    reads these."""
    return dict(AutoConfig.for_model(**c).rope_parameters)


# -- the draft forward, from a consumer's weights ----------------------------------------------------


def rms_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_frequencies(d: int, rope: dict) -> tuple[torch.Tensor, float]:
    """The [d/2] inverse frequencies and the cos/sin scale that vLLM 0.33's get_rope builds from a config's
    rope_parameters (model_executor/layers/rotary_embedding): base.py (default), llama3_rope.py
    (Llama3RotaryEmbedding._compute_inv_freq), yarn_scaling_rope.py with common.py's yarn_find_correction_range,
    yarn_linear_ramp_mask and yarn_get_mscale (truncate, attention_factor, mscale / mscale_all_dim honoured; sglang
    0.5.23's srt/layers/rotary_embedding/yarn.py reads the same keys)."""
    theta, kind = rope["rope_theta"], rope.get("rope_type", "default")
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    if kind == "default":
        return inv_freq, 1.0
    factor = rope["factor"]
    if kind == "llama3":
        old, low, high = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"]
        wave_len = 2 * math.pi / inv_freq
        smooth = (old / wave_len - low) / (high - low) if low != high else 0
        return torch.where(wave_len < old / high, inv_freq, torch.where(
            wave_len > old / low, inv_freq / factor, (1 - smooth) * inv_freq / factor + smooth * inv_freq)), 1.0
    assert kind == "yarn", f"no engine RoPE re-implemented here for rope_type {kind!r}"
    old = rope["original_max_position_embeddings"]

    def correction_dim(rotations):
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(rope.get("beta_fast", 32)), correction_dim(rope.get("beta_slow", 1))
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / ((high + 0.001 if low == high else high) - low))
    extrapolated = 1 - ramp.clamp(0, 1)
    inv_freq = inv_freq / factor * (1 - extrapolated) + inv_freq * extrapolated

    def get_mscale(m=1.0):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if rope.get("attention_factor") is not None:
        return inv_freq, float(rope["attention_factor"])
    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return inv_freq, get_mscale(rope["mscale"]) / get_mscale(rope["mscale_all_dim"])
    return inv_freq, get_mscale()


def rotate(x, rope):
    """Neox-style RoPE at positions 0..T-1 on [B, heads, T, d]: ``rope`` is a base (no scaling) or a config's
    rope_parameters (see rope_frequencies). As get_rope, a partial_rotary_factor rotates the head's first
    d * factor dims only (vLLM base.py forward_native: query_rot / query_pass)."""
    rope = rope if isinstance(rope, dict) else {"rope_theta": rope}
    T, d = x.shape[-2], int(x.shape[-1] * rope.get("partial_rotary_factor", 1.0))
    x, passed = x[..., :d], x[..., d:]
    inv_freq, scale = rope_frequencies(d, rope)
    angles = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos() * scale, torch.cat([angles, angles], -1).sin() * scale
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x * cos + torch.cat([-x2, x1], dim=-1) * sin, passed], dim=-1)


def attention(x, w):
    B, T, _ = x.shape
    h, kvh, d = w["heads"], w["kv_heads"], w["head_dim"]
    qkv = x @ w["qkv"].T
    if "qkv_bias" in w:
        qkv = qkv + w["qkv_bias"]
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = (t.view(B, T, -1, d).transpose(1, 2) for t in (q, k, v))
    if "q_norm" in w:  # Qwen3 layers: each head's q and k RMS-normed before RoPE
        q, k = rms_norm(q, w["q_norm"], w["eps"]), rms_norm(k, w["k_norm"], w["eps"])
    q, k = rotate(q, w["theta"]), rotate(k, w["theta"])
    k, v = k.repeat_interleave(h // kvh, dim=1), v.repeat_interleave(h // kvh, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, h * d) @ w["o"].T
    return out + w["o_bias"] if "o_bias" in w else out


def mlp(x, w):
    gate, up = (x @ w["gate_up"].T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w["down"].T


def eagle3_logits(w, target, ids=IDS):
    """The EAGLE-3 draft step the engines run (llama_eagle3.py): hidden = fc(aux); the first layer
    attends over [input_norm(embed(t)); hidden_norm(hidden)] with the un-normed hidden as residual."""
    T = ids.shape[1] - 1
    with torch.no_grad():
        hidden = target(ids).aux_hidden[:, :T] @ w["fc"].T
        x = torch.cat([rms_norm(w["embed"][ids[:, 1:]], w["input_norm"], w["eps"]),
                       rms_norm(hidden, w["hidden_norm"], w["eps"])], dim=-1)
        h = hidden + attention(x, w)
        out = h + mlp(rms_norm(h, w["post_norm"], w["eps"]), w)
        logits = rms_norm(out, w["norm"], w["eps"]) @ w["lm_head"].T
    return in_target_vocab(logits, w["to_target"], w["vocab_size"])


def eagle1_logits(w, target, ids=IDS):
    """The EAGLE-1 draft step (cnets1.py, llama_eagle.py): fc([embed(t); f]), one layer without its
    input norm, the target's LM head on the pre-norm output."""
    T = ids.shape[1] - 1
    with torch.no_grad():
        x = torch.cat([w["embed"][ids[:, 1:]], target(ids).final_hidden[:, :T]], dim=-1) @ w["fc"].T
        if "fc_bias" in w:
            x = x + w["fc_bias"]
        h = x + attention(x, w)
        out = h + mlp(rms_norm(h, w["post_norm"], w["eps"]), w)
        return out @ w["lm_head"].T


def assert_same_logits(consumer, drafter, target):
    want = specdraft_logits(drafter, target)
    assert torch.allclose(consumer, want, rtol=RTOL, atol=ATOL), (consumer - want).abs().max()


def captured_layers(ids, num_layers):
    """vllm/model_executor/models/llama.py and sglang srt/models/llama.py:
    ``for i in layers: if i in capture: aux.append(hidden_states + residual)`` -- each layer once, and
    layer 0 has no residual yet."""
    captured = [i for i in range(num_layers) if i in ids]
    assert 0 not in captured, "layer 0's input has no residual to add in either engine"
    return captured


# -- EAGLE-3 consumers --------------------------------------------------------------------------------


def sglang_eagle3_loads(folder, target):
    """sglang 0.5.23 srt/models/llama_eagle3.py (LlamaForCausalLMEagle3, its LlamaModel and load_weights),
    models/llama.py (attention bias, set_embed, set_eagle3_layers_to_capture), speculative/eagle_worker_v2.py
    (init_lm_head: set_embed, hot_token_id from the draft's d2t), model_executor/model_runner_components/
    spec_aux_hidden_state.py (layer ids)."""
    c, tensors = read(folder)
    assert c["architectures"] == ["LlamaForCausalLMEagle3"]  # EntryClass
    assert c["model_type"] == "llama"  # AutoConfig -> LlamaConfig; "llama4_text" switches intermediate size
    assert c["hidden_act"] == "silu"  # llama.py LlamaMLP raises otherwise
    assert c["tie_word_embeddings"] is False  # True: lm_head = embed_tokens
    assert isinstance(c["draft_vocab_size"], int)  # None: a vocab_size-wide head loaded from the target
    assert c.get("norm_output", False) is False  # else the next step's hidden is the normed one (ours is not)
    H, N = c["hidden_size"], c["draft_vocab_size"]
    eagle_config = c.get("eagle_config") or {}
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    num_aux = c.get("num_aux_hidden_states") or (len(ids) if ids else 3)
    hidden_in = c.get("target_hidden_size", H)
    attention_bias = c.get("attention_bias", False) or c.get("bias", False)  # llama.py LlamaAttention
    params = {
        "model.embed_tokens.weight": {None: (c["vocab_size"], H)},
        "model.fc.weight": {None: (H, num_aux * hidden_in)},
        "model.norm.weight": {None: (H,)},
        "lm_head.weight": {None: (N, H)},
        # qkv_proj overridden: 2H inputs, bias=False; o_proj keeps llama.py's bias; LlamaMLP has no bias
        **layer_params("model.layers.0", c, qkv_in=2 * H, o_bias=attention_bias, hidden_norm=True),
    }
    if c.get("bias", False):
        params["model.fc.bias"] = {None: (H,)}
    if eagle_config.get("norm_before_fc", c.get("norm_before_fc", False)):
        params["model.input_norm.weight"] = {None: (num_aux * hidden_in,)}
    if c.get("fc_norm") or c.get("use_aux_norm", False):
        params |= {f"model.fc_norm.{i}.weight": {None: (hidden_in,)} for i in range(num_aux)}
    loaded, hot_token_id = {}, None
    for name, tensor in tensors.items():
        name = name.replace("midlayer", "layers.0")  # legacy_name_map
        if "d2t" in name:
            hot_token_id = tensor + torch.arange(tensor.shape[0])
            continue
        if "t2d" in name:
            continue
        name, shard = fuse(name)
        name = name if name in params else f"model.{name}"
        assert name in params, f"SGLang drops {name} silently"
        fill(params, loaded, name, shard, tensor)
    assert_all_filled(params, loaded, from_target={"model.embed_tokens.weight"})
    taps = captured_layers([i + 1 for i in ids], target.num_layers)  # "we plus 1 here" (llama.py)
    # set_embed: the target's embedding replaces the draft's (hidden sizes equal)
    assert c.get("target_hidden_size", H) == H
    w = {"embed": target_embedding(target), "fc": value(loaded, "model.fc.weight"),
         "input_norm": value(loaded, "model.layers.0.input_layernorm.weight"),
         "hidden_norm": value(loaded, "model.layers.0.hidden_norm.weight"),
         "norm": value(loaded, "model.norm.weight"), "lm_head": value(loaded, "lm_head.weight"),
         **fused_layer(loaded, "model.layers.0", o_bias=attention_bias),
         **dims(c, rope_of(c)), "to_target": hot_token_id, "vocab_size": target.vocab_size}
    return taps, w


def vllm_eagle3_loads(folder, target):
    """vLLM 0.33.0 vllm/transformers_utils/configs/speculators/{base,algos}.py (config),
    vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM), v1/spec_decode/llm_base_proposer.py
    (_maybe_share_embeddings), v1/worker/gpu_model_runner.py (layer ids); field types from speculators 0.9.0
    src/speculators/config.py, models/eagle3/config.py, proposals/greedy.py."""
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
    assert c["norm_before_residual"] is False  # the residual is the hidden before hidden_norm (ours)
    for key in ("norm_before_fc", "fc_norm", "norm_output"):
        c[key] = d.get(key, False)
    assert c["norm_output"] is False  # the next step's hidden is the pre-norm output (ours)
    assert c["model_type"] in ("llama", "qwen3")  # eagle3_arch_map -> Eagle3LlamaForCausalLM, Eagle3Qwen3ForCausalLM
    qk_norm = c["model_type"] == "qwen3"  # qwen3_eagle3.py: Qwen3DecoderLayer's q_norm / k_norm
    assert not qk_norm or all(t == "full_attention" for t in c["layer_types"])  # no sliding window
    c["eagle_aux_hidden_state_layer_ids"] = d["eagle_aux_hidden_state_layer_ids"]

    H = c["hidden_size"]
    N = c["draft_vocab_size"] if c["draft_vocab_size"] is not None else c["vocab_size"]
    eagle_config = c.get("eagle_config") or {}
    assert eagle_config.get("use_aux_hidden_state", True)  # else there is no fc
    norm_before_fc = bool(eagle_config.get("norm_before_fc", c["norm_before_fc"]))
    layer_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    num_aux = c.get("num_aux_hidden_states") or (len(layer_ids) if layer_ids else 3)
    hidden_in = c.get("target_hidden_size", H)
    attention_bias = c.get("attention_bias", False) or c.get("bias", False)
    params = {
        "model.embed_tokens.weight": {None: (c["vocab_size"], H)},
        "model.fc.weight": {None: (H, num_aux * hidden_in)},  # ReplicatedLinear, bias=False
        "model.norm.weight": {None: (H,)},
        "lm_head.weight": {None: (N, H)},
        **layer_params("model.layers.0", c, qkv_in=2 * H, qkv_bias=c.get("attention_bias", False),
                       o_bias=attention_bias, mlp_bias=c.get("mlp_bias", False), hidden_norm=True, qk_norm=qk_norm),
    }
    target_vocab = target.config.vocab_size  # model_config.get_vocab_size(): the target's
    if N != target_vocab:
        params["draft_id_to_target_id"] = {None: (N,)}
    if norm_before_fc:
        params["model.input_norm.weight"] = {None: (num_aux * hidden_in,)}
    if c["fc_norm"]:
        params |= {f"model.fc_norm.{i}.weight": {None: (hidden_in,)} for i in range(num_aux)}
    loaded = {}
    for name, tensor in tensors.items():  # Eagle3LlamaForCausalLM.load_weights + LlamaModel's mapper
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        name, shard = fuse(name.replace("midlayer.", "layers.0."))
        assert name in params, f"There is no module or parameter named {name!r} in Eagle3LlamaForCausalLM"
        fill(params, loaded, name, shard, tensor)
    # no embed_tokens tensor: skipped, and the proposer shares the target's
    assert_all_filled(params, loaded, from_target={"model.embed_tokens.weight"})
    taps = captured_layers(c["eagle_aux_hidden_state_layer_ids"], target.num_layers)
    # _maybe_share_embeddings: no own embedding, or one identical to the target's -> the target's
    own = loaded.get("model.embed_tokens.weight", {}).get(None)
    shared = own is None or torch.equal(own, target_embedding(target))
    assert c["vocab_size"] == target_vocab  # compute_logits scatters into the draft config's vocab_size
    to_target = None
    if "draft_id_to_target_id" in params:
        to_target = torch.arange(N) + value(loaded, "draft_id_to_target_id")
    w = {"embed": target_embedding(target) if shared else own, "fc": value(loaded, "model.fc.weight"),
         "input_norm": value(loaded, "model.layers.0.input_layernorm.weight"),
         "hidden_norm": value(loaded, "model.layers.0.hidden_norm.weight"),
         "norm": value(loaded, "model.norm.weight"), "lm_head": value(loaded, "lm_head.weight"),
         **fused_layer(loaded, "model.layers.0", bias=c.get("attention_bias", False), o_bias=attention_bias),
         **dims(c, rope_of(c)), "to_target": to_target, "vocab_size": c["vocab_size"]}
    return c, taps, w, method["speculative_tokens"], spec["verifier"]["name_or_path"], shared


def speculators_eagle3_loads(folder, target):
    """speculators 0.9.0 SpeculatorModel.from_pretrained on the vllm export: src/speculators/model.py
    (from_pretrained, DraftVocabMixin._init_vocab / load_verifier_weights), models/eagle3/core.py
    (Eagle3DraftModel), models/eagle3/config.py, models/eagle3/model_definitions.py (first layer),
    models/utils.py (resolve_target_layer_ids), under transformers 5: a missing key is materialised
    uninitialised, and embed_tokens / lm_head are copied from the verifier only where still NaN."""
    d, tensors = read(folder)
    tl = AutoConfig.for_model(**d["transformer_layer_config"])  # validate_transformer_config
    assert tl.model_type in ("llama", "qwen3")  # model_classes
    assert "head_dim" in d["transformer_layer_config"], "the rotary config doubles hidden_size: head_dim must be set"
    H, V, N = tl.hidden_size, tl.vocab_size, d["draft_vocab_size"]
    use_draft_vocab = N != V
    # from_pretrained / load_verifier_weights open the verifier: it must be a folder or hub id
    verifier = AutoConfig.from_pretrained(d["speculators_config"]["verifier"]["name_or_path"])
    ids = d["eagle_aux_hidden_state_layer_ids"]
    assert ids and len(set(ids)) == len(ids) and 0 <= min(ids) and max(ids) <= verifier.num_hidden_layers
    assert verifier.hidden_size == H  # "Verifier hidden size ... does not match draft hidden size"
    tc = {"hidden_size": H, "intermediate_size": tl.intermediate_size, "num_attention_heads": tl.num_attention_heads,
          "num_key_value_heads": tl.num_key_value_heads, "head_dim": tl.head_dim, "rms_norm_eps": tl.rms_norm_eps}
    params = {
        "embed_tokens.weight": {None: (V, H)},
        "fc.weight": {None: (H, len(ids) * H)},
        "norm.weight": {None: (H,)},
        "lm_head.weight": {None: (N, H)},
        "verifier_lm_head.weight": {None: (N, H)},
        "verifier_norm.weight": {None: (H,)},
        **layer_params("layers.0", tc, qkv_in=2 * H, qkv_bias=tl.attention_bias, o_bias=tl.attention_bias,
                       mlp_bias=tl.mlp_bias, hidden_norm=True, fused=False, qk_norm=tl.model_type == "qwen3"),
    }
    if use_draft_vocab:  # persistent buffers
        params |= {"d2t": {None: (N,)}, "t2d": {None: (V,)}}
    if d.get("norm_before_fc", False):
        params["input_norm.weight"] = {None: (len(ids) * H,)}
    if d.get("fc_norm", False):
        params |= {f"fc_norm.{i}.weight": {None: (H,)} for i in range(len(ids))}
    loaded = {}
    for name, tensor in tensors.items():
        assert name in params, f"transformers drops the unexpected key {name} with a warning"
        fill(params, loaded, name, None, tensor)
    # load_verifier_weights loads these two unconditionally; embed_tokens and lm_head only where NaN
    assert_all_filled(params, loaded, from_target={"verifier_lm_head.weight", "verifier_norm.weight"})
    assert not d.get("norm_output", False) and not d.get("norm_before_residual", False)
    to_target = torch.arange(N) + value(loaded, "d2t") if use_draft_vocab else None
    w = {"embed": value(loaded, "embed_tokens.weight"), "fc": value(loaded, "fc.weight"),
         "input_norm": value(loaded, "layers.0.input_layernorm.weight"),
         "hidden_norm": value(loaded, "layers.0.hidden_norm.weight"),
         "norm": value(loaded, "norm.weight"), "lm_head": value(loaded, "lm_head.weight"),
         **split_layer(loaded, "layers.0"),
         **dims(tc, dict(tl.rope_parameters), head_dim=tl.head_dim), "to_target": to_target, "vocab_size": V}
    return w


def econfig(c):
    """SafeAILab/EAGLE eagle/model/configs.py EConfig._rope_scaling_validation, and what cnets.py /
    cnets1.py read from it: head_dim = hidden_size // num_attention_heads, RoPE base rope_theta. As under
    transformers 4, which the EAGLE repo requires: config keys become attributes as written."""
    scaling = c.get("rope_scaling")
    assert scaling is None or (len(scaling) == 2 and scaling.get("type") in ("linear", "dynamic")), (
        f"EConfig rejects rope_scaling {scaling}")
    assert scaling is None, "cnets.py would scale RoPE; these tests use unscaled targets"
    H, heads = c["hidden_size"], c["num_attention_heads"]
    assert (H // heads) * heads == H  # LlamaAttention raises otherwise
    return H // heads, c.get("rope_theta", 10000)  # hasattr(config, "rope_theta")


def eamodel_eagle3_loads(folder, target, target_dir):
    """SafeAILab/EAGLE EaModel.from_pretrained(use_eagle3=True, base_model_path=target_dir,
    ea_model_path=folder): eagle/model/ea_model.py (EConfig from config.json, d2t/t2d deleted when
    vocab_size == draft_vocab_size, load_state_dict(strict=False)), eagle/model/cnets.py (Model)."""
    c, tensors = read(folder)
    head_dim, theta = econfig(c)
    H, V, N = c["hidden_size"], c["vocab_size"], c["draft_vocab_size"]
    ec = {**c, "num_key_value_heads": c.get("num_key_value_heads") or c["num_attention_heads"]}
    params = {
        "embed_tokens.weight": {None: (V, H)},
        "lm_head.weight": {None: (N, H)},
        "fc.weight": {None: (H, 3 * c.get("target_hidden_size", H))},  # bias=False whatever "bias" says
        "norm.weight": {None: (H,)},
        **layer_params("midlayer", ec, qkv_in=2 * H, hidden_norm=True, fused=False, head_dim=head_dim),
    }
    if V != N:  # zero-initialised buffers
        params |= {"d2t": {None: (N,)}, "t2d": {None: (V,)}}
    from_target = set()
    if "target_hidden_size" not in c:  # Model.__init__: `if load_emb and not hasattr(config, "target_hidden_size")`
        indexes = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
        assert any((target_dir / i).is_file() for i in indexes), "cnets.py reads the base embedding only via an index"
        from_target.add("embed_tokens.weight")
    loaded = {}
    for name, tensor in tensors.items():
        assert name in params, f"load_state_dict(strict=False) drops {name} silently"
        fill(params, loaded, name, None, tensor)  # a size mismatch raises even with strict=False
    assert_all_filled(params, loaded, from_target)
    embed = value(loaded, "embed_tokens.weight") if "embed_tokens.weight" in loaded else target_embedding(target)
    to_target = None if V == N else torch.arange(N) + value(loaded, "d2t")  # topK_genrate
    w = {"embed": embed, "fc": value(loaded, "fc.weight"),
         "input_norm": value(loaded, "midlayer.input_layernorm.weight"),
         "hidden_norm": value(loaded, "midlayer.hidden_norm.weight"),
         "norm": value(loaded, "norm.weight"), "lm_head": value(loaded, "lm_head.weight"),
         **split_layer(loaded, "midlayer"),
         **dims(ec, theta, head_dim=head_dim), "to_target": to_target, "vocab_size": target.vocab_size}
    return w


# -- EAGLE-1 consumers --------------------------------------------------------------------------------


def sglang_eagle1_loads(folder, target):
    """sglang 0.5.23 srt/models/llama_eagle.py (LlamaForCausalLMEagle), qwen2_eagle.py (Qwen2ForCausalLMEagle),
    llama.py / qwen2.py (layers, load_weights), speculative/eagle_worker_v2.py (set_embed_and_head)."""
    c, tensors = read(folder)
    kind = {"LlamaForCausalLMEagle": "llama", "Qwen2ForCausalLMEagle": "qwen2"}[c["architectures"][0]]
    assert c["model_type"] == kind and c["hidden_act"] == "silu" and c["tie_word_embeddings"] is False
    H = c["hidden_size"]
    if kind == "llama":  # llama.py: attention bias = attention_bias or bias, on qkv and o_proj
        qkv_bias = o_bias = c.get("attention_bias", False) or c.get("bias", False)
    else:  # qwen2.py Qwen2Attention: qkv bias always, o_proj never
        qkv_bias, o_bias = True, False
    params = {
        "model.embed_tokens.weight": {None: (c["vocab_size"], H)},
        "lm_head.weight": {None: (c["vocab_size"], H)},
        "model.fc.weight": {None: (H, 2 * H)},  # torch.nn.Linear(2H, H): bias always
        "model.fc.bias": {None: (H,)},
        # layer 0's input_layernorm is deleted (identity); SGLang's MLPs have no bias
        **layer_params("model.layers.0", c, qkv_in=H, qkv_bias=qkv_bias, o_bias=o_bias, input_norm=False),
    }
    loaded = {}
    for name, tensor in tensors.items():
        assert "lm_head" not in name, "LlamaForCausalLMEagle.load_weights skips lm_head tensors"
        name, shard = fuse("model." + name)
        # llama.py load_weights drops unknown *.bias silently and warns on other unknown names
        fill(params, loaded, name, shard, tensor)
    assert_all_filled(params, loaded, from_target={"model.embed_tokens.weight", "lm_head.weight"})
    w = {"embed": target_embedding(target), "lm_head": target.lm_head.weight.detach(),
         "fc": value(loaded, "model.fc.weight"), "fc_bias": value(loaded, "model.fc.bias"),
         **fused_layer(loaded, "model.layers.0", bias=qkv_bias, o_bias=o_bias), **dims(c, rope_theta(c))}
    return kind, w


def vllm_eagle1_loads(folder, target):
    """vLLM 0.33.0 vllm/transformers_utils/configs/eagle.py (EAGLEConfig, method "eagle"),
    model_executor/models/registry.py, llama_eagle.py (EagleLlamaForCausalLM), llama.py (layer)."""
    c, tensors = read(folder)
    archs = [a if a.startswith("Eagle") else f"Eagle{a}" for a in c["architectures"]]  # EAGLEConfig
    assert archs == ["EagleLlamaForCausalLM"]  # the registry's EAGLE-1 Llama entry
    AutoConfig.for_model(**c)  # AutoConfig.for_model(**model) inside EAGLEConfig
    H = c["hidden_size"]
    attention_bias = c.get("attention_bias", False) or c.get("bias", False)  # llama.py LlamaDecoderLayer
    params = {
        "model.embed_tokens.weight": {None: (c["vocab_size"], H)},
        "model.fc.weight": {None: (H, 2 * H)},  # ReplicatedLinear(2H, H, bias=False)
        **layer_params("model.layers.0", c, qkv_in=H, qkv_bias=attention_bias, o_bias=attention_bias,
                       mlp_bias=c.get("mlp_bias", False), input_norm=False),  # layer 0: input norm disabled
    }
    loaded = {}
    for name, tensor in tensors.items():
        assert "lm_head" not in name, "EagleLlamaForCausalLM has no lm_head parameter (the target's is used)"
        name, shard = fuse("model." + name)
        fill(params, loaded, name, shard, tensor)  # AutoWeightsLoader: unknown names raise
    assert_all_filled(params, loaded, from_target={"model.embed_tokens.weight"})  # no own embedding: shared
    return {"embed": target_embedding(target), "lm_head": target.lm_head.weight.detach(),
            "fc": value(loaded, "model.fc.weight"),
            **fused_layer(loaded, "model.layers.0", bias=attention_bias, o_bias=attention_bias),
            **dims(c, rope_theta(c))}


def eamodel_eagle1_loads(folder, target, target_dir):
    """SafeAILab/EAGLE EaModel.from_pretrained(use_eagle3=False): eagle/model/ea_model.py (fc bias =
    config.json "bias", True when missing; load_state_dict(strict=False)), eagle/model/cnets1.py
    (Model: load_emb reads the base embedding through the base checkpoint's index; LlamaAttention:
    q/k/v bias only with qkv_bias, o_proj never; layer 0 without input_layernorm; head = base lm_head)."""
    c, tensors = read(folder)
    head_dim, theta = econfig(c)
    H = c["hidden_size"]
    fc_bias = c.get("bias", True)
    qkv_bias = bool(c.get("qkv_bias", False))
    ec = {**c, "num_key_value_heads": c.get("num_key_value_heads") or c["num_attention_heads"]}
    params = {
        "embed_tokens.weight": {None: (c["vocab_size"], H)},
        "fc.weight": {None: (H, 2 * H)},
        **layer_params("layers.0", ec, qkv_in=H, qkv_bias=qkv_bias, input_norm=False, fused=False, head_dim=head_dim),
    }
    if fc_bias:
        params["fc.bias"] = {None: (H,)}
    assert (target_dir / "model.safetensors.index.json").is_file(), "cnets1.py raises without the base model's index"
    loaded = {}
    for name, tensor in tensors.items():
        assert name in params, f"load_state_dict(strict=False) drops {name} silently"
        fill(params, loaded, name, None, tensor)
    assert_all_filled(params, loaded, from_target={"embed_tokens.weight"})
    w = {"embed": target_embedding(target), "lm_head": target.lm_head.weight.detach(),
         "fc": value(loaded, "fc.weight"),
         **split_layer(loaded, "layers.0", qkv_bias=qkv_bias),
         **dims(ec, theta, head_dim=head_dim)}
    if fc_bias:
        w["fc_bias"] = value(loaded, "fc.bias")
    return w


# -- EAGLE-3 ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def e3(tmp_path_factory):
    """A reduced draft vocabulary (64 of 256) on a sharded target checkpoint."""
    tmp = tmp_path_factory.mktemp("e3")
    target = tiny_target(taps="eagle3", rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    drafter = eagle3(target)
    target_dir = save_target(target, tmp / "target", sharded=True)
    return target, drafter, make_run(tmp, drafter, target_dir), target_dir


@pytest.fixture(scope="module")
def e3_full(tmp_path_factory):
    """The whole vocabulary as draft vocabulary (the quickstart's recipe), on a one-file target checkpoint."""
    tmp = tmp_path_factory.mktemp("e3full")
    target = tiny_target(taps="eagle3", seed=3, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    drafter = eagle3(target, vocab_size=TINY["vocab_size"])
    target_dir = save_target(target, tmp / "target")
    return target, drafter, make_run(tmp, drafter, target_dir), target_dir


def test_sglang_eagle3_loads_and_runs_the_trained_drafter(e3, tmp_path):
    target, drafter, run, _ = e3
    assert target.taps == (2, 4, 5)
    taps, w = sglang_eagle3_loads(export(run, "sglang", tmp_path / "sglang"), target)
    assert taps == list(target.taps)
    assert torch.equal(w["to_target"], drafter.draft_to_target)
    assert_same_logits(eagle3_logits(w, target), drafter, target)


def test_eagle_reference_repo_runs_the_sglang_eagle3_export(e3, tmp_path):
    """EaModel reads the sglang format; with target_hidden_size in the config it takes the embedding
    from the folder only, so the export ships the target's."""
    target, drafter, run, target_dir = e3
    out = export(run, "sglang", tmp_path / "sglang")
    w = eamodel_eagle3_loads(out, target, target_dir)
    assert torch.equal(w["embed"], target_embedding(target))
    assert_same_logits(eagle3_logits(w, target), drafter, target)


def test_sglang_eagle3_config_pinned(e3, tmp_path):
    target, drafter, run, _ = e3
    config, tensors = read(export(run, "sglang", tmp_path / "sglang"))
    assert config == {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-06,
        "max_position_embeddings": 512, "rope_theta": 50000.0, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
        "vocab_size": 256, "tie_word_embeddings": False, "torch_dtype": "float32", "dtype": "float32",
        "draft_vocab_size": 64, "target_hidden_size": 64, "bias": False, "attention_bias": False, "mlp_bias": False,
        "norm_before_fc": False, "fc_norm": False, "norm_output": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True},
    }
    # SGLang's names are ours, plus the target's embedding in the export dtype
    assert set(tensors) == set(drafter.state_dict()) | {"embed_tokens.weight"}
    assert tensors["embed_tokens.weight"].dtype == torch.float32
    assert torch.equal(tensors["embed_tokens.weight"], target_embedding(target))
    # transformers 5 reads the same RoPE (newer engines use rope_parameters)
    assert AutoConfig.for_model(**config).rope_parameters["rope_theta"] == 50000.0


def test_vllm_eagle3_loads_as_speculators(e3, tmp_path):
    target, drafter, run, target_dir = e3
    out = export(run, "vllm", tmp_path / "vllm")
    c, taps, w, k, verifier, shared = vllm_eagle3_loads(out, target)
    assert taps == list(target.taps)  # vLLM's ids are our taps
    assert torch.equal(w["to_target"], drafter.draft_to_target)
    assert shared  # the shipped embedding is the target's, so vLLM keeps the target's own
    assert (k, verifier) == (4, str(target_dir.resolve()))  # eval.k and target.path from the run's recipe
    assert c["target_hidden_size"] == 64 and c["rope_parameters"]["rope_theta"] == 50000.0
    assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["architectures"] == [
        "LlamaForCausalLM"]
    assert_same_logits(eagle3_logits(w, target), drafter, target)


def test_speculators_runs_the_vllm_eagle3_export(e3, tmp_path):
    target, drafter, run, _ = e3
    w = speculators_eagle3_loads(export(run, "vllm", tmp_path / "vllm"), target)
    assert torch.equal(w["embed"], target_embedding(target))
    assert_same_logits(eagle3_logits(w, target), drafter, target)


def test_without_the_embedding_eamodel_and_speculators_would_run_on_an_unloaded_one(e3, tmp_path):
    """What the shipped embedding fixes: SGLang and vLLM share the target's, the others do not."""
    target, _, run, target_dir = e3
    for fmt in ("sglang", "vllm"):
        out = export(run, fmt, tmp_path / fmt)
        config, tensors = read(out)
        del tensors["embed_tokens.weight"]
        save_file(tensors, str(out / "model.safetensors"))
        if fmt == "sglang":
            sglang_eagle3_loads(out, target)
            with pytest.raises(AssertionError, match="embed_tokens.weight left uninitialized"):
                eamodel_eagle3_loads(out, target, target_dir)
        else:
            assert vllm_eagle3_loads(out, target)[-1]  # shared
            with pytest.raises(AssertionError, match="embed_tokens.weight left uninitialized"):
                speculators_eagle3_loads(out, target)


def test_the_checks_see_a_wrong_tensor_and_a_wrong_rope(e3, tmp_path):
    """The logits comparison is not loose enough to pass a drafter that was not loaded right."""
    target, drafter, run, _ = e3
    _, w = sglang_eagle3_loads(export(run, "sglang", tmp_path / "sglang"), target)
    want = specdraft_logits(drafter, target)
    for key, wrong in (("theta", 10000.0), ("hidden_norm", torch.ones(64)), ("embed", torch.randn(256, 64) * 0.02)):
        assert not torch.allclose(eagle3_logits({**w, key: wrong}, target), want, rtol=RTOL, atol=ATOL), key


def test_full_vocabulary_eagle3_loads_in_every_consumer(e3_full, tmp_path):
    """The quickstart's case: vLLM builds no vocabulary map, so the export ships no d2t/t2d, and every
    config says draft vocabulary = target vocabulary."""
    target, drafter, run, target_dir = e3_full
    vllm_out, sglang_out = export(run, "vllm", tmp_path / "vllm"), export(run, "sglang", tmp_path / "sglang")
    for out in (vllm_out, sglang_out):
        assert not {"d2t", "t2d"} & set(read(out)[1])
    d = read(vllm_out)[0]
    assert d["draft_vocab_size"] == d["transformer_layer_config"]["vocab_size"] == target.config.vocab_size == 256
    assert read(sglang_out)[0]["draft_vocab_size"] == read(sglang_out)[0]["vocab_size"] == 256

    c, taps, w, _, _, _ = vllm_eagle3_loads(vllm_out, target)
    assert w["to_target"] is None and taps == list(target.taps)
    assert_same_logits(eagle3_logits(w, target), drafter, target)
    assert_same_logits(eagle3_logits(speculators_eagle3_loads(vllm_out, target), target), drafter, target)
    _, w = sglang_eagle3_loads(sglang_out, target)
    assert w["to_target"] is None  # hot_token_id None: draft id = target id
    assert_same_logits(eagle3_logits(w, target), drafter, target)
    assert_same_logits(eagle3_logits(eamodel_eagle3_loads(sglang_out, target, target_dir), target), drafter, target)

    # what the quickstart's export did before: d2t shipped with a full vocabulary
    config, tensors = read(vllm_out)
    save_file({**tensors, "d2t": torch.zeros(256, dtype=torch.long), "t2d": torch.ones(256, dtype=torch.bool)},
              str(vllm_out / "model.safetensors"))
    with pytest.raises(AssertionError, match="no module or parameter named 'draft_id_to_target_id'"):
        vllm_eagle3_loads(vllm_out, target)


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_full_vocabulary_export_reads_back(e3_full, tmp_path, fmt):
    target, drafter, run, _ = e3_full
    loaded = load_exported(export(run, fmt, tmp_path / fmt), target)
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
    assert torch.equal(draft_logits(loaded, target), draft_logits(drafter, target))


def test_vllm_options_override_the_recipe(e3, tmp_path):
    target, _, run, target_dir = e3
    other = shutil.copytree(target_dir, tmp_path / "models" / "llama")
    out = export(run, "vllm", tmp_path / "vllm", verifier=str(other), num_speculative_tokens=7)
    _, _, _, k, verifier, _ = vllm_eagle3_loads(out, target)
    assert (k, verifier) == (7, str(other.resolve()))


def test_the_toy_shortcut_is_named_by_its_folder(e3, tmp_path, monkeypatch):
    """target.path "toy" is a specdraft shortcut: the export names (and reads) the folder it stands for,
    through the same resolve_target_path training uses."""
    import specdraft.target

    target, drafter, _, target_dir = e3
    monkeypatch.setattr(specdraft.target, "toy_target_path", lambda: target_dir)  # where resolve_target_path looks
    run = make_run(tmp_path, drafter, "toy")
    for fmt in ("vllm", "sglang"):
        out = export(run, fmt, tmp_path / fmt)
        assert json.loads((out / "specdraft.json").read_text())["options"]["verifier"] == str(target_dir.resolve())
        assert torch.equal(read(out)[1]["embed_tokens.weight"], target_embedding(target))
    assert vllm_eagle3_loads(tmp_path / "vllm", target)[4] == str(target_dir.resolve())


def test_a_relative_target_path_is_named_absolute(e3, tmp_path, monkeypatch):
    target, drafter, _, target_dir = e3
    monkeypatch.chdir(target_dir.parent)
    out = export(make_run(tmp_path, drafter, target_dir.name), "vllm", tmp_path / "vllm")
    assert vllm_eagle3_loads(out, target)[4] == str(target_dir.resolve())


def test_a_hub_target_is_named_as_given_and_read_through_the_hub_cache(e3, tmp_path, monkeypatch):
    import specdraft.export as export_module
    from huggingface_hub.errors import EntryNotFoundError

    target, drafter, _, target_dir = e3
    fetched = []

    def hf_hub_download(repo_id, filename):  # the hub cache, holding this one repo
        fetched.append(filename)
        path = target_dir / filename
        if repo_id != "org/tiny-target" or not path.is_file():
            raise EntryNotFoundError(f"{repo_id}/{filename}")
        return str(path)

    monkeypatch.setattr(export_module, "hf_hub_download", hf_hub_download)  # the name export reads through
    out = export(make_run(tmp_path, drafter, "org/tiny-target"), "vllm", tmp_path / "vllm")
    assert vllm_eagle3_loads(out, target)[4] == "org/tiny-target"
    index = json.loads((target_dir / "model.safetensors.index.json").read_text())
    assert fetched == ["model.safetensors.index.json", index["weight_map"]["model.embed_tokens.weight"]]
    with pytest.raises(SpecdraftError, match="has no model.safetensors.*--target"):
        export(make_run(tmp_path / "b", drafter, "org/other"), "sglang", tmp_path / "sglang")


def test_the_embedding_is_read_alone_from_sharded_and_single_file_checkpoints(tmp_path):
    target = tiny_target()
    single = save_target(target, tmp_path / "single")
    sharded = save_target(target, tmp_path / "sharded", sharded=True)
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    shard = weight_map["model.embed_tokens.weight"]
    for other in sharded.glob("model-*.safetensors"):
        if other.name != shard:
            other.unlink()  # only the shard that holds it is read
    for folder in (single, sharded):
        embed = read_target_embedding(str(folder))
        assert torch.equal(embed, target_embedding(target))
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(single / "model.safetensors"))
    with pytest.raises(SpecdraftError, match="holds no model.embed_tokens.weight"):
        read_target_embedding(str(single))


def test_a_target_of_other_dimensions_is_refused(e3, tmp_path):
    other = save_target(tiny_target(vocab_size=128), tmp_path / "other")
    with pytest.raises(SpecdraftError, match=r"\(128, 64\) token embedding.*\(256, 64\)"):
        export(e3[2], "vllm", tmp_path / "vllm", verifier=str(other))


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "hf"])
def test_eagle3_export_reads_back_to_identical_logits(e3, tmp_path, fmt):
    target, drafter, run, _ = e3
    loaded = load_exported(export(run, fmt, tmp_path / fmt), target)
    want = draft_logits(drafter, target)
    assert torch.equal(draft_logits(loaded, target), want)
    # a drafter that did not load the trained weights would differ
    assert not torch.allclose(draft_logits(randomize(eagle3(target), seed=2), target), want)


def test_an_export_for_another_target_is_refused_on_read_back(e3, tmp_path):
    out = export(e3[2], "sglang", tmp_path / "sglang")
    other = tiny_target(taps="eagle3", seed=7, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    with pytest.raises(SpecdraftError, match="not this target's"):
        load_exported(out, other)


def test_edited_export_is_refused_on_read_back(e3, tmp_path):
    out = export(e3[2], "sglang", tmp_path / "sglang")
    config = json.loads((out / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdraftError, match="changed after export.*eagle_config"):
        load_exported(out, e3[0])


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_taps_the_engines_cannot_capture_are_refused(e3, tmp_path, fmt):
    # (2, 6//2, 6-3) takes layer 3 twice: refused when the target is built, before any training
    with pytest.raises(SpecdraftError, match=r"repeat a layer"):
        tiny_target(taps="eagle3", num_hidden_layers=6)
    target = tiny_target(taps=[0, 3, 5])  # layer 0's input: hidden + residual does not exist yet
    with pytest.raises(SpecdraftError, match="three distinct layers"):
        export(make_run(tmp_path / "b", eagle3(target), e3[3]), fmt, tmp_path / "out")


# -- EAGLE-1 ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_target_dir(tmp_path_factory):
    """EaModel's EAGLE-1 model reads the base embedding through the checkpoint index: a sharded target."""
    target = tiny_target()
    return target, save_target(target, tmp_path_factory.mktemp("e1") / "target", sharded=True)


def test_sglang_eagle1_loads_in_the_reference_layout(llama_target_dir, tmp_path):
    target, target_dir = llama_target_dir
    drafter = eagle1(target)  # fc with a bias, the reference default
    out = export(make_run(tmp_path, drafter, target_dir), "sglang", tmp_path / "sglang")
    kind, w = sglang_eagle1_loads(out, target)
    assert kind == "llama"
    assert_same_logits(eagle1_logits(w, target), drafter, target)
    config, tensors = read(out)
    # "bias" means attention bias to SGLang (missing: none) and fc bias to EaModel (missing: one)
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and "bias" not in config
    assert "layers.0.input_layernorm.weight" not in tensors and torch.equal(tensors["fc.bias"], drafter.fc.bias)
    assert "embed_tokens.weight" not in tensors  # every EAGLE-1 consumer binds the target's
    w = eamodel_eagle1_loads(out, target, target_dir)
    assert torch.equal(w["fc_bias"], drafter.fc.bias)
    assert_same_logits(eagle1_logits(w, target), drafter, target)


def test_sglang_eagle1_gets_a_zero_fc_bias_when_trained_without(llama_target_dir, tmp_path):
    target, target_dir = llama_target_dir
    drafter = eagle1(target, fc_bias=False)
    out = export(make_run(tmp_path, drafter, target_dir), "sglang", tmp_path / "sglang")
    _, w = sglang_eagle1_loads(out, target)  # SGLang's fc always has a bias: it must be loaded, with zeros
    assert torch.equal(w["fc_bias"], torch.zeros(64))
    assert_same_logits(eagle1_logits(w, target), drafter, target)
    assert_same_logits(eagle1_logits(eamodel_eagle1_loads(out, target, target_dir), target), drafter, target)


def test_sglang_eagle1_qwen2_target(tmp_path):
    target = tiny_target(Qwen2Config, num_hidden_layers=2)
    target_dir = save_target(target, tmp_path / "target", sharded=True)
    drafter = eagle1(target)
    assert "layers.0.self_attn.q_proj.bias" in drafter.state_dict()
    out = export(make_run(tmp_path, drafter, target_dir), "sglang", tmp_path / "sglang")
    kind, w = sglang_eagle1_loads(out, target)
    assert kind == "qwen2"
    assert_same_logits(eagle1_logits(w, target), drafter, target)
    # EaModel's layer builds q/k/v biases only with qkv_bias: without it they would be dropped silently
    assert_same_logits(eagle1_logits(eamodel_eagle1_loads(out, target, target_dir), target), drafter, target)
    assert read(out)[0]["qkv_bias"] is True
    assert torch.equal(draft_logits(load_exported(out, target), target), draft_logits(drafter, target))


def test_vllm_eagle1_loads_without_fc_bias(llama_target_dir, tmp_path):
    target, target_dir = llama_target_dir
    drafter = eagle1(target, fc_bias=False)
    out = export(make_run(tmp_path, drafter, target_dir), "vllm", tmp_path / "vllm")
    assert_same_logits(eagle1_logits(vllm_eagle1_loads(out, target), target), drafter, target)
    config, tensors = read(out)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["bias"] is False
    assert "fc.bias" not in tensors and "embed_tokens.weight" not in tensors
    w = eamodel_eagle1_loads(out, target, target_dir)  # "bias": false -> an fc without bias
    assert "fc_bias" not in w
    assert_same_logits(eagle1_logits(w, target), drafter, target)


def test_vllm_eagle1_refuses_a_learned_fc_bias(llama_target_dir, tmp_path):
    target, target_dir = llama_target_dir
    with pytest.raises(SpecdraftError, match="no bias on fc.*fc_bias: false"):
        export(make_run(tmp_path, eagle1(target), target_dir), "vllm", tmp_path / "vllm")
    zero_bias = eagle1(target)
    with torch.no_grad():
        zero_bias.fc.bias.zero_()  # exactly zero: nothing is lost by dropping it
    out = export(make_run(tmp_path / "b", zero_bias, target_dir), "vllm", tmp_path / "vllm")
    assert_same_logits(eagle1_logits(vllm_eagle1_loads(out, target), target), zero_bias, target)
    assert torch.equal(draft_logits(load_exported(out, target), target), draft_logits(zero_bias, target))


@pytest.mark.parametrize("fmt,fc_bias", [("sglang", True), ("sglang", False), ("vllm", False), ("hf", True)])
def test_eagle1_export_reads_back_to_identical_logits(llama_target_dir, tmp_path, fmt, fc_bias):
    target, target_dir = llama_target_dir
    drafter = eagle1(target, fc_bias=fc_bias)
    loaded = load_exported(export(make_run(tmp_path, drafter, target_dir), fmt, tmp_path / fmt), target)
    want = draft_logits(drafter, target)
    assert torch.equal(draft_logits(loaded, target), want)
    assert not torch.allclose(draft_logits(randomize(eagle1(target, fc_bias=fc_bias), seed=2), target), want)


@pytest.mark.parametrize("config_cls,fmt", [(Qwen3Config, "sglang"), (Qwen3Config, "vllm"), (Qwen2Config, "vllm")])
def test_eagle1_layers_without_an_engine_model_are_refused(tmp_path, config_cls, fmt):
    target = tiny_target(config_cls, num_hidden_layers=2)
    with pytest.raises(SpecdraftError, match="EAGLE-1 models for .* only.*--format hf"):
        export(make_run(tmp_path, eagle1(target, fc_bias=False), "org/unused"), fmt, tmp_path / "out")


# -- the command and its errors ---------------------------------------------------------------------


def test_no_checkpoint(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(SpecdraftError, match="no drafter checkpoint"):
        export(tmp_path / "run", "sglang", tmp_path / "out")


def test_unknown_format(e3, tmp_path):
    with pytest.raises(SpecdraftError, match="unknown export format 'onnx'; choose one of hf, .*sglang, vllm"):
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
    with pytest.raises(SpecdraftError, match=r"holds files that specdraft export did not write"):
        export(e3[2], "sglang", out, overwrite=True)  # --overwrite replaces an export, not the user's folder
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    export(e3[2], "sglang", out, overwrite=True)  # an empty folder
    export(e3[2], "sglang", out, overwrite=True)  # and its own export
    assert sorted(p.name for p in out.iterdir()) == [".specdraft-owner.json", "config.json", "model.safetensors",
                                                     "specdraft.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folders left
    with pytest.raises(SpecdraftError, match="holds the drafter being exported"):
        export(e3[2], "hf", e3[2], overwrite=True)


def test_newest_checkpoint_is_exported_when_the_run_has_no_final_drafter(e3, tmp_path):
    target, _, _, target_dir = e3
    run = tmp_path / "run"
    for step in (5, 10):
        drafter = eagle3(target)
        with torch.no_grad():
            drafter.fc.weight.fill_(step)
        ckpt = run / "checkpoints" / f"step-{step:07d}"
        drafter.save_pretrained(ckpt / "drafter")
        (ckpt / "trainer_state.json").write_text("{}")  # marks the checkpoint complete
    (run / "recipe.yaml").write_text(yaml.safe_dump({"target": {"path": str(target_dir)}}))
    config, tensors = read(export(run, "vllm", tmp_path / "vllm"))
    assert torch.equal(tensors["fc.weight"], torch.full((64, 192), 10.0))
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target_dir.resolve())
    # A final drafter that lost its config.json is named, not passed over for an older checkpoint.
    drafter = eagle3(target)
    drafter.save_pretrained(run / "drafter")
    (run / "drafter" / "config.json").unlink()
    with pytest.raises(SpecdraftError, match=r"drafter has no config.json.*newest checkpoint's is .*step-0000010"):
        export(run, "vllm", tmp_path / "vllm2")
    assert not (tmp_path / "vllm2").exists()


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


def test_engine_exports_need_the_target(e3, llama_target_dir, tmp_path):
    bare = tmp_path / "drafter"
    shutil.copytree(e3[2] / "drafter", bare)  # no recipe next to it, and a from_config target has no path
    for fmt in ("vllm", "sglang"):  # EAGLE-3 ships the target's embedding; vLLM also names the target
        with pytest.raises(SpecdraftError, match="--target"):
            export(bare, fmt, tmp_path / "out")
    assert vllm_eagle3_loads(export(bare, "vllm", tmp_path / "out", verifier=str(e3[3])), e3[0])[4] == str(
        e3[3].resolve())
    eagle1(llama_target_dir[0]).save_pretrained(tmp_path / "e1")
    assert export(tmp_path / "e1", "sglang", tmp_path / "e1-out").is_dir()  # EAGLE-1 needs nothing of the target


def test_cli(e3, tmp_path, capsys):
    assert main(["export", str(e3[2]), "--format", "vllm", "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert f"vllm serve {e3[3].resolve()} --speculative-config" in printed
    out = tmp_path / "out"
    recorded = json.loads((out / "config.json").read_text())["speculators_config"]["proposal_methods"][0]
    assert "'{" + f'"method": "eagle3", "model": "{out}", "num_speculative_tokens": {recorded["speculative_tokens"]}' \
        + "}'" in printed  # the K the export wrote, not a placeholder
    assert main(["export", str(e3[2]), "--format", "vllm", "--out", str(tmp_path / "k7"),
                 "--num-speculative-tokens", "7"]) == 0
    assert '"num_speculative_tokens": 7}' in capsys.readouterr().out
    assert main(["export", str(e3[2]), "--format", "vllm", "--out", str(tmp_path / "out")]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert main(["export", str(e3[2]), "--format", "sglang", "--out", str(tmp_path / "s"), "--target", "/no/x"]) == 2
    assert "--target" in capsys.readouterr().err


def test_a_bf16_export_reads_back_on_the_float32_target(tmp_path):
    """Trained on a bf16 copy of the target, read back on its float32 original (`specdraft eval`'s CPU
    default): the shipped embedding is the original's rounded to bf16, not another target's."""
    import copy

    original = tiny_target(taps="eagle3", seed=5)
    rounded = copy.deepcopy(original)
    rounded.model.to(torch.bfloat16)
    drafter = eagle3(rounded)
    out = export(make_run(tmp_path, drafter, save_target(rounded, tmp_path / "target")), "sglang", tmp_path / "sg")
    shipped = load_file(out / "model.safetensors")["embed_tokens.weight"]
    assert shipped.dtype == torch.bfloat16 and not torch.equal(shipped.float(), original.embed_tokens.weight)
    assert torch.equal(load_exported(out, original).lm_head.weight, drafter.lm_head.weight)
    with pytest.raises(SpecdraftError, match="not this target's"):  # another target is still refused
        load_exported(out, tiny_target(taps="eagle3", seed=6))


def test_a_familys_own_exporter_is_what_the_driver_runs(e3, tmp_path, monkeypatch, capsys):
    """Formats belong to the family (Family.exporters): a family registered with its own exporter gets
    it written, named in the serve hint, checked and read back, with nothing in export.py about it."""
    import dataclasses

    from specdraft.contract import Exporter
    from specdraft.drafters import FAMILIES

    def write(saved, tensors, opts):
        return {"kind": "reversed", "k": opts.num_speculative_tokens}, {f"r.{k}": t for k, t in tensors.items()}

    def read_back(saved, tensors):
        return {k.removeprefix("r."): t for k, t in tensors.items()}

    own = Exporter(write, read_back, serve_hint="serve {out} on TARGET")
    monkeypatch.setitem(FAMILIES, "eagle3", dataclasses.replace(FAMILIES["eagle3"], exporters={"mine": own}))
    target, drafter, run, target_dir = e3
    assert main(["export", str(run), "--format", "mine", "--out", str(tmp_path / "mine")]) == 0
    assert f"serve {tmp_path / 'mine'} on {target_dir.resolve()}" in capsys.readouterr().out
    config, tensors = read(tmp_path / "mine")
    assert config == {"kind": "reversed", "k": 4} and "r.fc.weight" in tensors
    loaded = load_exported(tmp_path / "mine", target)
    assert torch.equal(loaded.fc.weight, drafter.fc.weight)
    with pytest.raises(SpecdraftError, match="cannot be exported as sglang.*Formats for eagle3: hf, mine"):
        export(run, "sglang", tmp_path / "sg")
