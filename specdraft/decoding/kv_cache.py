"""A preallocated, position-indexed KV cache for the target (gpt-fast's), in transformers' cache API.

transformers' ``DynamicCache`` grows every layer's keys and values by ``torch.cat`` at each forward:
a fresh [B, H, L, D] copy per layer per step, so decoding L tokens moves O(L^2) bytes. Here each layer
owns one buffer sized for the whole decode, a forward writes its new positions in place, and a
rollback (a rejected draft, a tree's discarded branches) only moves the length back. The layer keeps
``keys``/``values`` as views of the filled part, so attention, masks and ``keep_slots`` read it
exactly as they read a ``DynamicCache``. If a decode outgrows the buffer it is reallocated at twice
the size (rare: the decoder sizes it for prompt + budget + a step's drafts).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from specdraft.errors import SpecdraftError


class PreallocatedLayer(DynamicLayer):
    """One decoder layer's keys and values in a preallocated buffer; see the module docstring."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.key_buffer = key_states.new_zeros(*key_states.shape[:2], self.capacity, key_states.shape[3])
        self.value_buffer = value_states.new_zeros(*value_states.shape[:2], self.capacity, value_states.shape[3])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(max(end, 2 * self.capacity))
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self._set_length(end)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (transformers' convention: a count from the end)."""
        if tokens_to_remove > 0:
            raise SpecdraftError(f"crop takes a negative count of positions to drop, got {tokens_to_remove}")
        if self.is_initialized:
            self._set_length(max(0, self.length + tokens_to_remove))

    @classmethod
    def stacked(cls, layers: list[PreallocatedLayer], room: int) -> PreallocatedLayer:
        """One layer holding the rows of ``layers`` in order (an empty layer counts as one row), each right-padded
        with zeros to the longest (the caller masks the padding), with ``room`` free slots after it: how a batch
        drafts over its rows' caches, and how the batched decoder joins its prefill groups."""
        longest = max(layer.length for layer in layers)
        stack = cls(longest + room)
        if longest:
            sizes = [layer.keys.shape[0] if layer.is_initialized else 1 for layer in layers]
            like = next(layer.keys for layer in layers if layer.length)[:1].expand(sum(sizes), -1, -1, -1)  # its shape
            stack.lazy_initialization(like, like)
            first = 0
            for layer, size in zip(layers, sizes):
                if layer.length:
                    stack.key_buffer[first : first + size, :, : layer.length] = layer.keys
                    stack.value_buffer[first : first + size, :, : layer.length] = layer.values
                first += size
            stack._set_length(longest)
        return stack

    def _set_length(self, length: int) -> None:
        self.length = length
        self.keys = self.key_buffer[:, :, :length]
        self.values = self.value_buffer[:, :, :length]

    def _grow(self, capacity: int) -> None:
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
        self.capacity = capacity


def preallocated_cache(config, capacity: int) -> Cache:
    """A cache for a decoder of ``config``'s layers, each sized for ``capacity`` positions."""
    num_layers = config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[PreallocatedLayer(capacity) for _ in range(num_layers)])


def rows_step_mask(cached_valid: torch.Tensor, new_valid: torch.Tensor, sees: torch.Tensor | None = None) -> torch.Tensor:
    """[R, 1, W, S + W] bool attention mask of a step over rows of different lengths: query j of row b sees
    the row's valid cached slots (``cached_valid`` [R, S]) and the valid new inputs it may see (``sees``
    [R, W, W]: a tree's ancestors; default causal, inputs up to j) among ``new_valid`` [R, W]; a padded query
    also sees itself, so no softmax runs over nothing (its output is never read, and no real query sees its key)."""
    width = new_valid.shape[1]
    eye = torch.eye(width, dtype=torch.bool, device=new_valid.device)
    sees = torch.ones_like(eye).tril()[None] if sees is None else sees
    new = (sees & new_valid[:, None, :]) | eye[None]
    return torch.cat([cached_valid[:, None, :].expand(-1, width, -1), new], dim=2)[:, None]


def ragged_rows(cached: list[int], new: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``cached[b]`` cache slots (padded to L = max) reading ``new[b]`` inputs (padded to M = max):
    (``slot_valid`` [R, L + M], which slots hold each row's real keys once the inputs are read; ``positions``
    [R, M], the inputs' positions, the row's length + j). Both lists are host values: no sync."""
    cached_t, new_t = torch.tensor(cached, device=device), torch.tensor(new, device=device)
    slot_valid = torch.cat([torch.arange(max(cached), device=device)[None] < cached_t[:, None],
                            torch.arange(max(new), device=device)[None] < new_t[:, None]], dim=1)  # fmt: skip
    return slot_valid, cached_t[:, None] + torch.arange(max(new), device=device)[None]


def keep_slots(cache, start: int, kept: list[list[int]], width: int) -> None:
    """After a step appended ``width`` slots per row from slot ``start``, keep each row's ``kept`` slots (step
    indices, in order: the pending token, then its accepted path) as the first of those slots, and crop every row
    to the most any row kept (the caller masks the rest of a row's). A chain keeps a prefix: nothing moves, the
    crop alone rolls back. Works on any cache whose layers hold ``keys``/``values`` [B, H, L, D]."""
    most = max(len(slots) for slots in kept)
    if any(slots != list(range(len(slots))) for slots in kept):
        order = [slots + sorted(set(range(width)) - set(slots)) for slots in kept]
        index = torch.tensor(order, device=cache.layers[0].keys.device)[:, None, :, None]
        for layer in cache.layers:
            for step_slots in (layer.keys[:, :, start : start + width], layer.values[:, :, start : start + width]):
                step_slots.copy_(step_slots.gather(2, index.expand_as(step_slots)))  # gather copies before the write
    if width > most:
        cache.crop(-(width - most))  # transformers' crop counts from the end when negative
