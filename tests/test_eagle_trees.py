"""EAGLE tree drafting: every node's children come from the drafter run on that node's path as a chain (tree
attention in the drafter's cache is right), EAGLE-2's dynamic tree is the brute-force one, and the source goes
on after a tree exactly as after a chain. Greedy decoding with trees is in tests/test_trees.py."""

import pytest
import torch
import torch.nn.functional as F
from test_batched import tiny_target_for
from tiny import seeded_init_

from specdraft.decoding.sampling import SamplingParams
from specdraft.decoding.speculative import TreeDrafting, plain_decode, speculative_decode
from specdraft.decoding.trees import NAMED_TREES, DynamicTree, StaticTree, check_tree, parse_tree, path_to
from specdraft.errors import SpecdraftError

GREEDY = SamplingParams()
PROMPT = torch.tensor([[1, 17, 40, 99, 7, 17, 40, 123, 5]])


@pytest.fixture(scope="module", params=["eagle1", "eagle3"])
def setup(request):
    """An untrained drafter with its own weights redrawn larger (std 0.3), so that what a node attends to moves
    its children's ranking: a tree mask that showed a node its siblings' slots changes the tree."""
    target, source = tiny_target_for(request.param)
    seeded_init_(source.drafter, seed=3, std=0.3)
    return target, source


def started(target, source, prompt=PROMPT):
    source.start(prompt[:, :-1], target(prompt[:, :-1]))
    return source


def chain_log_probs(target, source, path: list[int]) -> torch.Tensor:
    """[V_draft] the drafter's log-probabilities after pending + ``path`` (target ids), read one token at a
    time as a chain propose reads its own drafts."""
    src = started(target, type(source)(source.drafter))
    d = src.drafter
    hidden = src._read_queued(PROMPT[:, -1:])[:, -1:]
    for token in path:
        hidden = d.draft_step(hidden, torch.tensor([[token]]), src._positions(1), src.cache)
    return F.log_softmax(d.draft_logits(hidden[:, -1]).float(), dim=-1)[0]


def draft_ids(source, tokens: torch.Tensor) -> torch.Tensor:
    mapping = source.drafter.draft_to_target
    return tokens if mapping is None else torch.tensor([int((mapping == t).nonzero()) for t in tokens])


def test_static_tree_nodes_are_ranked_children_of_their_paths(setup):
    target, source = setup
    tree = StaticTree(((0,), (1,), (2,), (0, 0), (0, 1), (2, 0), (0, 0, 0), (0, 1, 1), (0, 0, 0, 2)))
    proposal = started(target, source).propose_tree(PROMPT[:, -1:], tree, GREEDY, None)
    tokens, parents = proposal.tokens[0].tolist(), proposal.parents[0].tolist()
    assert parents == tree.parents and proposal.probs is None
    draft = draft_ids(source, proposal.tokens[0]).tolist()
    for i in range(tree.num_nodes):
        path = [tokens[j] for j in path_to(parents[i], parents)]
        order = chain_log_probs(target, source, path).sort(descending=True).indices
        assert draft[i] == int(order[tree.ranks[i]]), f"node {i}"


def brute_force_eagle2(target, source, tree: DynamicTree) -> dict[tuple[int, ...], float]:
    """Every kept path (draft ids) of EAGLE-2 with its score, computed from chain runs in plain Python."""
    to_target = (lambda t: t) if source.drafter.draft_to_target is None else \
        (lambda t: int(source.drafter.draft_to_target[t]))  # fmt: skip
    root = chain_log_probs(target, source, [])
    values, ids = root.topk(tree.top_k)
    candidates = [((int(t),), float(v)) for v, t in zip(values, ids)]  # (path of draft ids, score), in order
    frontier = list(candidates)
    for _ in range(2, tree.depth + 1):
        children = []
        for path, score in frontier:
            values, ids = chain_log_probs(target, source, [to_target(t) for t in path]).topk(tree.top_k)
            children += [(path + (int(t),), score + min(float(v), 0.0)) for v, t in zip(values, ids)]
        candidates += children
        frontier = sorted(children, key=lambda c: -c[1])[: tree.top_k]  # sorted() is stable: ties keep order
    kept = sorted(candidates, key=lambda c: -c[1])[: tree.total_tokens]
    return dict(kept)


@pytest.mark.parametrize("tree", [DynamicTree(total_tokens=7, depth=3, top_k=3),
                                  DynamicTree(total_tokens=20, depth=4, top_k=2)])
def test_dynamic_tree_is_brute_force_eagle2(setup, tree):
    target, source = setup
    proposal = started(target, source).propose_tree(PROMPT[:, -1:], tree, GREEDY, None)
    parents = proposal.parents[0].tolist()
    check_tree(proposal.parents, proposal.tokens)
    assert proposal.tokens.shape[1] == min(tree.total_tokens, tree.num_nodes)
    draft = draft_ids(source, proposal.tokens[0]).tolist()
    paths = {tuple(draft[j] for j in path_to(i, parents)) for i in range(len(parents))}
    expected = brute_force_eagle2(target, source, tree)
    assert paths == set(expected)
    depths = [len(path_to(i, parents)) for i in range(len(parents))]
    assert depths == sorted(depths)  # topological: by depth


def test_a_chain_tree_is_the_chain(setup):
    target, source = setup
    tree = started(target, source).propose_tree(PROMPT[:, -1:], StaticTree.chain(4), GREEDY, None)
    chain = started(target, type(source)(source.drafter)).propose(PROMPT[:, -1:], 4, GREEDY, None)
    assert torch.equal(tree.tokens, chain.tokens)


def test_after_a_tree_the_source_goes_on_as_after_a_chain(setup):
    """propose_tree, then commit of an accepted path: the next proposal equals that of a source that drafted a
    chain and committed the same tokens."""
    target, source = setup
    tree_source = started(target, source)
    proposal = tree_source.propose_tree(PROMPT[:, -1:], NAMED_TREES["eagle2-small"], GREEDY, None)
    parents = proposal.parents[0].tolist()
    deepest = max(range(len(parents)), key=lambda i: len(path_to(i, parents)))
    path = proposal.tokens[0, path_to(deepest, parents)][None]
    kept = torch.cat([PROMPT[:, -1:], path], dim=1)  # as if the target accepted this path
    full = torch.cat([PROMPT, path], dim=1)
    out = target(full).slice(slice(PROMPT.shape[1] - 1, full.shape[1]))
    chain_source = started(target, type(source)(source.drafter))
    chain_source.propose(PROMPT[:, -1:], 3, GREEDY, None)
    for src in (tree_source, chain_source):
        src.commit(kept, out)
    nxt = torch.tensor([[11]])
    a = tree_source.propose(nxt, 3, GREEDY, None)
    b = chain_source.propose(nxt, 3, GREEDY, None)
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(a.probs, b.probs)


def test_greedy_tree_decoding_is_plain_greedy_decoding(setup):
    target, source = setup
    for spec in ("eagle2:total_tokens=10,depth=4,top_k=3", "medusa-16"):
        for prompt in (PROMPT, PROMPT[:, :4]):
            expected = plain_decode(target, prompt, max_new_tokens=20).tokens
            assert speculative_decode(target, TreeDrafting(source, parse_tree(spec)), prompt, k=6,
                                      max_new_tokens=20).tokens == expected  # fmt: skip


def test_bad_calls(setup):
    target, source = setup
    with pytest.raises(SpecdraftError, match="one prompt at a time"):
        started(target, source).propose_tree(torch.tensor([[1], [2]]), StaticTree.chain(2), GREEDY, None)
    with pytest.raises(SpecdraftError, match="StaticTree or a DynamicTree"):
        started(target, source).propose_tree(PROMPT[:, -1:], "medusa-63", GREEDY, None)
