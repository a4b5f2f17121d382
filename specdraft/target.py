"""The frozen target: any transformers causal LM, tapped at chosen layers in one forward.

Tap convention (vLLM's): tap ``i`` is the *input* of decoder layer ``i``
(``hidden_states + residual`` before layer i runs), i.e. HF's
``output_hidden_states[i]``. EAGLE-3's default taps are ``(2, N//2, N-3)``.
SGLang's config ids name the *output* of a layer instead, so SGLang id ``j``
is our tap ``j + 1``; exporters convert (``sglang_layer_ids``).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from .drafters.base import TargetOutputs
from .errors import SpecdraftError
from .masks import block_causal_mask

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def eagle3_default_taps(num_layers: int) -> list[int]:
    """Low, middle and high features: inputs of layers 2, N//2 and N-3 (EAGLE-3, vLLM default)."""
    return [2, num_layers // 2, num_layers - 3]


def sglang_layer_ids(taps: list[int]) -> list[int]:
    """SGLang names the layer whose *output* is captured: our input-of-layer i is its i-1."""
    return [t - 1 for t in taps]


def resolve_target_path(path: str, dtype: str = "float32") -> str:
    """A folder or hub id for ``path``. ``toy`` names the toy target shipped with specdraft; a name in
    ``NAMED_TARGETS`` (``smollm2-135m-instruct``) is converted once into a cached ``dtype`` folder."""
    from .named_targets import NAMED_TARGETS, materialize

    if path == "toy":
        from .toy_target import toy_target_path

        return str(toy_target_path())
    if path in NAMED_TARGETS:
        return str(materialize(path, dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")))
    return path


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise SpecdraftError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


class FrozenTarget(nn.Module):
    """A causal LM in eval mode with no trainable parameters, returning ``TargetOutputs``."""

    def __init__(self, model: nn.Module, taps: list[int] | None = None, tokenizer=None):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
        layers = getattr(base, "layers", None)
        if base is None or layers is None or getattr(base, "norm", None) is None:
            raise SpecdraftError(
                f"{type(model).__name__} does not expose `.model.layers` and `.model.norm`; specdraft "
                "supports Llama-style decoders (Llama, Qwen2/3, Mistral, ...). Use one of those targets."
            )
        self.base, self.layers = base, layers
        n = len(layers)
        self.taps = list(taps or [])
        if len(set(self.taps)) != len(self.taps):
            raise SpecdraftError(
                f"target.taps {self.taps} repeat a layer (a {n}-layer target's default EAGLE-3 taps 2, N//2, N-3 "
                "collide below 8 layers); serving engines capture each layer once, so give target.taps as "
                "distinct layer indices, e.g. [1, 2, 3]."
            )
        for t in self.taps:
            if not 0 <= t < n:
                raise SpecdraftError(
                    f"tap layer {t} is out of range: the target has {n} decoder layers, so taps must be in "
                    f"0..{n - 1} (input of that layer). Fix target.taps in the recipe."
                )

    # -- loading -----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        dtype: str | torch.dtype = "bfloat16",
        taps: list[int] | str | None = None,
        trust_remote_code: bool = False,
        device: str | torch.device | None = None,
        attn_implementation: str | None = None,
    ) -> "FrozenTarget":
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        try:
            config = AutoConfig.from_pretrained(str(name_or_path), trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise SpecdraftError(
                f"could not load the target config from {name_or_path!r}: {e}\n"
                "Give target.path a local transformers folder or a hub id you can reach "
                "(offline? run `specdraft toy-target` for a local stand-in)."
            ) from e
        kwargs = {"dtype": resolve_dtype(dtype), "trust_remote_code": trust_remote_code}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        model = AutoModelForCausalLM.from_pretrained(str(name_or_path), config=config, **kwargs)
        if device is not None:
            model.to(device)
        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path), trust_remote_code=trust_remote_code)
        if taps == "eagle3" or taps == "default":
            taps = eagle3_default_taps(config.num_hidden_layers)
        return cls(model, taps, tokenizer)

    @classmethod
    def from_config(cls, config, taps: list[int] | str | None = None, device: str = "meta") -> "FrozenTarget":
        """A target with random (or, on "meta", no) weights: tests, and sizing real models offline."""
        from transformers import AutoModelForCausalLM

        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
        if taps == "eagle3" or taps == "default":
            taps = eagle3_default_taps(config.num_hidden_layers)
        return cls(model, taps)

    # -- dimensions and shared weights ---------------------------------------------------------
    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def final_norm(self) -> nn.Module:
        return self.base.norm

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    # -- the one forward -----------------------------------------------------------------------
    @contextmanager
    def _tapping(self):
        captured: dict[int, torch.Tensor] = {}
        hooks = []
        for t in self.taps:
            def grab(module, args, kwargs, t=t):
                captured[t] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            hooks.append(self.layers[t].register_forward_pre_hook(grab, with_kwargs=True))
        try:
            yield captured
        finally:
            for h in hooks:
                h.remove()

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
    ) -> TargetOutputs:
        """One forward; taps are captured by pre-hooks, so there is never a second pass.

        ``attention_mask`` may be 2D (padding) or a 4D boolean block-causal mask (packing).
        With ``use_cache`` the caller owns ``past_key_values`` (decoding).
        """
        with self._tapping() as captured:
            out = self.base(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
            )
        last_hidden = out.last_hidden_state  # already passed through the final norm
        logits = self.lm_head(last_hidden).float()
        aux = torch.cat([captured[t] for t in self.taps], dim=-1) if self.taps else None
        return TargetOutputs(logits=logits, last_hidden=last_hidden, aux_hidden=aux)

    def forward_batch(self, batch: dict[str, torch.Tensor]) -> TargetOutputs:
        """Training-time forward on a collated batch (padding or packing)."""
        mask = batch["attention_mask"]
        if "seq_ids" in batch:
            mask = block_causal_mask(mask, batch["seq_ids"])
        return self(batch["input_ids"], attention_mask=mask, position_ids=batch.get("position_ids"))
