"""Tree drafting for the EAGLE drafters: static trees, and EAGLE-2's dynamic trees (Li et al. 2024,
arXiv 2406.16858, Sec. 4), with tree attention inside the drafter's own KV cache.

A node is *read* when the drafter runs one step on (its parent's hidden, its token): that gives the
hidden from which its children are drafted, and one cache slot. Nodes are read depth by depth, all of
a depth in one ``draft_step``, at position committed + depth - 1 (where a chain's draft at that depth
would be read), under a mask that shows each node the committed cache, the slots of its own ancestors
and itself. After verification ``EagleDraftSource.commit`` crops the cache back to the committed part,
so the next step reads the accepted path's verified features exactly as after a chain.

Children are ranked by the draft's log-probabilities: log_softmax of the logits at temperature 0, the
log of the warped q otherwise (tokens q gives zero are never proposed). Either way they are the top-k,
deterministic given the context, so the tree verifier tries them with q one-hot (``probs=None``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..contract import Proposal
from ..decoding.sampling import logits_to_probs
from ..decoding.trees import (
    DynamicTree,
    ancestor_matrix,
    check_tree_request,
    expand_static_tree,
    path_to,
)


def propose_tree(source, pending: torch.Tensor, tree, params) -> Proposal:
    """The tree ``tree`` (a ``StaticTree`` or ``DynamicTree``) drafted by ``source``, an EagleDraftSource."""
    tokens, parents, _ = draft_tree(source, pending, tree, params)
    return Proposal(source._to_target_ids(tokens)[None], None, parents[None])


def draft_tree(source, pending: torch.Tensor, tree, params) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``propose_tree``'s nodes: (draft-vocabulary tokens [N], parents [N], scores [N]), a node's score being
    its cumulative log q, the sum of log q over its path (what EAGLE-2 ranks by; tests compare it with chains)."""
    check_tree_request(source, tree, pending)  # before the queued features are read: a refused call changes nothing
    reader = _TreeReader(source, pending, params)
    return _dynamic(reader, tree) if isinstance(tree, DynamicTree) else _static(reader, tree)


class _TreeReader:
    """Reads tree nodes into the drafter's cache and scores their children."""

    def __init__(self, source, pending: torch.Tensor, params):
        self.source, self.drafter, self.params = source, source.drafter, params
        self.root_hidden = source._read_queued(pending)[:, -1]  # [1, H]: the pending position's
        self.committed = source.num_committed
        self.device = pending.device

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """[m, N] log-probabilities of the children of m read nodes (draft vocabulary)."""
        logits = self.drafter.draft_logits(hidden)
        if self.params.is_greedy:
            return F.log_softmax(logits.float(), dim=-1)
        return logits_to_probs(logits, self.params).log()

    def read(self, hidden: torch.Tensor, tokens: torch.Tensor, depth: int, ancestors: torch.Tensor) -> torch.Tensor:
        """One draft step over m nodes of ``depth``: ``hidden`` [m, H] their parents' hiddens, ``tokens`` [m]
        their target ids, ``ancestors`` [m, S] which of the S tree slots read so far each may see. Returns their
        hiddens [m, H]; their slots are S..S+m-1."""
        cache, m = self.source.cache, tokens.shape[0]
        num_tree = len(cache) - self.committed
        mask = torch.cat([torch.ones(m, self.committed, dtype=torch.bool, device=self.device), ancestors,
                          torch.eye(m, dtype=torch.bool, device=self.device)], dim=1)  # fmt: skip
        assert ancestors.shape[1] == num_tree
        positions = torch.full((1, m), self.committed + depth - 1, device=self.device)
        return self.drafter.draft_step(hidden[None], tokens[None], positions, cache, mask=mask[None, None])[0]


def _dynamic(reader: _TreeReader, tree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-2: the top_k frontier by cumulative log-probability, expanded ``depth`` times, then the best
    ``total_tokens`` of every candidate. Returns (draft-vocabulary tokens [N], parents [N], scores [N])."""
    device, top_k = reader.device, tree.top_k
    score = reader.scores(reader.root_hidden)[0]  # [V_draft]
    first_scores, first_tokens = score.topk(min(top_k, score.numel()))
    # Every candidate generated, in generation order: its token, cumulative score, parent (candidate index).
    tokens, scores = [first_tokens], [first_scores]
    parents = [torch.full_like(first_tokens, -1)]
    depths = [torch.ones_like(first_tokens)]
    frontier = torch.arange(first_tokens.numel(), device=device)  # candidate indices
    frontier_hidden = reader.root_hidden.expand(frontier.numel(), -1)  # their parents' hiddens
    frontier_ancestors = torch.zeros(frontier.numel(), 0, dtype=torch.bool, device=device)  # over tree slots
    num_candidates = first_tokens.numel()
    for depth in range(2, tree.depth + 1):
        all_tokens, all_scores = torch.cat(tokens), torch.cat(scores)
        read_tokens = reader.source._to_target_ids(all_tokens[frontier])
        hidden = reader.read(frontier_hidden, read_tokens, depth - 1, frontier_ancestors)  # [m, H]
        m = frontier.numel()
        # The frontier's own slots, appended after the tree slots read so far.
        ancestors = torch.cat([frontier_ancestors, torch.eye(m, dtype=torch.bool, device=device)], dim=1)
        child_scores, child_tokens = reader.scores(hidden).topk(min(top_k, score.numel()), dim=-1)  # [m, k]
        # cumulative log-probability; clamp: a log-softmax can round to +1e-8, and a child must never outscore
        # its parent (that is what keeps the reranked set a tree)
        child_scores = all_scores[frontier, None] + child_scores.clamp_max(0.0)
        k = child_tokens.shape[1]
        tokens.append(child_tokens.flatten())
        scores.append(child_scores.flatten())
        parents.append(frontier.repeat_interleave(k))
        depths.append(torch.full((m * k,), depth, device=device, dtype=torch.long))
        if depth < tree.depth:  # the next frontier: the best top_k of these children
            # stable sort, not topk: ties go to the earlier-generated child, as in the rerank below
            best = torch.sort(child_scores.flatten(), descending=True, stable=True).indices[:top_k]
            frontier = num_candidates + best
            parent_row = best // k
            frontier_hidden = hidden[parent_row]
            frontier_ancestors = ancestors[parent_row]  # a child sees its parent's slot and the parent's ancestors
        num_candidates += m * k
    all_tokens, all_scores = torch.cat(tokens), torch.cat(scores)
    all_parents, all_depths = torch.cat(parents), torch.cat(depths)
    # Rerank: the best total_tokens (stable: ties keep the earlier-generated node, so a parent, whose score
    # is never below its child's, is kept before it and the kept set stays a tree). Zero-probability
    # candidates (-inf) are never kept.
    order = torch.sort(all_scores, descending=True, stable=True).indices[: tree.total_tokens]
    order = order[all_scores[order] > float("-inf")]
    # Topological order: by depth, then score (the sort above), so parents come first.
    order = order[torch.sort(all_depths[order], stable=True).indices]
    new_index = torch.full_like(all_parents, -1)
    new_index[order] = torch.arange(order.numel(), device=device)
    kept_parents = all_parents[order]
    kept_parents = torch.where(kept_parents >= 0, new_index[kept_parents.clamp_min(0)], -1)
    return all_tokens[order], kept_parents, all_scores[order]


def _static(reader: _TreeReader, tree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A static tree: node i is the ranks[i]-th best child of its parent (``expand_static_tree``), the nodes of a
    depth that have children read in one step with tree attention. Returns (draft-vocabulary tokens [N],
    parents [N], scores [N])."""
    device = reader.device
    slot = {}  # read node -> its tree slot in the drafter's cache (host ints: the tree's shape is fixed)

    def step(depth, expanders, hiddens, tokens):
        if depth == 0:  # the root: the pending token was read with the queued pairs (_TreeReader)
            return hiddens, reader.scores(hiddens)
        # Each expander sees its own strict ancestors' slots: built on the host, one copy per depth.
        ancestors = [[False] * len(slot) for _ in expanders]
        for row, node in enumerate(expanders):
            for up in path_to(tree.parents[node], tree.parents):
                ancestors[row][slot[up]] = True
        visible = torch.tensor(ancestors, dtype=torch.bool, device=device).reshape(len(expanders), -1)
        read = reader.read(hiddens, reader.source._to_target_ids(tokens), depth, visible)
        slot.update({node: len(slot) + row for row, node in enumerate(expanders)})
        return read, reader.scores(read)

    tokens, log_q = expand_static_tree(tree, step, reader.root_hidden, torch.zeros(1, dtype=torch.long, device=device))
    parents = torch.tensor(tree.parents, device=device)
    # A node's score is its path's log q (clamped: a log-softmax can round to +1e-8), summed over its ancestors.
    scores = ancestor_matrix(parents).float() @ log_q.clamp_max(0.0)
    return tokens, parents, scores
