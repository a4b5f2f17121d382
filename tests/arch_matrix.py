"""Target architectures x drafter families: one cell trains, resumes, exports, loads in the engines and decodes.

Used by tests/test_architectures.py (one test per cell) and eval/architectures.py (the table in
eval/README.md, "Target architectures and FSDP on CPU"). Every target is a tiny seeded transformers model built here from its config class, with
no download: 4 layers, hidden 64, the tiny test tokenizer's ~300 tokens.

A cell, for one (architecture, family):
  trains   3 optimizer steps of ``specdraft train`` (in process), a checkpoint after each; then the run is
           resumed from its step-2 checkpoint in a copy and must end at bit-identical drafter weights
  exports  every engine format the family has (``hf`` for DistillSpec, whose only format it is)
  engines  each export passes the engines' loaders as tests/ re-implements them (test_export, test_medusa,
           test_mlp_speculator, test_dflash: every parameter filled with its shape), and reads back into
           specdraft; for EAGLE-3 the engine's draft logits are specdraft's
  greedy   speculative decoding with the trained drafter emits exactly transformers' ``generate()`` greedy
           tokens, past the sliding window where the target has one
A family the engines or specdraft cannot serve on a target is refused with a SpecdraftError: the cell records
the refusal ("refused: ..."), and the test checks it names the limit.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
import transformers as tf
from safetensors.torch import load_file

from spine import make_chat_data, make_recipe
from tiny import seeded_init_, tiny_tokenizer

from specdraft.checkpoint import checkpoint_dirs
from specdraft.config import parse_recipe
from specdraft.decoding.speculative import speculative_decode
from specdraft.drafters import FAMILIES, load_drafter
from specdraft.errors import SpecdraftError
from specdraft.contract import FolderExporter
from specdraft.export import check_exported, export, exporter_for, load_exported
from specdraft.target import FrozenTarget
from specdraft.train import train

SIZES = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 64}
# name -> (config class, what differs from SIZES). Each keeps the feature it is here for.
ARCHITECTURES = {
    "llama3": (tf.LlamaConfig, dict(tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)),
    "qwen3": (tf.Qwen3Config, dict(tie_word_embeddings=True, head_dim=16)),  # QK-norm, tied embeddings
    "qwen3_moe": (tf.Qwen3MoeConfig, dict(tie_word_embeddings=False, head_dim=16, num_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=32,
                                          output_router_logits=True)),
    "mixtral": (tf.MixtralConfig, dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                                       output_router_logits=True)),
    # sliding layers with an 8-token window (decoding runs past it), soft-capped logits, tied embeddings
    "gemma3": (tf.Gemma3TextConfig, dict(tie_word_embeddings=True, head_dim=16, sliding_window=8,
                                         layer_types=["sliding_attention", "full_attention"] * 2,
                                         final_logit_softcapping=5.0, query_pre_attn_scalar=16)),
    "mistral": (tf.MistralConfig, dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2": (tf.Qwen2Config, dict(tie_word_embeddings=False)),  # q/k/v biases
    # yarn RoPE (factor 8 over 64 positions) (truncate: false, as gpt-oss ships), attention sinks, sliding layers with
    # an 8-token window, mixture of experts with clamped SwiGLU, q/k/v/o biases
    "gpt_oss": (tf.GptOssConfig, dict(tie_word_embeddings=False, head_dim=16, sliding_window=8,
                                      layer_types=["sliding_attention", "full_attention"] * 2, num_local_experts=4,
                                      num_experts_per_tok=2, rope_parameters=GPT_OSS_YARN, output_router_logits=True)),
    # multi-head latent attention (q and kv LoRA ranks, a decoupled 8-dim RoPE part), a dense first layer then
    # routed + shared experts
    "deepseek_v3": (tf.DeepseekV3Config, dict(tie_word_embeddings=False, num_key_value_heads=4, q_lora_rank=24,
                                              kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                              n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                              moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                                              topk_group=1)),
    # chunked attention (8-token chunks) on the RoPE layers, a NoPE full-attention layer, QK-norm, llama3 RoPE,
    # dense and MoE layers interleaved
    "llama4": (tf.Llama4TextConfig, dict(tie_word_embeddings=False, head_dim=16, intermediate_size=32,
                                         intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
                                         interleave_moe_layer_step=2, attention_chunk_size=8,
                                         layer_types=["chunked_attention"] * 3 + ["full_attention"],
                                         no_rope_layers=[1, 1, 1, 0], rope_parameters=LLAMA3_ROPE,
                                         attn_temperature_tuning=True, floor_scale=16, attn_scale=0.1)),
    # GLM-4: RoPE on half of each head (partial_rotary_factor 0.5), fused gate_up, sandwich norms, q/k/v biases
    "glm4": (tf.Glm4Config, dict(tie_word_embeddings=False, head_dim=16)),
    "glm4_moe": (tf.Glm4MoeConfig, dict(tie_word_embeddings=False, head_dim=16, n_routed_experts=4,
                                        num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                                        first_k_dense_replace=1, use_qk_norm=True)),
}
MOE = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "llama4", "glm4_moe")
DRAFTERS = {
    "eagle1": {"family": "eagle1", "fc_bias": False},  # vLLM's EAGLE-1 fc has no bias
    "eagle3": {"family": "eagle3", "ttt_steps": 2, "draft_vocab_size": 128},
    "eagle3-qk": {"family": "eagle3", "ttt_steps": 2, "draft_vocab_size": 128, "draft_layer": "qwen3"},  # QK-norm
    "medusa1": {"family": "medusa1", "num_heads": 2, "num_layers": 1},
    "medusa2": {"family": "medusa2", "num_heads": 2, "num_layers": 1, "lora_r": 4, "lora_alpha": 8},
    "mlp_speculator": {"family": "mlp_speculator", "n_predict": 2},
    "distillspec": {"family": "distillspec", "init": "truncate", "num_layers": 1, "generation_max_new_tokens": 8},
    "dflash": {"family": "dflash", "block_size": 4, "num_layers": 1, "num_taps": 1, "num_anchors": 4,
               "mask_token_id": 0},
}
TAPS = {"eagle3": [1, 2, 3], "eagle3-qk": [1, 2, 3], "dflash": [2]}  # engines capture layers >= 1, each once
# Medusa-2's LoRA modules where specdraft's default (q/k/v/o and gate/up/down projections) does not fit. MoE experts
# are fused 3-D parameters in transformers 5, not Linear modules: LoRA adapts attention there. DeepSeek-V3's latent
# attention has its own projections; GLM-4 fuses gate and up.
ATTENTION_LORA = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_MODULES = {**{arch: ATTENTION_LORA for arch in MOE},
                "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
                "glm4": ATTENTION_LORA + ["gate_up_proj", "down_proj"]}
STEPS, NEW_TOKENS = 3, 24


@dataclass
class Cell:
    arch: str
    family: str
    trains: str = "-"
    exports: str = "-"
    engines: str = "-"
    greedy: str = "-"
    refusal: str | None = None  # the SpecdraftError's message, where the family is refused
    notes: dict[str, str] = field(default_factory=dict)  # format -> why its export was refused

    def row(self) -> list[str]:
        drafter = DRAFTERS[self.family]
        shown = self.family if self.family in FAMILIES else f"{drafter['family']}, draft_layer: {drafter['draft_layer']}"
        return [self.arch, shown, self.trains, self.exports, self.engines, self.greedy]


def target_config(arch: str, vocab_size: int):
    cls, extra = ARCHITECTURES[arch]
    config = cls(**{**SIZES, "vocab_size": vocab_size, **extra})
    config.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    return config


@lru_cache(maxsize=None)
def target_folder(arch: str, root: str) -> Path:
    """The seeded tiny target of ``arch`` with the tiny tokenizer, saved once per root."""
    folder = Path(root) / arch
    if not (folder / "config.json").is_file():
        tokenizer = tiny_tokenizer(300)
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(target_config(arch, len(tokenizer)))
        seeded_init_(model, 0, std=0.05).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def recipe_for(arch: str, family: str, folder: Path, target: Path, data: Path) -> dict:
    recipe = make_recipe(folder, target, data, training={"max_steps": STEPS, "grad_accumulation": 1},
                         checkpoint={"save_every": 1, "keep_last": STEPS})
    recipe["drafter"] = dict(DRAFTERS[family])
    if family == "medusa2" and arch in LORA_MODULES:
        recipe["drafter"]["lora_target_modules"] = LORA_MODULES[arch]
    recipe["target"]["taps"] = TAPS.get(family, "auto")
    return recipe


def resumed_run(recipe: dict, straight: Path, folder: Path) -> Path:
    """A copy of the finished run cut back to its step-2 checkpoint, resumed to the end."""
    shutil.copytree(straight, folder)
    for ckpt in checkpoint_dirs(folder)[2:]:
        shutil.rmtree(ckpt)
    shutil.rmtree(folder / "drafter")
    return train(parse_recipe({**recipe, "checkpoint": {**recipe["checkpoint"], "output_dir": str(folder)}}),
                 resume=True, show_progress=False)


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_file(a / "drafter" / "model.safetensors"), load_file(b / "drafter" / "model.safetensors")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def engine_check(name: str, fmt: str, out: Path, target: FrozenTarget, drafter) -> str:
    """The engines' loaders, as tests/ re-implements them, on one export: what loads it."""
    family = DRAFTERS[name]["family"]
    if family == "eagle3":
        from test_export import (assert_same_logits, eagle3_logits, sglang_eagle3_loads, speculators_eagle3_loads,
                                 vllm_eagle3_loads)
        if fmt == "sglang":
            consumers = {"SGLang": sglang_eagle3_loads(out, target)[1]}
        else:
            consumers = {"vLLM": vllm_eagle3_loads(out, target)[2], "speculators": speculators_eagle3_loads(out, target)}
        for w in consumers.values():  # the draft logits through each consumer's weights (and RoPE) are specdraft's
            assert_same_logits(eagle3_logits(w, target), drafter, target)
        return ", ".join(consumers)
    if family == "eagle1":
        from test_export import sglang_eagle1_loads, vllm_eagle1_loads
        (sglang_eagle1_loads if fmt == "sglang" else vllm_eagle1_loads)(out, target)
        return "SGLang" if fmt == "sglang" else "vLLM"
    if family == "dflash":
        from test_dflash import sglang_loads, vllm_loads
        if fmt == "sglang":
            sglang_loads(out, target.num_layers)
            return "SGLang"
        vllm_loads(out)
        return "vLLM"
    if family == "medusa1":
        from test_medusa import fasterdecoding_loads, vllm_loads
        if fmt == "medusa":
            fasterdecoding_loads(out)
            return "FasterDecoding"
        dropped = []
        vllm_loads(out, dropped)
        assert not dropped, f"vLLM would drop {dropped}"
        return "vLLM"
    if family == "mlp_speculator":
        from test_mlp_speculator import fms_extras_state_names, vllm_load
        config, tensors = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
        assert {n: tuple(t.shape) for n, t in tensors.items()} == fms_extras_state_names(config)
        vllm_load(config, tensors)
        return "fms-extras, vLLM"
    check_exported(out, out.parent / "run" / "drafter")  # a whole model: medusa2's merged target, distillspec's LM
    return "transformers"


def formats_of(name: str) -> list[str]:
    engine = [f for f in FAMILIES[DRAFTERS[name]["family"]].exporters if f != "hf"]
    return engine or ["hf"]


def run_cell(arch: str, family: str, root: Path) -> Cell:
    """One (architecture, family) cell (``family``: a key of DRAFTERS) under ``root`` (a fresh folder): see the module docstring."""
    cell = Cell(arch, family)
    root.mkdir(parents=True, exist_ok=True)
    target_dir = target_folder(arch, str(root.parent / "targets"))
    data = make_chat_data(root / "chat.jsonl")
    recipe = recipe_for(arch, family, root, target_dir, data)
    try:
        straight = train(parse_recipe(recipe), show_progress=False)
    except SpecdraftError as e:
        cell.refusal = str(e)
        cell.trains = "refused"
        return cell
    resumed = resumed_run(recipe, straight, root / "resumed")
    assert same_weights(straight, resumed), f"{arch} {family}: the resumed run ends at other weights"
    cell.trains = f"yes ({STEPS} steps, exact resume)"

    target = FrozenTarget.from_pretrained(target_dir, dtype="float32")
    drafter = load_drafter(straight / "drafter", target)
    exported, engines = [], []
    for fmt in formats_of(family):
        out = root / f"export-{fmt}"
        try:
            export(straight, fmt, out)
        except SpecdraftError as e:
            cell.notes[fmt] = str(e)
            exported.append(f"{fmt}: refused")
            continue
        exported.append(fmt)
        engines.append(engine_check(family, fmt, out, target, drafter))
        if not isinstance(exporter_for(DRAFTERS[family]["family"], fmt), FolderExporter):  # a drafter folder: it reads back
            load_exported(out, target)
    cell.exports = ", ".join(exported)
    cell.engines = "; ".join(engines) or "none"

    # Medusa-2 decodes against its adapted target: the merged export is that model.
    reference = root / "export-merged" if family == "medusa2" else target_dir
    model = tf.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    prompts = [torch.tensor([[1, 40 + 7 * i, 50 + 3 * i, 60 + i, 70]]) for i in range(3)]
    drafted = accepted = 0
    for prompt in prompts:
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)[0, prompt.shape[1]:].tolist()
        source = drafter.draft_source(target)
        out = speculative_decode(target, source, prompt, k=2, max_new_tokens=NEW_TOKENS, eos_token_ids=[])
        assert out.tokens == expected, f"{arch} {family}: speculative greedy {out.tokens} != generate {expected}"
        drafted += sum(s.num_drafted for s in out.steps)
        accepted += sum(s.num_accepted for s in out.steps)
    cell.greedy = f"yes ({accepted}/{drafted} drafts accepted)"
    return cell
