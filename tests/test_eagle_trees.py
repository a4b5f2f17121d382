"""EAGLE tree drafting: every node is read as its root-to-node path would be read as a chain (tree attention in the
drafter's cache is right), EAGLE-2's dynamic tree is the brute-force one, static trees take the ranked children
of their paths, and the source goes on after a tree exactly as after a chain. EAGLE-3 drafts over a reduced
vocabulary (a random half of the target's), so the draft -> target id map is exercised throughout.
Greedy decoding with trees through the decoder: the last tests here, and tests/test_trees.py."""

import pytest
import torch
import torch.nn.functional as F
from test_eagle_decoding import make_drafter, tiny_target
from tiny import assert_close, seeded_init_

from specdraft.decoding.sampling import SamplingParams, logits_to_probs
from specdraft.decoding.speculative import TreeDrafting, plain_decode, speculative_decode
from specdraft.decoding.trees import NAMED_TREES, DynamicTree, StaticTree, check_tree, parse_tree, path_to
from specdraft.drafters.eagle_tree import _TreeReader, draft_tree
from specdraft.errors import SpecdraftError

GREEDY = SamplingParams(temperature=0.0)
# top_k 3 < the trees' top_k 4: some children have q = 0 and must never be proposed
WARPED = SamplingParams(temperature=0.7, top_k=3)
PROMPT = torch.tensor([[1, 17, 40, 99, 7, 17, 40, 123, 5]])  # the last token is the pending one
# A node's logits come from one draft step over its whole depth with a tree mask, its chain's from one step per
# token with a causal mask: the same float32 sums in another order and shape. Measured: at most 3.5e-7 of the
# logits' scale (a few float32 roundings of ~6e-8 each), so rel 1e-5 (tiny.assert_close's) leaves a 30x margin, while a
# node that saw a wrong slot (a sibling's, a cousin's) or sat at a wrong position is off by O(1) of the scale.
REL = 1e-5
# Cumulative scores (sums of log_softmax values of size ~1-20) differ from their chains' by float32 rounding only:
# measured under 1e-6; 1e-5 leaves a 10x margin, while a wrong context moves a log q by ~0.1-1 (see ``setup``).
SCORE_ATOL = 1e-5
# The drafters' own weights: large enough that what a node attends to moves its logits by O(1) (measured: another
# first token changes the logits two steps later by ~3.6 for EAGLE-1 and ~0.8 for EAGLE-3, at logit scales ~9 and
# ~6). EAGLE-1's logits are its unnormed hidden through the target's head, so std 0.3 there gives logits ~1e5.
DRAFTER_STD = {"eagle1": 0.1, "eagle3": 0.3}


@pytest.fixture(scope="module", params=["eagle1", "eagle3"])
def setup(request):
    """An untrained drafter with its own weights redrawn larger (``DRAFTER_STD``), so that what a node attends to
    moves its logits by O(1): a tree mask that showed a node its siblings' slots changes its children."""
    target = tiny_target()
    drafter = make_drafter(request.param, target).eval()
    seeded_init_(drafter, seed=3, std=DRAFTER_STD[request.param])
    drafter.requires_grad_(False)
    return target, drafter.draft_source(target)


def started(target, source, prompt=PROMPT):
    source.start(prompt[:, :-1], target(prompt[:, :-1]))
    return source


def fresh(target, source):
    return started(target, type(source)(source.drafter))


def to_target(source, draft_tokens) -> list[int]:
    mapping = source.drafter.draft_to_target
    return [int(t) if mapping is None else int(mapping[t]) for t in draft_tokens]


def to_draft(source, target_tokens: torch.Tensor) -> list[int]:
    mapping = source.drafter.draft_to_target
    return [int(t) if mapping is None else int((mapping == t).nonzero()) for t in target_tokens.flatten()]


def chain_logits(target, source, path: list[int]) -> torch.Tensor:
    """[V_draft] the draft logits after pending + ``path`` (target ids), read one token at a time as ``propose``
    reads its own drafts, on a fresh source."""
    src = fresh(target, source)
    d = src.drafter
    hidden = src._read_queued(PROMPT[:, -1:])[:, -1:]
    for token in path:
        hidden = d.draft_step(hidden, torch.tensor([[token]]), src._positions(1), src.cache)
    return d.draft_logits(hidden[:, -1])[0]


def log_q(logits: torch.Tensor, params) -> torch.Tensor:
    """The score of a child, as the tree ranks it: log_softmax at temperature 0, the log of the warped q else."""
    return F.log_softmax(logits, -1) if params.is_greedy else logits_to_probs(logits, params).log()


def test_tree_attention_reads_each_node_as_its_chain(setup):
    """A hand-made tree read level by level through the reader: each node's draft logits equal its chain's. Level 1
    holds three siblings, level 2 two children of the first and one of the third sharing a token with its cousin,
    level 3 a child under each of two level-2 nodes: any slot shown to the wrong node moves its logits."""
    target, source = setup
    d = source.drafter
    ids = to_target(source, range(6))  # six target ids inside the draft vocabulary
    reader = _TreeReader(started(target, source), PROMPT[:, -1:], GREEDY)
    committed = reader.committed
    eye = torch.eye(3, dtype=torch.bool)
    # (parent path, token) of each node, and the [m, slots] ancestor masks the reader gets, slots in read order
    level1 = [((), ids[0]), ((), ids[1]), ((), ids[2])]
    h1 = reader.read(reader.root_hidden.expand(3, -1), torch.tensor([t for _, t in level1]), 1,
                     torch.zeros(3, 0, dtype=torch.bool))
    level2 = [((ids[0],), ids[3]), ((ids[0],), ids[4]), ((ids[2],), ids[3])]
    h2 = reader.read(h1[[0, 0, 2]], torch.tensor([t for _, t in level2]), 2, eye[[0, 0, 2]])
    level3 = [((ids[0], ids[4]), ids[5]), ((ids[2], ids[3]), ids[5])]
    seen = torch.zeros(2, 6, dtype=torch.bool)  # slots 0-2: level 1, 3-5: level 2
    seen[0, [0, 4]] = True  # (ids[0], ids[4]) and its parent ids[0]
    seen[1, [2, 5]] = True  # (ids[2], ids[3]) and its parent ids[2]
    h3 = reader.read(h2[[1, 2]], torch.tensor([t for _, t in level3]), 3, seen)
    assert len(source.cache) == committed + 8
    worst = 0.0
    for (path, token), hidden in zip(level1 + level2 + level3, torch.cat([h1, h2, h3])):
        expected = chain_logits(target, source, list(path) + [token])
        worst = max(worst, assert_close(d.draft_logits(hidden), expected, rel=REL, what=f"node {path + (token,)}"))
    print(f"max |tree - chain| / scale of the logits: {worst:.2g}")


@pytest.mark.parametrize("params", [GREEDY, WARPED], ids=["greedy", "warped"])
def test_static_tree_nodes_are_ranked_children_of_their_paths(setup, params):
    target, source = setup
    tree = StaticTree(((0,), (1,), (2,), (0, 0), (0, 1), (2, 0), (0, 0, 0), (0, 1, 1), (0, 0, 0, 2)))
    tokens, parents, scores = draft_tree(started(target, source), PROMPT[:, -1:], tree, params)
    assert parents.tolist() == tree.parents
    for i in range(tree.num_nodes):
        path = path_to(i, tree.parents)
        chain = log_q(chain_logits(target, source, to_target(source, tokens[path[:-1]])), params)
        assert int(tokens[i]) == int(chain.sort(descending=True, stable=True).indices[tree.ranks[i]]), f"node {i}"
        # the cumulative score, checked one level at a time: its own log q plus its parent's score
        parent_score = scores[path[-2]] if len(path) > 1 else 0.0
        assert abs(float(scores[i] - parent_score - chain[tokens[i]])) <= SCORE_ATOL, f"node {i}"


def brute_force_eagle2(target, source, tree: DynamicTree, params) -> dict[tuple[int, ...], float]:
    """EAGLE-2's kept paths (draft ids) with their scores, from chain runs of every path, in plain Python."""

    def children(path, score):
        values, ids = log_q(chain_logits(target, source, to_target(source, path)), params).topk(tree.top_k)
        return [(path + (int(t),), score + min(float(v), 0.0)) for v, t in zip(values, ids)]

    candidates = children((), 0.0)  # (path, cumulative score), in generation order
    frontier = candidates
    for _ in range(2, tree.depth + 1):
        new = [child for path, score in frontier for child in children(path, score)]
        candidates = candidates + new
        frontier = sorted(new, key=lambda c: -c[1])[: tree.top_k]  # sorted() is stable: ties keep generation order
    kept = sorted(candidates, key=lambda c: -c[1])[: tree.total_tokens]
    return {path: score for path, score in kept if score > float("-inf")}  # q = 0: never proposed


@pytest.mark.parametrize("tree,params", [
    (DynamicTree(total_tokens=7, depth=3, top_k=3), GREEDY),
    (DynamicTree(total_tokens=20, depth=4, top_k=2), GREEDY),
    (DynamicTree(total_tokens=30, depth=3, top_k=4), WARPED),  # 24 candidates with q > 0: fewer than 30 nodes
], ids=["k3d3n7", "k2d4n20", "warped"])  # fmt: skip
def test_dynamic_tree_is_brute_force_eagle2(setup, tree, params):
    target, source = setup
    src = started(target, source)
    tokens, parents, scores = draft_tree(src, PROMPT[:, -1:], tree, params)
    expected = brute_force_eagle2(target, source, tree, params)
    check_tree(parents, tokens)  # parents come first, no duplicate siblings
    parents = parents.tolist()
    depths = [len(path_to(i, parents)) for i in range(len(parents))]
    assert len(parents) == len(expected) == min(tree.num_nodes, len(expected))
    if params.is_greedy:
        assert len(parents) == tree.num_nodes  # every candidate has q > 0: min(total_tokens, #candidates)
    else:  # warped top_k 3 < tree top_k 4: 3 + 3 * 3 + 4 * 3 = 24 candidates with q > 0, fewer than 30
        assert len(parents) == 24 < tree.num_nodes
    # The same nodes, each under the same parent (a node's path names its parents), with the same scores.
    paths = {tuple(int(tokens[j]) for j in path_to(i, parents)): float(scores[i]) for i in range(len(parents))}
    assert set(paths) == set(expected)
    assert max(abs(paths[p] - expected[p]) for p in paths) <= SCORE_ATOL
    # Topological order: by depth, then by score descending.
    assert [(dep, -float(s)) for dep, s in zip(depths, scores)] == sorted(zip(depths, (-scores).tolist()))
    # The proposal is the same tree in target ids, with deterministic children (probs None).
    proposal = fresh(target, source).propose_tree(PROMPT[:, -1:], tree, params, None)
    assert proposal.probs is None and proposal.parents[0].tolist() == parents
    assert to_draft(source, proposal.tokens) == tokens.tolist()


def test_a_chain_tree_is_the_chain(setup):
    target, source = setup
    tree = started(target, source).propose_tree(PROMPT[:, -1:], StaticTree.chain(4), GREEDY, None)
    chain = fresh(target, source).propose(PROMPT[:, -1:], 4, GREEDY, None)
    assert torch.equal(tree.tokens, chain.tokens) and tree.parents.tolist() == [[-1, 0, 1, 2]]


@pytest.mark.parametrize("spec,accept", [("eagle2-small", "deepest"), ("eagle2-small", 1), ("medusa-16", 2)])
def test_after_a_tree_the_source_goes_on_as_after_a_chain(setup, spec, accept):
    """propose_tree, then commit of an accepted path (a whole root-to-leaf path, or its first nodes): the next
    proposals (chain and tree) equal those of a source that drafted a chain and committed the same tokens."""
    target, source = setup
    tree_source = started(target, source)
    proposal = tree_source.propose_tree(PROMPT[:, -1:], parse_tree(spec), GREEDY, None)
    parents = proposal.parents[0].tolist()
    deepest = path_to(max(range(len(parents)), key=lambda i: len(path_to(i, parents))), parents)
    path = proposal.tokens[:, deepest if accept == "deepest" else deepest[:accept]]
    kept = torch.cat([PROMPT[:, -1:], path], dim=1)  # as if the target accepted this path
    full = torch.cat([PROMPT, path], dim=1)
    out = target(full).slice(slice(PROMPT.shape[1] - 1, full.shape[1]))
    chain_source = fresh(target, source)
    chain_source.propose(PROMPT[:, -1:], 3, GREEDY, None)
    for src in (tree_source, chain_source):
        src.commit(kept, out)
    sources, pending = (tree_source, chain_source), torch.tensor([[11]])
    before = [len(src.cache) for src in sources]  # the committed cache, before the queue is read
    a, b = (src.propose(pending, 3, WARPED, torch.Generator().manual_seed(0)) for src in sources)
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(a.probs, b.probs)
    # and as trees: back to the committed cache (the queue stays until the next commit), then a tree each
    for src, length in zip(sources, before):
        src.cache.keep(length)
    a, b = (draft_tree(src, pending, DynamicTree(total_tokens=8, depth=3, top_k=3), GREEDY) for src in sources)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    torch.testing.assert_close(a[2], b[2])


def test_greedy_tree_decoding_is_plain_greedy_decoding(setup):
    target, source = setup
    for spec in ("eagle2:total_tokens=10,depth=4,top_k=3", "medusa-16"):
        for prompt in (PROMPT, PROMPT[:, :4]):
            expected = plain_decode(target, prompt, max_new_tokens=20).tokens
            assert speculative_decode(target, TreeDrafting(source, parse_tree(spec)), prompt, k=6,
                                      max_new_tokens=20).tokens == expected  # fmt: skip


def test_bad_calls_are_refused_and_change_nothing(setup):
    target, source = setup
    src = started(target, source)
    with pytest.raises(SpecdraftError, match="one prompt at a time"):
        src.propose_tree(torch.tensor([[1], [2]]), StaticTree.chain(2), GREEDY, None)
    with pytest.raises(SpecdraftError, match="StaticTree or a DynamicTree.*parse_tree"):
        src.propose_tree(PROMPT[:, -1:], "medusa-63", GREEDY, None)
    # Neither refusal read the queued features into the cache: the source drafts as a fresh one.
    tree = NAMED_TREES["eagle2-small"]
    after = src.propose_tree(PROMPT[:, -1:], tree, GREEDY, None)
    expected = fresh(target, source).propose_tree(PROMPT[:, -1:], tree, GREEDY, None)
    assert torch.equal(after.tokens, expected.tokens) and torch.equal(after.parents, expected.parents)
