"""DFlash (specdraft/drafters/dflash.py): the block forward against its equations, training against decoding,
the loss, exact decoding (greedy identity at batch 1 and in batches, T = 1 statistics), save/load, a killed and
resumed `specdraft train`, the recipes, the two engine exports and bad input.

The engines are not installed here: ``vllm_loads`` and ``sglang_loads`` re-implement, from their source, what
vLLM (vllm/transformers_utils/configs/speculators/{base,algos}.py, model_executor/models/qwen3_dflash.py) and
SGLang (srt/speculative/dflash_utils.py, srt/models/dflash.py) do with an exported folder: parse the config,
build the parameter table the model's ``__init__`` builds, route every tensor the way ``load_weights`` does
(q/k/v into qkv_proj, gate/up into gate_up_proj), and require every parameter filled with its shape.
``reference_block_logits`` then runs the draft from those fused weights, written from z-lab's
dflash/model.py forward (keys and values of [context; block], QK-norm per head, RoPE, no mask).
"""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file
from test_mlp_speculator import KILL_HOOK as MLP_KILL_HOOK
from tiny import seeded_init_
from transformers import LlamaConfig, Qwen3Config

from specdraft.contract import TargetNeeds, TrainingContext
from specdraft.decoding.rows import fresh_sources
from specdraft.decoding.sampling import SamplingParams
from specdraft.decoding.speculative import TreeDrafting, plain_decode, speculative_decode, speculative_decode_batch
from specdraft.drafters import FAMILIES, get_family, load_drafter
from specdraft.drafters.dflash import DFLASH, DFlashConfig, build_dflash, dflash_default_taps, zlab_layer_ids
from specdraft.errors import SpecdraftError
from specdraft.export import export
from specdraft.target import FrozenTarget
from specdraft.target_fingerprint import embedding_probe, record_target

GREEDY, SAMPLED = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
VOCAB = 256


def tiny_target(vocab=VOCAB, layers=6, hidden=64, context=256, std=0.3, seed=0, config_cls=LlamaConfig, **extra):
    config = config_cls(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=2 * hidden, vocab_size=vocab, max_position_embeddings=context,
                        tie_word_embeddings=False, **extra)
    config.architectures = [config_cls.__name__.replace("Config", "ForCausalLM")]
    target = FrozenTarget.from_config(config, device="cpu")
    seeded_init_(target.model, seed=seed, std=std)
    return target


def dflash(target, seed=1, randomize=True, **cfg):
    """A DFlash drafter; ``randomize``: every tensor (norm weights too) drawn, so a dropped one shows."""
    settings = {"block_size": 4, "num_layers": 2, "num_anchors": 8, "loss_decay_gamma": 4.0, **cfg}
    drafter = build_dflash(target, DFlashConfig(**settings))
    if randomize:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                scale = 0.3 if name.endswith("norm.weight") else 0.2
                p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + torch.randn(p.shape, generator=g) * scale)
    return drafter


def random_ids(*shape, seed, vocab=VOCAB):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def batch_of(ids, loss_mask=None):
    ones = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": ones, "loss_mask": ones.clone() if loss_mask is None else loss_mask}


def loss_on(drafter, target, batch):
    example = drafter.prepare(batch, TrainingContext(target))
    return drafter.compute_loss(example.batch, example.target)


# -- the consumers' side: a block forward written from z-lab's, over fused (engine-layout) weights ----------------


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x, positions, theta, d):
    """Neox-style RoPE (vLLM's and SGLang's default is_neox_style, HF's rotate_half) on [T, heads, d]."""
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = positions.double()[:, None] * inv[None]
    cos, sin = torch.cat([freqs, freqs], -1).cos().float()[:, None], torch.cat([freqs, freqs], -1).sin().float()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_block_logits(w: dict, c: dict, embed, lm_head, features, block_ids, prefix: str = ""):
    """z-lab's DFlashDraftModel.forward for one sequence: context = hidden_norm(fc(features)) [S], block [Q] at
    positions S..S+Q-1; every layer's keys/values over [context; block], no mask. ``w`` holds the consumer's
    fused tensors (qkv_proj, gate_up_proj) under ``prefix``; ``c`` the config values it reads."""
    H, heads, kv, d, eps, theta = c["hidden"], c["heads"], c["kv_heads"], c["head_dim"], c["eps"], c["theta"]
    S, Q = features.shape[0], block_ids.shape[0]
    ctx = rms(features @ w[prefix + "fc.weight"].T, w[prefix + "hidden_norm.weight"], eps)
    h = embed[block_ids]
    ctx_pos, block_pos = torch.arange(S), torch.arange(S, S + Q)
    for i in range(c["layers"]):
        p = f"{prefix}layers.{i}."
        qkv = w[p + "self_attn.qkv_proj.weight"]
        Wq, Wk, Wv = qkv.split([heads * d, kv * d, kv * d])
        x = rms(h, w[p + "input_layernorm.weight"], eps)
        q = rms((x @ Wq.T).view(Q, heads, d), w[p + "self_attn.q_norm.weight"], eps)
        both = torch.cat([ctx, x])
        k = rms((both @ Wk.T).view(S + Q, kv, d), w[p + "self_attn.k_norm.weight"], eps)
        v = (both @ Wv.T).view(S + Q, kv, d)
        q, k = rope(q, block_pos, theta, d), rope(k, torch.cat([ctx_pos, block_pos]), theta, d)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d), -1)
        h = h + torch.einsum("hqk,khd->qhd", att, v).reshape(Q, heads * d) @ w[p + "self_attn.o_proj.weight"].T
        y = rms(h, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = w[p + "mlp.gate_up_proj.weight"].chunk(2)
        h = h + (F.silu(y @ gate.T) * (y @ up.T)) @ w[p + "mlp.down_proj.weight"].T
    return rms(h, w[prefix + "norm.weight"], eps) @ lm_head.T


def fused(tensors: dict, prefix: str = "") -> dict:
    """Both engines' stacking: q/k/v -> qkv_proj (q, k, v shards), gate/up -> gate_up_proj (shards 0, 1)."""
    out, stacks = {}, {}
    for name, t in tensors.items():
        for part, (param, shard) in {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                                     "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}.items():
            if f".{part}." in name:
                stacks.setdefault(prefix + name.replace(part, param), {})[shard] = t
                break
        else:
            out[prefix + name] = t
    for name, shards in stacks.items():
        out[name] = torch.cat([shards[i] for i in sorted(shards)])
    return out


def engine_parameters(c: dict, fc_in: int, prefix: str = "") -> dict:
    """The parameter table DFlashQwen3Model (vLLM) / DFlashDraftModel (SGLang) builds from the config."""
    H, heads, kv, d, inner = c["hidden"], c["heads"], c["kv_heads"], c["head_dim"], c["intermediate"]
    table = {prefix + "fc.weight": (H, fc_in), prefix + "hidden_norm.weight": (H,), prefix + "norm.weight": (H,)}
    for i in range(c["layers"]):
        p = f"{prefix}layers.{i}."
        table.update({p + "self_attn.qkv_proj.weight": ((heads + 2 * kv) * d, H), p + "self_attn.o_proj.weight": (H, heads * d),
                      p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                      p + "mlp.gate_up_proj.weight": (2 * inner, H), p + "mlp.down_proj.weight": (H, inner),
                      p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)})
    return table


def layer_values(cfg: dict) -> dict:
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    return {"hidden": cfg["hidden_size"], "heads": cfg["num_attention_heads"], "kv_heads": cfg["num_key_value_heads"],
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            "eps": cfg["rms_norm_eps"], "theta": theta, "layers": cfg["num_hidden_layers"],
            "intermediate": cfg["intermediate_size"]}


def vllm_loads(folder: Path):
    """vllm/transformers_utils/configs/speculators/base.py + algos.py update_dflash, then qwen3_dflash.py's
    DFlashQwen3ForCausalLM: (config values, aux layer ids, mask token id, speculative tokens, weights)."""
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    assert config["speculators_model_type"] == "dflash"  # base.py: SUPPORTED_SPECULATORS_TYPES lookup
    spec = config["speculators_config"]
    k = spec["proposal_methods"][0]["speculative_tokens"]
    assert spec["verifier"]["name_or_path"]
    pre = dict(config["transformer_layer_config"])  # base.py: the draft's model config
    # algos.py update_dflash
    pre["architectures"] = ["DFlashDraftModel"]
    pre["draft_vocab_size"] = config.get("draft_vocab_size")
    if config.get("target_hidden_size") is not None:
        pre["target_hidden_size"] = config["target_hidden_size"]
    aux = config["aux_hidden_state_layer_ids"]
    pre["eagle_aux_hidden_state_layer_ids"] = aux
    pre["dflash_config"] = {"mask_token_id": config["mask_token_id"], "target_layer_ids": [i - 1 for i in aux]}
    # qwen3_dflash.py: causality and window per layer (_resolve_layer_attention), non-causal full attention here
    assert pre.get("is_causal") is None and "causal" not in pre["dflash_config"]
    assert all(t != "sliding_attention" for t in pre.get("layer_types") or [])
    assert not pre["dflash_config"].get("use_swa", False)
    assert pre["model_type"] == "qwen3" and pre["hidden_act"] == "silu" and not pre.get("attention_bias", False)
    c = layer_values(pre)
    fc_in = len(aux) * (pre.get("target_hidden_size") or pre["hidden_size"])  # _get_dflash_fc_input_size
    table = engine_parameters(c, fc_in, prefix="model.")
    assert pre["draft_vocab_size"] == pre["vocab_size"]  # else draft_id_to_target_id, filled from d2t
    # load_weights: t2d skipped, d2t renamed; all but lm_head under model.; embed_tokens / lm_head only if shipped
    assert not any(n in ("d2t", "t2d") or "embed_tokens" in n or "lm_head" in n for n in tensors)
    weights = fused({n: t for n, t in tensors.items()}, prefix="model.")
    assert {n: tuple(t.shape) for n, t in weights.items()} == table  # every parameter filled, nothing left over
    return c, aux, pre["dflash_config"]["mask_token_id"], k, weights


def sglang_loads(folder: Path, target_num_layers: int):
    """srt/speculative/dflash_utils.py (parse the draft config) and srt/models/dflash.py (DFlashDraftModel and
    load_weights): (config values, target layer ids, mask token id, block size, weights)."""
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    assert config["architectures"] == ["DFlashDraftModel"]
    dflash = config["dflash_config"]
    ids = [int(x) for x in dflash["target_layer_ids"]]
    num_target = int(config.get("num_target_layers", config["num_hidden_layers"]))
    assert num_target == target_num_layers and ids and all(0 <= i < num_target for i in ids)
    block = int(dflash.get("block_size", config.get("block_size")))
    mask = dflash["mask_token_id"]
    assert isinstance(mask, int) and not isinstance(mask, bool) and mask >= 0
    layer_types = config.get("layer_types")
    assert layer_types is None or all(t == "full_attention" for t in layer_types)  # ENCODER_ONLY: non-causal
    assert config["hidden_act"] == "silu" and not config.get("attention_bias", False)
    c = layer_values(config)
    table = engine_parameters(c, len(ids) * config["hidden_size"])
    # load_weights: stacked q/k/v and gate/up, other names as-is (or model.-prefixed); unmatched names ignored
    weights = {n: t for n, t in fused(tensors).items() if n in table}
    assert set(fused(tensors)) == set(weights), "SGLang would drop these silently"
    assert {n: tuple(t.shape) for n, t in weights.items()} == table
    return c, ids, mask, block, weights


def specdraft_block_logits(drafter, target, ids, anchor):
    """What specdraft's source drafts from: the block logits after the prompt ids[:anchor], pending ids[anchor]."""
    source = drafter.draft_source(target)
    prompt = ids[None, :anchor]
    source.start(prompt, target(prompt, logits="last"))
    captured = []
    real = drafter.draft_logits
    drafter.draft_logits = lambda hidden: captured.append(real(hidden)) or captured[-1]
    try:
        source.propose(ids[None, anchor : anchor + 1], drafter.config.block_size - 1, GREEDY, None)
    finally:
        del drafter.draft_logits
    return captured[0][0]  # [block_size - 1, V]


# -- the block forward, training and its loss -------------------------------------------------------------------


def test_registered_as_the_fifth_family():
    assert FAMILIES["dflash"] is DFLASH and get_family("dflash").config_cls is DFlashConfig
    assert set(DFLASH.exporters) == {"vllm", "sglang"}


def test_the_block_forward_is_zlabs_equations():
    """specdraft's draft logits equal the reference forward on the same weights (stacked the engines' way)."""
    target = tiny_target(config_cls=Qwen3Config, head_dim=24)  # head_dim != hidden / heads
    drafter = dflash(target, block_size=5, num_taps=2)
    ids = random_ids(20, seed=3)
    c = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 24, "eps": target.config.rms_norm_eps,
         "theta": target.config.rope_parameters["rope_theta"], "layers": 2}
    features = target(ids[None, :11], logits="last").aux_hidden[0]
    block = torch.tensor([ids[11].item()] + [drafter.mask_token_id] * 4)
    expected = reference_block_logits(fused(drafter.state_dict()), c, target.embed_tokens.weight,
                                      target.lm_head.weight, features, block)[1:]
    with torch.no_grad():
        torch.testing.assert_close(specdraft_block_logits(drafter, target, ids, 11), expected, rtol=1e-4, atol=1e-4)


def test_training_blocks_are_the_blocks_decoding_drafts():
    """A training block at anchor a sees exactly what the source sees after the prompt t_<a with t_a pending:
    the block logits agree, for several anchors of one forward (blocks never see each other)."""
    target = tiny_target()
    drafter = dflash(target, block_size=4, num_anchors=3)
    ids = random_ids(1, 24, seed=5)
    anchors = torch.tensor([[3, 9, 22]])  # the last block runs past the sequence (its tail is not counted)
    drafter.sample_anchors = lambda valid, generator: (anchors, torch.ones_like(anchors, dtype=torch.bool))
    captured, real = [], drafter.draft_logits
    drafter.draft_logits = lambda hidden: captured.append(real(hidden)) or captured[-1]
    with torch.no_grad():
        loss_on(drafter, target, batch_of(ids))
    del drafter.draft_logits, drafter.sample_anchors
    for n, a in enumerate(anchors[0].tolist()):
        torch.testing.assert_close(captured[0][0, n], specdraft_block_logits(drafter, target, ids[0], a),
                                   rtol=1e-4, atol=1e-5)


def loss_and_slot_losses(drafter, target, labels: str):
    """The drafter's loss on a 16-token row whose answer stops at 6 (a user turn) and goes on, with blocks at
    anchors 4 and 14 (the latter runs past the row after slot 1); and, written out, each block's CE per counted
    slot j: labels: target, CE(p_target(. | t_<a+j), q); labels: tokens (SpecForge's hard labels), -log q(t_{a+j})."""
    ids = random_ids(1, 16, seed=7)
    loss_mask = torch.ones_like(ids)
    loss_mask[0, 6] = 0
    anchors = torch.tensor([[4, 14]])
    drafter.sample_anchors = lambda valid, generator: (anchors, torch.ones_like(anchors, dtype=torch.bool))
    out = loss_on(drafter, target, batch_of(ids, loss_mask))
    del drafter.sample_anchors
    target_logits = target(ids, logits="full").logits[0]
    per_block = []
    for a in anchors[0].tolist():
        q = torch.log_softmax(specdraft_block_logits(drafter, target, ids[0], a), -1)
        ce = {}
        for j in range(1, drafter.config.block_size):
            if a + j < 16 and loss_mask[0, a + j]:
                ce[j] = -q[j - 1, ids[0, a + j]] if labels == "tokens" else \
                    -(torch.softmax(target_logits[a + j - 1], -1) * q[j - 1]).sum()
        per_block.append(ce)
    return out.loss, per_block


@pytest.mark.parametrize("labels", ["target", "tokens"])
def test_the_loss_is_decaying_cross_entropy_toward_the_chosen_labels(labels):
    """Slot j of the block at anchor a, weighted exp(-(j-1)/gamma) and averaged over the counted slots by their
    weights (a slot past the sequence or on a non-answer token counts nothing), toward the chosen labels."""
    target = tiny_target()
    gamma = 2.0
    drafter = dflash(target, block_size=4, num_anchors=2, loss_decay_gamma=gamma, labels=labels)
    loss, per_block = loss_and_slot_losses(drafter, target, labels)
    weighted = [(math.exp(-(j - 1) / gamma), ce) for block in per_block for j, ce in block.items()]
    expected = sum(w * ce for w, ce in weighted) / sum(w for w, _ in weighted)
    torch.testing.assert_close(loss, torch.as_tensor(expected, dtype=torch.float32), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("labels", ["target", "tokens"])
def test_dpace_weighs_each_slot_by_the_accepted_length_still_to_gain(labels):
    """position_weights: dpace (arXiv 2605.18810, Eq. 7-8): per block, q~_i = (1 - alpha) exp(-CE_i) + alpha over
    the counted slots (an uncounted slot is 1 in the products and adds nothing), w_j = sum over counted m >= j
    of prod_{i <= m} q~_i; the loss is the w-weighted mean of the slots' CE."""
    target = tiny_target()
    alpha = 0.3
    drafter = dflash(target, block_size=4, num_anchors=2, labels=labels, position_weights="dpace", dpace_alpha=alpha)
    loss, per_block = loss_and_slot_losses(drafter, target, labels)
    weighted = []
    for ce in per_block:  # the block at 4: slots 1 and 3 counted (6 is not an answer token); at 14: slot 1
        reach, reached = 1.0, {}
        for j in sorted(ce):
            reach *= (1 - alpha) * math.exp(-ce[j].item()) + alpha
            reached[j] = reach
        weighted += [(sum(reached[m] for m in ce if m >= j), ce[j]) for j in ce]
    expected = sum(w * ce for w, ce in weighted) / sum(w for w, _ in weighted)
    torch.testing.assert_close(loss, torch.as_tensor(expected, dtype=torch.float32), rtol=1e-4, atol=1e-5)


def test_a_drafter_that_outputs_the_targets_next_token_state_loses_only_the_targets_entropy():
    """The loss targets are aligned: a drafter whose slot j (at position a + j) outputs the target's final
    state at a + j - 1 reproduces the target's logits there, so its distillation loss is the target's own
    entropy (zero KL), whatever the anchors; any shift of slots against target positions adds a KL."""
    target = tiny_target()
    drafter = dflash(target, block_size=5, num_anchors=6)
    ids = random_ids(2, 24, seed=11)
    final = target.model.model(ids).last_hidden_state  # normed: lm_head(final) = the target's logits
    rows = torch.arange(2)[:, None]
    drafter.norm = torch.nn.Identity()
    drafter.block_hidden = lambda block_ids, positions, context_kv, mask: final[rows, (positions - 1).clamp(min=0)]
    torch.manual_seed(3)
    out = loss_on(drafter, target, batch_of(ids))
    del drafter.block_hidden
    logp = torch.log_softmax(target(ids, logits="full").logits.float(), -1)
    entropy = -(logp.exp() * logp).sum(-1)  # [2, 24]: of the target's next-token distribution at each position
    torch.manual_seed(3)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[:, -1] = False  # the last token has no next token
    anchors, keep = drafter.sample_anchors(valid, None)
    num = den = 0.0
    for row in range(2):
        for a in anchors[row][keep[row]].tolist():
            for j in range(1, 5):
                if a + j < 24:
                    w = math.exp(-(j - 1) / 4.0)
                    num, den = num + w * entropy[row, a + j - 1], den + w
    torch.testing.assert_close(out.loss, torch.as_tensor(num / den, dtype=torch.float32), rtol=1e-4, atol=1e-5)


def test_anchors_are_distinct_answer_positions_drawn_at_random():
    target = tiny_target()
    drafter = dflash(target, num_anchors=5)
    valid = torch.zeros(3, 30, dtype=torch.bool)
    valid[0, 10:20] = True
    valid[1, [2, 7, 29]] = True  # fewer than num_anchors
    draws = []
    for seed in range(4):
        anchors, keep = drafter.sample_anchors(valid, torch.Generator().manual_seed(seed))
        assert anchors.shape == keep.shape == (3, 5)
        assert keep[0].all() and keep[1].tolist() == [True] * 3 + [False] * 2 and not keep[2].any()
        for row in range(3):
            real = anchors[row][keep[row]].tolist()
            assert len(set(real)) == len(real) and all(valid[row, a] for a in real) and real == sorted(real)
        assert anchors[1][keep[1]].tolist() == [2, 7, 29]
        draws.append(anchors[0].tolist())
    assert len({tuple(d) for d in draws}) > 1  # random, not the first five


def test_a_few_steps_reduce_the_loss_and_leave_the_target_alone():
    target = tiny_target()
    before = {n: t.clone() for n, t in target.model.state_dict().items()}
    torch.manual_seed(0)
    drafter = dflash(target, randomize=False)
    batch = batch_of(random_ids(2, 40, seed=2))
    optimizer = torch.optim.AdamW(drafter.trained_module().parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        optimizer.zero_grad()
        out = loss_on(drafter, target, batch)
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.7 * losses[0]
    assert {"loss_0", "loss_2", "acc_0", "sim_accept_len"} <= set(out.metrics)
    assert all(torch.equal(before[n], t) for n, t in target.model.state_dict().items())
    assert not any(n.startswith(("embed", "lm_head")) for n, _ in drafter.named_parameters())


# -- decoding ---------------------------------------------------------------------------------------------------


def trained_on_own_greedy_text(target, prompts, steps, **cfg):
    text = torch.cat([torch.cat([p, torch.tensor([plain_decode(target, p, max_new_tokens=40).tokens])], dim=1)
                      for p in prompts])
    torch.manual_seed(0)  # the drafter's initialisation and its anchors
    drafter = dflash(target, randomize=False, **cfg)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    batch = batch_of(text)
    example = drafter.prepare(batch, TrainingContext(target))
    for _ in range(steps):
        optimizer.zero_grad()
        drafter.compute_loss(example.batch, example.target).loss.backward()
        optimizer.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def half_trained():
    target = tiny_target()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (1, 6), generator=g) for _ in range(12)]
    drafter = trained_on_own_greedy_text(target, prompts, steps=80, block_size=4, num_anchors=32)
    return target, drafter, prompts


def test_greedy_speculative_decoding_is_greedy_decoding(half_trained):
    """Batch 1, with a drafter that half learned the target's greedy text: steps accept none, some and all of
    the block's drafts, and every token is the target's greedy token (which transformers' generate() gives:
    tests/test_speculative.py checks plain_decode against it)."""
    target, drafter, prompts = half_trained
    steps = []
    for prompt in prompts[:6]:
        expected = plain_decode(target, prompt, max_new_tokens=40).tokens
        out = speculative_decode(target, drafter.draft_source(target), prompt, k=3, max_new_tokens=40)
        assert out.tokens == expected
        steps += out.steps
    accepted = [s.num_accepted for s in steps]
    assert 0 in accepted and 3 in accepted and any(0 < n < 3 for n in accepted)


def test_greedy_batches_decode_what_each_prompt_decodes_alone(half_trained):
    target, drafter, prompts = half_trained
    batch = [p[0, : 3 + i] for i, p in enumerate(prompts[:4])]  # ragged lengths
    outs = speculative_decode_batch(target, fresh_sources(drafter.draft_source(target), len(batch)), batch, k=3,
                                    max_new_tokens=30)
    for prompt, out in zip(batch, outs):
        assert out.tokens == plain_decode(target, prompt[None], max_new_tokens=30).tokens
    assert sum(s.num_accepted for out in outs for s in out.steps) > 0


def test_one_draft_forward_per_step_and_the_same_drafts_for_any_k(half_trained):
    """A step runs the draft once, whatever k, over the whole trained block: the first k' drafts of k are the
    k' drafts."""
    target, drafter, prompts = half_trained
    calls = []
    real = drafter.block_hidden
    drafter.block_hidden = lambda *args: calls.append(args[0].shape) or real(*args)
    try:
        proposals = {}
        for k in (1, 3):
            source = drafter.draft_source(target)
            source.start(prompts[0], target(prompts[0], logits="last"))
            proposals[k] = source.propose(torch.tensor([[5]]), k, GREEDY, None).tokens
    finally:
        del drafter.block_hidden
    assert calls == [torch.Size([1, 4])] * 2
    assert proposals[3][:, :1].tolist() == proposals[1].tolist()


def test_after_commits_the_source_drafts_what_a_fresh_start_on_the_whole_prefix_drafts():
    """The context cache grows by the committed tokens' features at their positions: two steps in (kept 3, then
    2 tokens), the block logits are those of a source started on the whole prefix.

    In float64: the cached path multiplies the context in chunks of 6, 3 and 2 positions, the fresh start in one
    of 11, and float32 matmuls of different shapes round differently: 3.8e-5 apart on logits of 8 on an AVX2-only
    CPU, beyond the float32 tolerance, where AVX-512 machines had passed. In float64 the two agree exactly here,
    so the tolerance is tight and a feature cached at the wrong position, or a step missed, still shows."""
    target = tiny_target()
    target.model.to(torch.float64)
    drafter = dflash(target, block_size=4).to(torch.float64)
    ids = random_ids(20, seed=11)
    full = target(ids[None], logits="full")
    source = drafter.draft_source(target)
    source.start(ids[None, :6], target(ids[None, :6], logits="last"))
    for start, end in ((6, 9), (9, 11)):
        source.propose(ids[None, start : start + 1], 3, GREEDY, None)
        source.commit(ids[None, start:end], full.slice(slice(start, end)))
    captured, real = [], drafter.draft_logits
    drafter.draft_logits = lambda hidden: captured.append(real(hidden)) or captured[-1]
    source.propose(ids[None, 11:12], 3, GREEDY, None)
    del drafter.draft_logits
    torch.testing.assert_close(captured[0][0], specdraft_block_logits(drafter, target, ids, 11), rtol=1e-6, atol=1e-6)


def test_sampling_at_temperature_1_emits_the_targets_marginals():
    """The decoder's statistical checks (tests/test_decode_statistics.py) on a 16-token target, with a drafter
    trained for 150 steps on the target's own samples: its q is related to p and differs by block slot, so drafts
    are accepted and rejected alike, and a q taken from the wrong slot, or drafts not drawn from q, show."""
    from test_decode_statistics import PROMPT, all_checks, assert_all_pass, assert_both_paths_ran, decode_many

    target = tiny_target(vocab=16, layers=4, hidden=32, context=64, std=0.5)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 16, (1, 4), generator=g) for _ in range(16)]
    text = torch.cat([torch.cat([p, torch.tensor([plain_decode(target, p, max_new_tokens=24, params=SAMPLED,
                                                               generator=torch.Generator().manual_seed(i)).tokens])], 1)
                      for i, p in enumerate(prompts)])
    torch.manual_seed(0)  # the drafter's initialisation and its anchors
    drafter = dflash(target, randomize=False, block_size=4, num_layers=1, num_taps=1, num_anchors=16)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    example = drafter.prepare(batch_of(text), TrainingContext(target))
    for _ in range(150):
        optimizer.zero_grad()
        drafter.compute_loss(example.batch, example.target).loss.backward()
        optimizer.step()
    drafter.eval()
    decodes = decode_many(target, lambda: drafter.draft_source(target), SAMPLED, PROMPT, 400, num_tokens=6)
    assert_all_pass(all_checks(decodes, target, SAMPLED))
    assert_both_paths_ran(decodes)


def test_trees_are_refused_the_paper_drafts_chains():
    from specdraft.decoding.trees import StaticTree

    target = tiny_target()
    with pytest.raises(SpecdraftError, match="DFlashDraftSource drafts"):
        TreeDrafting(dflash(target).draft_source(target), StaticTree(((0,), (1,))))


# -- save, load, the target it was trained for ----------------------------------------------------------------


def test_save_load_gives_identical_drafts(tmp_path):
    target = tiny_target()
    drafter = dflash(target, mask_token_id=7)
    drafter.save_pretrained(tmp_path / "d")
    loaded = load_drafter(tmp_path / "d", target)
    assert loaded.config == drafter.config and loaded.needs == drafter.needs
    ids = random_ids(18, seed=9)
    with torch.no_grad():
        assert torch.equal(specdraft_block_logits(loaded, target, ids, 12), specdraft_block_logits(drafter, target, ids, 12))


def test_the_resolved_mask_token_is_saved(tmp_path):
    target = tiny_target()
    drafter = dflash(target)  # mask_token_id null, no tokenizer: the last row
    assert drafter.mask_token_id == VOCAB - 1
    drafter.save_pretrained(tmp_path / "d")
    assert json.loads((tmp_path / "d" / "config.json").read_text())["config"]["mask_token_id"] == VOCAB - 1


def test_a_drafter_given_another_target_is_refused(tmp_path):
    target = tiny_target()
    drafter = dflash(target)
    drafter.save_pretrained(tmp_path / "d")
    record_target(tmp_path / "d", embedding_probe(target.embed_tokens.weight))
    other = tiny_target(seed=5)  # same shapes, other weights
    with pytest.raises(SpecdraftError, match="trained for another target"):
        load_drafter(tmp_path / "d", other)
    with pytest.raises(SpecdraftError, match="hidden_size=64"):
        DFLASH.load(tmp_path / "d", tiny_target(hidden=32))
    load_drafter(tmp_path / "d", target)


# -- training through `specdraft train`: kill -9 and an exact resume --------------------------------------------

TRAIN_STEPS, SAVE_EVERY, KILL_AT_STEP = 6, 3, 5
TRAIN_DRAFTER = {"family": "dflash", "block_size": 4, "num_layers": 1, "num_taps": 1, "num_anchors": 4,
                 "mask_token_id": 0, "loss_decay_gamma": 4.0}
# The MLP speculator's kill -9 hook (the specdraft CLI, killed at the PROBE_KILL_AT_CALL-th training loss), on DFlash.
KILL_HOOK = MLP_KILL_HOOK.replace("specdraft.drafters.mlp_speculator", "specdraft.drafters.dflash").replace(
    "MLPSpeculator", "DFlashDrafter")


def dflash_killed_run(folder: Path):
    from spine import KilledRun, make_recipe

    recipe = make_recipe(folder, folder / "target", folder / "chat.jsonl", training={"max_steps": TRAIN_STEPS},
                         checkpoint={"save_every": SAVE_EVERY})
    recipe["target"]["taps"] = [1]  # the 2-layer tiny target: the input of its last layer
    recipe["drafter"] = dict(TRAIN_DRAFTER)
    accumulation = recipe["training"]["grad_accumulation"]
    return KilledRun(folder, recipe, kill_at_call=(KILL_AT_STEP - 1) * accumulation + 1, checkpoint_step=3,
                     launcher=lambda: [sys.executable, "-c", KILL_HOOK])


@pytest.fixture(scope="module")
def dflash_runs(tmp_path_factory):
    from spine import built_killed_run

    return built_killed_run(tmp_path_factory, "dflash-kill-9", dflash_killed_run)


def test_a_kill_9_resumes_exactly(dflash_runs):
    """From the step-3 checkpoint: the anchors after it come from the restored RNG."""
    from spine import read_metrics

    assert [m["step"] for m in read_metrics(dflash_runs.straight) if "train/loss" in m] == list(range(1, 7))
    dflash_runs.check_resume("resumed")


def test_a_resume_that_loses_the_rng_is_caught(dflash_runs):
    """The anchors are random: a resume without the checkpoint's RNG draws others and ends elsewhere, so the
    exact-resume check above would see a lost RNG."""
    from spine import drafter_weights

    out, run_dir = dflash_runs.resume("no-rng", env={"PROBE_MUTANT": "skip_rng_restore"})
    assert out.returncode == 0, out.stderr[-3000:]
    straight, mutant = drafter_weights(dflash_runs.straight), drafter_weights(run_dir)
    assert any(not torch.equal(straight[name], mutant[name]) for name in straight)


# -- recipes ------------------------------------------------------------------------------------------------------

DFLASH_RECIPES = sorted(RECIPES.glob("*dflash.yaml"))


def expected_parameters(cfg, config) -> int:
    """fc, hidden_norm, norm and num_layers Qwen3 layers of the target's dimensions, by hand."""
    H, heads, kv, inner = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    d = getattr(config, "head_dim", None) or H // heads
    layer = H * heads * d * 2 + H * kv * d * 2 + 3 * H * inner + 2 * H + 2 * d
    return cfg.taps_wanted * H * H + 2 * H + cfg.num_layers * layer


def test_the_recipes_are_shipped_under_the_bench_naming():
    assert {p.name for p in DFLASH_RECIPES} == {"toy_dflash.yaml", "smollm2-135m-dflash.yaml",
                                                  "llama3.1-8b-dflash.yaml", "qwen3-8b-dflash.yaml"}


@pytest.mark.parametrize("path", DFLASH_RECIPES, ids=lambda p: p.name)
def test_every_recipe_builds_at_real_dimensions(path):
    from test_config import recipe_on_meta

    recipe, config, target = recipe_on_meta(path, "dflash")
    drafter = get_family("dflash").build(target, recipe.drafter, None)
    assert sum(p.numel() for p in drafter.trained_module().parameters()) == expected_parameters(recipe.drafter, config)
    assert recipe.eval.k == recipe.drafter.block_size - 1  # K = block_size - 1: the whole block is used
    assert drafter.mask_token_id == recipe.drafter.mask_token_id < config.vocab_size
    assert recipe.training.max_grad_norm == pytest.approx(1.0)


def test_the_final_norm_starts_at_norm_init_and_smollm2_starts_it_small():
    """The final norm feeds the target's frozen head: at weight 1 a fresh draft's logits are far wider than a
    uniform guess; ``norm_init`` sets its starting weight, and the SmolLM2 recipe starts it at 0.1 (its first
    loss 12.6 nats instead of 47 against log V = 10.8, eval/probe_dflash_init.py)."""
    target = tiny_target(std=1.0)
    batch = batch_of(random_ids(2, 40, seed=5))
    losses = {}
    for scale in (1.0, 0.1):
        torch.manual_seed(0)
        drafter = dflash(target, randomize=False, norm_init=scale)
        assert torch.equal(drafter.norm.weight, torch.full_like(drafter.norm.weight, scale))
        torch.manual_seed(0)
        losses[scale] = loss_on(drafter, target, batch).loss.item()
    uniform = math.log(VOCAB)
    assert abs(losses[0.1] - uniform) < 0.5 * abs(losses[1.0] - uniform)
    assert DFlashConfig().norm_init == 1.0  # the engines' and SpecForge's start, for targets not measured here
    smollm2 = yaml.safe_load((RECIPES / "smollm2-135m-dflash.yaml").read_text())["drafter"]
    assert smollm2["norm_init"] == pytest.approx(0.1)


def test_the_8b_recipes_follow_the_paper_and_zlabs_checkpoints():
    """z-lab/Qwen3-8B-DFlash-b16: 5 layers, blocks of 16, target_layer_ids [1, 9, 17, 25, 33], mask 151669."""
    from specdraft.config import load_recipe

    qwen = load_recipe(RECIPES / "qwen3-8b-dflash.yaml").drafter
    assert (qwen.block_size, qwen.num_layers, qwen.mask_token_id, qwen.loss_decay_gamma) == (16, 5, 151669, 7.0)
    assert zlab_layer_ids(36, 5) == [1, 9, 17, 25, 33] and dflash_default_taps(36, 5) == (2, 10, 18, 26, 34)
    llama = load_recipe(RECIPES / "llama3.1-8b-dflash.yaml").drafter
    assert (llama.block_size, llama.num_layers, llama.mask_token_id) == (16, 5, 128002)
    assert dflash_default_taps(32, 5) == (2, 9, 16, 23, 30)


# -- exports --------------------------------------------------------------------------------------------------------


def make_run(tmp_path, drafter, target_path):
    run = tmp_path / "run"
    drafter.save_pretrained(run / "drafter")
    (run / "recipe.yaml").write_text(yaml.safe_dump({"target": {"path": str(target_path)}, "eval": {"k": 3}}))
    return run


@pytest.fixture
def exported(tmp_path):
    target = tiny_target(layers=8, config_cls=Qwen3Config, head_dim=24, rope_theta=50000.0)
    target_dir = tmp_path / "target"
    target.model.save_pretrained(target_dir)
    drafter = dflash(target, block_size=5, num_layers=2, num_taps=3, mask_token_id=11)
    return target, drafter, make_run(tmp_path, drafter, target_dir), target_dir


def check_engine_logits(c, weights, prefix, target, drafter, features_taps):
    ids = random_ids(20, seed=4)
    for anchor in (6, 13):
        features = target(ids[None, :anchor], logits="last").aux_hidden[0]
        assert target.taps == tuple(features_taps)
        block = torch.tensor([ids[anchor].item()] + [drafter.mask_token_id] * (drafter.config.block_size - 1))
        engine = reference_block_logits(weights, c, target.embed_tokens.weight, target.lm_head.weight, features,
                                        block, prefix)[1:]
        with torch.no_grad():
            torch.testing.assert_close(engine, specdraft_block_logits(drafter, target, ids, anchor), rtol=1e-4, atol=1e-4)


def test_vllm_loads_the_speculators_dflash_export(exported, tmp_path):
    target, drafter, run, target_dir = exported
    out = export(run, "vllm", tmp_path / "vllm")
    c, aux, mask, k, weights = vllm_loads(out)
    assert aux == list(drafter.needs.taps) and mask == 11 and k == drafter.config.block_size - 1
    assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == \
        str(target_dir.resolve())
    check_engine_logits(c, weights, "model.", target, drafter, aux)


def test_sglang_loads_the_zlab_layout_export(exported, tmp_path):
    target, drafter, run, _ = exported
    out = export(run, "sglang", tmp_path / "sglang")
    c, ids, mask, block, weights = sglang_loads(out, target.num_layers)
    assert [i + 1 for i in ids] == list(drafter.needs.taps)  # SGLang captures before layer id + 1
    assert (mask, block) == (11, drafter.config.block_size)
    check_engine_logits(c, weights, "", target, drafter, [i + 1 for i in ids])


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_the_exports_read_back_into_the_same_drafter(exported, tmp_path, fmt):
    from specdraft.export import load_exported

    target, drafter, run, _ = exported
    back = load_exported(export(run, fmt, tmp_path / fmt), target)
    assert {n: t for n, t in back.state_dict().items()}.keys() == drafter.state_dict().keys()
    assert all(torch.equal(back.state_dict()[n], t) for n, t in drafter.state_dict().items())


def test_the_engine_checks_see_a_wrong_tensor(exported, tmp_path):
    """The logits comparison is not vacuous: a k_norm swapped between layers, or another RoPE base, shows."""
    target, drafter, run, _ = exported
    c, aux, _, _, weights = vllm_loads(export(run, "vllm", tmp_path / "vllm"))
    swapped = dict(weights)
    swapped["model.layers.0.self_attn.k_norm.weight"] = weights["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(AssertionError):
        check_engine_logits(c, swapped, "model.", target, drafter, aux)
    with pytest.raises(AssertionError):
        check_engine_logits({**c, "theta": 10000.0}, weights, "model.", target, drafter, aux)


@pytest.mark.parametrize("fmt, engine", [("vllm", "vLLM"), ("sglang", "SGLang")])
def test_an_export_of_a_draft_layer_the_engine_lacks_is_refused(tmp_path, fmt, engine):
    target = tiny_target(layers=8)
    target_dir = tmp_path / "target"
    target.model.save_pretrained(target_dir)
    run = make_run(tmp_path, dflash(target, draft_layer="llama"), target_dir)
    with pytest.raises(SpecdraftError, match=f"{engine}'s DFlash layers are Qwen3 layers.*'llama'.*--format hf"):
        export(run, fmt, tmp_path / fmt)
    export(run, "hf", tmp_path / "hf")  # specdraft's own folder takes any draft layer


# -- bad input ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("settings, match", [
    ({"block_size": 1}, "block_size must be an integer >= 2"),
    ({"block_size": 0}, "block_size must be an integer >= 2"),
    ({"num_layers": 0}, "num_layers must be an integer >= 1"),
    ({"mask_token_id": -1}, "mask_token_id must be an integer >= 0"),
    ({"loss_decay_gamma": 0}, "loss_decay_gamma must be > 0"),
    ({"draft_layer": "gemma"}, "draft_layer must be one of qwen3, llama"),
    ({"norm_init": 0}, "norm_init must be a number > 0"),
    ({"norm_init": "small"}, "norm_init must be a number > 0"),
    ({"labels": "soft"}, "labels must be one of target, tokens"),
    ({"position_weights": "linear"}, "position_weights must be one of decay, dpace"),
    ({"dpace_alpha": 0}, r"dpace_alpha must be a number in \(0, 1\]"),
    ({"dpace_alpha": 1.5}, r"dpace_alpha must be a number in \(0, 1\]"),
])
def test_bad_config_values(settings, match):
    with pytest.raises(SpecdraftError, match=match):
        DFlashConfig(**settings)


def test_a_block_longer_than_the_context_is_refused():
    target = tiny_target(context=16)
    with pytest.raises(SpecdraftError, match="block_size 16 does not fit the target's context of 16"):
        DFLASH.needs(DFlashConfig(block_size=16, num_layers=2), target.config)
    with pytest.raises(SpecdraftError, match="block_size 32 does not fit"):
        build_dflash(target, DFlashConfig(block_size=32, num_layers=2))


def test_a_mask_token_outside_the_vocabulary_is_refused():
    target = tiny_target()
    with pytest.raises(SpecdraftError, match=f"mask_token_id {VOCAB} is outside the target's vocabulary of {VOCAB}"):
        DFLASH.needs(DFlashConfig(mask_token_id=VOCAB, num_layers=2), target.config)
    with pytest.raises(SpecdraftError, match="outside the target's vocabulary"):
        build_dflash(target, DFlashConfig(mask_token_id=VOCAB + 5, num_layers=2))


def test_tapped_layers_out_of_range_are_refused():
    target = tiny_target(layers=6)
    with pytest.raises(SpecdraftError, match=r"DFlash taps \[2, 6\] are out of range for a 6-layer target"):
        build_dflash(target, DFlashConfig(num_layers=2), taps=(2, 6))
    with pytest.raises(SpecdraftError, match=r"DFlash taps \[2, 2\] repeat a layer for a 4-layer target"):
        build_dflash(tiny_target(layers=4), DFlashConfig(num_layers=2))  # z-lab's ids 1, 1: fewer features
    with pytest.raises(SpecdraftError, match=r"DFlash taps \[2\] are out of range for a 2-layer target"):
        build_dflash(tiny_target(layers=2), DFlashConfig(num_layers=1))  # the middle layer's output


def test_a_recipe_with_taps_out_of_range_names_the_key():
    """The recipe's target.taps replace the default one for one, and the target refuses one it does not have."""
    from specdraft.drafters import declared_needs

    target = tiny_target(layers=6)
    needs = declared_needs(DFLASH, DFlashConfig(num_layers=2), target.config, [1, 9])
    with pytest.raises(SpecdraftError, match="tap layer 9 is out of range.*Fix target.taps"):
        target.require(needs)
    with pytest.raises(SpecdraftError, match="target.taps is \\[1\\], but the dflash drafter reads 2 target layers"):
        declared_needs(DFLASH, DFlashConfig(num_layers=2), target.config, [1])


def test_asked_for_more_drafts_than_the_block_holds_it_drafts_the_block():
    """At most block_size - 1 drafts a step (the decoder takes at most k), the same as when asked for those (and a
    second propose before a commit drafts from the same context)."""
    target = tiny_target()
    source = dflash(target, block_size=4).draft_source(target)
    prompt = random_ids(1, 6, seed=1)
    source.start(prompt, target(prompt, logits="last"))
    more = source.propose(torch.tensor([[3]]), 5, SAMPLED, torch.Generator().manual_seed(0))
    block = source.propose(torch.tensor([[3]]), 3, SAMPLED, torch.Generator().manual_seed(0))
    assert more.tokens.shape == (1, 3) and torch.equal(more.tokens, block.tokens) and torch.equal(more.probs, block.probs)


def test_a_draft_vocabulary_is_refused():
    from specdraft.data.vocab import DraftVocab

    target = tiny_target()
    with pytest.raises(SpecdraftError, match="takes no draft vocabulary"):
        build_dflash(target, DFlashConfig(num_layers=2), DraftVocab.from_target_ids(torch.arange(10), VOCAB))


def test_without_a_mask_token_id_the_first_row_past_the_tokenizer_is_lent_or_the_recipe_must_name_one():
    """SpecForge adds <|MASK|> past the tokenizer (Qwen3: 151669, a row its embedding has); a tokenizer that fills
    the embedding leaves no row, and the recipe must name one."""
    from tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    roomy = tiny_target(vocab=len(tokenizer) + 12)
    roomy.tokenizer = tokenizer
    assert dflash(roomy, randomize=False).mask_token_id == len(tokenizer)
    full = tiny_target(vocab=len(tokenizer))
    full.tokenizer = tokenizer
    with pytest.raises(SpecdraftError, match="fill the embedding: set drafter.mask_token_id"):
        dflash(full, randomize=False)
    assert dflash(full, randomize=False, mask_token_id=3).mask_token_id == 3
