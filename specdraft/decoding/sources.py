"""Draft sources that need no training in specdraft: an independent draft LM, and prompt lookup.

Both implement ``specdraft.contract.DraftSource`` (start / propose / commit); trained
drafters (EAGLE, Medusa, ...) give theirs with ``drafter.draft_source(target)``.
"""

from __future__ import annotations

import torch

from specdraft.contract import Proposal, TargetOutputs
from specdraft.decoding.kv_cache import preallocated_cache
from specdraft.decoding.sampling import SamplingParams, logits_to_probs, sample
from specdraft.errors import SpecdraftError


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

    def __init__(self, model: torch.nn.Module, vocab_map: torch.Tensor | None = None):
        self.model = model.eval().requires_grad_(False)
        self.draft_vocab_size = model.get_output_embeddings().weight.shape[0]
        self.vocab_map = vocab_map
        self._target_vocab_size = None

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, target_out: TargetOutputs) -> None:
        self._bind_vocab(target_out.logits.shape[-1])
        self.cache = preallocated_cache(self.model.config, prompt_ids.shape[1] + 256)  # doubles when outgrown
        self.model(
            input_ids=self._to_draft_ids(prompt_ids), past_key_values=self.cache, use_cache=True, logits_to_keep=1
        )
        self.num_committed = prompt_ids.shape[1]
        self.unread = prompt_ids[:, :0]  # committed tokens the draft has not read yet

    @torch.no_grad()
    def propose(self, pending: torch.Tensor, k: int, params: SamplingParams, generator) -> Proposal:
        tokens, probs = [], []
        next_input = torch.cat([self.unread, pending], dim=1)
        for _ in range(k):
            out = self.model(
                input_ids=self._to_draft_ids(next_input), past_key_values=self.cache, use_cache=True, logits_to_keep=1
            )
            self.unread = next_input[:, :0]  # read now
            logits = self._to_target_logits(out.logits[:, -1])  # [1, V_target]
            if params.is_greedy:  # q is one-hot on the argmax: no V-wide q is formed (Proposal.probs None)
                next_input = logits.argmax(-1).view(1, 1)
            else:
                q = logits_to_probs(logits, params)  # warped like p
                next_input = sample(q, generator).view(1, 1)
                probs.append(q)
            tokens.append(next_input)
        return Proposal(torch.cat(tokens, dim=1), torch.stack(probs, dim=1) if probs else None)

    def commit(self, kept_ids: torch.Tensor, target_out: TargetOutputs) -> None:
        self.num_committed += kept_ids.shape[1]
        num_read = self.cache.get_seq_length()
        if num_read > self.num_committed:  # rejected drafts: forget them
            self.cache.crop(self.num_committed - num_read)
            num_read = self.num_committed
        self.unread = kept_ids[:, kept_ids.shape[1] - (self.num_committed - num_read) :]

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
