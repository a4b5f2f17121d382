"""The frozen target: any transformers causal LM, computing in one forward what its drafters need.

What it computes comes from ``TargetNeeds`` (``specdraft.contract``): the loop builds it from the
family's declaration, and building or loading a drafter on it adds that drafter's needs
(``require``). Logits are asked for per call: full, the draft vocabulary's rows only, the last
position only, or none.

Tap convention (vLLM's): tap ``i`` is the *input* of decoder layer ``i``
(``hidden_states + residual`` before layer i runs), i.e. HF's ``output_hidden_states[i]``.
Which layers a family taps is its own declaration.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .contract import TargetNeeds, TargetOutputs
from .dtypes import resolve_dtype
from .errors import SpecdraftError
from .masks import block_causal_mask
from .named_targets import NAMED_TARGETS, materialize
from .toy_target import toy_target_path
from .transformers_compat import cache_kwargs, enable_activation_checkpointing


def resolve_target_path(path: str, dtype: str = "float32") -> str:
    """A folder or hub id for ``path``. ``toy`` names the toy target shipped with specdraft; a name in
    ``NAMED_TARGETS`` (``smollm2-135m-instruct``) is converted once into a cached ``dtype`` folder."""
    if path == "toy":
        return str(toy_target_path())
    if path in NAMED_TARGETS:
        return str(materialize(path, dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")))
    return path


def load_target_config(name_or_path: str | Path, trust_remote_code: bool = False):
    """The target's transformers config alone: what a family's ``needs`` reads before any weight loads."""
    try:
        return AutoConfig.from_pretrained(str(name_or_path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise SpecdraftError(
            f"could not load the target config from {name_or_path!r}: {e}\n"
            "Give target.path a local transformers folder or a hub id you can reach "
            "(offline? run `specdraft toy-target` for a local stand-in)."
        ) from e


def check_taps(taps: tuple[int, ...], num_layers: int) -> None:
    """Distinct layer indices of the target, each in 0..N-1 (the input of that layer)."""
    if len(set(taps)) != len(taps):
        raise SpecdraftError(
            f"target.taps {list(taps)} repeat a layer (on a {num_layers}-layer target, default taps can collide: "
            "EAGLE-3's 2, N//2, N-3 do below 8 layers); serving engines capture each layer once, so give "
            "target.taps as distinct layer indices, e.g. [1, 2, 3]."
        )
    for t in taps:
        if not 0 <= t < num_layers:
            raise SpecdraftError(
                f"tap layer {t} is out of range: the target has {num_layers} decoder layers, so taps must be in "
                f"0..{num_layers - 1} (input of that layer). Fix target.taps in the recipe."
            )


def stop_token_ids(model: nn.Module | None, tokenizer) -> list[int]:
    """End-of-sequence ids: the tokenizer's and the model's generation config's (which may list several)."""
    ids = {getattr(tokenizer, "eos_token_id", None)}
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)


def decoder_of(model: nn.Module) -> nn.Module | None:
    """The decoder stack under a causal LM's head (embedding, layers, final norm), or None.

    Llama4ForCausalLM's get_decoder() returns the model itself (its base_model_prefix names a "language_model" it
    does not have): its decoder is ``.model``, as for the Llama-style models whose get_decoder() finds it.
    """
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    return getattr(model, "model", None) if base is model else base


class FrozenTarget(nn.Module):
    """A causal LM in eval mode whose own weights never train, returning ``TargetOutputs``.

    ``needs`` says which features every forward computes (taps, the final hidden state); a
    family that trains adapters inside it (``needs.trains_adapters``) adds them itself, and
    only then does the forward keep autograd.
    """

    def __init__(self, model: nn.Module, needs: TargetNeeds | None = None, tokenizer=None):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        # A mixture-of-experts config may ask every forward to collect each layer's router logits (for the
        # auxiliary load-balancing loss): a frozen target has no use for them, so none are kept.
        if getattr(model.config, "output_router_logits", False):
            model.config.output_router_logits = False
        self.tokenizer = tokenizer
        base = decoder_of(model)
        layers = getattr(base, "layers", None)
        if base is None or layers is None or getattr(base, "norm", None) is None:
            raise SpecdraftError(
                f"{type(model).__name__} does not expose `.model.layers` and `.model.norm` (so no final hidden "
                "state to hand a drafter); specdraft supports Llama-style decoders (Llama, Qwen2/3, Mistral, ...). "
                "Use one of those targets."
            )
        self.base, self.layers = base, layers
        self.needs = TargetNeeds()
        self._head_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, lm_head rows): see _rows_of_head
        self.require(needs or TargetNeeds())

    def require(self, needs: TargetNeeds) -> None:
        """From now on also compute what ``needs`` asks for (the logits are asked per call).

        One target taps one set of layers: drafters that read different layers need their own targets.
        """
        if needs.taps and self.needs.taps and needs.taps != self.needs.taps:
            raise SpecdraftError(
                f"a drafter reads target layers {list(needs.taps)} (taps), but this target already taps "
                f"{list(self.needs.taps)} for another drafter; evaluate drafters that read different layers in "
                "separate runs, or load a target built with the drafter's taps."
            )
        check_taps(needs.taps, len(self.layers))
        self.needs = TargetNeeds(
            final_hidden=self.needs.final_hidden or needs.final_hidden,
            taps=self.needs.taps or needs.taps,
            trains_adapters=self.needs.trains_adapters or needs.trains_adapters,
        )

    # -- loading -----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        dtype: str | torch.dtype = "bfloat16",
        needs: TargetNeeds | None = None,
        trust_remote_code: bool = False,
        device: str | torch.device | None = None,
        attn_implementation: str | None = None,
    ) -> FrozenTarget:
        config = load_target_config(name_or_path, trust_remote_code)
        kwargs = {"dtype": resolve_dtype(dtype), "trust_remote_code": trust_remote_code}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        model = AutoModelForCausalLM.from_pretrained(str(name_or_path), config=config, **kwargs)
        if device is not None:
            model.to(device)
        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path), trust_remote_code=trust_remote_code)
        return cls(model, needs, tokenizer)

    @classmethod
    def from_config(cls, config, needs: TargetNeeds | None = None, device: str = "meta") -> FrozenTarget:
        """A target with random (or, on "meta", no) weights: tests, and sizing real models offline."""
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
        return cls(model, needs)

    # -- dimensions and shared weights ---------------------------------------------------------
    @property
    def config(self):
        return self.model.config

    def stop_token_ids(self) -> list[int]:
        """End-of-sequence ids: the tokenizer's and the generation config's (which may list several)."""
        return stop_token_ids(self.model, self.tokenizer)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def taps(self) -> tuple[int, ...]:
        return self.needs.taps

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
        for t in self.needs.taps:
            def grab(module, args, kwargs, t=t):
                captured[t] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            hooks.append(self.layers[t].register_forward_pre_hook(grab, with_kwargs=True))
        try:
            yield captured
        finally:
            for h in hooks:
                h.remove()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
        logits: str = "full",
        rows: torch.Tensor | None = None,
    ) -> TargetOutputs:
        """One forward; taps are captured by pre-hooks, so there is never a second pass.

        ``attention_mask`` may be 2D (padding) or a 4D boolean block-causal mask (packing).
        With ``use_cache`` the caller owns ``past_key_values`` (decoding). ``logits``: "full",
        "draft_rows" (the rows ``rows`` of the LM head only), "last" (last position) or "none".
        The frozen forward runs without autograd and without autocast: a mixed-precision training
        step does not change the target's numbers (the feature cache holds the same ones).
        """
        frozen = not (self.needs.trains_adapters and torch.is_grad_enabled())
        autocast = torch.autocast(input_ids.device.type, enabled=False) if frozen else _nothing()
        with torch.set_grad_enabled(not frozen), autocast, self._tapping() as captured:
            out = self.base(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=use_cache,
                **cache_kwargs(self.base, past_key_values),
            )
            hidden = out.last_hidden_state  # already passed through the final norm
            return TargetOutputs(
                logits=self.logits_of(hidden, logits, rows),
                vocab_rows=rows if logits == "draft_rows" else None,
                last_only=logits == "last",
                final_hidden=hidden if self.needs.final_hidden else None,
                aux_hidden=torch.cat([captured[t] for t in self.needs.taps], dim=-1) if self.needs.taps else None,
                taps=self.needs.taps,
            )

    def checkpoint_activations(self) -> None:
        """Keep only each decoder layer's input for the backward pass, and recompute the rest there
        (transformers' gradient checkpointing, non-reentrant): for a family that backpropagates through the
        target (``needs.trains_adapters``), whose activations are the step's largest memory. It acts only in
        train mode, so decoding and held-out evals run as before."""
        if not self.needs.trains_adapters:
            raise SpecdraftError(
                "target.gradient_checkpointing recomputes the target's activations in the backward pass, and this "
                "drafter runs the target without autograd (only a family that trains adapters inside it, "
                "such as medusa2, backpropagates through it). Remove target.gradient_checkpointing from the recipe.")
        enable_activation_checkpointing(self.model)

    def forward_batch(self, batch: dict[str, torch.Tensor], logits: str = "full",
                      rows: torch.Tensor | None = None) -> TargetOutputs:
        """Training-time forward on a collated batch (padding or packing)."""
        mask = batch["attention_mask"]
        if "seq_ids" in batch:
            mask = block_causal_mask(mask, batch["seq_ids"])
        return self(batch["input_ids"], attention_mask=mask, position_ids=batch.get("position_ids"),
                    logits=logits, rows=rows)

    def logits_of(self, hidden: torch.Tensor, logits: str, rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """float32 logits from final hidden states [B, T, H], only as many as asked for (see ``forward``)."""
        if logits == "none":
            return None
        if logits == "last":
            return self._softcapped(self.lm_head(hidden[:, -1:]).float())
        if logits == "full":
            return self._softcapped(self.lm_head(hidden).float())
        if logits != "draft_rows":
            raise SpecdraftError(f"logits must be none, full, draft_rows or last, got {logits!r}")
        if rows is None:
            raise SpecdraftError("logits='draft_rows' needs rows: the target ids of the draft vocabulary")
        weight, bias = self._rows_of_head(rows)
        return self._softcapped(F.linear(hidden, weight, bias).float())  # [B, T, N]: no V-wide logits formed

    def _softcapped(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's own final logit soft-capping, cap * tanh(logits / cap) (Gemma 2 and 3), where it has one:
        the target's distribution is that of its ``forward``/``generate``, not of the bare LM head."""
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _rows_of_head(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head's rows ``rows``, gathered once and kept while the same ``rows`` tensor is asked for
        (the head is frozen): one [N, H] copy for the run, not one per forward."""
        if self._head_rows is None or self._head_rows[0] is not rows:
            head = self.lm_head
            bias = None if head.bias is None else head.bias.index_select(0, rows)
            self._head_rows = (rows, (head.weight.index_select(0, rows), bias))
        return self._head_rows[1]


@contextmanager
def _nothing():
    yield
