"""How the rows of a batch share the target: one cache, one forward per step, one draft call where they can.

Rows accept different numbers of drafts, so each keeps its own length. The target's KV cache is one preallocated
cache for the batch (``kv_cache``) in which every step appends the same number of slots to every row (the widest
row's K'+1, or its tree's nodes + 1); a per-row slot mask records which slots hold the row's kept tokens, and each
row's tokens take their own positions (its length + j, or + a node's depth). After the verify each row's kept slots
(pending and its accepted path) move to the front of the step's slots, where a chain's already are, and the cache is
cropped to the most any row kept (``kv_cache.keep_slots``): a rejection rolls back by masking, and a cache grows by
the longest accepted path per step. This uses only what transformers' models accept from any caller (a cache, a 4-D
boolean mask and position ids), so it holds across transformers' cache refactors. One row needs no mask: its slots
are all its own (``StepLayout.ragged``). The prompts are read in groups of similar length (``prefill_rows``), so a
batch of short and long prompts does not pad every prompt to the longest.

Each row has its own ``DraftSource``. A source that declares its per-sequence state (``capabilities.row_state``)
drafts every row at once: Medusa heads and the MLP speculator, which read one hidden state, in one ``propose`` over
the rows' states stacked; EAGLE and draft LMs, whose rows' KV caches differ in length (``capabilities.ragged_rows``),
in their ``propose_rows`` (one padded, masked draft forward per draft step). The others (a compiled draft LM; prompt
lookup's token history; trees) draft row by row (``propose_rows``).
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache

from specdraft.contract import Proposal, TargetOutputs
from specdraft.decoding.kv_cache import PreallocatedLayer, preallocated_cache, rows_step_mask
from specdraft.decoding.trees import ancestor_matrix

PAD_ID = 0  # fills input slots past a row's drafts; their keys are masked out and their outputs never read
PREFILL_PADDING = 1.25  # a prefill group reads at most this many slots per prompt token


def prefill_rows(target, prompts: list[torch.Tensor], sources, room: int, static=None):
    """Read the prompts [1, L_b] (longest first) into one cache for the batch, with ``room`` free slots per row;
    each source starts on its row's outputs. Returns the cache, the slot mask [B, L] of the slots holding each
    row's prompt, and the prompts' last logits [B, V].

    One prompt is read straight into the decode's cache: a preallocated one, or ``static``, a compiled verify's
    ``StaticVerifyCache`` (read eagerly). Several are read in groups of similar length, each group one forward
    left-padded to its longest prompt, so that padding costs at most ``PREFILL_PADDING`` of the tokens read (one
    forward for 16 Spec-Bench questions of 40 to 780 tokens would read 4x their tokens); only the last position's
    logits are formed."""
    lengths = [p.shape[1] for p in prompts]
    device = prompts[0].device
    if len(prompts) == 1:
        cache = preallocated_cache(target.config, lengths[0] + room) if static is None else static
        out = target(prompts[0], past_key_values=cache if static is None else static.static, use_cache=True,
                     logits="last")  # fmt: skip
        if static is not None:
            static.length = lengths[0]
        if sources is not None:
            sources[0].start(prompts[0], out)
        return cache, torch.ones(1, lengths[0], dtype=torch.bool, device=device), out.logits[:, -1]
    groups, first = [], 0
    while first < len(prompts):
        end = first + 1  # lengths descend, so a group's first prompt is its longest
        while end < len(prompts) and (end + 1 - first) * lengths[first] <= PREFILL_PADDING * sum(lengths[first : end + 1]):
            end += 1
        groups.append(range(first, end))
        first = end
    caches, valids, last_logits = [], [], []
    for group in groups:
        width = lengths[group[0]]
        pads = torch.tensor([width - lengths[b] for b in group], device=device)[:, None]
        slots = torch.arange(width, device=device)[None]
        ids = torch.full((len(group), width), PAD_ID, dtype=torch.long, device=device)
        for i, b in enumerate(group):
            ids[i, width - lengths[b] :] = prompts[b][0]
        cache = preallocated_cache(target.config, width)
        out = target(ids, attention_mask=rows_step_mask(slots.new_zeros(len(group), 0, dtype=torch.bool), slots >= pads),
                     position_ids=(slots - pads).clamp_min(0), past_key_values=cache, use_cache=True, logits="last")
        if sources is not None:
            for i, b in enumerate(group):
                sources[b].start(prompts[b], row_outputs(out, i, slice(width - lengths[b], width)))
        caches.append(cache)
        valids.append(torch.cat([slots >= pads, pads.new_zeros(len(group), lengths[0] - width, dtype=torch.bool)], 1))
        last_logits.append(out.logits[:, -1])
    layers = [PreallocatedLayer.stacked([c.layers[i] for c in caches], room) for i in range(len(caches[0].layers))]
    return Cache(layers=layers), torch.cat(valids), torch.cat(last_logits)


class StepLayout:
    """The target's inputs for one step of the active ``rows`` of a batch of ``batch``: ``ids`` [B, W] (pending,
    then the drafts; ``PAD_ID`` past a row's), ``counts`` (each active row's drafts), ``offsets`` [B, W] (position
    past the row's length: j for a chain, the node's depth for a tree), and for trees ``sees`` [B, W, W] (the
    pending token and each node's ancestors) with each row's padded ``parents``, ``ancestors`` and ``depths``
    [R, N(, N)]. ``ragged``: the rows differ (a batch); one row's step needs no mask or position ids for a chain."""

    def __init__(self, rows: list[int], proposals: dict, pending: torch.Tensor, batch: int):
        device = pending.device
        self.rows, self.proposals, self.ragged = rows, proposals, batch > 1
        self.counts = [proposals[b].tokens.shape[1] for b in rows]
        self.trees = any(proposals[b].parents is not None for b in rows)
        width = 1 + max(self.counts)
        if not self.ragged:  # one row: its inputs are exactly pending and its drafts
            self.ids = torch.cat([pending.view(1, 1), proposals[rows[0]].tokens], dim=1)
            self.valid = None
        else:
            self.ids = torch.full((batch, width), PAD_ID, dtype=torch.long, device=device)
            self.valid = torch.zeros(batch, width, dtype=torch.bool, device=device)
            for b, count in zip(rows, self.counts):
                self.ids[b, : 1 + count] = torch.cat([pending[b].view(1), proposals[b].tokens[0]])
                self.valid[b, : 1 + count] = True
        self.offsets = None if not self.ragged else torch.arange(width, device=device)[None].expand(batch, -1)
        self.sees = None
        if self.trees:
            # A chain among trees is the tree whose node i has parent i - 1. Padding nodes hang off the root.
            parents = torch.full((len(rows), width - 1), -1, dtype=torch.long, device=device)
            for i, (b, count) in enumerate(zip(rows, self.counts)):
                given = proposals[b].parents
                parents[i, :count] = torch.arange(-1, count - 1, device=device) if given is None else given[0].long()
            self.parents = parents
            self.ancestors = torch.stack([ancestor_matrix(row) for row in parents])  # [R, N, N]
            self.depths = self.ancestors.sum(2)  # [R, N]
            rows_t = torch.tensor(rows, device=device)
            offsets = torch.zeros(batch, width, dtype=torch.long, device=device)
            offsets[rows_t, 1:] = self.depths
            self.offsets = offsets
            sees = torch.zeros(batch, width, width, dtype=torch.bool, device=device)
            sees[:, :, 0] = True
            sees[rows_t, 1:, 1:] = self.ancestors
            self.sees = sees
            if self.valid is None:
                self.valid = torch.ones(1, width, dtype=torch.bool, device=device)

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    def forward(self, target, cache, cached_valid: torch.Tensor | None) -> TargetOutputs:
        """The target's one forward over the step: query j of row b sees the row's valid cached slots
        (``cached_valid`` [B, S]; None for one row, whose slots are all its own) and the inputs it may see among
        its own (causally, or a tree's ``sees``), at the row's length + offset. One row's chain reads on from
        its cache as any decode does."""
        if self.offsets is None:
            return target(self.ids, past_key_values=cache, use_cache=True)
        if cached_valid is None:  # one row's tree: every cached slot is the row's
            cached_valid = torch.ones(1, cache.get_seq_length(), dtype=torch.bool, device=self.ids.device)
        mask = rows_step_mask(cached_valid, self.valid, self.sees)
        positions = cached_valid.sum(1, keepdim=True) + self.offsets
        return target(self.ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)


def propose_rows(sources: list, pending: torch.Tensor, wanted: dict[int, int], params, generator) -> dict:
    """Row b -> its proposal of at most ``wanted[b]`` drafts ([1, K_b]).

    Sources declaring their per-sequence state (``capabilities.row_state``) that otherwise share everything
    (copies of one source: same model) draft all rows at once: through their class's ``propose_rows`` where they
    declare ``ragged_rows`` (EAGLE, draft LMs: the rows' KV caches differ in length), else in one ``propose`` on a
    copy holding the rows' states (tensors whose dim 0 is the batch) stacked. Each row keeps the first
    ``wanted[b]`` drafts of its chain, which are what it would draft alone. Any other sources draft row by row."""
    rows = list(wanted)
    if len(rows) == 1:  # one row reads no capabilities: a source with just start, propose and commit decodes alone
        return {b: sources[b].propose(pending[b].view(1, 1), wanted[b], params, generator) for b in rows}
    first = sources[rows[0]]
    capabilities = first.capabilities
    names = capabilities.row_state
    shared = {name: value for name, value in vars(first).items() if name not in names}

    def same(a, b) -> bool:  # the same object (a model, a tensor), or equal plain values (a vocabulary size)
        return a is b or (not isinstance(a, (torch.Tensor, torch.nn.Module)) and type(a) is type(b) and a == b)

    if not names or any(
        type(sources[b]) is not type(first) or vars(sources[b]).keys() != vars(first).keys()
        or any(not same(vars(sources[b])[name], value) for name, value in shared.items()) for b in rows
    ):
        return {b: sources[b].propose(pending[b].view(1, 1), wanted[b], params, generator) for b in rows}
    if capabilities.ragged_rows:  # row states of different lengths (a KV cache per row): the source batches them
        proposal = type(first).propose_rows([sources[b] for b in rows], pending[rows].view(-1, 1),
                                            max(wanted.values()), params, generator)  # fmt: skip
    else:
        stacked = copy.copy(first)
        for name in names:
            setattr(stacked, name, torch.cat([getattr(sources[b], name) for b in rows]))
        proposal = stacked.propose(pending[rows].view(-1, 1), max(wanted.values()), params, generator)

    def row(x, i, n):
        return None if x is None else x[i : i + 1, :n]

    return {b: Proposal(row(proposal.tokens, i, wanted[b]), row(proposal.probs, i, wanted[b]),
                        row(proposal.parents, i, wanted[b]))
            for i, b in enumerate(rows)}  # fmt: skip


def fresh_sources(source, count: int) -> list:
    """``count`` independent copies of a DraftSource for the rows of a batch. A source's per-sequence state is
    made by ``start``, so a shallow copy shares only its (read-only) model; a source holding another source
    (``TreeDrafting``) copies that one too, in its ``__copy__``."""
    return [copy.copy(source) for _ in range(count)]


def row_outputs(out: TargetOutputs, b: int, positions: slice | torch.Tensor) -> TargetOutputs:
    """Row b of a batched target output at ``positions`` (a slice, or indices), as a one-row output a source reads."""

    def cut(x):
        return None if x is None else x[b : b + 1, positions]

    logits = out.logits[b : b + 1] if out.last_only else cut(out.logits)
    return TargetOutputs(logits, out.vocab_rows, out.last_only, cut(out.final_hidden), cut(out.aux_hidden), out.taps)
