"""EAGLE-1 and EAGLE-3 in the folders vLLM and SGLang serve: the two families' exporters.

Formats (``specdraft export RUN --format F``; ``hf``, specdraft's own folder, is the export driver's):
  sglang  EAGLE-3 as LlamaForCausalLMEagle3; EAGLE-1 in the EAGLE reference layout, as SGLang's
          LlamaForCausalLMEagle (Qwen2ForCausalLMEagle for Qwen2 targets) loads it. The EAGLE
          reference repo's EaModel (SafeAILab/EAGLE eagle/model/ea_model.py) reads the same folders.
  vllm    EAGLE-3 in the speculators format (Eagle3Speculator), which vLLM and the speculators
          library load; EAGLE-1 in the reference layout with a Llama config, which vLLM's
          EAGLEConfig turns into EagleLlamaForCausalLM

What each folder holds (``config.json`` and ``model.safetensors``, nothing pickled), format by family:

  sglang, EAGLE-3  ``LlamaForCausalLMEagle3``: ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, the target's
                   ``embed_tokens``, and ``d2t``, ``t2d`` if the draft vocabulary is reduced; layer ids in
                   SGLang's convention. The EAGLE repo's ``EaModel`` loads it too
  sglang, EAGLE-1  EAGLE reference layout (``LlamaForCausalLMEagle``, also ``EaModel``): ``fc`` with its
                   bias, ``layers.0.*``
  vllm, EAGLE-3    speculators ``Eagle3Speculator`` (``speculators_config``, ``transformer_layer_config``,
                   ``eagle_aux_hidden_state_layer_ids``): ``fc``, ``layers.0.*``, ``norm``, ``lm_head``,
                   the target's ``embed_tokens``, and ``d2t``, ``t2d`` if reduced. vLLM and the
                   speculators library load it
  vllm, EAGLE-1    reference layout with a Llama config (``method: eagle``): ``fc`` without bias,
                   ``layers.0.*``
  hf, both         specdraft's own folder, loaded by ``specdraft eval``

EAGLE-3 engine exports ship the target's token embedding (``embed_tokens.weight``: the driver reads
only the target's ``model.embed_tokens.weight`` from its safetensors, sharded or not, in the export
dtype). vLLM and SGLang share the target's own embedding anyway, but EaModel (EAGLE-3 configs with ``target_hidden_size``) and speculators (under
transformers 5) would otherwise run the draft on an embedding nobody loaded. Every consumer of the
EAGLE-1 layouts reads the target's embedding itself, so those ship none. Each exporter's docstring
gives the reasons per consumer.

Every config field an engine reads is written out, never left to a default: the engines disagree
(vLLM reads a missing ``norm_before_residual`` in a speculators config as true, speculators itself
as false; ``bias: true`` gives vLLM's and SGLang's Llama layers attention biases). The one
exception is a key two consumers of one format read with different meanings (``bias`` in the
EAGLE-1 sglang export: SGLang reads it as attention bias, default none; EaModel as the fc bias,
default on): it is left out, so that each consumer's default applies. Each exporter's docstring names
the loader files its fields and tensor names were checked against.

A full-size EAGLE-3 draft vocabulary ships no ``d2t``/``t2d``, and the config gives
``draft_vocab_size`` = ``vocab_size``: vLLM builds no vocabulary map then and refuses the tensors,
and every other consumer reads the absence as the identity.

The verifier is the recipe's ``target.path``, or ``--target``: ``toy`` and named targets are resolved
to the folder that training loaded, and a local folder is named by its absolute path. The vLLM config
names this verifier. ``vllm serve EXPORT`` on its own accepts only a hub id as verifier; with a local
target, run ``vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "EXPORT", ...}'``.

Tests re-implement, from each consumer's source (vLLM 0.33, SGLang 0.5.23, speculators 0.9 and
SafeAILab/EAGLE's EaModel), its config parsing and weight mapping. They check every tensor name and
shape, and that every parameter the consumer has gets filled; for loaders that skip missing names
silently, this is the only check. They compute the draft logits through each consumer's mapping and
check that these equal specdraft's own, and that export, then load, gives identical draft logits.
EaModel itself (on transformers 4, which it requires) fails loudly on some targets: where
``head_dim`` is not hidden/heads, on RoPE scalings other than linear or dynamic (llama3's, for
example), and, for EAGLE-1, on a target saved as a single file.

Layer ids: our tap i is the *input* of target layer i (vLLM's convention); SGLang names the layer
whose *output* it captures, so SGLang id = tap - 1. Both engines capture ``hidden + residual``
before the layer runs, and each layer once: served taps must be 3 distinct layers >= 1.
"""

from __future__ import annotations

import torch

from ..contract import Exporter, ExportOptions
from ..dtypes import export_dtype
from ..errors import SpecdraftError
from .eagle_common import draft_rope_parameters

SPECULATORS_VERSION = "0.3.0"  # the speculators config schema the vLLM export follows
EMBED = "embed_tokens.weight"  # the target's token embedding, as EAGLE-3 engine exports ship it


def sglang_layer_ids(taps: list[int]) -> list[int]:
    """SGLang names the layer whose *output* is captured: our input-of-layer i is its i-1."""
    return [t - 1 for t in taps]


# -- what both EAGLE exports share ---------------------------------------------------------------

EAGLE3_TENSORS = {
    EMBED, "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
}
QK_NORM_TENSORS = {"midlayer.self_attn.q_norm.weight", "midlayer.self_attn.k_norm.weight"}  # draft_layer: qwen3


def _eagle3_draft_layer(saved: dict) -> str:
    """llama, or qwen3 (QK-norm); drafters saved before the choice existed have the llama layer."""
    return saved["config"].get("draft_layer", "llama")


def _eagle3_tensors(saved: dict) -> set[str]:
    return EAGLE3_TENSORS | (QK_NORM_TENSORS if _eagle3_draft_layer(saved) == "qwen3" else set())


def _rope_fields(tc: dict) -> dict:
    """The target's RoPE in both spellings: transformers 4 (rope_theta, rope_scaling), 5 (rope_parameters)."""
    params = tc.get("rope_parameters")
    if params is None:  # a transformers-4 config; old ones spell rope_type "type"
        scaling = tc.get("rope_scaling") or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        params = {**scaling, "rope_type": rope_type, "rope_theta": tc.get("rope_theta", 10000.0)}
    params = draft_rope_parameters(params)  # the draft layer rotates its whole head (GLM-4's target does not)
    scaling = None if params.get("rope_type", "default") == "default" else {
        k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_theta": params["rope_theta"], "rope_scaling": scaling, "rope_parameters": params}


def _layer_fields(saved: dict, tensors: dict, model_type: str, vocab_size: int) -> dict:
    """The draft layer as a one-layer transformers config. Both EAGLE drafters build their layer
    from the target's config, so its dimensions, norm eps and RoPE are the target's."""
    tc = saved["target_config"]
    if tc.get("hidden_act") != "silu":
        raise SpecdraftError(
            f"the target's hidden_act is {tc.get('hidden_act')!r}; vLLM's and SGLang's Llama MLP (which the EAGLE "
            "draft layer runs as) support only silu. Export --format hf instead."
        )
    heads = tc["num_attention_heads"]
    dtype = export_dtype(saved, tensors)
    return {
        "model_type": model_type,
        "hidden_size": tc["hidden_size"],
        "intermediate_size": tc["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": tc.get("num_key_value_heads") or heads,
        "head_dim": tc.get("head_dim") or tc["hidden_size"] // heads,
        "hidden_act": "silu",
        "rms_norm_eps": tc["rms_norm_eps"],
        "max_position_embeddings": tc["max_position_embeddings"],
        **_rope_fields(tc),
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,  # True would make the engines use the embedding as LM head
        "torch_dtype": dtype,
        "dtype": dtype,  # transformers 5's name for torch_dtype
    }


# Targets (transformers model_type) each engine feeds a draft from captured layers, among those specdraft's EAGLE-3
# and DFlash drafters tap. vLLM 0.33.0: the target's model class implements SupportsEagle3
# (v1/worker/gpu_model_runner.py raises "Model does not support EAGLE3 interface" otherwise; DFlash also runs on
# aux hidden states): llama.py (MistralForCausalLM and llama4.py's Llama4ForCausalLM subclass it; mllama4.py's
# Llama4ForConditionalGeneration too), qwen2.py, qwen3.py, qwen3_moe.py, gpt_oss.py, deepseek_v2.py
# (DeepseekV3ForCausalLM subclasses DeepseekV2ForCausalLM); mixtral.py, glm4.py and glm4_moe.py do not.
# sglang 0.5.23 (model_executor/model_runner_components/attention_backend_setup.py raises without them): the model
# class has set_eagle3_layers_to_capture (llama.py, which mistral.py and llama4.py subclass, qwen2.py, qwen3.py,
# qwen3_moe.py, gpt_oss.py, deepseek_v2.py, glm4_moe.py) or set_dflash_layers_to_capture (llama.py, qwen3.py,
# qwen3_moe.py, gpt_oss.py, deepseek_v2.py); mixtral.py and glm4.py have neither. Every one of these captures
# hidden + residual at a layer's input, as llama.py does.
SERVED_TARGETS = {
    ("vLLM", "EAGLE-3"): ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3", "llama4_text"),
    ("SGLang", "EAGLE-3"): ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3",
                            "llama4_text", "glm4_moe"),
    ("vLLM", "DFlash"): ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3", "llama4_text"),
    ("SGLang", "DFlash"): ("llama", "mistral", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3", "llama4_text"),
}


def check_served_target(saved: dict, engine: str, method: str) -> None:
    """Refuse an export for a target whose model the engine cannot feed this draft (no layer capture)."""
    model_type = saved["target_config"].get("model_type")
    served = SERVED_TARGETS[engine, method]
    if model_type not in served:
        raise SpecdraftError(
            f"{engine} serves {method} drafts only on targets whose model captures the tapped layers "
            f"({', '.join(served)}); its {model_type} model does not, so this drafter cannot run there. "
            "Export --format hf, or train for a target the engine serves."
        )


def _served_taps(saved: dict) -> list[int]:
    taps = list(saved["target_taps"])
    if len(taps) != 3 or len(set(taps)) != 3 or min(taps) < 1:
        raise SpecdraftError(
            f"this drafter reads target layers {taps}, but vLLM and SGLang feed EAGLE-3 three distinct layers, each "
            "captured as hidden + residual before a layer >= 1. Retrain with three distinct taps >= 1 "
            "(target.taps: eagle3 on a target with >= 7 layers), or export --format hf."
        )
    return taps


def _check_tensor_names(have: set, want: set, engine: str) -> None:
    if have != want:
        raise SpecdraftError(
            f"{engine} cannot load this drafter: it has no parameter for {sorted(have - want)} and needs "
            f"{sorted(want - have)}. Export --format hf, which any specdraft drafter supports."
        )


# -- EAGLE-3 -------------------------------------------------------------------------------------


def _eagle3_vocab(saved: dict, tensors: dict) -> tuple[int, int, dict]:
    """(target vocab V, draft vocab N, the tensors to ship). A full-size draft vocabulary (N == V) is
    the identity map, and ships no d2t/t2d (see the exporters for each consumer's reading)."""
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    V, N = t2d.numel(), d2t.numel()
    if saved["target_config"].get("vocab_size") != V:
        raise SpecdraftError(
            f"this drafter's vocabulary map covers {V} target tokens, but its target's config says vocab_size "
            f"{saved['target_config'].get('vocab_size')}; the engines size the map from the config. Export --format hf."
        )
    if N < V:
        return V, N, dict(tensors)
    if d2t.any() or not t2d.all():  # from_target_ids sorts its ids, so a full vocabulary is the identity
        raise SpecdraftError("this drafter's full-size draft vocabulary is not the identity map; export --format hf")
    return V, N, {k: t for k, t in tensors.items() if k not in ("d2t", "t2d")}


def eagle3_to_sglang(saved: dict, tensors: dict, opts: ExportOptions) -> tuple[dict, dict]:
    """SGLang's LlamaForCausalLMEagle3; tensor names are ours, plus the target's embedding.

    Checked against sglang 0.5.23 (the PyPI wheel):
      srt/models/llama_eagle3.py  fc = Linear(num_aux * target_hidden_size, hidden_size, bias=config.bias);
        num_aux: num_aux_hidden_states, else len(eagle_config ids); norm_before_fc (eagle_config or config),
        fc_norm / use_aux_norm and norm_output read from the config, all written here as false;
        lm_head [draft_vocab_size, hidden] unless tie_word_embeddings; the first layer keeps the hidden as
        residual before hidden_norm (ours); load_weights: midlayer -> layers.0, d2t -> hot_token_id =
        d2t + arange, t2d skipped, q/k/v -> qkv_proj, gate/up -> gate_up_proj, other names tried as-is then
        as model.<name> (so embed_tokens.weight loads into model.embed_tokens), unmatched names dropped silently
      srt/models/llama.py  attention bias = attention_bias or bias; LlamaMLP: silu only; set_embed replaces
        the draft's embedding with the target's (hidden sizes equal), so SGLang runs on the target's own
      srt/speculative/eagle_worker_v2.py  init_lm_head / init_token_map: hot_token_id only from the draft's
        d2t; None means draft id = target id, so a full-size vocabulary ships no d2t/t2d
      srt/model_executor/model_runner_components/spec_aux_hidden_state.py  layer ids from the draft config's
        eagle_config["eagle_aux_hidden_state_layer_ids"]; models/llama.py set_eagle3_layers_to_capture adds 1
    and SafeAILab/EAGLE (main at cb7e084, on the transformers 4 it requires: under transformers 5 EConfig turns
    any RoPE into rope_scaling-as-rope_parameters and cnets.py fails on rope_scaling["type"], whatever the
    folder says), which reads the same folder (EaModel.from_pretrained(use_eagle3=True)):
      eagle/model/ea_model.py  EConfig from config.json; state dict loaded with strict=False (missing and
        unexpected names pass silently); d2t/t2d buffers deleted when vocab_size == draft_vocab_size
      eagle/model/cnets.py Model.__init__  takes the base model's embedding only `if load_emb and not
        hasattr(config, "target_hidden_size")`, and then only through model.safetensors.index.json or
        pytorch_model.bin.index.json (a single-file target raises); otherwise embed_tokens stays nn.Embedding's
        random init unless the state dict has embed_tokens.weight. SGLang and vLLM size fc by target_hidden_size,
        so the key stays and the embedding ships. d2t/t2d are zero-initialised buffers: a reduced vocabulary
        must ship both. Attention head_dim = hidden_size // num_attention_heads; RoPE from rope_theta, or
        rope_scaling {"type": linear|dynamic, "factor"} (configs.py EConfig rejects other scalings)
    """
    if _eagle3_draft_layer(saved) != "llama":
        raise SpecdraftError(
            "SGLang 0.5.23's EAGLE-3 draft for these targets is LlamaForCausalLMEagle3 (srt/models/llama_eagle3.py), a "
            f"Llama layer without QK-norm; this drafter's draft_layer is {_eagle3_draft_layer(saved)!r}. Export "
            "--format vllm (vLLM's Eagle3Qwen3ForCausalLM runs it), or retrain with drafter.draft_layer: llama."
        )
    _check_tensor_names(set(tensors), EAGLE3_TENSORS, "SGLang's LlamaForCausalLMEagle3")
    check_served_target(saved, "SGLang", "EAGLE-3")
    layer_ids = sglang_layer_ids(_served_taps(saved))
    if saved["target_config"].get("model_type") == "deepseek_v3" and layer_ids[0] != 1:
        raise SpecdraftError(
            "SGLang 0.5.23's DeepseekV3ForCausalLM (srt/models/deepseek_v2.py, set_eagle3_layers_to_capture) adds 1 "
            "to the draft's eagle_aux_hidden_state_layer_ids only when the first id is 1, and otherwise captures "
            f"one layer early; this drafter's taps {list(saved['target_taps'])} make them {layer_ids}. Retrain with "
            "the first tap at layer 2 (target.taps: eagle3 picks 2, L/2 and L-3), or export --format vllm."
        )
    V, N, out = _eagle3_vocab(saved, tensors)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_layer_fields(saved, tensors, "llama", vocab_size=V),
        "draft_vocab_size": N,
        "target_hidden_size": saved["target_config"]["hidden_size"],
        "bias": False,  # fc has no bias, and llama.py would also give attention a bias
        "attention_bias": False,
        "mlp_bias": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,  # the next step's hidden is the pre-norm output
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": layer_ids,
            "use_aux_hidden_state": True,
        },
    }
    return config, out


def eagle3_to_vllm(saved: dict, tensors: dict, opts: ExportOptions) -> tuple[dict, dict]:
    """The speculators format, which vLLM serves as Eagle3LlamaForCausalLM (Eagle3Qwen3ForCausalLM for
    ``draft_layer: qwen3``); midlayer.* -> layers.0.*.

    Checked against vLLM 0.33.0 (the PyPI wheel):
      vllm/transformers_utils/configs/speculators/base.py  requires speculators_model_type,
        speculators_config.proposal_methods[0].speculative_tokens, speculators_config.verifier.name_or_path
        and a transformer_layer_config dict, which becomes the draft's model config
      vllm/transformers_utils/configs/speculators/algos.py  update_eagle3 copies draft_vocab_size,
        target_hidden_size, norm_before_residual (missing -> True, unlike ours), norm_before_fc, fc_norm,
        norm_output and eagle_aux_hidden_state_layer_ids; the architecture comes from the layer config's
        model_type (eagle3_arch_map: "llama" -> Eagle3LlamaForCausalLM, "qwen3" -> Eagle3Qwen3ForCausalLM)
      vllm/model_executor/models/qwen3_eagle3.py  Qwen3Eagle3DecoderLayer: vLLM's Qwen3DecoderLayer (q_norm,
        k_norm over head_dim) with qkv_proj over 2 * hidden and a hidden_norm, a sliding window only where the
        layer config's layer_types says sliding_attention; the same loader and weight mapping as llama_eagle3.py
      vllm/model_executor/models/llama_eagle3.py  fc = num_aux * target_hidden_size -> hidden, no bias;
        q/k/v read 2 * hidden; qkv bias = attention_bias; draft_id_to_target_id exists only when
        draft_vocab_size != the target's vocab size (model_config.get_vocab_size()), and load_weights renames
        d2t to it, so a full-size vocabulary must ship no d2t ("There is no module or parameter named
        'draft_id_to_target_id'"); t2d skipped; midlayer. -> layers.0., all but lm_head under model.;
        an embed_tokens tensor is loaded, and process_eagle_weight marks has_own_embed_tokens
      vllm/v1/spec_decode/llm_base_proposer.py  _maybe_share_embeddings: an own embedding identical to the
        target's is replaced by the target's (the shipped one is the target's, so vLLM shares it)
      vllm/v1/worker/gpu_model_runner.py  _get_eagle3_aux_layers_from_config: the draft config's
        eagle_aux_hidden_state_layer_ids, in vLLM's convention (= our taps)
      vllm/transformers_utils/config.py  maybe_override_with_speculators: `vllm serve EXPORT` alone serves
        the verifier, and only a hub repo id there ("Select local verifiers explicitly with --model and
        --speculative-config"); so the verifier is the real folder or hub id, never a specdraft shortcut
    and speculators 0.9.0 (the PyPI wheel), which loads the same folder (SpeculatorModel.from_pretrained):
      src/speculators/model.py  DraftVocabMixin._init_vocab: d2t/t2d buffers only when draft_vocab_size !=
        transformer_layer_config.vocab_size; embed_tokens and lm_head start as NaN; from_pretrained then
        load_verifier_weights copies the verifier's embedding only where embed_tokens is still NaN. Under
        transformers 5 a missing key is materialised uninitialised instead (embed_tokens.weight is in
        _keys_to_ignore_on_load_missing, so nothing warns): the embedding must ship
      src/speculators/models/eagle3/core.py  Eagle3DraftModel: fc = num_aux * hidden; layers.0 with
        hidden_norm; rotary from the layer config with hidden_size doubled (so head_dim is written);
        from_pretrained opens the verifier (resolve_target_layer_ids, AutoConfig.from_pretrained)
      src/speculators/models/eagle3/config.py, src/speculators/config.py, src/speculators/proposals/greedy.py
      src/speculators/models/eagle3/model_definitions.py  model_classes: "llama" and "qwen3" first layers
        (Qwen3DecoderEagle3FirstLayer, with its q_norm / k_norm)
    Tensor names are the ones speculators itself saves (layers.0.*).
    """
    draft_layer = _eagle3_draft_layer(saved)
    engine_model = {"llama": "Eagle3LlamaForCausalLM", "qwen3": "Eagle3Qwen3ForCausalLM"}[draft_layer]
    _check_tensor_names(set(tensors), _eagle3_tensors(saved), f"vLLM's {engine_model}")
    check_served_target(saved, "vLLM", "EAGLE-3")
    V, N, out = _eagle3_vocab(saved, tensors)
    if not opts.verifier:
        raise SpecdraftError(
            "vLLM's speculators config names the target model (speculators_config.verifier.name_or_path), and "
            "no recipe with target.path was found next to the drafter: pass --target HUB_ID_OR_PATH."
        )
    tc = saved["target_config"]
    layer = _layer_fields(saved, tensors, draft_layer, vocab_size=V)  # model_type picks vLLM's model
    layer.update(attention_bias=False, mlp_bias=False, eagle_config={"use_aux_hidden_state": True})
    if draft_layer == "qwen3":  # Qwen3Eagle3DecoderLayer windows the layers layer_types says slide: none
        layer.update(use_sliding_window=False, sliding_window=None, layer_types=["full_attention"])
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{
                "proposal_type": "greedy",
                "speculative_tokens": opts.num_speculative_tokens,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": opts.verifier, "architectures": tc.get("architectures") or []},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": N,
        "norm_before_residual": False,  # our residual is the hidden before hidden_norm
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,  # the next step's hidden is the pre-norm output
        "target_hidden_size": tc["hidden_size"],
        "eagle_aux_hidden_state_layer_ids": _served_taps(saved),
        "torch_dtype": layer["torch_dtype"],
    }
    return config, {name.replace("midlayer.", "layers.0."): t for name, t in out.items()}


# -- EAGLE-1 -------------------------------------------------------------------------------------

# The reference layout (SafeAILab/EAGLE eagle/model/cnets1.py): fc, then one decoder layer of the
# target's architecture whose input_layernorm is removed. Embedding and LM head are the target's.
# Target model_type -> the engine layer that computes the same function. A Mistral layer is a Llama
# layer here: the draft attends over its whole context (no sliding window).
EAGLE1_LAYER_KIND = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


def _eagle1_tensors(kind: str, attention_bias: bool, fc_bias: bool) -> set[str]:
    names = {"fc.weight", "layers.0.post_attention_layernorm.weight"}
    names |= {f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"}
    names |= {f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    biased = "qkv" if kind == "qwen2" else ("qkvo" if attention_bias else "")  # Qwen2: q/k/v biases only
    names |= {f"layers.0.self_attn.{p}_proj.bias" for p in biased}
    return names | ({"fc.bias"} if fc_bias else set())


def _eagle1_kind(saved: dict, engine_models: dict[str, str], engine: str) -> str:
    model_type = saved["target_config"].get("model_type")
    kind = EAGLE1_LAYER_KIND.get(model_type)
    if kind not in engine_models:
        raise SpecdraftError(
            f"{engine} has EAGLE-1 models for {', '.join(engine_models.values())} only; this drafter's layer is a "
            f"{model_type} layer. Export --format hf, or train EAGLE-3 (its draft layer is a Llama layer on any "
            "target)."
        )
    return kind


def eagle1_to_sglang(saved: dict, tensors: dict, opts: ExportOptions) -> tuple[dict, dict]:
    """The reference layout as SGLang's LlamaForCausalLMEagle / Qwen2ForCausalLMEagle load it.

    Checked against sglang 0.5.23 (the PyPI wheel):
      srt/models/llama_eagle.py, qwen2_eagle.py  fc = Linear(2H, H) with a bias, always (a drafter trained
        without one gets a zero bias, else nn.Linear's random init would stay); cat(embed, feature) order;
        layer 0's input_layernorm is deleted (no tensor); load_weights skips lm_head names and prefixes the
        rest with model.
      srt/speculative/eagle_worker_v2.py  init_lm_head: set_embed_and_head binds the target's embedding
        and LM head, so neither is written
      srt/models/llama.py  attention bias = attention_bias or bias (a missing bias reads False); unknown
        *.bias names are dropped silently, other unknown names only warn. qwen2.py: q/k/v biases always,
        no qkv_bias key read
    and SafeAILab/EAGLE (transformers 4, as for EAGLE-3), which reads the same folder
    (EaModel.from_pretrained(use_eagle3=False)):
      eagle/model/ea_model.py  fc bias = config.json "bias", True when missing; strict=False load
      eagle/model/cnets1.py Model.__init__  fc = Linear(2H, H, bias); q/k/v biases only with "qkv_bias";
        o_proj never biased; load_emb reads the base model's embedding (through a sharded checkpoint's
        index only: with a single-file target EaModel raises, whatever the export ships), so none is written
    So "bias" is left out (SGLang: no attention bias; EaModel: fc bias, which this export always has), and
    a Qwen2 layer says qkv_bias: true. EaModel cannot hold a Llama layer's o_proj bias (attention_bias
    targets); SGLang, the engine this format names, can.
    """
    models = {"llama": "LlamaForCausalLMEagle", "qwen2": "Qwen2ForCausalLMEagle"}
    kind = _eagle1_kind(saved, models, "SGLang")
    tc = saved["target_config"]
    attention_bias = bool(tc.get("attention_bias", False))
    out = dict(tensors)
    if "fc.bias" not in out:
        out["fc.bias"] = torch.zeros_like(out["fc.weight"][:, 0])
    _check_tensor_names(set(out), _eagle1_tensors(kind, attention_bias, fc_bias=True), f"SGLang's {models[kind]}")
    config = {"architectures": [models[kind]], **_layer_fields(saved, tensors, kind, tc["vocab_size"])}
    if kind == "llama":
        config.update(attention_bias=attention_bias, mlp_bias=False)
    else:  # Qwen2's q/k/v biases are built in; the draft layer attends without a window
        config.update(use_sliding_window=False, sliding_window=None, qkv_bias=True)
    return config, out


def eagle1_to_vllm(saved: dict, tensors: dict, opts: ExportOptions) -> tuple[dict, dict]:
    """The reference layout with a Llama config; serve with --speculative-config '{"method": "eagle", ...}'.

    Checked against vLLM 0.33.0 (the PyPI wheel):
      vllm/transformers_utils/configs/eagle.py  EAGLEConfig (method "eagle") renames architecture X to
        EagleX: LlamaForCausalLM -> EagleLlamaForCausalLM (model_executor/models/registry.py)
      vllm/model_executor/models/llama_eagle.py  fc = Linear(2H, H, bias=False), so a trained fc bias has
        no place (refused unless exactly zero); layer 0's input_layernorm is disabled (no tensor); no
        lm_head parameter (the target's is used); unknown names raise; without an embed_tokens tensor,
        has_own_embed_tokens stays false and llm_base_proposer.py shares the target's embedding
      vllm/model_executor/models/llama.py  attention bias = attention_bias or bias, hence "bias": false
    SafeAILab/EAGLE's EaModel reads the layout too: "bias": false gives it an fc without bias (ours), and
    cnets1.py reads the base model's embedding itself.
    """
    kind = _eagle1_kind(saved, {"llama": "LlamaForCausalLM (EagleLlamaForCausalLM)"}, "vLLM")
    tc = saved["target_config"]
    out = dict(tensors)
    fc_bias = out.pop("fc.bias", None)
    if fc_bias is not None and fc_bias.any():
        raise SpecdraftError(
            "vLLM's EAGLE-1 model (llama_eagle.py) has no bias on fc, and this drafter learned one. Retrain with "
            "drafter.fc_bias: false to serve on vLLM, or export --format sglang (SGLang's fc has a bias)."
        )
    attention_bias = bool(tc.get("attention_bias", False))
    _check_tensor_names(set(out), _eagle1_tensors(kind, attention_bias, fc_bias=False), "vLLM's EagleLlamaForCausalLM")
    config = {
        "architectures": ["LlamaForCausalLM"],
        **_layer_fields(saved, tensors, "llama", tc["vocab_size"]),
        "bias": False,
        "attention_bias": attention_bias,
        "mlp_bias": False,
    }
    return config, out


# -- reading an export back into the drafter's own tensors -------------------------------------------


def eagle3_read_back(saved: dict, tensors: dict) -> dict:
    """The exporters' renaming undone (vllm's layers.0. -> midlayer.), and a full-size vocabulary's
    identity map restored."""
    out = {name.replace("layers.0.", "midlayer."): t for name, t in tensors.items()}
    if "d2t" not in out:
        out["d2t"] = torch.zeros(saved["draft_vocab_size"], dtype=torch.long)
        out["t2d"] = torch.ones(saved["target_config"]["vocab_size"], dtype=torch.bool)
    return out


def eagle1_read_back(saved: dict, tensors: dict) -> dict:
    """sglang always has fc.bias, vllm never: back to the drafter's own."""
    out = dict(tensors)
    bias = out.pop("fc.bias", None)
    if saved["config"].get("fc_bias", True):
        out["fc.bias"] = bias if bias is not None else torch.zeros_like(out["fc.weight"][:, 0])
    return out


# `specdraft export` prints these with {out}, TARGET and {k} filled in (str.replace, not str.format).
def _vllm_hint(method: str) -> str:
    return ('vllm serve TARGET --speculative-config '
            f"'{{\"method\": \"{method}\", \"model\": \"{{out}}\", \"num_speculative_tokens\": {{k}}}}'")


def _sglang_hint(algorithm: str) -> str:
    return (f"python -m sglang.launch_server --model-path TARGET --speculative-algorithm {algorithm} "
            "--speculative-draft-model-path {out}")


EAGLE3_EXPORTERS = {
    "sglang": Exporter(eagle3_to_sglang, eagle3_read_back, _sglang_hint("EAGLE3"), target_embedding=EMBED),
    "vllm": Exporter(eagle3_to_vllm, eagle3_read_back, _vllm_hint("eagle3"), target_embedding=EMBED),
}
EAGLE1_EXPORTERS = {
    "sglang": Exporter(eagle1_to_sglang, eagle1_read_back, _sglang_hint("EAGLE")),
    "vllm": Exporter(eagle1_to_vllm, eagle1_read_back, _vllm_hint("eagle")),
}
