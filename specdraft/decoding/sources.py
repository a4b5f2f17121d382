"""Draft sources that need no training in specdraft: an independent draft LM, and prompt lookup.

Both implement ``specdraft.contract.DraftSource`` (start / propose / commit); trained
drafters (EAGLE, Medusa, ...) give theirs with ``drafter.draft_source(target)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import StaticCache
from transformers.cache_utils import Cache, StaticLayer

from specdraft.contract import DraftCapabilities, Proposal, TargetOutputs
from specdraft.decoding.kv_cache import (
    PreallocatedLayer,
    preallocated_cache,
    ragged_rows,
    rows_step_mask,
)
from specdraft.decoding.sampling import SamplingParams, draw_drafts
from specdraft.errors import SpecdraftError
from specdraft.transformers_compat import cache_kwargs


class DraftLMSource:
    """A small causal LM drafting for a bigger one, with its own KV cache.

    Also how DistillSpec students are served. The draft must share the target's
    vocabulary, or be given ``vocab_map`` [V_draft] (the target id of each draft id,
    -1 where the target has no such token), e.g. from ``vocab_map_from_tokenizers``.
    Drafts are then drawn only among mapped tokens, and target tokens the draft
    does not know are fed to it as draft id 0 (they only cost acceptance, never correctness).

    Cache bookkeeping: after ``propose`` the draft has read pending, d_1..d_{k-1} (d_k is
    sampled but not read). ``commit`` crops what was rejected; if all k were accepted,
    d_k is read together with the next pending token.
    """

    # The per-sequence state. Rows' caches differ in length, so a batch drafts through ``propose_rows``.
    capabilities = DraftCapabilities(row_state=("cache", "num_read", "num_committed", "unread"), ragged_rows=True)
    room = 256  # positions a cache holds past the prompt before it first grows

    def __init__(self, model: torch.nn.Module, vocab_map: torch.Tensor | None = None, compile: bool | str = False):
        """``compile``: run the draft's decode steps (1 or 2 new tokens) through ``torch.compile`` over
        transformers' ``StaticCache`` (True, or a torch.compile mode: "reduce-overhead" captures CUDA graphs).
        A small draft's step is mostly per-op overhead, which compiling removes (``eval/bench_decode.py``
        measures it). Both step widths compile when a cache size is first used (seconds to a minute); the
        prompt's prefill stays eager. transformers' assisted generation switches compilation off for its assistant
        (``AssistedCandidateGenerator``), so this is specdraft's own."""
        self.model = model.eval().requires_grad_(False)
        self.draft_vocab_size = model.get_output_embeddings().weight.shape[0]
        self.vocab_map = vocab_map
        self._target_vocab_size = None
        self.compile = compile
        if compile:
            # A compiled step is specialised to one row's StaticCache: a batch's rows draft one at a time.
            self.capabilities = DraftCapabilities()
            check_static_cache()
            self._compiled_sizes = set()  # cache sizes the step is compiled for (shared by shallow copies)
            self._compiled_step = torch.compile(model.forward, mode=compile if isinstance(compile, str) else None)

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, target_out: TargetOutputs) -> None:
        self._bind_vocab(target_out.logits.shape[-1])
        self.num_read = 0  # positions in the draft's cache; the host knows them, so rollback needs no sync
        self.cache = self._new_cache(prompt_ids.shape[1] + self.room)  # grows (doubles) when outgrown
        self._read(prompt_ids)
        self.num_committed = prompt_ids.shape[1]
        self.unread = prompt_ids[:, :0]  # committed tokens the draft has not read yet

    @torch.no_grad()
    def propose(self, pending: torch.Tensor, k: int, params: SamplingParams, generator) -> Proposal:
        tokens, probs = [], []
        next_input = torch.cat([self.unread, pending], dim=1)
        for _ in range(k):
            logits = self._to_target_logits(self._read(next_input))  # [1, V_target]
            self.unread = next_input[:, :0]  # read now
            next_input, q = draw_drafts(logits, params, generator)
            next_input = next_input.view(1, 1)
            probs += [] if q is None else [q]
            tokens.append(next_input)
        return Proposal(torch.cat(tokens, dim=1), torch.stack(probs, dim=1) if probs else None)

    @staticmethod
    @torch.no_grad()
    def propose_rows(sources: list, pending: torch.Tensor, k: int, params: SamplingParams, generator) -> Proposal:
        """k drafts for each of R sequences ([R, k]) in one draft forward per draft step: ``sources`` are R copies
        of one eager source, ``pending`` [R, 1]. Step 0 reads each row's unread tokens and pending token,
        right-padded to [R, M], over the rows' caches right-padded to [R, L], each row at its own positions
        under a mask of its real slots; each later step reads every row's last draft. Each source ends as its
        own ``propose`` leaves it: its cache holds what it read (its commit crops the rejected drafts)."""
        first, R, device = sources[0], len(sources), pending.device
        read = [s.num_read for s in sources]
        inputs = [torch.cat([s.unread[0], pending[i]]) for i, s in enumerate(sources)]
        lengths = [x.shape[0] for x in inputs]  # 1 or 2; like the caches' lengths, known on the host
        L, M = max(read), max(lengths)
        cache = Cache(layers=[PreallocatedLayer.stacked([s.cache.layers[i] for s in sources], room=M + k)
                              for i in range(len(first.cache.layers))])  # fmt: skip
        slot_valid, positions = ragged_rows(read, lengths, device)
        mask = rows_step_mask(slot_valid[:, :L], slot_valid[:, L:])
        ids = nn.utils.rnn.pad_sequence(inputs, batch_first=True)  # [R, M], padded with 0
        last = torch.tensor(lengths, device=device) - 1  # each row's pending token: its drafts' context ends there
        tokens, probs = [], []
        for step in range(k):
            if step > 0:  # every row reads its last draft, one position on
                mask = rows_step_mask(slot_valid, slot_valid.new_ones(R, 1))
                slot_valid = F.pad(slot_valid, (0, 1), value=True)
                ids, positions, last = tokens[-1], positions.gather(1, last[:, None]) + 1, last.new_zeros(R)
            out = first.model(input_ids=first._to_draft_ids(ids), attention_mask=mask, position_ids=positions,
                              use_cache=True, **cache_kwargs(first.model, cache))  # fmt: skip
            logits = first._to_target_logits(out.logits[torch.arange(R, device=device), last])  # [R, V_target]
            ids, q = draw_drafts(logits, params, generator)
            tokens.append(ids[:, None])
            probs += [] if q is None else [q]
        for i, s in enumerate(sources):  # each row's cache gains what it read: its inputs, then its chain's drafts
            own = torch.cat([torch.arange(L, L + lengths[i]), torch.arange(L + M, L + M + k - 1)]).to(device)
            for row_layer, layer in zip(s.cache.layers, cache.layers):
                row_layer.update(layer.keys[i : i + 1, :, own], layer.values[i : i + 1, :, own])
            s.num_read, s.unread = read[i] + lengths[i] + k - 1, s.unread[:, :0]
        return Proposal(torch.cat(tokens, dim=1), torch.stack(probs, dim=1) if probs else None)

    def commit(self, kept_ids: torch.Tensor, target_out: TargetOutputs) -> None:
        self.num_committed += kept_ids.shape[1]
        if self.num_read > self.num_committed:  # rejected drafts: forget them
            self.cache.crop(self.num_committed - self.num_read)
            self.num_read = self.num_committed
        self.unread = kept_ids[:, kept_ids.shape[1] - (self.num_committed - self.num_read) :]

    # -- the draft's cache ----------------------------------------------------------------------
    def _read(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Run the draft over ``target_ids`` [1, n] at its next positions; the last position's logits [1, V_draft]."""
        n, forward, kwargs = target_ids.shape[1], self.model.forward, {}
        if self.compile:
            if self.num_read + n > self.capacity:
                self._grow(self.num_read + n)
            # A static cache attends over all its slots; the mask comes from these positions, so slots past
            # them (rejected drafts, not yet overwritten) are never seen. (Writes follow the cache's counter.)
            kwargs["position_ids"] = torch.arange(self.num_read, self.num_read + n, device=target_ids.device)[None]
            if n <= 2:  # decode steps; a prompt's prefill (any width) stays eager
                forward = self._compiled_step
        out = forward(input_ids=self._to_draft_ids(target_ids), use_cache=True, logits_to_keep=1,
                      **cache_kwargs(self.model, self.cache), **kwargs)  # fmt: skip
        self.num_read += n
        return out.logits[:, -1]

    def _new_cache(self, capacity: int):
        if not self.compile:
            return preallocated_cache(self.model.config, capacity)
        # Powers of two: a compiled step is specialised to the cache's size, so few sizes mean few compiles.
        self.capacity = 1 << (capacity - 1).bit_length()
        cache = StaticCache(config=self.model.config, max_cache_len=self.capacity)
        if self.capacity not in self._compiled_sizes:
            # Compile both step widths now, while the cache is empty, so no decode step waits on the compiler.
            device = self.model.get_output_embeddings().weight.device
            for width in (1, 2):
                self._compiled_step(input_ids=torch.zeros(1, width, dtype=torch.long, device=device),
                                    use_cache=True, logits_to_keep=1, position_ids=torch.arange(width, device=device)[None],
                                    **cache_kwargs(self.model, cache))  # fmt: skip
                cache.crop(-width)
            self._compiled_sizes.add(self.capacity)
        return cache

    def _grow(self, needed: int) -> None:
        """Move the static cache's filled slots into one twice as large (or more)."""
        old = self.cache
        self.cache = self._new_cache(max(needed, 2 * self.capacity))
        for old_layer, layer in zip(old.layers, self.cache.layers):
            if not layer.is_initialized:  # a size compiled before skips the warm-up that initialises it
                layer.lazy_initialization(old_layer.keys, old_layer.values)
            layer.keys[:, :, : self.num_read] = old_layer.keys[:, :, : self.num_read]
            layer.values[:, :, : self.num_read] = old_layer.values[:, :, : self.num_read]
            layer.cumulative_length.fill_(self.num_read)

    # -- vocabularies ---------------------------------------------------------------------------
    def _bind_vocab(self, target_vocab_size: int) -> None:
        if self._target_vocab_size == target_vocab_size:
            return
        if self.vocab_map is None:
            if self.draft_vocab_size != target_vocab_size:
                raise SpecdraftError(
                    f"the draft LM's vocabulary has {self.draft_vocab_size} tokens but the target's has "
                    f"{target_vocab_size}; use a draft from the target's model family, or pass "
                    "vocab_map=vocab_map_from_tokenizers(draft_tokenizer, target_tokenizer) "
                    "(CLI: --map-draft-vocab)."
                )
            self.draft_ids, self.target_ids, self.target_to_draft = None, None, None
        else:
            vocab_map = self.vocab_map.long()
            in_range = vocab_map.numel() == 0 or (vocab_map.min() >= -1 and vocab_map.max() < target_vocab_size)
            if vocab_map.shape != (self.draft_vocab_size,) or not in_range:
                raise SpecdraftError(
                    f"vocab_map must be a [{self.draft_vocab_size}] tensor of target ids in "
                    f"[0, {target_vocab_size}) or -1, got shape {tuple(vocab_map.shape)}; build it with "
                    "vocab_map_from_tokenizers(draft_tokenizer, target_tokenizer)."
                )
            device = self.model.get_output_embeddings().weight.device
            self.draft_ids = (vocab_map >= 0).nonzero().squeeze(1).to(device)
            self.target_ids = vocab_map[vocab_map >= 0].to(device)
            self.target_to_draft = torch.zeros(target_vocab_size, dtype=torch.long, device=device)
            self.target_to_draft[self.target_ids] = self.draft_ids
        self._target_vocab_size = target_vocab_size

    def _to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        return target_ids if self.target_to_draft is None else self.target_to_draft[target_ids]

    def _to_target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[1, V_draft] -> [1, V_target]; target tokens the draft lacks get -inf (q = 0)."""
        if self.target_ids is None:
            return draft_logits
        logits = draft_logits.new_full((draft_logits.shape[0], self._target_vocab_size), float("-inf"))
        logits[:, self.target_ids] = draft_logits[:, self.draft_ids]
        return logits


def static_cache_rolls_back() -> bool:
    """Whether this transformers' ``StaticCache`` rolls back with ``crop``, which writes through a position counter
    (``StaticLayer.cumulative_length``, transformers 5.23 and later): what every compiled decode needs."""
    return "cumulative_length" in getattr(StaticLayer, "__annotations__", {})


def check_static_cache() -> None:
    """Refuse compiled decoding on a transformers whose ``StaticCache`` cannot roll back, naming the fix."""
    if not static_cache_rolls_back():
        raise SpecdraftError(
            f"compiled decoding (compile_target, or a compiled draft LM) needs a transformers whose StaticCache "
            f"rolls back with crop() (5.23 or newer); this is {transformers.__version__}: "
            "pip install -U 'transformers>=5.23', or leave compile off."
        )


def vocab_map_from_tokenizers(draft_tokenizer, target_tokenizer, draft_vocab_size: int | None = None) -> torch.Tensor:
    """[V_draft] long: the target id of the token with the same string, or -1.

    Token strings compare as the tokenizers store them (e.g. byte-level BPE's "Ġthe"),
    so this maps tokenizers of the same kind. ``draft_vocab_size`` is the draft model's
    embedding rows (often padded beyond the tokenizer's ``len``).
    """
    target_vocab = target_tokenizer.get_vocab()
    draft_vocab = draft_tokenizer.get_vocab()
    size = draft_vocab_size or max(draft_vocab.values()) + 1
    vocab_map = torch.full((size,), -1, dtype=torch.long)
    for token, draft_id in draft_vocab.items():
        if draft_id < size and token in target_vocab:
            vocab_map[draft_id] = target_vocab[token]
    return vocab_map


class PromptLookupSource:
    """Prompt lookup decoding (Saxena 2023): the training-free baseline.

    Drafts are copied from the context: find an earlier occurrence of the last n tokens
    (n from ``max_ngram`` down to ``min_ngram``) and propose the k tokens that followed it.
    The first (leftmost) occurrence is used, as in the reference implementation and
    transformers' ``prompt_lookup_num_tokens``. Drafts are deterministic: q is one-hot
    (``probs=None``). No match means no drafts, and the step is a plain target step.
    """

    capabilities = DraftCapabilities()  # its token history is a host list per row: a batch drafts row by row

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise SpecdraftError(
                f"prompt lookup needs 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}."
            )
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, prompt_ids: torch.Tensor, target_out: TargetOutputs) -> None:
        self.context = prompt_ids[0].cpu()  # the search runs on the host: it is tiny and branchy

    def propose(self, pending: torch.Tensor, k: int, params: SamplingParams, generator) -> Proposal:
        context = torch.cat([self.context, pending[0].cpu()])
        drafts = context[:0]
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            # Every earlier n-gram with at least one token after it (so never the suffix itself).
            windows = context[:-1].unfold(0, n, 1)
            matches = (windows == context[-n:]).all(dim=1).nonzero()
            if len(matches) > 0:
                first = int(matches[0]) + n
                drafts = context[first : first + k]
                break
        return Proposal(drafts.view(1, -1).to(pending.device), None)

    def commit(self, kept_ids: torch.Tensor, target_out: TargetOutputs) -> None:
        self.context = torch.cat([self.context, kept_ids[0].cpu()])
