"""``specdraft selftest``'s verify checks: the device's verify backend against the reference, and exactness.

Two kinds of check, for chains (``specdraft.decoding.verify``) and trees (``tree_verify``):

* agreement   random batches of verify inputs (vocabularies below, at and above a block, odd sizes like
              32001, 0 to 15 drafts, batch 1 and 64, float32 and bfloat16 probabilities, with and without
              draft probabilities, greedy and sampled rows, the edge token ids 0 and V-1) through the Triton
              kernel and the pure-torch reference: every output token, accepted count and node must be equal.
* exactness   many independent verify steps of one small vocabulary on the device's backend: the emitted
              tokens must follow the target p whatever the draft q (Leviathan et al. 2023, Thm. 1). Pearson's
              chi-square on the histogram of the first emitted token (and, for chains, of the second given
              the first draft was accepted); each test fails a correct sampler with probability
              ``FALSE_ALARM`` (all five together at most 5x that). Power, simulated (300 draws each): a
              sampler that moves 1% of p's mass from its likeliest token to its rarest (p = 0.025) fails
              every one at 40,000 or 20,000 steps (--quick); moved between the two likeliest (p = 0.38
              and 0.30) the first-token test catches it about half the time at 40,000 steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.decoding.sampling import draw_exponentials, draw_uniforms, sample
from specdraft.decoding.tree_verify import TreeVerifyInputs, verify_tree_reference, verify_tree_triton
from specdraft.decoding.verify import VerifyInputs, verify_reference, verify_triton

FALSE_ALARM = 1e-4  # chance that one exactness test fails a correct sampler
STAT_VOCAB = 8
STAT_STEPS = 40_000


@dataclass(frozen=True)
class Grid:
    """Which random batches the agreement checks run: every combination, ``seeds`` batches each."""

    vocabs: tuple[int, ...]
    batches: tuple[int, ...]
    max_drafts: tuple[int, ...]  # K: each row drafts 0..K (the first row K, the last 0)
    dtypes: tuple[torch.dtype, ...]
    seeds: int = 1


def agreement_grids(device: torch.device, quick: bool) -> list[Grid]:
    """On CUDA (compiled kernels, fast) the full grid with V up to 152064; on a CPU the kernels run in Triton's
    interpreter, about 70 ms a row at V = 32001, so the odd large vocabulary at batch 1 only."""
    if device.type == "cuda":
        vocabs = (7, 100, 127, 128, 129, 1000, 32001, 152064)
        return [Grid(vocabs, (1, 64), (0, 1, 4, 15), (torch.float32, torch.bfloat16), seeds=1 if quick else 2)]
    large = Grid((32001,), (1,), (15,) if quick else (0, 15), (torch.float32,))
    if quick:
        return [Grid((7, 100, 129, 1000), (1, 16), (0, 15), (torch.float32, torch.bfloat16)), large]
    return [Grid((7, 100, 127, 128, 129, 1000), (1, 64), (0, 1, 4, 15), (torch.float32, torch.bfloat16)), large]


def _target_and_draft(g, rows: int, vocab: int, device):
    """p and a close-ish q for ``rows`` rows on ``device`` (drawn there: V = 152064 is 0.6 GB a tensor), with
    the edge ids 0 and V-1 made likely in some rows."""
    logits = torch.randn(rows, vocab, generator=g, device=device) * 2
    logits[0::3, vocab - 1] += 6
    logits[1::3, 0] += 6
    return logits.softmax(-1), (logits + torch.randn(rows, vocab, generator=g, device=device)).softmax(-1)


def _race_noise(g, batch: int, vocab: int, device) -> torch.Tensor:
    exponentials = draw_exponentials(batch, vocab, g, device)
    exponentials[0, vocab - 1] = exponentials[-1, 0] = 1e-30  # the race's winner on the edge ids too
    return exponentials


def _counts(seed: int, batch: int, most: int) -> torch.Tensor:
    """Drafts (or nodes) per row, 0..most: the first row ``most``, the last 0."""
    counts = torch.randint(0, most + 1, (batch,), generator=torch.Generator().manual_seed(seed))
    counts[0], counts[-1] = most, 0 if batch > 1 else most
    return counts


def random_chain_batch(seed: int, batch: int, vocab: int, max_drafts: int, dtype, with_q: bool, device):
    """Verify inputs of ``batch`` rows: runs of accepted drafts, rejections, greedy and sampled rows, and the
    edge ids 0 and V-1 as drafts, argmaxes and race winners."""
    g = torch.Generator(device=device).manual_seed(seed)
    counts = _counts(seed, batch, max_drafts).to(device)
    n = int(counts.sum())
    p, q = _target_and_draft(g, n, vocab, device)
    drafts = sample(q, g) if n else torch.zeros(0, dtype=torch.long, device=device)
    pick = torch.rand(n, generator=g, device=device)
    drafts = torch.where(pick < 0.4, p.argmax(-1), drafts)
    drafts = torch.where(pick > 0.9, torch.where(pick > 0.95, 0, vocab - 1), drafts)
    return (drafts, counts.cumsum(0), q.to(dtype) if with_q else None, p.to(dtype),
            torch.randint(0, vocab, (batch,), generator=g, device=device), draw_uniforms(n, g, device),
            _race_noise(g, batch, vocab, device), torch.rand(batch, generator=g, device=device) < 0.3)


def random_tree_batch(seed: int, batch: int, vocab: int, max_nodes: int, dtype, with_q: bool, device):
    """Tree-verify inputs of ``batch`` rows of random trees (0..max_nodes nodes, topological, siblings with
    distinct tokens among their parent's likeliest and the edge ids), the same mix of rows as the chains'."""
    g, host = torch.Generator(device=device).manual_seed(seed), torch.Generator().manual_seed(seed)
    counts = _counts(seed, batch, max_nodes)
    n = int(counts.sum())
    p, q = _target_and_draft(g, n + batch, vocab, device)
    candidates = q.topk(min(vocab, 8)).indices.tolist()  # per target row: one transfer, then host lists
    tokens, parents, rows, root = [], [], [], 0
    for count in counts.tolist():
        taken: dict[int, set] = {}
        for i in range(count):
            parent = int(torch.randint(-1, i, (1,), generator=host))
            row = root + 1 + parent  # the target row of the node's parent (the root's for -1)
            choices = candidates[row] + [0, vocab - 1]
            order = torch.randperm(len(choices), generator=host).tolist()
            token = next(choices[j] for j in order if choices[j] not in taken.setdefault(parent, set()))
            taken[parent].add(token)
            tokens.append(token)
            parents.append(parent)
            rows.append(row)
        root += count + 1
    draft_probs = q[torch.tensor(rows, dtype=torch.long, device=device)].to(dtype) if with_q else None
    return (torch.tensor(tokens, dtype=torch.long, device=device),
            torch.tensor(parents, dtype=torch.long, device=device),
            counts.cumsum(0).to(device), draft_probs, p.to(dtype), draw_uniforms(n, g, device),
            _race_noise(g, batch, vocab, device), torch.rand(batch, generator=g, device=device) < 0.3)


def tree_depth(parents: torch.Tensor, cu: torch.Tensor) -> int:
    """The deepest node of any row (row-local parents)."""
    parents, depth, deepest, start = parents.tolist(), [], 0, 0
    for end in cu.tolist():
        depth = []
        for parent in parents[start:end]:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        deepest, start = max([deepest, *depth]), end
    return deepest


def compare(grids: list[Grid], device, tree: bool) -> tuple[int, list[str]]:
    """(rows compared, disagreements) of the Triton kernel against the reference over the grids:
    ``verify_triton`` for chains, ``verify_tree_triton`` for trees (each batch's max_depth its deepest tree)."""
    make, reference, kernel, metadata = (
        (random_tree_batch, verify_tree_reference, verify_tree_triton, TreeVerifyInputs) if tree
        else (random_chain_batch, verify_reference, verify_triton, VerifyInputs))  # fmt: skip
    rows, failures = 0, []
    for case, (vocab, batch, k, dtype, with_q, seed) in enumerate(
            (v, b, k, d, q, s) for grid in grids for v in grid.vocabs for b in grid.batches for k in grid.max_drafts
            for d in grid.dtypes for q in (True, False) for s in range(grid.seeds)):
        inputs = make(1000 * case + seed, batch, vocab, k, dtype, with_q, device)
        size = {"max_depth": tree_depth(inputs[1].cpu(), inputs[2].cpu())} if tree else {"max_spec_len": k}
        ref, out = reference(metadata(*inputs, **size)), kernel(metadata(*inputs, **size))
        rows += batch
        if not all(torch.equal(a, b) for a, b in zip(out, ref)):
            failures.append(f"V={vocab} batch={batch} {'nodes' if tree else 'K'}<={k} {str(dtype)[6:]} q={with_q}")
    return rows, failures


# -- exactness ------------------------------------------------------------------------------------------


def chi_square_p_value(tokens: torch.Tensor, expected: torch.Tensor) -> float:
    """P(chi-square >= the statistic) for ``tokens`` (independent draws) against the distribution ``expected``,
    degrees of freedom = the tokens of nonzero probability - 1 (the survival function through gammaincc)."""
    tokens, expected = tokens.cpu(), expected.double().cpu()
    observed = torch.bincount(tokens, minlength=len(expected)).double()
    support = expected > 0
    if bool((observed[~support] > 0).any()):
        return 0.0  # a token the target never emits
    mean = expected[support] * len(tokens)
    statistic = float(((observed[support] - mean) ** 2 / mean).sum())
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def _distributions(g, count: int) -> list[torch.Tensor]:
    return [torch.randn(STAT_VOCAB, generator=g).mul(1.5).softmax(-1) for _ in range(count)]


def chain_exactness(verify_fn, device, steps: int = STAT_STEPS) -> dict[str, float]:
    """p-values: first emitted token ~ p_1, and second ~ p_2 given the first draft was accepted, for drafts
    sampled from q (draft_probs given) and deterministic drafts (q one-hot: the same token every step)."""
    g = torch.Generator().manual_seed(31)
    (p1, p2, p3), (q1, q2) = _distributions(g, 3), _distributions(g, 2)
    p_values = {}
    for name, deterministic in (("sampled drafts", False), ("deterministic drafts", True)):
        if deterministic:
            drafts, q = torch.tensor([int(q1.argmax()), int(q2.argmax())]).repeat(steps), None
        else:
            q = torch.stack([q1, q2]).repeat(steps, 1)
            drafts = sample(q, g)
        inputs = (drafts, torch.arange(1, steps + 1) * 2, q, torch.stack([p1, p2]).repeat(steps, 1),
                  sample(p3.expand(steps, STAT_VOCAB), g), draw_uniforms(2 * steps, g),
                  draw_exponentials(steps, STAT_VOCAB, g), torch.zeros(steps, dtype=torch.bool))
        out, accepted = verify_fn(VerifyInputs(*(None if x is None else x.to(device) for x in inputs), max_spec_len=2))
        out, accepted = out.cpu(), accepted.cpu()
        p_values[f"chain, {name}: 1st token ~ p"] = chi_square_p_value(out[:, 0], p1)
        p_values[f"chain, {name}: 2nd token ~ p"] = chi_square_p_value(out[accepted >= 1, 1], p2)
    return p_values


def tree_exactness(verify_tree_fn, device, steps: int = STAT_STEPS) -> dict[str, float]:
    """p-value: the first emitted token ~ p(root) for three siblings drawn from q without replacement (each
    node's q renormalised without its elder siblings), the tree EAGLE and SpecInfer sample."""
    g = torch.Generator().manual_seed(32)
    p_root, p_child, q = *_distributions(g, 2), _distributions(g, 1)[0]
    children = torch.multinomial(q.expand(steps, STAT_VOCAB), 3, replacement=False, generator=g)  # [N, 3]
    q_rows = []
    remaining = q.expand(steps, STAT_VOCAB).clone()
    for k in range(3):
        q_rows.append(remaining / remaining.sum(-1, keepdim=True))
        remaining = remaining.scatter(1, children[:, k : k + 1], 0.0)
    draft_probs = torch.stack(q_rows, 1).reshape(3 * steps, STAT_VOCAB)
    target = torch.stack([p_root, p_child, p_child, p_child]).repeat(steps, 1)
    inputs = (children.reshape(-1), torch.tensor([-1, -1, -1]).repeat(steps), torch.arange(1, steps + 1) * 3,
              draft_probs, target, draw_uniforms(3 * steps, g), draw_exponentials(steps, STAT_VOCAB, g),
              torch.zeros(steps, dtype=torch.bool))
    out, _, _ = verify_tree_fn(TreeVerifyInputs(*(x.to(device) for x in inputs), max_depth=1),
                               check=False)  # valid by construction
    return {"tree, 3 sampled siblings: 1st token ~ p": chi_square_p_value(out[:, 0].cpu(), p_root)}
