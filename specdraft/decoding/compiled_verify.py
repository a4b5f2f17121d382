"""The target's verify forward compiled: gpt-fast's decode loop, one shape per step.

A chain's verify reads [pending, d_1..d_K'] at positions past..past+K'. Over transformers' ``StaticCache``
(each layer one buffer, sized once) and with the inputs padded to K+1, every step has the same shapes, so
``torch.compile`` traces one graph per cache size and K, and a step runs without Python's per-op overhead.
The padding's keys land in slots past the kept length and are cropped at once; a rejected draft's are
cropped after the verify (``StaticCache.crop`` moves the counter its writes follow). A query attends only
up to its own position (``position_ids``), so stale slots are never read. The prompt's prefill stays eager.

A tree's verify passes its own attention mask (each node sees the kept cache, the pending token and its
ancestors) and position ids (length + depth); here that mask is laid over the whole static cache, padded to
the step's width, so trees compile too, one graph per (cache size, width) with a mask. The accepted path's
keys are then gathered into place in the static buffers (``kv_cache.keep_slots``) and the rest cropped.

EAGLE's taps (the inputs of chosen layers) come from the forward's hidden states, not from hooks. A target
that trains adapters (Medusa-2's) stays eager.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from transformers import StaticCache

from specdraft.contract import TargetOutputs
from specdraft.decoding.sources import check_static_cache
from specdraft.errors import SpecdraftError
from specdraft.transformers_compat import cache_kwargs

# One compiled forward per (target, mode): every decode of that target reuses its graphs.
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Graphs one verify function may hold: one per (cache size, step width, chain or tree, taps or none), for every
# target compiled in the process. Chains and trees of a few widths over two cache sizes already pass dynamo's
# default of 8, past which every new shape runs eager behind 8 failed guards (slower than never compiling).
RECOMPILE_LIMIT = 64


class StaticVerifyCache:
    """A decode's ``StaticCache`` and, on the host, how many positions it holds (no sync to read it)."""

    def __init__(self, static: StaticCache, width: int, tree: bool = False):
        self.static, self.length, self.width = static, 0, width  # every verify step runs ``width`` wide
        self.tree = tree  # its steps pass a tree's attention mask

    @property
    def layers(self):  # each with ``keys`` / ``values`` [1, H, capacity, D]: how ``kv_cache.keep_slots`` moves a path
        return self.static.layers

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:  # transformers' convention: a negative count from the end
        self.static.crop(tokens_to_remove)
        self.length += tokens_to_remove


class CompiledVerify:
    """``verify(ids, past_key_values=cache, use_cache=True, logits="full" | "last")``: the target's forward over
    a decode step, as ``FrozenTarget.__call__`` returns it, compiled. ``new_cache`` makes a decode's cache."""

    def __init__(self, target, mode: str | None = None):
        check_static_cache()
        self.target, self.mode = target, mode
        self._check_target()
        base, head = target.base, target.lm_head
        keyword = next(iter(cache_kwargs(base, None)))

        def forward(ids, cache, positions, layer_inputs: bool, mask):
            out = base(input_ids=ids, use_cache=True, position_ids=positions, output_hidden_states=layer_inputs,
                       attention_mask=mask, **{keyword: cache})  # fmt: skip
            hidden = out.last_hidden_state  # after the final norm
            # hidden_states[i] is the input of layer i: tap i (the target's convention)
            return hidden, head(hidden).float(), out.hidden_states if layer_inputs else None

        # one graph per (cache size, width, chain or tree, taps or none)
        self._forward = torch.compile(forward, mode=mode, dynamic=False)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        # CUDA-graph modes replay into the same output memory: a source keeping a step's hidden state past the
        # next step would see it overwritten, so those modes hand out copies.
        self._copy_outputs = mode in ("reduce-overhead", "max-autotune")
        self._compiled = set()  # (cache size, width, tree) already traced

    def _check_target(self) -> None:
        """A frozen target only. Its needs grow as drafters are put on it, so this is checked for every decode."""
        if self.target.needs.trains_adapters:
            raise SpecdraftError(
                "compile_target compiles a frozen target, and this one trains adapters (Medusa-2's): decode it with "
                "compile_target off")

    def new_cache(self, positions: int, width: int, tree: bool = False) -> StaticVerifyCache:
        """A decode's cache for ``positions`` kept positions, with room for one padded step of ``width`` past
        them; sized in powers of two, so few sizes (few compiled graphs) serve all prompts. ``tree``: its steps
        verify trees (each passes its mask). A size and width used for the first time are compiled here, so no
        decode step waits on the compiler."""
        self._check_target()
        capacity = 1 << (positions + width - 1).bit_length()
        cache = StaticVerifyCache(StaticCache(config=self.target.config, max_cache_len=capacity), width, tree)
        if (capacity, width, tree) not in self._compiled:
            ids = torch.zeros(1, width, dtype=torch.long, device=self.target.lm_head.weight.device)
            # An eager token first: the graph must be traced on an allocated cache, as every decode step sees it
            # (tracing the empty one bakes in a branch the next call fails, so the first step would recompile).
            self.target(ids[:, :1], past_key_values=cache.static, use_cache=True, logits="none")
            cache.length = 1
            mask = torch.ones(1, 1, width, 1 + width, dtype=torch.bool, device=ids.device) if tree else None
            self(ids, cache, attention_mask=mask, position_ids=torch.ones_like(ids) if tree else None)
            cache.crop(-cache.length)
            self._compiled.add((capacity, width, tree))
        return cache

    def __call__(self, ids: torch.Tensor, past_key_values: StaticVerifyCache, use_cache: bool = True,
                 logits: str = "full", attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None) -> TargetOutputs:  # fmt: skip
        """A chain step (causal, at the next positions), or with ``attention_mask`` [1, 1, n, length + n] and
        ``position_ids`` [1, n] a tree step (``tree_attention_mask``), on a cache made with ``tree=True``."""
        cache, n, width = past_key_values, ids.shape[1], past_key_values.width
        if logits not in ("full", "last"):
            raise SpecdraftError(f"a compiled verify returns full or last logits, not {logits!r}")
        if n > width:
            raise SpecdraftError(f"a compiled verify step of width {width} got {n} tokens")
        if (attention_mask is not None) != cache.tree:
            raise SpecdraftError("a compiled verify's cache is made for chains or for trees (new_cache(tree=...)); "
                                 "a tree step passes its attention mask, a chain step none")
        padded = F.pad(ids, (0, width - n)) if n < width else ids  # pad slots: cropped below, never read
        mask = None
        if attention_mask is None:
            positions = torch.arange(cache.length, cache.length + width, device=ids.device)[None]
        else:  # the tree's mask over the whole static cache; a pad query sees only itself, a real one no pad
            positions = F.pad(position_ids, (0, width - n), value=cache.length)
            capacity = cache.static.layers[0].max_cache_len
            mask = torch.zeros(1, 1, width, capacity, dtype=torch.bool, device=ids.device)
            mask[:, :, :n, : cache.length + n] = attention_mask
            pads = torch.arange(n, width, device=ids.device)
            mask[0, 0, pads, cache.length + pads] = True
        taps = self.target.needs.taps
        hidden, full, layer_inputs = self._forward(padded, cache.static, positions, bool(taps), mask)
        cache.length += width
        if n < width:
            cache.crop(n - width)
        hidden, full = hidden[:, :n], full[:, :n]
        aux = torch.cat([layer_inputs[t][:, :n] for t in taps], dim=-1) if taps else None  # a copy
        if self._copy_outputs:
            hidden, full = hidden.clone(), full.clone()
        final = hidden if self.target.needs.final_hidden else None
        if logits == "last":
            full = full[:, -1:]
        return TargetOutputs(logits=full, last_only=logits == "last", final_hidden=final, aux_hidden=aux, taps=taps)


def compiled_verify(target, mode: bool | str) -> CompiledVerify:
    """The target's compiled verify for ``mode`` (True: torch.compile's default), made once per target."""
    mode = None if mode is True else mode
    per_target = _COMPILED.setdefault(target, {})
    if mode not in per_target:
        per_target[mode] = CompiledVerify(target, mode)
    return per_target[mode]
