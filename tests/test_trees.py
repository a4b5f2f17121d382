"""Tree speculative decoding through the decoder: tree specs, the tree attention mask on a transformers
target, the cache keeping exactly the accepted path, greedy output identical to plain decoding for
every tree drafter, sampled output following the target, and bad input.

The tree verifier itself (greedy and lossless sampling walks, the Triton kernel) is tested in
tests/test_tree_verify.py; EAGLE's tree drafting in tests/test_eagle_trees.py.
"""

import pytest
import torch
from test_medusa import build as build_medusa
from test_medusa import random_ids
from test_medusa import tiny_target as medusa_target
from tiny import seeded_init_, tiny_llama
from transformers import DynamicCache

from specdraft.contract import DraftCapabilities, Proposal
from specdraft.decoding.kv_cache import preallocated_cache
from specdraft.decoding.sampling import SamplingParams
from specdraft.decoding.sources import PromptLookupSource
from specdraft.decoding.kv_cache import keep_slots
from specdraft.decoding.speculative import TreeDrafting, plain_decode, speculative_decode
from specdraft.decoding.trees import (
    MEDUSA_63,
    NAMED_TREES,
    DynamicTree,
    StaticTree,
    ancestor_matrix,
    check_tree,
    parse_tree,
    path_to,
    tree_attention_mask,
    tree_depths,
)
from specdraft.errors import SpecdraftError
from specdraft.target import FrozenTarget

VOCAB = 64


@pytest.fixture(scope="module")
def target():
    model = tiny_llama(VOCAB, hidden_size=32, intermediate_size=64, max_position_embeddings=128)
    seeded_init_(model, seed=0, std=0.4)
    return FrozenTarget(model)


# -- tree specs ---------------------------------------------------------------------------------------------


def test_medusa_63_is_the_published_tree_and_the_named_trees_are_closed_under_prefixes():
    tree = NAMED_TREES["medusa-63"]
    assert tree.num_nodes == 63 == len(MEDUSA_63) and tree.depth == 4
    assert [tree.top_k_at_depth(d) for d in (1, 2, 3, 4)] == [10, 10, 10, 2]
    for name, named in NAMED_TREES.items():
        if isinstance(named, StaticTree):
            check_tree(torch.tensor(named.parents))
            assert all(p[:-1] in named.choices for p in named.choices if len(p) > 1), name
            assert tree_depths(torch.tensor(named.parents)).tolist() == named.depths
    assert [NAMED_TREES[n].num_nodes for n in ("medusa-8", "medusa-16")] == [8, 16]
    assert StaticTree.chain(3).parents == [-1, 0, 1]
    assert tree.limited(2).num_nodes == sum(len(p) <= 2 for p in MEDUSA_63)


def test_parse_tree():
    assert parse_tree("medusa-16") is NAMED_TREES["medusa-16"]
    assert parse_tree("chain-4") == StaticTree.chain(4)
    assert parse_tree("eagle2:total_tokens=8,top_k=3") == DynamicTree(total_tokens=8, depth=6, top_k=3)
    with pytest.raises(SpecdraftError, match="unknown tree"):
        parse_tree("medusa-64")
    with pytest.raises(SpecdraftError, match="bad dynamic tree field"):
        parse_tree("eagle2:width=3")


def test_ancestors_and_depths_match_walking_up_the_parents():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 17, 63):
        parents = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]
        ancestors = ancestor_matrix(torch.tensor(parents))
        for i in range(n):
            assert set(ancestors[i].nonzero().flatten().tolist()) == set(path_to(i, parents))
        assert tree_depths(torch.tensor(parents)).tolist() == [len(path_to(i, parents)) for i in range(n)]


@pytest.mark.parametrize(
    "parents, tokens, match",
    [
        ([-1, 2, 0], None, "comes before"),  # node 1's parent comes after it
        ([-1, 1], None, "comes before"),  # its own parent: a cycle
        ([-1, 0, 5], None, "out of range"),
        ([-1, -2], None, "out of range"),
        ([-1, 0, 0], [3, 4, 4], "same token"),  # duplicate siblings
    ],
)
def test_malformed_trees_are_refused(parents, tokens, match):
    with pytest.raises(SpecdraftError, match=match):
        check_tree(torch.tensor(parents), None if tokens is None else torch.tensor(tokens))


def test_bad_tree_specs_are_refused():
    with pytest.raises(SpecdraftError, match="total_tokens >= 1"):
        DynamicTree(total_tokens=0)
    with pytest.raises(SpecdraftError, match="has no parent"):
        StaticTree(((0,), (1, 0)))
    with pytest.raises(SpecdraftError, match="appears twice"):
        StaticTree(((0,), (0,)))
    with pytest.raises(SpecdraftError, match="ranks >= 0"):
        StaticTree(((0,), (0, -1)))
    with pytest.raises(SpecdraftError, match="drafts chains only"):
        TreeDrafting(PromptLookupSource(), NAMED_TREES["medusa-8"])
    target, drafter = medusa_setup()
    with pytest.raises(SpecdraftError, match="static trees, not dynamic"):
        TreeDrafting(drafter.draft_source(target), DynamicTree())


# -- the tree forward and the cache ---------------------------------------------------------------------------


def random_tree(n: int, seed: int) -> tuple[list[int], torch.Tensor]:
    """n nodes, each the child of the node before it half the time (deep trees), else of a random earlier one."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1]
    for i in range(1, n):
        chain = bool(torch.rand(1, generator=g) < 0.5)
        parents.append(i - 1 if chain else int(torch.randint(-1, i, (1,), generator=g)))
    return parents, torch.randint(0, VOCAB, (n,), generator=g)


def test_tree_attention_gives_each_node_its_own_paths_logits(target):
    """One forward over [pending, tree] with the tree mask and depth positions, on a cache holding the prompt,
    gives at every node the logits of running prompt + pending + that node's path as a plain sequence."""
    prompt, pending = random_ids(1, 9, seed=3) % VOCAB, torch.tensor([[7]])
    for seed, n in enumerate((1, 6, 12)):
        parents, tokens = random_tree(n, seed)
        cache = DynamicCache(config=target.config)
        target(prompt, past_key_values=cache, use_cache=True, logits="none")
        ancestors = ancestor_matrix(torch.tensor(parents))
        positions = prompt.shape[1] + torch.cat([torch.zeros(1, dtype=torch.long), ancestors.sum(1)])
        out = target(torch.cat([pending, tokens[None]], 1), attention_mask=tree_attention_mask(ancestors, prompt.shape[1]),
                     position_ids=positions[None], past_key_values=cache, use_cache=True)  # fmt: skip
        for node in range(-1, n):
            path = path_to(node, parents)
            alone = target(torch.cat([prompt, pending, tokens[path][None]], 1)).logits[0, -1]
            # float32 rounding of the same sums in another order (measured 7e-6 here; a wrong mask gives O(1))
            torch.testing.assert_close(out.logits[0, node + 1], alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["dynamic", "preallocated"])
def test_the_cache_keeps_exactly_the_accepted_path(target, kind):
    """After keep_slots keeps the pending token and a path, the next token's logits equal those of a fresh forward
    over the kept text,
    for paths that are and are not a prefix of the node order, on transformers' cache and on specdraft's
    preallocated one (sized too small, so it also grows on the way)."""
    prompt, pending = random_ids(1, 8, seed=4) % VOCAB, torch.tensor([[5]])
    parents = [-1, -1, 0, 1, 3, 2, 4]
    tokens = torch.tensor([11, 12, 13, 14, 15, 16, 17])
    for last in (-1, 0, 2, 5, 6):
        path = path_to(last, parents)
        cache = DynamicCache(config=target.config) if kind == "dynamic" else preallocated_cache(target.config, 10)
        target(prompt, past_key_values=cache, use_cache=True, logits="none")
        ancestors = ancestor_matrix(torch.tensor(parents))
        positions = prompt.shape[1] + torch.cat([torch.zeros(1, dtype=torch.long), ancestors.sum(1)])
        target(torch.cat([pending, tokens[None]], 1), attention_mask=tree_attention_mask(ancestors, prompt.shape[1]),
               position_ids=positions[None], past_key_values=cache, use_cache=True, logits="none")  # fmt: skip
        keep_slots(cache, prompt.shape[1], [[0] + [node + 1 for node in path]], 1 + len(tokens))
        assert cache.get_seq_length() == prompt.shape[1] + 1 + len(path)
        nxt = torch.tensor([[3]])
        cached = target(nxt, past_key_values=cache, use_cache=True).logits[0, -1]
        fresh = target(torch.cat([prompt, pending, tokens[path][None], nxt], 1)).logits[0, -1]
        torch.testing.assert_close(cached, fresh, atol=1e-4, rtol=1e-4)


# -- decoding with trees --------------------------------------------------------------------------------------


class OracleTreeSource(PromptLookupSource):
    """Random trees in which one random branch spells the target's greedy continuation (known in advance) for a
    random number of tokens: accepted paths of every length, at every place in the node order."""

    capabilities = DraftCapabilities(tree_kinds=("static",))

    def __init__(self, continuation: list[int], depth: int, seed: int):
        super().__init__()
        self.continuation, self.depth, self.g = continuation, depth, torch.Generator().manual_seed(seed)

    def start(self, prompt_ids, target_out):
        super().start(prompt_ids, target_out)
        self.done = 0  # emitted tokens committed so far, pending excluded

    def propose_tree(self, pending, tree, params, generator):
        n = int(torch.randint(1, 12, (1,), generator=self.g))
        parents, tokens = random_tree(n, int(torch.randint(0, 10**6, (1,), generator=self.g)))
        # keep depth <= the decoder's limit (only the tree's depth is used), re-rooting nodes that are too deep
        depths = tree_depths(torch.tensor(parents)).tolist()
        parents = [p if d <= tree.depth else -1 for p, d in zip(parents, depths)]
        depths = tree_depths(torch.tensor(parents))
        deepest = bool(torch.rand(1, generator=self.g) < 0.5)
        leaf = int(depths.argmax()) if deepest else int(torch.randint(0, n, (1,), generator=self.g))
        right = int(torch.randint(0, self.depth + 1, (1,), generator=self.g))
        start = self.done + 1  # the pending token is continuation[self.done]
        for j, node in enumerate(path_to(leaf, parents)[:right]):
            if start + j < len(self.continuation):
                tokens[node] = self.continuation[start + j]
        tokens = dedupe_siblings(parents, tokens)
        return Proposal(tokens[None], None, torch.tensor(parents)[None])

    def commit(self, kept_ids, target_out):
        self.done += kept_ids.shape[1]


def dedupe_siblings(parents, tokens):
    seen = set()
    for i, p in enumerate(parents):
        while (p, int(tokens[i])) in seen:
            tokens[i] = (tokens[i] + 1) % VOCAB
        seen.add((p, int(tokens[i])))
    return tokens


def test_greedy_tree_decoding_is_plain_greedy_decoding(target):
    accepted = []
    for seed in range(6):
        prompt = random_ids(1, 6, seed=20 + seed) % VOCAB
        plain = plain_decode(target, prompt, max_new_tokens=40).tokens
        source = TreeDrafting(OracleTreeSource(plain, depth=5, seed=seed), StaticTree.chain(5))
        out = speculative_decode(target, source, prompt, k=5, max_new_tokens=40)
        assert out.tokens == plain
        accepted += [s.num_accepted for s in out.steps]
        assert all(s.depth is not None and s.num_accepted <= s.depth <= 5 for s in out.steps)
    assert {0, 1, 2, 3, 4, 5} <= set(accepted)  # every path length was accepted somewhere


def test_compiled_tree_verify_decodes_as_the_eager_one(target):
    """compile_target with trees: each verify runs as wide as the tree's nodes + 1, compiled over a static cache
    under the tree's mask; random trees of 1 to 11 nodes (padded steps) whose accepted paths sit anywhere in
    the node order (keys moved into place in the static buffers). The same tokens and accepted paths as the
    eager tree decode."""
    tree = StaticTree(((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)) + tuple((i,) for i in range(1, 8)))
    for seed in range(3):
        prompt = random_ids(1, 6, seed=20 + seed) % VOCAB
        plain = plain_decode(target, prompt, max_new_tokens=40).tokens
        eager, compiled = (speculative_decode(target, TreeDrafting(OracleTreeSource(plain, depth=5, seed=seed), tree),
                                              prompt, k=5, max_new_tokens=40, compile_target=mode)
                           for mode in (False, True))  # fmt: skip
        assert compiled.tokens == eager.tokens == plain
        assert [s.num_accepted for s in compiled.steps] == [s.num_accepted for s in eager.steps]
        assert any(s.num_accepted > 0 for s in compiled.steps)


def medusa_setup():
    target = medusa_target(std=0.5)
    return target, build_medusa(target, randomize=False, num_heads=4)


@pytest.mark.parametrize("tree", ["medusa-8", "medusa-63", "chain-3"])
def test_medusa_greedy_tree_decoding_is_the_targets_own(tree):
    """Identical to transformers' generate(), not only to specdraft's own plain decoding."""
    from test_speculative import hf_greedy

    target, drafter = medusa_setup()
    for seed in range(3):
        prompt = random_ids(1, 6, seed=10 + seed)
        plain = plain_decode(target, prompt, max_new_tokens=40).tokens
        assert hf_greedy(target.model, prompt, 40) == plain
        source = TreeDrafting(drafter.draft_source(target), parse_tree(tree))
        out = speculative_decode(target, source, prompt, k=5, max_new_tokens=40)
        assert out.tokens == plain
        assert max(s.num_drafted for s in out.steps) == parse_tree(tree).num_nodes


def test_medusa_tree_nodes_are_the_heads_ranked_tokens():
    target, drafter = medusa_setup()
    source = drafter.draft_source(target)
    prompt = random_ids(1, 6, seed=1)
    source.start(prompt, target(prompt))
    tree = NAMED_TREES["medusa-63"]
    proposal = source.propose_tree(prompt[:, -1:], tree, SamplingParams(), None)
    logits = drafter.head_logits(source.last_hidden, 4)[0]
    order = logits.sort(dim=-1, descending=True).indices  # float logits: no ties
    expected = [int(order[len(path) - 1, path[-1]]) for path in tree.choices]
    assert proposal.tokens[0].tolist() == expected and proposal.parents[0].tolist() == tree.parents
    with pytest.raises(SpecdraftError, match="static trees"):
        source.propose_tree(prompt[:, -1:], DynamicTree(), SamplingParams(), None)


def test_mlp_speculator_greedy_tree_decoding_is_the_targets_own():
    from test_mlp_speculator import tiny_target as mlp_target
    from test_mlp_speculator import train_on_own_greedy_text

    target = mlp_target()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, target.vocab_size, (1, 6), generator=g) for _ in range(12)]
    drafter = train_on_own_greedy_text(target, prompts, steps=15, n_predict=3, inner_dim=64)
    chain_tau, tree_tau = [], []
    for prompt in prompts[:4]:
        expected = plain_decode(target, prompt, max_new_tokens=40).tokens
        tree = speculative_decode(target, TreeDrafting(drafter.draft_source(target), NAMED_TREES["medusa-16"]),
                                  prompt, k=3, max_new_tokens=40)  # fmt: skip
        chain = speculative_decode(target, drafter.draft_source(target), prompt, k=3, max_new_tokens=40)
        assert tree.tokens == expected == chain.tokens
        tree_tau += [s.num_accepted + 1 for s in tree.steps]
        chain_tau += [s.num_accepted + 1 for s in chain.steps]
    # a tree holding the chain's path as its rank-0 branch accepts at least as much per step
    assert sum(tree_tau) / len(tree_tau) >= sum(chain_tau) / len(chain_tau)


def test_a_tree_deeper_than_k_is_refused(target):
    class TooDeep(PromptLookupSource):
        capabilities = DraftCapabilities(tree_kinds=("static",))

        def propose_tree(self, pending, tree, params, generator):
            return Proposal(torch.tensor([[1, 2, 3]]), None, torch.tensor([[-1, 0, 1]]))

    with pytest.raises(SpecdraftError, match="3 deep, asked for at most 2"):
        speculative_decode(target, TreeDrafting(TooDeep(), StaticTree.chain(5)), random_ids(1, 5, seed=0) % VOCAB, k=2)


def test_a_malformed_tree_from_a_source_is_refused(target):
    class Duplicates(PromptLookupSource):
        capabilities = DraftCapabilities(tree_kinds=("static",))

        def propose_tree(self, pending, tree, params, generator):
            return Proposal(torch.tensor([[4, 4]]), None, torch.tensor([[-1, -1]]))

    with pytest.raises(SpecdraftError, match="same token"):
        speculative_decode(target, TreeDrafting(Duplicates(), StaticTree.chain(5)), random_ids(1, 5, seed=0) % VOCAB, k=2)


def test_typical_acceptance_over_a_tree_runs():
    """Medusa's typical acceptance (LOSSY) over a tree: the deepest typical path is kept, never deeper than the
    tree, and the budget is met (its statistics are not the target's, so only its bookkeeping is checked)."""
    target, drafter = medusa_setup()
    prompt = random_ids(1, 6, seed=3)
    source = TreeDrafting(drafter.draft_source(target), NAMED_TREES["medusa-16"])
    out = speculative_decode(target, source, prompt, k=5, max_new_tokens=30, params=SamplingParams(temperature=1.0),
                             typical_acceptance=True, generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert len(out.tokens) == 30 and all(s.num_accepted <= s.depth for s in out.steps)


# -- sampling with trees: the output follows the target -------------------------------------------------------


class SampledChildrenSource(PromptLookupSource):
    """Sampled tree nodes, each drawn from its own q (SpecInfer's case): the root's two children from q's on the
    even and on the odd tokens (disjoint supports, so siblings never repeat a token), and one grandchild under
    each from a q on every token. The q's are fixed random distributions, unrelated to p."""

    capabilities = DraftCapabilities(tree_kinds=("static",))

    def __init__(self, vocab: int, device: str = "cpu"):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        logits = torch.randn(3, vocab, generator=g)
        even = torch.arange(vocab) % 2 == 0
        logits[0, ~even] = float("-inf")
        logits[1, even] = float("-inf")
        self.q = logits.softmax(-1).to(device)  # q_even, q_odd, q_all

    def propose_tree(self, pending, tree, params, generator):
        parents = [-1, -1, 0, 1][: 2 if tree.depth < 2 else 4]
        q = self.q[[0, 1, 2, 2][: len(parents)]]
        tokens = torch.multinomial(q, 1, generator=generator).flatten()
        return Proposal(tokens[None], q[None], torch.tensor(parents, device=q.device)[None])


def sampled_tree_scenario(make_source, tree, target, num_runs: int):
    from test_decode_statistics import PROMPT, SAMPLED, exact_marginals
    from test_verify_statistics import l1_check

    tokens, steps = [], []
    for seed in range(num_runs):
        out = speculative_decode(target, TreeDrafting(make_source(), tree), PROMPT, k=tree.depth,
                                 params=SAMPLED, max_new_tokens=3, generator=torch.Generator().manual_seed(seed))
        tokens.append(out.tokens)
        steps += out.steps
    tokens = torch.tensor(tokens)
    p2, p3 = exact_marginals(target, SAMPLED, PROMPT)
    checks = [l1_check("2nd token vs exact marginal", tokens[:, 1], p2),
              l1_check("3rd token vs exact marginal", tokens[:, 2], p3)]
    return checks, steps


def test_sampled_children_tree_decoding_emits_the_target_marginals():
    from test_decode_statistics import draft_lm_models
    from test_verify_statistics import assert_all_pass

    target, _ = draft_lm_models()
    checks, steps = sampled_tree_scenario(lambda: SampledChildrenSource(target.vocab_size), StaticTree.chain(2),
                                          target, 400)
    assert_all_pass(checks)
    accepted = [s.num_accepted for s in steps]
    assert 0 in accepted and 1 in accepted and 2 in accepted  # rejections, and both depths accepted


def test_medusa_static_tree_sampling_emits_the_target_marginals():
    """Deterministic top-k children (q one-hot) at T = 1: each child is tried against the residual of p."""
    from test_decode_statistics import small_llama
    from test_verify_statistics import assert_all_pass

    target = FrozenTarget(small_llama(std=0.2))
    drafter = build_medusa(target, randomize=False, num_heads=2)  # heads start as the target's own head
    tree = StaticTree(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0)))
    checks, steps = sampled_tree_scenario(lambda: drafter.draft_source(target), tree, target, 400)
    assert_all_pass(checks)
    accepted = [s.num_accepted for s in steps]
    assert 0 in accepted and 1 in accepted
