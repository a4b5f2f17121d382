"""Draft trees: which candidates a drafter proposes in one step, and their shape.

A tree proposal is N nodes in topological order (a node's parent comes before it), each with a
token and a parent index, -1 meaning the root: the pending token. The target verifies all N in one
forward with a tree attention mask (``tree_attention_mask``): a node sees the cached prefix, the
pending token and its own ancestors, at position prefix length + depth.

Two ways to choose the nodes:
  StaticTree   Medusa's ``medusa_choices`` (Cai et al. 2024, Sec. 2.1.2): a fixed list of paths of
               per-depth top-k ranks. Path (0, 2) is the top-1 token of depth 1 followed by the
               top-3 token of depth 2 drafted after it. Medusa heads and the MLP speculator use it.
  DynamicTree  EAGLE-2 (Li et al. 2024, arXiv 2406.16858, Sec. 4): expand the ``top_k`` best frontier
               nodes by cumulative log-probability for ``depth`` steps, then rerank every candidate
               and keep the ``total_tokens`` best. A child's cumulative score never exceeds its
               parent's, so the kept set is a tree (ties broken towards the earlier node).

Every tree here has deterministic children (top-k of the draft's warped q), so sampled verification
walks them with q one-hot (``specdraft.decoding.tree_verify``) and stays lossless.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache

import torch

from specdraft.contract import DraftCapabilities, check_capabilities
from specdraft.errors import SpecdraftError


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree of per-depth top-k ranks; see the module docstring."""

    choices: tuple[tuple[int, ...], ...]
    kind = "static"  # what a source lists in its ``capabilities.tree_kinds``

    def __post_init__(self):
        paths = [tuple(int(r) for r in path) for path in self.choices]
        if not paths:
            raise SpecdraftError("a static tree needs at least one path, e.g. [[0]] (a one-node chain)")
        seen = set()
        for path in paths:
            if len(path) == 0 or min(path) < 0:
                raise SpecdraftError(
                    f"tree path {list(path)} is not a non-empty list of top-k ranks >= 0; "
                    "each path lists, per depth, which of the drafter's top tokens to take (0 = its best)"
                )
            if path in seen:
                raise SpecdraftError(f"tree path {list(path)} appears twice: each node of the tree is listed once")
            seen.add(path)
        for path in paths:
            if len(path) > 1 and path[:-1] not in seen:
                raise SpecdraftError(
                    f"tree path {list(path)} has no parent: add {list(path[:-1])} (every prefix of a path is a node)"
                )
        # Topological order: by depth, then by rank path (Medusa's own order), so parents come first.
        object.__setattr__(self, "choices", tuple(sorted(paths, key=lambda p: (len(p), p))))

    @classmethod
    def chain(cls, length: int) -> StaticTree:
        """The chain of ``length`` top-1 tokens: the tree form of chain drafting."""
        if length < 1:
            raise SpecdraftError(f"a chain tree needs length >= 1, got {length}")
        return cls(tuple((0,) * d for d in range(1, length + 1)))

    @property
    def num_nodes(self) -> int:
        return len(self.choices)

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.choices)

    @cached_property
    def parents(self) -> list[int]:
        """Parent node index of each node, -1 for depth-1 nodes."""
        index = {path: i for i, path in enumerate(self.choices)}
        return [index[p[:-1]] if len(p) > 1 else -1 for p in self.choices]

    @cached_property
    def ranks(self) -> list[int]:
        """Which of its parent's top tokens each node takes (0 = the best)."""
        return [p[-1] for p in self.choices]

    @cached_property
    def depths(self) -> list[int]:
        return [len(p) for p in self.choices]

    def top_k_at_depth(self, depth: int) -> int:
        """How many top tokens a drafter needs at ``depth`` (1-based)."""
        return max((p[-1] + 1 for p in self.choices if len(p) == depth), default=0)

    def limited(self, max_depth: int) -> StaticTree:
        """The nodes no deeper than ``max_depth``: for a drafter with fewer heads than the tree is deep,
        and near the end of the token budget (a verify never runs past the context)."""
        return self if max_depth >= self.depth else _static_prefix(self, max_depth)


@lru_cache(maxsize=64)
def _static_prefix(tree: StaticTree, max_depth: int) -> StaticTree:
    """Cached: a drafter with fewer heads than the tree is deep asks for the same cut every step."""
    return StaticTree(tuple(p for p in tree.choices if len(p) <= max_depth))


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's dynamic tree; defaults follow EAGLE-3 (total_tokens 60, depth 6, top_k 10)."""

    total_tokens: int = 60
    depth: int = 6
    top_k: int = 10
    kind = "dynamic"

    def __post_init__(self):
        for name in ("total_tokens", "depth", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecdraftError(
                    f"a dynamic tree needs {name} >= 1, got {value!r}; EAGLE-3's defaults are total_tokens=60, "
                    "depth=6, top_k=10 (on a CPU try total_tokens=16, depth=5, top_k=4)"
                )

    def limited(self, max_depth: int) -> DynamicTree:
        """At most ``max_depth`` deep (near the end of the token budget)."""
        return self if max_depth >= self.depth else replace(self, depth=max(1, max_depth))

    @property
    def num_nodes(self) -> int:
        """At most this many nodes: total_tokens, or fewer if the expansion makes fewer candidates."""
        return min(self.total_tokens, self.top_k + (self.depth - 1) * self.top_k * self.top_k)


# Medusa's published 63-node tree (FasterDecoding/Medusa, medusa/model/medusa_choices.py, `mc_sim_7b_63`).
MEDUSA_63 = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,), (9,),
    (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1),
    (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0),
    (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0),
    (0, 0, 0, 1), (1, 6), (0, 7, 0),
)  # fmt: skip

# Smaller trees for CPUs, where a verify forward's cost grows with its width: the first nodes of the
# 63-node tree (its order is by measured acceptance), closed under prefixes.
NAMED_TREES = {
    "medusa-63": StaticTree(MEDUSA_63),
    "medusa-16": StaticTree(MEDUSA_63[:16]),
    "medusa-8": StaticTree(MEDUSA_63[:8]),
    "eagle2": DynamicTree(),
    "eagle2-small": DynamicTree(total_tokens=16, depth=5, top_k=4),
}


def parse_tree(spec: str) -> StaticTree | DynamicTree:
    """A tree from the command line: a name in ``NAMED_TREES``, ``chain-N``, or
    ``eagle2:total_tokens=T,depth=D,top_k=K`` (any of the three; the rest keep EAGLE-3's defaults)."""
    if spec in NAMED_TREES:
        return NAMED_TREES[spec]
    if spec.startswith("chain-") and spec[6:].isdigit():
        return StaticTree.chain(int(spec[6:]))
    if spec.startswith("eagle2:"):
        fields = {}
        for item in filter(None, spec[7:].split(",")):
            key, _, value = item.partition("=")
            if key not in ("total_tokens", "depth", "top_k") or not value.lstrip("-").isdigit():
                raise SpecdraftError(f"bad dynamic tree field {item!r} in {spec!r}; write e.g. "
                                     "eagle2:total_tokens=16,depth=5,top_k=4")
            fields[key] = int(value)
        return DynamicTree(**fields)
    raise SpecdraftError(
        f"unknown tree {spec!r}; use one of {sorted(NAMED_TREES)}, chain-N, or eagle2:total_tokens=T,depth=D,top_k=K"
    )


# -- tensors of a tree proposal ------------------------------------------------------------------------


def check_tree(parents: torch.Tensor, tokens: torch.Tensor | None = None) -> None:
    """Refuse a malformed tree: a parent out of range or not before its node (which also rules out
    cycles), or two siblings with the same token. ``parents`` [N] or [1, N]; host syncs, so the
    decoder checks a source's first proposal of a call, not every step."""
    parents = parents.reshape(-1).long().cpu()
    n = parents.numel()
    index = torch.arange(n)
    bad = ((parents < -1) | (parents >= n)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise SpecdraftError(f"tree node {i} has parent {int(parents[i])}, out of range [-1, {n}); "
                             "a parent is a node index, or -1 for the root (the pending token)")
    bad = (parents >= index).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise SpecdraftError(
            f"tree node {i} comes before (or is) its parent {int(parents[i])}: list nodes in topological order, "
            "each after its parent (this also rules out cycles)"
        )
    if tokens is not None:
        tokens = tokens.reshape(-1).long().cpu()
        pairs = torch.stack([parents, tokens], dim=1)
        if torch.unique(pairs, dim=0).shape[0] != n:
            seen = {}
            for i, (p, t) in enumerate(pairs.tolist()):
                if (p, t) in seen:
                    raise SpecdraftError(f"tree nodes {seen[(p, t)]} and {i} are siblings (parent {p}) with the same "
                                         f"token {t}: a duplicate sibling can never be accepted; drop one")
                seen[(p, t)] = i


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """[N, N] bool: ``a[i, j]`` is True where node j is node i or one of its ancestors.

    Pointer doubling: start from "itself or its parent" and square the reachability ceil(log2 N) times,
    each squaring doubling the path length covered. A fixed number of small matmuls on the device, so
    no host sync (a loop until nothing changes would need one per generation)."""
    parents = parents.long().reshape(-1)
    n = parents.numel()
    reach = torch.eye(n, dtype=torch.float32, device=parents.device)
    # Each node reaches its parent; a root's child (-1) adds nothing (a masked add: no nonzero(), no sync).
    reach[torch.arange(n, device=parents.device), parents.clamp_min(0)] += (parents >= 0).float()
    reach = reach.clamp_max(1.0)
    for _ in range(max(n - 1, 1).bit_length()):
        reach = ((reach @ reach) > 0).float()
    return reach > 0


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """[N] depth of each node, 1 for a child of the root: how many nodes its path holds (itself included)."""
    return ancestor_matrix(parents).sum(1)


def tree_attention_mask(ancestors: torch.Tensor, past_length: int) -> torch.Tensor:
    """[1, 1, N+1, past+N+1] bool mask for the verify forward over [pending, node_1..node_N], from the
    ``ancestor_matrix``: every query sees the whole cache; the pending token (row 0) sees itself; node i
    sees the pending token, its ancestors and itself."""
    n = ancestors.shape[0]
    mask = torch.zeros(n + 1, past_length + n + 1, dtype=torch.bool, device=ancestors.device)
    mask[:, : past_length + 1] = True
    mask[1:, past_length + 1 :] = ancestors
    return mask[None, None]


def path_to(node: int, parents: list[int]) -> list[int]:
    """Node indices from the root's child down to ``node`` (host lists; -1 gives the empty path)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def check_tree_kind(source, tree) -> None:
    """``source`` drafts trees of ``tree``'s kind (its declared ``capabilities.tree_kinds``, backed by a
    ``propose_tree``: ``check_capabilities``); else an error naming what it drafts."""
    kinds, name = check_capabilities(source).tree_kinds, type(source).__name__
    if not kinds:
        raise SpecdraftError(
            f"{name} drafts chains only (its capabilities declare no tree_kinds); trees are drafted by EAGLE-1/3 "
            "(static or EAGLE-2 dynamic trees), Medusa heads and the MLP speculator (static trees)"
        )
    kind = getattr(tree, "kind", None)
    if kind not in kinds:
        wanted = " or a ".join({"static": "StaticTree", "dynamic": "DynamicTree"}[k] for k in kinds)
        raise SpecdraftError(
            f"{name} drafts {' and '.join(kinds)} trees, not {kind or type(tree).__name__} ones: give a {wanted} "
            "(specdraft.decoding.trees.parse_tree, e.g. 'medusa-16'; EAGLE-2's dynamic trees need a drafter that "
            "reads its own drafts, EAGLE-1/3)"
        )


def check_tree_request(source, tree, pending: torch.Tensor) -> None:
    """What every ``propose_tree`` checks before it touches its state: the tree's kind, and one prompt."""
    if getattr(tree, "kind", None) not in source.capabilities.tree_kinds:  # each step: the full check only to refuse
        check_tree_kind(source, tree)
    if pending.shape[0] != 1:
        raise SpecdraftError(f"tree drafting takes one prompt at a time, got a batch of {pending.shape[0]}; "
                             "draft a batch as chains (propose), or decode its prompts one by one")


def expand_static_tree(tree: StaticTree, step, root_state: torch.Tensor, root_token: torch.Tensor):
    """(tokens [N], values [N]) of ``tree`` drafted by a model that drafts depth by depth: Medusa heads, the MLP
    speculator, and EAGLE (whose ``step`` reads the nodes into its cache with tree attention).

    ``step(d, expanders, states [m, ...], tokens [m]) -> (states [m, ...], scores [m, V])`` runs the m nodes of
    depth d that have children (``expanders``: their indices, -1 for the root) from the states their parents
    left (``root_state`` [1, ...] for the root, whose token is the pending ``root_token`` [1]); it returns the
    states they leave and the scores of their children. Node i takes the ``ranks[i]``-th best child of its
    parent; ``values[i]`` is that child's score. Temperature, top-k and top-p keep the logits' order, so
    ranking by logits is ranking by the warped q. One ``step`` call per depth."""
    n = tree.num_nodes
    tokens, values = root_token.new_zeros(n), None
    node_states = None  # [N, ...] the state each node's children are drafted from
    for d in range(tree.depth):
        nodes = [i for i in range(n) if tree.depths[i] == d + 1]
        expanders = sorted({tree.parents[i] for i in nodes})  # -1 (the root) first, then node indices
        rows = {e: r for r, e in enumerate(expanders)}
        states = torch.cat([root_state if e < 0 else node_states[e : e + 1] for e in expanders])
        parent_tokens = torch.stack([root_token.reshape(()) if e < 0 else tokens[e] for e in expanders])
        states, scores = step(d, expanders, states, parent_tokens)
        top = scores.topk(max(tree.ranks[i] for i in nodes) + 1, dim=-1)  # [m, k]
        index = torch.tensor(nodes, device=tokens.device)
        row_of = torch.tensor([rows[tree.parents[i]] for i in nodes], device=tokens.device)
        rank = torch.tensor([tree.ranks[i] for i in nodes], device=tokens.device)
        tokens[index] = top.indices[row_of, rank]
        if node_states is None:
            node_states = states.new_zeros(n, *states.shape[1:])
            values = scores.new_zeros(n)
        node_states[index] = states[row_of]
        values[index] = top.values[row_of, rank]
    return tokens, values


class TreeDrafting:
    """A ``DraftSource`` that drafts ``tree`` each step through ``source.propose_tree``: how the decoder and
    ``evaluate`` are asked for tree decoding. The decoder's ``k`` caps the tree's depth (the budget's end
    shortens it); ``evaluate`` passes ``depth``. A source declares the trees it drafts in
    ``capabilities.tree_kinds``; this wrapper itself drafts row by row in a batch."""

    capabilities = DraftCapabilities()

    def __init__(self, source, tree: StaticTree | DynamicTree):
        check_tree_kind(source, tree)  # here, so a wrong pairing fails before any decoding
        self.source, self.tree = source, tree

    @property
    def depth(self) -> int:
        return self.tree.depth

    def __copy__(self) -> TreeDrafting:
        """An independent copy for another row of a batch (``rows.fresh_sources``): its source copied too."""
        return TreeDrafting(copy.copy(self.source), self.tree)

    def start(self, prompt_ids, target_out) -> None:
        self.source.start(prompt_ids, target_out)

    def propose(self, pending, k: int, params, generator):
        return self.source.propose_tree(pending, self.tree.limited(k), params, generator)

    def commit(self, kept_ids, target_out) -> None:
        self.source.commit(kept_ids, target_out)
