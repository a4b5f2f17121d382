"""verify_tree: hand-worked trees, the chain case equals the chain verify, the Triton kernel == the
torch reference token for token, the emitted tokens follow the target, and bad inputs are refused."""

import pytest
import torch
from kernel_device import on_kernel_device
from test_verify_statistics import assert_all_pass, l1, l1_check

from specdraft.decoding import tree_verify
from specdraft.decoding.sampling import draw_exponentials, draw_uniforms, sample, sample_with_exponentials
from specdraft.decoding.tree_verify import TreeVerifyInputs, verify_tree, verify_tree_reference
from specdraft.decoding.verify import VerifyInputs, verify_reference
from specdraft.errors import SpecdraftError

verify_tree_triton = on_kernel_device(tree_verify.verify_tree_triton)
IMPLS = {"reference": verify_tree_reference, "triton": verify_tree_triton}


def run(impl, tokens, parents, counts, q, p, uniforms, exps, greedy, max_depth, **kwargs):
    """Call one implementation with plain Python lists for the small hand-worked cases."""
    t = torch.tensor
    return IMPLS[impl](TreeVerifyInputs(
        t(tokens, dtype=torch.long), t(parents, dtype=torch.long), t(counts, dtype=torch.long).cumsum(0),
        None if q is None else t(q, dtype=torch.float32), t(p, dtype=torch.float32),
        t(uniforms, dtype=torch.float32), t(exps, dtype=torch.float32), t(greedy, dtype=torch.bool),
        max_depth), **kwargs,
    )


def check(result, output, accepted_nodes, num_accepted):
    assert result[0].tolist() == output
    assert result[1].tolist() == accepted_nodes
    assert result[2].tolist() == num_accepted


# ---------------------------------------------------------------- hand-worked trees

# Five-token vocabulary. Tree:  root -> node 0 (token 3) -> node 2 (token 2)
#                                     -> node 1 (token 1) -> node 3 (token 4)
#                                                         -> node 4 (token 0)
PARENTS = [-1, -1, 0, 1, 1]
TOKENS = [3, 1, 2, 4, 0]


def onehot_rows(*argmaxes, vocab=5):
    """Target rows that peak at the given tokens (argmax), with a little mass elsewhere."""
    rows = []
    for a in argmaxes:
        row = [0.1] * vocab
        row[a] = 1 - 0.1 * (vocab - 1)
        rows.append(row)
    return rows


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_follows_the_argmax_child_not_the_first(impl):
    # p at root peaks at 1 -> node 1 (the second child); p after node 1 peaks at 0 -> node 4 (its
    # second child); p after node 4 peaks at 2, and node 4 is a leaf -> final token 2.
    p = onehot_rows(1, 0, 0, 0, 0, 2)  # root, then after nodes 0..4
    result = run(impl, TOKENS, PARENTS, [5], None, p, [0.5] * 5, [[1.0] * 5], [True], 3)
    check(result, [[1, 0, 2, -1]], [[1, 4, -1]], [2])


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_without_matching_child_emits_the_argmax(impl):
    # Root peaks at 3 -> node 0; after node 0 p peaks at 4 but its only child is token 2.
    p = onehot_rows(3, 4, 0, 0, 0, 0)
    result = run(impl, TOKENS, PARENTS, [5], None, p, [0.0] * 5, [[1.0] * 5], [True], 3)
    check(result, [[3, 4, -1, -1]], [[0, -1, -1]], [1])


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_argmax_tie_goes_to_lowest_id(impl):
    # Root p ties tokens 1 and 3: argmax is 1, so node 1 (token 1) is taken, not node 0 (token 3).
    p = [[0.1, 0.35, 0.1, 0.35, 0.1]] + onehot_rows(0, 0, 0, 0, 0)
    result = run(impl, TOKENS, PARENTS, [5], None, p, [0.0] * 5, [[1.0] * 5], [True], 3)
    check(result, [[1, 0, 0, -1]], [[1, 4, -1]], [2])


@pytest.mark.parametrize("impl", IMPLS)
def test_sampled_sibling_is_tested_against_the_renormalised_residual(impl):
    # Root p = [.5, .3, .2, 0], children tokens 0 and 1 (one-hot q).
    # Child 0: u = .6, .6 * (1 * 1) = .6 >= .5 rejects; r = [0, .3, .2, 0], m = .5.
    # Child 1: u = .55, .55 * (.5 * 1) = .275 < .3 accepts: p'(1) = .3 / .5 = .6 > .55, although
    # p(1) = .3 < .55 (a test against p instead of the residual would reject it).
    p = [[0.5, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]]
    result = run(impl, [0, 1], [-1, -1], [2], None, p, [0.6, 0.55], [[1.0] * 4], [False], 1)
    check(result, [[1, 2]], [[1]], [1])
    # u = .7 for child 1: .35 >= .3 rejects too; r = [0, 0, .2, 0] leaves only token 2.
    result = run(impl, [0, 1], [-1, -1], [2], None, p, [0.6, 0.7], [[0.01, 0.01, 5.0, 0.01]], [False], 1)
    check(result, [[2, -1]], [[-1]], [0])


@pytest.mark.parametrize("impl", IMPLS)
def test_sampled_rejection_with_draft_probs_subtracts_the_scaled_draft(impl):
    # Root p = [.4, .6, 0], q = [.5, 0, .5] for both children (token 0, then token 2).
    # Child 0: u = .99, .99 * (1 * .5) >= .4 rejects; r = max(0, p - q) = [0, .6, 0], m = .6.
    # Child 1 (token 2): r(2) = 0 never accepts; r = max(0, r - .6 q) = [0, .6, 0] -> token 1,
    # although the race's noise favours tokens 0 and 2 (a race over p would pick 0).
    p = [[0.4, 0.6, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    q = [[0.5, 0.0, 0.5], [0.5, 0.0, 0.5]]
    result = run(impl, [0, 2], [-1, -1], [2], q, p, [0.99, 0.0], [[0.01, 1.0, 0.01]], [False], 1)
    check(result, [[1, -1]], [[-1]], [0])


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_residual_races_over_p(impl):
    # Root p = q = [0, 1, 0] and the child is token 2, which both give 0: u * (1 * 0) < 0 is false,
    # so it is rejected, yet r = max(0, p - q) = 0 everywhere. The race runs over p -> token 1.
    p = [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    result = run(impl, [2], [-1], [1], [[0.0, 1.0, 0.0]], p, [0.5], [[1.0, 1.0, 1.0]], [False], 1)
    check(result, [[1, -1]], [[-1]], [0])


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_without_nodes_and_an_empty_batch(impl):
    # Row 0 (sampled): root only; row 1 (greedy): root, node 0; row 2 (greedy): root only.
    p = [[0.2, 0.8], [0.9, 0.1], [0.3, 0.7], [0.6, 0.4]]
    result = run(impl, [0], [-1], [0, 1, 0], None, p, [0.5], [[1.0, 1.0]] * 3, [False, True, True], 2)
    check(result, [[1, -1, -1], [0, 1, -1], [0, -1, -1]], [[-1, -1], [0, -1], [-1, -1]], [0, 1, 0])
    empty = IMPLS[impl](TreeVerifyInputs(
        torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), None,
        torch.zeros(0, 4), torch.zeros(0), torch.ones(0, 4), torch.zeros(0, dtype=torch.bool), 2,
    ))
    assert [tuple(t.shape) for t in empty] == [(0, 3), (0, 2), (0,)]


def test_verify_tree_dispatches_to_reference_on_cpu():
    inputs = make_inputs(seed=1, trees=[[-1, 0, -1], [-1]], vocab=20, greedy=[False, True], with_draft_probs=True)
    out = verify_tree(TreeVerifyInputs(*inputs, max_depth=2))
    ref = verify_tree_reference(TreeVerifyInputs(*inputs, max_depth=2))
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_triton_on_cpu_without_the_interpreter_names_the_fix(monkeypatch):
    inputs = make_inputs(seed=1, trees=[[-1]], vocab=8, greedy=[False], with_draft_probs=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for call in (lambda: tree_verify.verify_tree_triton(TreeVerifyInputs(*inputs, max_depth=1)),
                 lambda: verify_tree(TreeVerifyInputs(*inputs, max_depth=1), backend="triton")):
        with pytest.raises(SpecdraftError, match="TRITON_INTERPRET=1.*verify_tree_reference"):
            call()
    metadata = TreeVerifyInputs(*inputs, max_depth=1)
    assert all(torch.equal(a, b) for a, b in zip(verify_tree(metadata, backend="reference"),
                                                 verify_tree_reference(metadata)))


@pytest.mark.parametrize("block_v", [64, 3, 8192, None])
def test_block_v_outside_the_race_free_range_names_the_range(block_v):
    inputs = make_inputs(seed=1, trees=[[-1, 0]], vocab=300, greedy=[False], with_draft_probs=True)
    if block_v is None:  # the default is in range
        assert verify_tree_triton(TreeVerifyInputs(*inputs, max_depth=2))[2].shape == (1,)
        return
    with pytest.raises(SpecdraftError, match=r"block_v must be a power of two in \[128, 4096\]"):
        verify_tree_triton(TreeVerifyInputs(*inputs, max_depth=2), block_v=block_v)


# ---------------------------------------------------------------- random trees, kernel == reference


def random_parents(g, kind, n):
    """Row-local parents in topological order: a chain, a bushy tree, or an arbitrary one."""
    if kind == "chain":
        return list(range(-1, n - 1))
    if kind == "bushy":  # wide and shallow: each node hangs off the root or one of the first few nodes
        return [int(torch.randint(-1, min(i, 3), (1,), generator=g)) for i in range(n)]
    return [int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)]


def make_inputs(seed, trees, vocab, greedy, with_draft_probs, dtype=torch.float32):
    """Random tree-verify inputs: children are the parent's likeliest tokens under a noisy copy of the
    target (so paths get accepted), with the edge ids 0 and V-1 often among them."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor([len(t) for t in trees], dtype=torch.long)
    batch, num_nodes = len(trees), int(counts.sum())
    logits = torch.randn(num_nodes + batch, vocab, generator=g) * 2
    logits[0::3, vocab - 1] += 6  # the tail of the last BLOCK_V chunk
    logits[1::3, 0] += 6
    p = logits.softmax(-1)
    noisy = logits + 0.7 * torch.randn(num_nodes + batch, vocab, generator=g)
    tokens, parents, q_rows = [], [], []
    root = 0  # target_probs row of the current tree's root
    for tree in trees:
        first = len(tokens)  # flat index of the tree's node 0
        for i, parent in enumerate(tree):
            parent_row = root + 1 + parent  # the target row of the node's parent (root if -1)
            draft = noisy[parent_row].clone()
            for k in range(i):  # siblings before it are taken: draw without replacement
                if tree[k] == parent:
                    draft[tokens[first + k]] = float("-inf")
            q = draft.softmax(-1)
            tokens.append(int(draft.argmax()) if torch.rand(1, generator=g) < 0.6 else int(sample(q, g)))
            parents.append(parent)
            q_rows.append(q)
        root += len(tree) + 1
    tokens = torch.tensor(tokens, dtype=torch.long)
    draft_probs = torch.stack(q_rows).to(dtype) if with_draft_probs and num_nodes else None
    if with_draft_probs and not num_nodes:
        draft_probs = torch.zeros(0, vocab, dtype=dtype)
    exps = torch.empty(batch, vocab).exponential_(generator=g)
    exps[0, vocab - 1] = 1e-30  # let the race's winner land on the edge ids too
    exps[-1, 0] = 1e-30
    return (
        tokens, torch.tensor(parents, dtype=torch.long), counts.cumsum(0), draft_probs, p.to(dtype),
        torch.rand(num_nodes, generator=g), exps, torch.tensor(greedy, dtype=torch.bool),
    )


def random_case(seed):
    """A small batch of mixed trees (0..7 nodes), vocab 37 or 300, greedy and sampled rows."""
    g = torch.Generator().manual_seed(1000 + seed)
    kinds = ["chain", "bushy", "any"]
    trees = []
    for r in range(3 + seed % 2):
        n = [0, 1, 7, 5, 3, 6][(seed + 2 * r) % 6]
        trees.append(random_parents(g, kinds[(seed + r) % 3], n))
    greedy = [bool((seed + r) % 3 == 0) for r in range(len(trees))]
    vocab = [37, 300][seed % 2]
    return trees, greedy, vocab


def depth_of(tree):
    depth = []
    for parent in tree:
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return max(depth, default=0)


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_kernel_matches_reference_on_random_trees(with_draft_probs):
    """50 batches; V = 300 ones over 1 to 3 vocabulary splits (chunks of 128, or 256 in one split)."""
    seen = dict(accepted=0, rejected_root=0, deep=0, edge=0, greedy_accepted=0, split=0)
    for seed in range(50):
        trees, greedy, vocab = random_case(seed)
        dtype = torch.bfloat16 if seed % 10 == 5 else torch.float32  # half-precision probs: same tokens
        inputs = make_inputs(seed, trees, vocab, greedy, with_draft_probs, dtype=dtype)
        max_depth = max(depth_of(t) for t in trees) + seed % 2  # sometimes a slot of pure padding
        ref = verify_tree_reference(TreeVerifyInputs(*inputs, max_depth=max_depth))
        num_splits = [1, 2, 3][seed // 2 % 3]
        out = verify_tree_triton(TreeVerifyInputs(*inputs, max_depth=max_depth),
                                 block_v=256 if num_splits == 1 else 128, num_splits=num_splits)  # fmt: skip
        for name, a, b in zip(("tokens", "accepted_nodes", "num_accepted"), out, ref):
            assert torch.equal(a, b), (seed, name, a, b)
        n = ref[2]
        seen["accepted"] += int(n.sum())
        seen["greedy_accepted"] += int(n[inputs[-1]].sum())
        seen["rejected_root"] += int(((n == 0) & (torch.tensor([len(t) for t in trees]) > 0)).sum())
        seen["deep"] += int((n >= 2).sum())
        seen["edge"] += int(((ref[0] == 0) | (ref[0] == vocab - 1)).sum())
        seen["split"] += int(vocab > 128 and num_splits > 1)
    assert all(v > 0 for v in seen.values()), seen


@pytest.mark.parametrize("greedy", [True, False])
def test_winners_on_either_side_of_a_split_boundary(greedy):
    """V = 300 in 3 splits of 128. The final token's argmax (greedy) or race winner (random, after the root's
    one child is rejected and zeroed) on the first or last id of a split is found, whichever split holds it."""
    vocab = 300
    for winner in (0, 127, 128, 255, 256, 299):
        p = torch.full((2, vocab), 0.5 / (vocab - 1))
        p[0, winner] = 0.5
        exps = torch.ones(1, vocab)
        exps[0, winner] = 0.01
        child = (winner + 1) % vocab  # never the root's argmax: greedy rejects it too
        args = (torch.tensor([child]), torch.tensor([-1]), torch.tensor([1]), None, p, torch.tensor([0.99]), exps,
                torch.tensor([greedy]))
        expected = [[winner, -1]]
        assert verify_tree_reference(TreeVerifyInputs(*args, max_depth=1))[0].tolist() == expected
        out = verify_tree_triton(TreeVerifyInputs(*args, max_depth=1), block_v=128, num_splits=3)
        assert out[0].tolist() == expected, winner


@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_duplicate_sibling_of_a_rejected_one_is_rejected_too(num_splits):
    """Unchecked trees may repeat a token among siblings: once one is rejected, r(x) = 0 for the other, as in
    the reference (the kernel keeps no residual row for deterministic drafts, so it looks the token up)."""
    tokens, parents = torch.tensor([5, 5, 7]), torch.tensor([-1, -1, -1])
    vocab = 300
    p = torch.full((4, vocab), 0.5 / (vocab - 2))
    p[:, 5] = p[:, 7] = 0.25
    exps = torch.ones(1, vocab)
    exps[0, 299] = 1e-3  # the race's winner lies in the last split
    args = (tokens, parents, torch.tensor([3]), None, p, torch.tensor([0.99, 0.0, 0.99]), exps, torch.tensor([False]))
    ref = verify_tree_reference(TreeVerifyInputs(*args, max_depth=1), check=False)
    out = verify_tree_triton(TreeVerifyInputs(*args, max_depth=1), check=False, block_v=128, num_splits=num_splits)
    assert ref[2].tolist() == [0] and ref[0].tolist() == [[299, -1]]  # u = 0 yet rejected: r(5) = 0
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_kernel_matches_reference_when_unchecked_trees_are_cut_at_max_depth():
    trees = [[-1, 0, 1, 2, 3], [-1, -1, 0, 2]]
    inputs = make_inputs(3, trees, 37, [True, False], with_draft_probs=False)
    # Make every greedy child the argmax so the walk reaches the cut.
    tokens, parents, cu, q, p = inputs[:5]
    p = p.clone()
    p[torch.arange(5), tokens[:5]] = 5.0
    inputs = (tokens, parents, cu, q, p, *inputs[5:])
    ref = verify_tree_reference(TreeVerifyInputs(*inputs, max_depth=2), check=False)
    out = verify_tree_triton(TreeVerifyInputs(*inputs, max_depth=2), check=False, block_v=128)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert ref[2][0] == 2 and ref[1][0].tolist() == [0, 1]


# The compiled (sm_80, sm_90) kernels are checked in tests/test_kernels_compile.py.


# ---------------------------------------------------------------- a chain is the chain verify


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["greedy", "sampled", "mixed"])
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_chain_tree_emits_what_the_chain_verify_emits(impl, mode, with_draft_probs):
    """A chain-shaped tree, same draws: verify_tree == verify with the bonus token drawn by
    sample_with_exponentials(p after the last draft, exponentials) (argmax for greedy rows),
    as the chain decoder does."""
    chains = [[-1, 0, 1, 2], [-1], [], [-1, 0, 1, 2, 3], [-1, 0]]
    greedy = {"greedy": [True] * 5, "sampled": [False] * 5, "mixed": [False, True, False, True, False]}[mode]
    for seed in range(4):
        tokens, parents, cu, q, p, uniforms, exps, greedy_t = make_inputs(
            seed, chains, 100, greedy, with_draft_probs
        )
        counts = torch.tensor([len(c) for c in chains])
        # Tree layout: per row [p_1 .. p_k, p_{k+1}]; the chain's target_probs drops each row's last.
        last_rows = (counts + 1).cumsum(0) - 1
        keep = torch.ones(len(p), dtype=torch.bool)
        keep[last_rows] = False
        p_last = p[last_rows]
        bonus = torch.where(greedy_t, p_last.argmax(-1), sample_with_exponentials(p_last, exps))
        max_depth = int(counts.max())
        chain_out, chain_n = verify_reference(VerifyInputs(tokens, cu, q, p[keep], bonus, uniforms, exps, greedy_t,
                                                           max_depth))  # fmt: skip
        out, nodes, n = IMPLS[impl](TreeVerifyInputs(tokens, parents, cu, q, p, uniforms, exps, greedy_t, max_depth))
        assert torch.equal(out, chain_out) and torch.equal(n, chain_n), (seed, out, chain_out)
        for row, k in enumerate(n.tolist()):
            assert nodes[row].tolist() == list(range(k)) + [-1] * (max_depth - k)


# ---------------------------------------------------------------- the emitted tokens follow the target

STAT_VOCAB = 6
STAT_SHAPES = [[-1, -1, -1], [-1, 0, 0, -1, 1], [-1, 0], [-1], [-1, -1, 0, 1, 0]]
STAT_TRIALS_PER_SHAPE = 40_000


def markov_target(g):
    """p at the root, and p after token x (a first-order Markov target: p after a node depends only
    on its token), with a draft that disagrees with it: ||p0 - q0||_1 >= 0.5."""
    while True:
        p0 = (torch.randn(STAT_VOCAB, generator=g) * 1.5).softmax(-1)
        q0 = (torch.randn(STAT_VOCAB, generator=g) * 1.5).softmax(-1)
        if l1(p0, q0) >= 0.5:
            break
    after = (torch.randn(STAT_VOCAB, STAT_VOCAB, generator=g) * 1.5).softmax(-1)
    draft_after = (torch.randn(STAT_VOCAB, STAT_VOCAB, generator=g) * 1.5).softmax(-1)
    return p0, q0, after, draft_after


def draft_trees(target, kind, g, shapes=STAT_SHAPES, trials=STAT_TRIALS_PER_SHAPE):
    """Many independent one-row tree verifications, flattened into one batch.

    kind "topk": children are the draft's top tokens in rank order (q one-hot, draft_probs None).
    kind "sampled": child k is drawn from the draft q with siblings 1..k-1 removed and renormalised
    (without replacement: siblings never repeat), and that q_k is its draft_probs row.
    """
    p0, q0, after, draft_after = target
    tokens, parents, draft_probs, target_probs, counts = [], [], [], [], []
    for shape in shapes:
        n = len(shape)
        node_tokens = torch.zeros(trials, n, dtype=torch.long)
        node_q = torch.zeros(trials, n, STAT_VOCAB)
        for i, parent in enumerate(shape):
            q = q0.expand(trials, -1).clone() if parent < 0 else draft_after[node_tokens[:, parent]]
            for k in range(i):
                if shape[k] == parent:
                    q[torch.arange(trials), node_tokens[:, k]] = 0.0
            q = q / q.sum(-1, keepdim=True)
            node_tokens[:, i] = q.argmax(-1) if kind == "topk" else sample(q, g)
            node_q[:, i] = q
        rows = torch.cat([p0.expand(trials, 1, -1), after[node_tokens]], dim=1)  # [trials, n + 1, V]
        tokens.append(node_tokens.flatten())
        parents.append(torch.tensor(shape).repeat(trials))
        draft_probs.append(node_q.reshape(-1, STAT_VOCAB))
        target_probs.append(rows.reshape(-1, STAT_VOCAB))
        counts.append(torch.full((trials,), n))
    batch = trials * len(shapes)
    num_nodes = sum(len(s) for s in shapes) * trials
    return (
        torch.cat(tokens), torch.cat(parents), torch.cat(counts).cumsum(0),
        torch.cat(draft_probs) if kind == "sampled" else None, torch.cat(target_probs),
        draw_uniforms(num_nodes, g), draw_exponentials(batch, STAT_VOCAB, g), torch.zeros(batch, dtype=torch.bool),
    )


def emitted_checks(name, target, inputs):
    """The first emitted token follows p0; the second, given an accepted first token x, follows p after x."""
    p0, _, after, _ = target
    out, _, n = verify_tree_reference(TreeVerifyInputs(*inputs, max_depth=3), check=False)
    checks = [l1_check(f"{name}: first token vs p0", out[:, 0], p0)]
    for x in range(STAT_VOCAB):
        rows = (n >= 1) & (out[:, 0] == x)
        if int(rows.sum()) >= 1000:
            checks.append(l1_check(f"{name}: second token | first {x} vs p after {x}", out[rows, 1], after[x]))
    return checks, out


@pytest.mark.parametrize("kind", ["topk", "sampled"])
def test_emitted_tokens_follow_the_target(kind):
    g = torch.Generator().manual_seed({"topk": 11, "sampled": 12}[kind])
    target = markov_target(g)
    inputs = draft_trees(target, kind, g)
    checks, out = emitted_checks(kind, target, inputs)
    assert len(checks) >= 3  # the conditional second-token checks ran too
    assert_all_pass(checks)

    # Controls, so the checks can fail. p0 and q0 are far apart compared with the bound...
    p0, q0 = target[0], target[1]
    bound = checks[0].bound
    assert l1(p0, q0) > 2 * bound
    # ...a verifier that accepts every first child (u = 0) emits the draft's picks, not p0...
    always = verify_tree_reference(TreeVerifyInputs(*inputs[:5], torch.zeros_like(inputs[5]), *inputs[6:], max_depth=3),
                                   check=False)[0]  # fmt: skip
    assert l1_check("", always[:, 0], p0).statistic > 2 * bound
    # ...one that tests every sibling against p instead of the residual re-emits rejected tokens...
    no_residual = lambda original: lambda residual, mass, *args: (residual, mass)  # noqa: E731
    assert first_token_l1_with(no_residual, inputs, p0) > 2 * bound
    # ...and one that subtracts the draft but forgets to renormalise (keeps m) under-accepts the
    # later siblings. The subtlest slip: it fails by 4x the bound with sampled children and by
    # 1.5x with top-k ones (where m only scales the one-hot test).
    keep_mass = lambda original: lambda residual, mass, *args: (original(residual, mass, *args)[0], mass)  # noqa: E731
    assert first_token_l1_with(keep_mass, inputs, p0) > (2 if kind == "sampled" else 1) * bound


def first_token_l1_with(mutate, inputs, p0):
    """The first-token check's statistic when the reference runs ``mutate(the real residual update)``."""
    original = tree_verify._residual_after_rejection
    try:
        tree_verify._residual_after_rejection = mutate(original)
        out = verify_tree_reference(TreeVerifyInputs(*inputs, max_depth=3), check=False)[0]
    finally:
        tree_verify._residual_after_rejection = original
    return l1_check("", out[:, 0], p0).statistic


def test_kernel_agrees_with_the_reference_on_the_statistical_trees():
    """The kernel (interpreted) emits the reference's tokens on a small batch of each design above:
    bushy roots over a 6-token vocabulary reject sibling after sibling, which exercises the
    residual and mass updates far more than the random trees do."""
    for kind in ("topk", "sampled"):
        g = torch.Generator().manual_seed(21)
        inputs = draft_trees(markov_target(g), kind, g, trials=16)
        inputs = (*inputs[:-1], torch.arange(len(inputs[-1])) % 7 == 3)  # and a few greedy rows
        ref = verify_tree_reference(TreeVerifyInputs(*inputs, max_depth=3))
        out = verify_tree_triton(TreeVerifyInputs(*inputs, max_depth=3))
        assert all(torch.equal(a, b) for a, b in zip(out, ref))
        assert int((ref[2] == 0).sum()) > 0 and int((ref[2] >= 2).sum()) > 0


# ---------------------------------------------------------------- input errors


def test_bad_inputs_raise_clear_errors():
    trees = [[-1, 0, -1], [-1]]
    tokens, parents, cu, q, p, uniforms, exps, greedy = make_inputs(
        0, trees, 10, [False, True], with_draft_probs=True
    )
    ok = dict(node_token_ids=tokens, node_parents=parents, cu_num_nodes=cu, draft_probs=q, target_probs=p,
              uniforms=uniforms, exponentials=exps, greedy=greedy, max_depth=2)
    distinct = torch.tensor([1, 2, 3, 4])  # tokens with no duplicate siblings in any of the shapes below
    bad_cases = [
        (dict(node_parents=torch.tensor([-1, 0, 5, -1])), "out of range"),
        (dict(node_parents=torch.tensor([-1, 2, 1, -1]), node_token_ids=distinct), "cycles"),  # 1 <-> 2
        (dict(node_parents=torch.tensor([1, -1, 0, -1]), node_token_ids=distinct), "comes before"),
        (dict(node_parents=torch.tensor([-1, 1, 0, -1]), node_token_ids=distinct), "its parent"),  # own parent
        (dict(node_token_ids=torch.tensor([4, 5, 4, 1])), "same token"),  # nodes 0 and 2: root's children
        (dict(max_depth=1), "raise max_depth"),
        (dict(max_depth=-1), "max_depth must be"),
        (dict(target_probs=p[:-1]), "target_probs has shape"),
        (dict(target_probs=p[None]), "per row"),
        (dict(exponentials=exps[:, :5]), "exponentials has shape"),
        (dict(uniforms=uniforms[:2]), "uniforms has shape"),
        (dict(draft_probs=q[:, :5]), "draft_probs has shape"),
        (dict(node_parents=parents[:3][None]), "node_parents has shape"),
        (dict(node_token_ids=tokens.float()), "integers"),
        (dict(greedy=greedy.long()), "bool"),
        (dict(cu_num_nodes=torch.tensor([4, 3])), "cumsum"),
        (dict(cu_num_nodes=cu[:, None]), "1-D"),
        (dict(node_token_ids=torch.tensor([0, 10, 1, 2])), "d2t"),
    ]
    for impl in IMPLS.values():
        for change, message in bad_cases:
            with pytest.raises(SpecdraftError, match=message):
                impl(TreeVerifyInputs(**{**ok, **change}))
    assert verify_tree_reference(TreeVerifyInputs(**ok))[0].shape == (2, 3)  # the unchanged inputs are fine
