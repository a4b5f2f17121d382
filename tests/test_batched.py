"""Batched decoding: B prompts of different lengths in one target forward per step. Each row's greedy output is
what that prompt gives decoded alone, for every kind of source; sampled rows follow the target; bad input."""

import copy

import pytest
import torch
from test_speculative import VOCAB, noisy_copy, prompts, target, target_model  # noqa: F401 (fixtures)

from specdraft.contract import DraftCapabilities
from specdraft.decoding.rows import fresh_sources
from specdraft.decoding.sampling import SamplingParams
from specdraft.decoding.sources import DraftLMSource, PromptLookupSource
from specdraft.decoding.speculative import TreeDrafting, plain_decode, speculative_decode, speculative_decode_batch
from specdraft.decoding.trees import StaticTree
from specdraft.drafters import FAMILIES
from specdraft.errors import SpecdraftError
from specdraft.target import FrozenTarget

MAX_NEW = 24
B = 4


def batch_prompts():
    """Four prompts of lengths 1, 8, 13 and 18 (prompts() of test_speculative), so rows start unaligned."""
    return [p[0] for p in prompts(B)]


def tiny_target_for(family: str):
    """A 4-layer target tapped at layers 1-3 and an untrained (seeded) drafter of ``family`` on it."""
    from tiny import seeded_init_
    from transformers import LlamaConfig

    from specdraft.contract import TargetNeeds
    from specdraft.drafters import get_family

    config = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256)  # fmt: skip
    target = FrozenTarget.from_config(config, needs=TargetNeeds(taps=(1, 2, 3)), device="cpu")
    seeded_init_(target.model, seed=0)
    fam = get_family(family)
    torch.manual_seed(0)
    return target, fam.build(target, fam.config_cls()).eval().draft_source(target)


def alone(target, source, prompt, **kwargs):
    if source is None:
        return plain_decode(target, prompt[None], **kwargs).tokens
    return speculative_decode(target, source, prompt[None], k=4, **kwargs).tokens


@pytest.mark.parametrize("name", ["plain", "identical", "noisy", "prompt_lookup"])
def test_each_row_is_its_prompt_decoded_alone(target, target_model, name):
    make = {
        "plain": lambda: None,
        "identical": lambda: DraftLMSource(target_model),  # every draft accepted: rows run ahead of each other
        "noisy": lambda: DraftLMSource(noisy_copy(target_model, 0.2, seed=1)),  # some accepted, rows diverge
        "prompt_lookup": lambda: PromptLookupSource(max_ngram=3, min_ngram=1),  # often 0 drafts in a row
    }[name]
    batch = batch_prompts()
    sources = None if make() is None else fresh_sources(make(), B)
    outs = speculative_decode_batch(target, sources, batch, k=4, max_new_tokens=MAX_NEW)
    for prompt, out in zip(batch, outs):
        assert out.tokens == alone(target, make(), prompt, max_new_tokens=MAX_NEW)
    if name == "noisy":  # rows accepted different numbers of drafts in the same step
        per_step = list(zip(*[[s.num_accepted for s in out.steps] for out in outs]))
        assert any(len(set(step)) > 1 for step in per_step)


def test_each_rows_predicted_alpha_is_what_it_predicts_alone(target, target_model):
    """alpha predicted (sum_x min(p, q) at each tested position) is kept per row in a batch, from the flat verify
    layout: each row's steps report what the prompt's decode alone reports, greedy and sampled (where a row's
    draws differ from its decode alone, its alpha is still one value per tested position, in [0, 1])."""
    batch = batch_prompts()
    make = lambda: DraftLMSource(noisy_copy(target_model, 0.2, seed=1))  # noqa: E731
    lookup = lambda: PromptLookupSource(max_ngram=3, min_ngram=1)  # noqa: E731 (rows draft 0 to k: ragged)
    for maker in (make, lookup):
        outs = speculative_decode_batch(target, fresh_sources(maker(), B), batch, k=4, max_new_tokens=MAX_NEW)
        for prompt, out in zip(batch, outs):
            single = speculative_decode(target, maker(), prompt[None], k=4, max_new_tokens=MAX_NEW)
            assert [s.alpha_predicted for s in out.steps] == [s.alpha_predicted for s in single.steps]
        assert any(0.0 in s.alpha_predicted for out in outs for s in out.steps)  # rejections were tested
    sampled = speculative_decode_batch(target, fresh_sources(make(), B), batch, k=4, max_new_tokens=MAX_NEW,
                                       params=SamplingParams(temperature=1.0), generator=torch.Generator().manual_seed(0))
    for out in sampled:
        for s in out.steps:
            assert len(s.alpha_predicted) == min(s.num_accepted + 1, s.num_drafted)
            assert all(0.0 <= a <= 1.0 + 1e-6 for a in s.alpha_predicted)


def test_typical_acceptance_verifies_each_row_as_alone():
    """Batched typical acceptance (LOSSY): each row keeps its leading typical drafts, never past its own count, and
    draws its next token from p after them with its own noise row: what Medusa's rule gives the row alone."""
    from specdraft.decoding.sampling import sample_with_exponentials
    from specdraft.decoding.speculative import _typical_verify
    from specdraft.decoding.verify import typical_acceptance

    g = torch.Generator().manual_seed(3)
    counts, width, vocab = [2, 0, 3], 4, 6
    p = torch.rand(3, width, vocab, generator=g).pow(4).softmax(-1)
    p[0, 0, 1], p[0, 1, 0], p[1, :3, 1], p[2, :3, 2] = 40.0, 40.0, 40.0, 40.0  # mostly on one token each
    p = p / p.sum(-1, keepdim=True)  # row 0: draft 1 typical, draft 5 not; row 1's padding typical; row 2 all
    drafts = torch.tensor([[1, 5, 0], [1, 1, 1], [2, 2, 2]])  # row 1 has no drafts: its typical ids are padding
    noise = torch.empty(3, vocab).exponential_(generator=g)
    emitted, n = _typical_verify(drafts, p, counts, noise)
    for r, count in enumerate(counts):
        alone = int(typical_acceptance(drafts[r, :count], p[r, :count])) if count else 0
        assert int(n[r]) == alone <= count
        assert emitted[r, :alone].tolist() == drafts[r, :alone].tolist()
        assert int(emitted[r, alone]) == int(sample_with_exponentials(p[r, alone], noise[r]))
    assert n.tolist() == [1, 0, 3]  # row 1 is clamped to its 0 drafts although its padding looks typical


def test_rows_stop_at_their_own_stop_token_and_budget(target, target_model):
    batch = batch_prompts()
    eos = alone(target, None, batch[2], max_new_tokens=MAX_NEW)[5]  # row 2 emits it early
    outs = speculative_decode_batch(target, fresh_sources(DraftLMSource(target_model), B), batch, k=4,
                                    max_new_tokens=MAX_NEW, eos_token_ids=[eos])  # fmt: skip
    for prompt, out in zip(batch, outs):
        assert out.tokens == alone(target, DraftLMSource(target_model), prompt, max_new_tokens=MAX_NEW,
                                   eos_token_ids=[eos])  # fmt: skip
    assert len(outs[2].tokens) <= 6 and outs[2].tokens[-1] == eos


@pytest.mark.parametrize("family", ["eagle1", "eagle3", "medusa1", "mlp_speculator"])
def test_trained_drafter_families_decode_in_batches(family):
    target, source = tiny_target_for(family)
    batch = batch_prompts()
    outs = speculative_decode_batch(target, fresh_sources(source, B), batch, k=3, max_new_tokens=MAX_NEW)
    for prompt, out in zip(batch, outs):
        assert out.tokens == plain_decode(target, prompt[None], max_new_tokens=MAX_NEW).tokens


def test_sampled_rows_follow_the_target():
    """T = 1, B = 4 rows decoding the same prompt with a draft LM: the 2nd and 3rd tokens of all rows
    against the target's exact marginals (the chain decoder's statistics)."""
    from test_decode_statistics import PROMPT, SAMPLED, draft_lm_models, exact_marginals
    from test_verify_statistics import assert_all_pass, l1_check

    target, draft = draft_lm_models()
    tokens = []
    for seed in range(100):
        outs = speculative_decode_batch(target, fresh_sources(DraftLMSource(draft), B), [PROMPT[0]] * B, k=3,
                                        params=SAMPLED, max_new_tokens=3, generator=torch.Generator().manual_seed(seed))
        tokens += [out.tokens for out in outs]
    tokens = torch.tensor(tokens)
    p2, p3 = exact_marginals(target, SAMPLED, PROMPT)
    assert_all_pass([l1_check("2nd token", tokens[:, 1], p2), l1_check("3rd token", tokens[:, 2], p3)])


def bonus_token_scenario(num_runs=100, rows=32, k=2, num_tokens=6):
    """T = 1, ``rows`` rows decoding the same prompt with a draft LM; each bonus token (a step accepted all its
    drafts and drew one more from p after them) against p given its own context, from one teacher-forced target
    forward over the emitted text: it is p's mode with probability max p, so the count of modes minus those
    probabilities is a martingale (Freedman bound). A bonus drawn at another position's p fails it.
    Returns ([the check], the number of bonus tokens)."""
    from test_decode_statistics import PROMPT, SAMPLED, draft_lm_models
    from test_verify_statistics import martingale_check

    from specdraft.decoding.sampling import logits_to_probs

    model, draft = draft_lm_models()
    tokens, bonus = [], []
    for seed in range(num_runs):
        outs = speculative_decode_batch(model, fresh_sources(DraftLMSource(draft), rows), [PROMPT[0]] * rows, k=k,
                                        params=SAMPLED, max_new_tokens=num_tokens,
                                        generator=torch.Generator().manual_seed(seed))  # fmt: skip
        for out in outs:
            is_bonus, t = [False] * num_tokens, 1  # token 0 came from the prefill
            for step in out.steps:
                t += step.num_accepted
                if step.num_accepted == step.num_drafted and t < num_tokens:
                    is_bonus[t] = True
                t += 1
            tokens.append(out.tokens)
            bonus.append(is_bonus)
    tokens, bonus = torch.tensor(tokens), torch.tensor(bonus)
    L = PROMPT.shape[1]
    with torch.no_grad():
        p = logits_to_probs(model(torch.cat([PROMPT.expand(len(tokens), L), tokens], dim=1)).logits[:, L - 1 : -1],
                            SAMPLED)  # [N, T, V]: p of each emitted token given the text before it
    mode_probability, mode = p.max(-1)
    check = martingale_check("bonus tokens that are p's mode", (tokens == mode)[bonus], mode_probability[bonus])
    return [check], int(bonus.sum())


def test_sampled_bonus_tokens_follow_the_target():
    """The rows' bonus tokens are drawn from p after the last accepted draft (the chain decoder's tests cover one
    prompt; test_sampled_rows_follow_the_target stops before any bonus token)."""
    from test_verify_statistics import assert_all_pass

    checks, num_bonus = bonus_token_scenario()
    assert num_bonus > 1000  # the check has bonus tokens to test
    assert_all_pass(checks)


@pytest.mark.parametrize("kind", ["chain", "tree with draft probs", "tree of deterministic children"])
def test_the_verify_backend_reaches_every_verify(kind, monkeypatch):
    """verify_backend="triton" verifies with the kernels (interpreted on a CPU, compiled on a GPU), one prompt or a
    batch, and emits the reference backend's tokens from the same draws; "reference" never calls a kernel."""
    from kernel_device import KERNEL_DEVICE
    from test_decode_statistics import PROMPT, SAMPLED, draft_lm_models
    from test_medusa import build as build_medusa
    from test_trees import SampledChildrenSource

    from specdraft.decoding import tree_verify, verify

    calls = []
    for module, name in ((verify, "verify_triton"), (tree_verify, "verify_tree_triton")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, kernel=kernel, **k: calls.append(1) or kernel(*a, **k))
    target, draft = draft_lm_models()  # a 12-token vocabulary and peaked p: drafts are accepted and rejected
    target = FrozenTarget(target.model.to(KERNEL_DEVICE))
    tree = StaticTree(((0,), (1,), (0, 0), (1, 0)))
    source = {"chain": lambda: DraftLMSource(draft.to(KERNEL_DEVICE)),
              "tree with draft probs": lambda: TreeDrafting(SampledChildrenSource(target.vocab_size, KERNEL_DEVICE), tree),
              "tree of deterministic children": lambda: TreeDrafting(
                  build_medusa(target, randomize=False, num_heads=2).to(KERNEL_DEVICE).draft_source(target), tree),
              }[kind]  # fmt: skip
    batch = [PROMPT[0].to(KERNEL_DEVICE), torch.tensor([2, 8, 8, 4], device=KERNEL_DEVICE)]

    def decode(backend):
        """(every output's tokens, every step's accepted count, kernel calls decoding alone and in a batch)"""
        seeded = dict(params=SAMPLED, max_new_tokens=12, verify_backend=backend)
        calls.clear()
        alone = speculative_decode(target, source(), batch[0][None], k=2,
                                   generator=torch.Generator(KERNEL_DEVICE).manual_seed(0), **seeded)  # fmt: skip
        alone_calls = len(calls)
        rows = speculative_decode_batch(target, [source() for _ in batch], batch, k=2,
                                        generator=torch.Generator(KERNEL_DEVICE).manual_seed(0), **seeded)  # fmt: skip
        outs = [alone, *rows]
        return [o.tokens for o in outs], [s.num_accepted for o in outs for s in o.steps], (alone_calls, len(calls) - alone_calls)

    tokens, accepted, kernel_calls = decode("reference")
    assert kernel_calls == (0, 0)
    triton_tokens, triton_accepted, kernel_calls = decode("triton")
    assert (triton_tokens, triton_accepted) == (tokens, accepted) and min(kernel_calls) > 0
    assert {0, 1} <= set(accepted)  # drafts were rejected and accepted
    with pytest.raises(SpecdraftError, match="must be one of auto, triton, reference"):
        speculative_decode_batch(target, None, batch, verify_backend="kernel")


def test_bad_batches_are_refused(target):
    long = torch.ones(target.config.max_position_embeddings, dtype=torch.long)
    with pytest.raises(SpecdraftError, match="prompt 1 of the batch.*context"):
        speculative_decode_batch(target, None, [torch.tensor([1, 2]), long])
    with pytest.raises(SpecdraftError, match="one source per prompt"):
        speculative_decode_batch(target, [PromptLookupSource()], batch_prompts())
    with pytest.raises(SpecdraftError, match="at least one prompt"):
        speculative_decode_batch(target, None, [])

    class TreeLookup(PromptLookupSource):
        capabilities = DraftCapabilities(tree_kinds=("static",))

        def propose_tree(self, pending, tree, params, generator):
            from specdraft.contract import Proposal

            return Proposal(torch.tensor([[5, 6]]), None, torch.tensor([[1, -1]]))  # node 0's parent after it

    with pytest.raises(SpecdraftError, match="comes before"):
        speculative_decode_batch(target, fresh_sources(TreeDrafting(TreeLookup(), StaticTree.chain(2)), B),
                                 batch_prompts(), k=2, max_new_tokens=4)


class CountingTarget:
    """The target, counting the input slots of every forward: what the batched decoder reads."""

    def __init__(self, target):
        self.target, self.config, self.read = target, target.config, []

    def __call__(self, ids, **kwargs):
        self.read.append(ids.numel())
        return self.target(ids, **kwargs)


def test_prefill_reads_prompts_in_groups_of_similar_length(target):
    """Prompts of 30, 2, 28, 3 and 12 tokens: one padded prefill would read 5 x 30 = 150 slots for 75 tokens;
    in groups of similar length ({30, 28}, {12}, {3, 2}) it reads 78, and every row still decodes as alone."""
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(3, VOCAB, (n,), generator=g) for n in (30, 2, 28, 3, 12)]
    counting = CountingTarget(target)
    outs = speculative_decode_batch(counting, None, batch, max_new_tokens=1)  # the prefill's forwards only
    assert counting.read == [2 * 30, 12, 2 * 3]
    for prompt, out in zip(batch, outs):
        assert out.tokens == alone(target, None, prompt, max_new_tokens=1)
    outs = speculative_decode_batch(target, fresh_sources(DraftLMSource(noisy_copy(target.model, 0.2, seed=1)),
                                                          len(batch)), batch, k=4, max_new_tokens=MAX_NEW)  # fmt: skip
    for prompt, out in zip(batch, outs):
        assert out.tokens == alone(target, None, prompt, max_new_tokens=MAX_NEW)


def test_tree_rows_are_each_prompt_decoded_alone():
    """Each row drafts random trees in which one branch, anywhere in the node order, spells that row's greedy
    continuation for a random number of tokens: rows accept paths of different lengths and places in the same
    step, and the cache keeps each row's path. Every row emits its plain greedy tokens and accepts, step by step,
    what the same source accepts decoding that prompt alone."""
    from test_trees import OracleTreeSource

    from tiny import seeded_init_, tiny_llama

    model = tiny_llama(64, hidden_size=32, intermediate_size=64, max_position_embeddings=128)
    seeded_init_(model, seed=0, std=0.4)
    tree_target = FrozenTarget(model)
    batch = [p[0] % 64 for p in prompts(B, seed=5)]
    plain = [alone(tree_target, None, prompt, max_new_tokens=40) for prompt in batch]
    accepted = []
    for seed in range(3):
        def source(b):
            return TreeDrafting(OracleTreeSource(plain[b], depth=5, seed=10 * seed + b), StaticTree.chain(5))

        outs = speculative_decode_batch(tree_target, [source(b) for b in range(B)], batch, k=5, max_new_tokens=40)
        for b, (prompt, out) in enumerate(zip(batch, outs)):
            assert out.tokens == plain[b]
            by_itself = speculative_decode(tree_target, source(b), prompt[None], k=5, max_new_tokens=40)
            assert [s.num_accepted for s in out.steps] == [s.num_accepted for s in by_itself.steps]
            assert all(s.depth is not None and s.num_accepted <= s.depth for s in out.steps)
        accepted += [len({out.steps[i].num_accepted for out in outs if i < len(out.steps)})
                     for i in range(max(len(out.steps) for out in outs))]  # fmt: skip
    assert max(accepted) >= 3  # in some step, rows accepted paths of three different lengths


@pytest.mark.parametrize("family", ["eagle1", "eagle3", "medusa1", "mlp_speculator"])
def test_trained_drafter_families_decode_trees_in_batches(family):
    """Each family's trees (EAGLE-2 dynamic trees; static trees of top-k ranks for the heads) in a batch: every
    row's output is the target's greedy one, and each row's steps are those the row's tree decode takes alone."""
    from specdraft.decoding.trees import DynamicTree

    target, source = tiny_target_for(family)
    tree = DynamicTree(total_tokens=8, depth=3, top_k=3) if family.startswith("eagle") else \
        StaticTree(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))  # fmt: skip
    batch = batch_prompts()
    outs = speculative_decode_batch(target, fresh_sources(TreeDrafting(source, tree), B), batch, k=3,
                                    max_new_tokens=MAX_NEW)  # fmt: skip
    for prompt, out in zip(batch, outs):
        assert out.tokens == plain_decode(target, prompt[None], max_new_tokens=MAX_NEW).tokens
        by_itself = speculative_decode(target, TreeDrafting(copy.copy(source), tree), prompt[None], k=3,
                                       max_new_tokens=MAX_NEW)  # fmt: skip
        assert [(s.num_drafted, s.num_accepted) for s in out.steps] == \
            [(s.num_drafted, s.num_accepted) for s in by_itself.steps]  # fmt: skip


def test_sampled_tree_rows_follow_the_target():
    """T = 1, B = 4 rows, two prompts: on each prompt one row drafts sampled children (each node from its own
    q) and one Medusa's deterministic top-k children (q one-hot), all verified together; the 2nd and 3rd
    tokens of each prompt's rows against that prompt's exact marginals."""
    from test_decode_statistics import PROMPT, SAMPLED, exact_marginals, small_llama
    from test_medusa import build as build_medusa
    from test_trees import SampledChildrenSource
    from test_verify_statistics import assert_all_pass, l1_check

    target = FrozenTarget(small_llama(std=0.2))
    heads = build_medusa(target, randomize=False, num_heads=2).draft_source(target)
    tree = StaticTree(((0,), (1,), (0, 0), (1, 0)))
    two = [PROMPT, torch.tensor([[2, 8, 8, 4]])]
    tokens, accepted = {0: [], 1: []}, []
    for seed in range(150):
        sources = [TreeDrafting(SampledChildrenSource(target.vocab_size), tree) for _ in range(2)] + \
            fresh_sources(TreeDrafting(heads, tree), 2)  # fmt: skip
        outs = speculative_decode_batch(target, sources, [two[0][0], two[1][0]] * 2, k=2, params=SAMPLED,
                                        max_new_tokens=3, generator=torch.Generator().manual_seed(seed))  # fmt: skip
        for b, out in enumerate(outs):
            tokens[b % 2].append(out.tokens)
        accepted += [s.num_accepted for out in outs for s in out.steps]
    checks = []
    for i, prompt in enumerate(two):
        found, (p2, p3) = torch.tensor(tokens[i]), exact_marginals(target, SAMPLED, prompt)
        checks += [l1_check(f"prompt {i}: 2nd token", found[:, 1], p2), l1_check(f"prompt {i}: 3rd token", found[:, 2], p3)]
    assert_all_pass(checks)
    assert {0, 1, 2} <= set(accepted)  # rejections, and both depths accepted


@pytest.mark.parametrize("family", ["medusa1", "mlp_speculator"])
def test_heads_draft_every_row_in_one_propose(family, monkeypatch):
    """Sources naming their ``row_state`` (heads reading one hidden state) draft the whole batch in one
    propose a step, and each row gets what its own source drafts alone: the same greedy drafts, the same q
    at T = 1 for every draft whose predecessors match (rows asking for fewer drafts get the start of
    their chain). Copies of different drafters are never stacked."""
    from specdraft.decoding.rows import propose_rows as _propose_rows
    from specdraft.decoding.sampling import SamplingParams

    target, source = tiny_target_for(family)
    batch = batch_prompts()
    calls = []
    propose = type(source).propose
    monkeypatch.setattr(type(source), "propose", lambda self, pending, *a: calls.append(pending.shape[0])
                        or propose(self, pending, *a))  # fmt: skip
    outs = speculative_decode_batch(target, fresh_sources(source, B), batch, k=3, max_new_tokens=MAX_NEW)
    for prompt, out in zip(batch, outs):
        assert out.tokens == plain_decode(target, prompt[None], max_new_tokens=MAX_NEW).tokens
    assert len(calls) == max(len(out.steps) for out in outs) and calls[0] == B

    _, other = tiny_target_for(family)  # a second drafter of the same kind, its weights moved
    with torch.no_grad():
        for module in (v for v in vars(other).values() if isinstance(v, torch.nn.Module)):
            for param in module.parameters():
                param.add_(0.05 * torch.randn_like(param))
    sources = fresh_sources(source, B - 1) + [other]
    for s, prompt in zip(sources, batch):
        s.start(prompt[None], target(prompt[None], logits="last"))
    pending = torch.tensor([7, 11, 13, 17])
    wanted = {0: 3, 1: 1, 2: 2}  # row 3 (the other drafter) is asked separately below
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)):
        rows = _propose_rows(sources, pending, wanted, params, torch.Generator().manual_seed(0))
        assert_drafted_as_alone(rows, sources, pending, wanted, params)
    calls.clear()
    mixed = _propose_rows(sources, pending, {0: 2, 3: 2}, SamplingParams(temperature=1.0), None)
    assert calls == [1, 1]  # not stacked: rows 0 and 3 hold different drafters
    assert_same_q(mixed[3], other.propose(pending[3].view(1, 1), 2, SamplingParams(temperature=1.0), None))


@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "draft_lm"])
def test_rows_with_kv_caches_draft_together_as_each_would_alone(kind, monkeypatch):
    """EAGLE's rows and a draft LM's hold KV caches (and EAGLE's, queues) of different lengths; ``propose_rows``
    drafts them in one padded, masked draft forward per draft step. Mid-decode (four caches of different lengths,
    EAGLE's queues of 1-4 verified pairs), it gives each row the drafts and q its own ``propose`` gives, and
    leaves each source in a state whose next step, after the same commit, drafts as the row alone does.
    Through the batched decoder it is called once a step for every row, and the output is plain decoding's."""
    import copy

    from tiny import tiny_llama

    from specdraft.decoding.rows import propose_rows as _propose_rows
    from specdraft.decoding.sampling import SamplingParams

    if kind == "draft_lm":
        model = tiny_llama(VOCAB, seed=0)
        target, source = FrozenTarget(model), DraftLMSource(noisy_copy(model, 0.2, seed=1))
    else:
        target, source = tiny_target_for(kind)

    def cache_keys(s):  # every layer's committed keys
        return [layer.keys for layer in getattr(s.cache, "layers", [s.cache])]

    batch = batch_prompts()
    calls = []
    propose_rows = type(source).propose_rows
    monkeypatch.setattr(type(source), "propose_rows", staticmethod(
        lambda sources, *a: calls.append(len(sources)) or propose_rows(sources, *a)))  # fmt: skip
    propose, alone_calls = type(source).propose, []
    monkeypatch.setattr(type(source), "propose", lambda self, *a: alone_calls.append(1) or propose(self, *a))
    outs = speculative_decode_batch(target, fresh_sources(source, B), batch, k=3, max_new_tokens=MAX_NEW)
    for prompt, out in zip(batch, outs):
        assert out.tokens == plain_decode(target, prompt[None], max_new_tokens=MAX_NEW).tokens
    # Every step with two or more rows left drafted them together; only a last row drafts alone.
    assert calls[0] == B and min(calls) >= 2
    assert sum(calls) + len(alone_calls) == sum(len(out.steps) for out in outs)
    assert len(alone_calls) == max(len(out.steps) for out in outs) - len(calls)
    monkeypatch.setattr(type(source), "propose", propose)

    def clone(s):  # a source's state copied: propose rewrites its cache
        c = copy.copy(s)
        c.cache = copy.deepcopy(s.cache)
        return c

    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    sequences = [prompt[None] for prompt in batch]
    sources = fresh_sources(source, B)
    for s, seq in zip(sources, sequences):
        s.start(seq, target(seq, logits="last"))
    pending = torch.tensor([7, 11, 13, 17])
    kept_counts = [0, 3, 1, 2]  # drafts each row keeps: its queue for the next step is 1-4 pairs

    def commit_all(rows, proposals, sequences):  # each row keeps kept_counts[b] drafts; the longer sequences
        longer = []
        for b, (s, proposal) in enumerate(zip(rows, proposals)):
            kept = torch.cat([pending[b].view(1, 1), proposal.tokens[:, : kept_counts[b]]], dim=1)
            longer.append(torch.cat([sequences[b], kept], dim=1))
            s.commit(kept, target(longer[-1], logits="full").slice(slice(sequences[b].shape[1], None)))
        return longer

    # One step alone: the caches now differ in length, as do the queues.
    first = [s.propose(pending[b].view(1, 1), 3, greedy, None) for b, s in enumerate(sources)]
    sequences = commit_all(sources, first, sequences)
    assert len({cache_keys(s)[0].shape[2] for s in sources}) == B  # the rows really are ragged
    wanted = {0: 3, 1: 1, 2: 2, 3: 3}
    for params in (greedy, sampled):
        together = [clone(s) for s in sources]
        alone = [clone(s) for s in sources]
        rows = _propose_rows(together, pending, wanted, params, torch.Generator().manual_seed(0))
        assert_drafted_as_alone(rows, alone, pending, wanted, params)
        assert [s.num_committed for s in together] == [s.num_committed for s in alone]
        if params.is_greedy:  # the next step, after the same commits, drafts alike
            commit_all(together, [rows[b] for b in range(B)], sequences)
            commit_all(alone, [rows[b] for b in range(B)], sequences)
            for b in range(B):  # the same keys for the committed tokens both have read (a draft LM that read
                # more drafts than a row was given may have read a kept one that the row alone reads next step)
                n = min(keys.shape[2] for keys in cache_keys(together[b]) + cache_keys(alone[b]))
                assert n >= together[b].num_committed - 1
                torch.testing.assert_close([k[:, :, :n] for k in cache_keys(together[b])],
                                           [k[:, :, :n] for k in cache_keys(alone[b])])  # fmt: skip
            again = _propose_rows(together, pending, {b: 3 for b in range(B)}, greedy, None)
            for b in range(B):
                assert torch.equal(again[b].tokens, alone[b].propose(pending[b].view(1, 1), 3, greedy, None).tokens)


def test_eagle_draft_cache_is_written_in_place_and_grows():
    """EAGLE's decoding cache is preallocated: an update writes into its buffer (no concatenation), a crop
    moves the length, an outgrown buffer doubles with its slots kept, and a decode whose cache grows
    several times still gives plain decoding's tokens."""
    from specdraft.drafters.eagle_common import DraftCache

    keys = torch.randn(1, 2, 5, 4)
    cache = DraftCache(3)
    cache.update(keys[:, :, :2], -keys[:, :, :2])
    buffer = cache.key_buffer.data_ptr()
    cache.update(keys[:, :, 2:3], -keys[:, :, 2:3])
    assert cache.key_buffer.data_ptr() == buffer and len(cache) == 3
    cache.keep(2)
    cache.update(keys[:, :, 3:5], -keys[:, :, 3:5])  # past the capacity: the buffer doubles
    expected = torch.cat([keys[:, :, :2], keys[:, :, 3:5]], dim=2)
    assert cache.capacity == 6 and torch.equal(cache.keys, expected) and torch.equal(cache.values, -expected)

    target, source = tiny_target_for("eagle3")
    source.room = 1  # the prompt's slots and one more: the decode outgrows it
    prompt = batch_prompts()[2]
    assert alone(target, source, prompt, max_new_tokens=MAX_NEW) == alone(target, None, prompt, max_new_tokens=MAX_NEW)
    assert source.cache.capacity >= 2 * (prompt.shape[0] + 1)


def assert_drafted_as_alone(rows, sources, pending, wanted, params):
    """Each row's proposal (``_propose_rows``) is what ``sources[b]`` proposes alone for ``wanted[b]`` drafts: the
    same greedy drafts; at T > 0 the same q (``assert_same_q``)."""
    for b, n in wanted.items():
        alone = sources[b].propose(pending[b].view(1, 1), n, params, torch.Generator().manual_seed(0))
        assert rows[b].tokens.shape == (1, n)
        if params.is_greedy:
            assert torch.equal(rows[b].tokens, alone.tokens)
        else:
            assert_same_q(rows[b], alone)


def assert_same_q(proposal, alone):
    """q of every draft up to the first that the two draws disagree on (draft j's q depends on the drafts
    before it in the MLP speculator's chain)."""
    same = (proposal.tokens == alone.tokens)[0].int().cumprod(0).sum()
    torch.testing.assert_close(proposal.probs[:, : same + 1], alone.probs[:, : same + 1], rtol=1e-5, atol=1e-6)


def test_kv_caches_go_under_the_name_transformers_takes(target, target_model):
    """transformers 5.24 renamed a model's ``past_key_values`` argument to ``cache``; the old name warns on
    every forward and goes in 5.40. The target, a draft LM (eager and compiled) and EAGLE-1's draft layer
    (a transformers decoder layer) all pass their cache under the name their forward declares."""
    import warnings

    prompt = batch_prompts()[1][None]
    eagle_target, eagle = tiny_target_for("eagle1")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*", category=FutureWarning)
        for source in (DraftLMSource(target_model), DraftLMSource(target_model, compile=True)):
            speculative_decode(target, source, prompt, k=3, max_new_tokens=6)
        speculative_decode(eagle_target, eagle, prompt, k=3, max_new_tokens=6)


# -- declared capabilities -------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"probe"}))  # probe: the tests' own, registered by others
def test_every_familys_source_declares_what_it_can_do(family):
    """A family's draft source declares its capabilities, and they hold: each declared tree kind is drafted by its
    ``propose_tree`` (one prompt's tree) and each other kind is refused, naming the source; ragged rows come with
    the staticmethod ``propose_rows``, and a class with either method declares it; each ``row_state`` name is an
    attribute after ``start`` (a [1, ...] tensor where the rows' states are concatenated), and all else the
    source holds is the same for two sequences, so that copies of it draft a batch's rows together."""
    import inspect

    from specdraft.contract import TREE_KINDS, check_capabilities
    from specdraft.decoding.sampling import SamplingParams
    from specdraft.decoding.trees import DynamicTree

    target, source = tiny_target_for(family)
    capabilities, name = check_capabilities(source), type(source).__name__
    tree_method = inspect.getattr_static(type(source), "propose_tree", None)
    rows_method = inspect.getattr_static(type(source), "propose_rows", None)
    assert callable(tree_method) == bool(capabilities.tree_kinds)
    assert isinstance(rows_method, staticmethod) == (rows_method is not None) == capabilities.ragged_rows

    prompt, pending = batch_prompts()[1][None], torch.tensor([[7]])
    trees = {"static": StaticTree(((0,), (1,), (0, 0))), "dynamic": DynamicTree(total_tokens=4, depth=2, top_k=2)}
    assert set(trees) == set(TREE_KINDS)
    for kind, tree in trees.items():
        if kind in capabilities.tree_kinds:
            drafting = TreeDrafting(copy.copy(source), tree)
            drafting.start(prompt, target(prompt, logits="last"))
            proposal = drafting.propose(pending, tree.depth, SamplingParams(), None)
            assert proposal.parents is not None and proposal.parents.shape == proposal.tokens.shape
            assert proposal.tokens.shape[0] == 1 and 1 <= proposal.tokens.shape[1] <= tree.num_nodes
        else:
            with pytest.raises(SpecdraftError, match=f"{name} drafts"):
                TreeDrafting(source, tree)

    one, other = fresh_sources(source, 2)
    for s, p in zip((one, other), batch_prompts()[1:3]):
        s.start(p[None], target(p[None], logits="last"))
    assert vars(one).keys() == vars(other).keys()
    for attribute in capabilities.row_state:
        assert attribute in vars(one), f"{name} declares row_state {attribute!r}, which start does not set"
        if not capabilities.ragged_rows:  # concatenated along dim 0 for a batch's rows
            assert isinstance(vars(one)[attribute], torch.Tensor) and vars(one)[attribute].shape[0] == 1
    for attribute, value in vars(one).items():
        if capabilities.row_state and attribute not in capabilities.row_state:
            theirs = vars(other)[attribute]
            assert value is theirs or (not isinstance(value, (torch.Tensor, torch.nn.Module)) and value == theirs), \
                f"{name}.{attribute} differs between two sequences but is not in its row_state"


def test_a_source_must_back_what_it_declares(target):
    """A declaration its class does not back is refused before any decoding, with a message naming the source: a
    tree kind without ``propose_tree``, ragged rows without ``propose_rows``, no declaration, a declaration that is
    not a ``DraftCapabilities``; and ``DraftCapabilities`` refuses an unknown tree kind, or ragged rows of no state."""

    class NoTreeMethod(PromptLookupSource):
        capabilities = DraftCapabilities(tree_kinds=("static",))

    class NoRowsMethod(PromptLookupSource):
        capabilities = DraftCapabilities(row_state=("context",), ragged_rows=True)

    class Undeclared:  # a source that says nothing of what else it can do
        def start(self, prompt_ids, target_out): ...

        def propose(self, pending, k, params, generator): ...

        def commit(self, kept_ids, target_out): ...

    class Misdeclared(PromptLookupSource):
        capabilities = {"tree_kinds": ("static",)}

    with pytest.raises(SpecdraftError, match="NoTreeMethod declares .* has no propose_tree"):
        TreeDrafting(NoTreeMethod(), StaticTree.chain(2))
    with pytest.raises(SpecdraftError, match="Undeclared is not a DraftSource.*capabilities = DraftCapabilities"):
        TreeDrafting(Undeclared(), StaticTree.chain(2))
    counting = CountingTarget(target)
    for source, match in ((NoRowsMethod(), "NoRowsMethod declares .* has no propose_rows"),
                          (Undeclared(), "Undeclared is not a DraftSource"),
                          (Misdeclared(), "Misdeclared.capabilities must be a specdraft.contract.DraftCapabilities")):
        with pytest.raises(SpecdraftError, match=match):
            speculative_decode_batch(counting, fresh_sources(source, B), batch_prompts(), k=2, max_new_tokens=4)
    assert counting.read == []  # refused before the prefill
    with pytest.raises(SpecdraftError, match="lists 'radix'; the tree kinds are static, dynamic"):
        DraftCapabilities(tree_kinds=("static", "radix"))
    with pytest.raises(SpecdraftError, match="ragged_rows=True.*needs row_state"):
        DraftCapabilities(ragged_rows=True)


def test_a_tree_wrappers_rows_draft_with_their_own_sources():
    """``fresh_sources`` copies a ``TreeDrafting``'s source too (its ``__copy__``): rows never share a source's
    per-sequence state."""
    _, heads = tiny_target_for("medusa1")
    rows = fresh_sources(TreeDrafting(heads, StaticTree.chain(2)), 3)
    assert len({id(row) for row in rows}) == len({id(row.source) for row in rows}) == 3
    assert all(row.source.drafter is heads.drafter and row.tree is rows[0].tree for row in rows)
