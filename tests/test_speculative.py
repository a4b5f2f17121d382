"""The speculative decoder: greedy output is the target's own, stats add up, bad input is refused."""

import copy
import re

import pytest
import torch
from tiny import seeded_init_, tiny_llama

from specdraft.contract import Proposal, TargetNeeds
from specdraft.decoding.sampling import SamplingParams
from specdraft.decoding.sources import DraftLMSource, PromptLookupSource
from specdraft.decoding.speculative import plain_decode, speculative_decode
from specdraft.errors import SpecdraftError
from specdraft.target import FrozenTarget

VOCAB = 300
MAX_NEW = 24


@pytest.fixture(scope="module")
def target_model():
    return tiny_llama(VOCAB, seed=0)


@pytest.fixture(scope="module")
def target(target_model):
    return FrozenTarget(target_model)


def noisy_copy(model, scale, seed):
    """The target with Gaussian noise on every weight: a draft that agrees with it often, not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=g) * scale * param.std().clamp_min(1e-3))
    return draft


@pytest.fixture(scope="module")
def sources(target_model):
    """Every kind of source: a perfect draft, a partly-right one, an unrelated one, prompt lookup."""
    return {
        "identical": lambda: DraftLMSource(target_model),
        "noisy": lambda: DraftLMSource(noisy_copy(target_model, 0.2, seed=1)),
        "random": lambda: DraftLMSource(tiny_llama(VOCAB, seed=7, num_hidden_layers=1)),
        "prompt_lookup": lambda: PromptLookupSource(max_ngram=3, min_ngram=1),
    }


def prompts(count, seed=0):
    """Random prompts of varied lengths, including a single token and repeated n-grams."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.tensor([[1]])]
    for i in range(count - 1):
        body = torch.randint(3, VOCAB, (3 + 5 * i,), generator=g)
        out.append(torch.cat([torch.tensor([1]), body, body[:4]])[None])
    return out


def naive_greedy(model, prompt_ids, max_new_tokens):
    """The plainest possible greedy loop: re-run the whole sequence, no KV cache."""
    ids = prompt_ids
    for _ in range(max_new_tokens):
        next_id = model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=1)
    return ids[0, prompt_ids.shape[1] :].tolist()


def hf_greedy(model, prompt_ids, max_new_tokens, eos_token_id=None):
    out = model.generate(
        prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=max_new_tokens,
        do_sample=False, eos_token_id=eos_token_id, pad_token_id=0,
    )  # fmt: skip
    return out[0, prompt_ids.shape[1] :].tolist()


@pytest.mark.parametrize("name", ["identical", "noisy", "random", "prompt_lookup"])
def test_greedy_equals_target_greedy(target, target_model, sources, name):
    source = sources[name]()
    accepted = drafted = 0
    for prompt in prompts(10):
        expected = hf_greedy(target_model, prompt, MAX_NEW)
        assert naive_greedy(target_model, prompt, MAX_NEW) == expected
        for k in (1, 4):
            out = speculative_decode(target, source, prompt, k=k, max_new_tokens=MAX_NEW)
            assert out.tokens == expected, f"{name} k={k} prompt={prompt.tolist()}"
            accepted += sum(s.num_accepted for s in out.steps)
            drafted += sum(s.num_drafted for s in out.steps)
    # The test means something only if drafts were really accepted (and, for "random", mostly rejected).
    if name == "random":
        assert accepted < 0.1 * drafted
    else:
        assert accepted > 30


def test_plain_decode_equals_target_greedy(target, target_model):
    for prompt in prompts(4):
        assert plain_decode(target, prompt, max_new_tokens=MAX_NEW).tokens == hf_greedy(target_model, prompt, MAX_NEW)


def test_stops_at_eos_like_generate(target, target_model, sources):
    prompt = prompts(3)[2]
    greedy = hf_greedy(target_model, prompt, MAX_NEW)
    eos = greedy[9]  # a token the target emits at step 10 (maybe earlier too)
    expected = hf_greedy(target_model, prompt, MAX_NEW, eos_token_id=eos)
    assert expected[-1] == eos and len(expected) <= 10
    for name in ("identical", "noisy", "prompt_lookup"):
        out = speculative_decode(target, sources[name](), prompt, k=4, max_new_tokens=MAX_NEW, eos_token_ids=[eos])
        assert out.tokens == expected, name
        # No step after the one that emitted the stop token (even as an accepted draft mid-step):
        # the prefill's token and every step but the last fall short of the stop token, the last
        # step reaches it (emitting possibly more, which decoding then cuts).
        emitted = [1] + [s.num_accepted + 1 for s in out.steps]
        assert sum(emitted[:-1]) < len(expected) <= sum(emitted), (name, emitted)
    assert plain_decode(target, prompt, max_new_tokens=MAX_NEW, eos_token_ids=eos).tokens == expected


def test_step_stats_add_up(target, target_model):
    prompt = prompts(4)[3]
    k = 3
    out = speculative_decode(target, DraftLMSource(noisy_copy(target_model, 0.2, 1)), prompt, k=k, max_new_tokens=40)
    assert len(out.tokens) == 40
    # One token from the prefill, then n + 1 per step (the last step may be cut at the budget).
    emitted = 1 + sum(s.num_accepted + 1 for s in out.steps)
    assert 40 <= emitted <= 40 + k
    assert all(0 <= s.num_accepted <= s.num_drafted <= k for s in out.steps)
    assert any(0 < s.num_accepted < s.num_drafted for s in out.steps)
    for s in out.steps:
        # Greedy p and q are one-hot, so alpha predicted is 1 exactly where the draft was accepted.
        assert s.alpha_predicted == [1.0] * s.num_accepted + [0.0] * (s.num_accepted < s.num_drafted)
        assert s.draft_seconds > 0 and s.target_seconds > 0
    assert out.seconds >= out.prefill_seconds + sum(s.draft_seconds + s.target_seconds for s in out.steps)


def test_identical_draft_accepts_everything(target, target_model):
    out = speculative_decode(target, DraftLMSource(target_model), prompts(2)[1], k=5, max_new_tokens=25)
    assert [s.num_accepted for s in out.steps] == [5, 5, 5, 5]
    # Temperature sampling too: q == p, so every draft passes u < p/q = 1.
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(0)
    out = speculative_decode(target, DraftLMSource(target_model), prompts(2)[1], k=5, params=params,
                             max_new_tokens=25, generator=g)  # fmt: skip
    assert [s.num_accepted for s in out.steps] == [5, 5, 5, 5]
    assert all(a == pytest.approx(1.0, abs=1e-5) for s in out.steps for a in s.alpha_predicted)


def test_sampling_is_reproducible_and_seed_dependent(target, target_model):
    prompt = prompts(3)[2]
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)

    def run(seed):
        source = DraftLMSource(noisy_copy(target_model, 0.5, 1))
        g = torch.Generator().manual_seed(seed)
        return speculative_decode(target, source, prompt, k=4, params=params, max_new_tokens=30, generator=g).tokens

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_lossy_knobs(target, target_model):
    prompt = prompts(3)[2]
    expected = hf_greedy(target_model, prompt, MAX_NEW)
    draft = noisy_copy(target_model, 0.2, 1)
    # Greedy p is one-hot: typical acceptance keeps d iff p(d) = 1 > threshold, which is greedy verify.
    out = speculative_decode(target, DraftLMSource(draft), prompt, k=4, max_new_tokens=MAX_NEW, typical_acceptance=True)
    assert out.tokens == expected
    # Lenience only changes random rows, never greedy ones.
    out = speculative_decode(target, DraftLMSource(draft), prompt, k=4, max_new_tokens=MAX_NEW, lenience=0.3)
    assert out.tokens == expected
    # Sampling with typical acceptance still runs and respects the budget.
    g = torch.Generator().manual_seed(0)
    out = speculative_decode(target, DraftLMSource(draft), prompt, k=4, params=SamplingParams(temperature=1.0),
                             max_new_tokens=MAX_NEW, generator=g, typical_acceptance=True)  # fmt: skip
    assert len(out.tokens) == MAX_NEW


def test_budget_capped_by_context():
    model = tiny_llama(VOCAB, seed=0, max_position_embeddings=40)
    target = FrozenTarget(model)
    prompt = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(0))
    out = speculative_decode(target, DraftLMSource(model), prompt, k=8, max_new_tokens=100)
    assert len(out.tokens) == 10  # 30 + 10 = the whole context, never more
    assert out.tokens == hf_greedy(model, prompt, 10)
    assert len(plain_decode(target, prompt, max_new_tokens=100).tokens) == 10
    with pytest.raises(SpecdraftError, match="max_position_embeddings"):
        speculative_decode(target, PromptLookupSource(), torch.ones(1, 40, dtype=torch.long), k=2)
    with pytest.raises(SpecdraftError, match="max_position_embeddings"):
        plain_decode(target, torch.ones(1, 41, dtype=torch.long))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(k=0), "k \\(drafts per step\\)"),
        (dict(k=-2), "k \\(drafts per step\\)"),
        (dict(k=2.5), "k \\(drafts per step\\)"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(lenience=0.0), "lenience"),
        (dict(lenience=1.5), "lenience"),
        (dict(verify_backend="cuda"), "verify backend must be one of auto, triton, reference; got 'cuda'"),
    ],
)
def test_bad_arguments(target, kwargs, message):
    with pytest.raises(SpecdraftError, match=message):
        speculative_decode(target, PromptLookupSource(), prompts(2)[1], **kwargs)


def test_bad_prompts_and_temperature(target):
    with pytest.raises(SpecdraftError, match="one prompt at a time"):
        speculative_decode(target, PromptLookupSource(), torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(SpecdraftError, match="shape"):
        speculative_decode(target, PromptLookupSource(), torch.ones(1, 0, dtype=torch.long))
    with pytest.raises(SpecdraftError, match="temperature"):
        SamplingParams(temperature=-0.5)


def test_source_returning_too_many_drafts_is_caught(target):
    class Greedy(PromptLookupSource):
        def propose(self, pending, k, params, generator):
            proposal = super().propose(pending, k, params, generator)
            proposal.tokens = torch.ones(1, k + 1, dtype=torch.long)
            return proposal

    with pytest.raises(SpecdraftError, match="asked for at most"):
        speculative_decode(target, Greedy(), prompts(2)[1], k=2)


class Fixed(PromptLookupSource):
    """Proposes the same tokens every step, as a chain or as the tree ``parents`` describes."""

    def __init__(self, parents):
        super().__init__()
        self.parents = parents

    def propose(self, pending, k, params, generator):
        return Proposal(torch.ones(1, k, dtype=torch.long), None, self.parents[:, :k])


def test_a_proposal_is_a_chain_or_a_tree(target):
    """parents=None and parents -1, 0, 1, .. are both chains; a tree goes through tree verification, whose
    first proposal of a call is checked (here: two siblings with the same token, which no tree may have)."""
    chain = torch.tensor([[-1, 0, 1]])
    assert Proposal(torch.ones(1, 3, dtype=torch.long), None).is_chain()
    assert Proposal(torch.ones(1, 3, dtype=torch.long), None, chain).is_chain()
    tree = torch.tensor([[-1, 0, 0]])  # two children of the first draft
    assert not Proposal(torch.ones(1, 3, dtype=torch.long), None, tree).is_chain()
    expected = plain_decode(target, prompts(2)[1], max_new_tokens=6).tokens
    assert speculative_decode(target, Fixed(chain), prompts(2)[1], k=3, max_new_tokens=6).tokens == expected
    with pytest.raises(SpecdraftError, match="siblings .* same token"):
        speculative_decode(target, Fixed(tree), prompts(2)[1], k=3, max_new_tokens=6)


@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
def test_drafter_families_plug_in(family):
    """Any registered drafter's DraftSource runs through the decoder and stays lossless (greedy)."""
    from transformers import LlamaConfig

    from specdraft.decoding.speculative import TreeDrafting
    from specdraft.decoding.trees import DynamicTree
    from specdraft.drafters import get_family

    config = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256)  # fmt: skip
    target = FrozenTarget.from_config(config, needs=TargetNeeds(taps=(1, 2, 3)), device="cpu")
    seeded_init_(target.model, seed=0)
    fam = get_family(family)
    source = fam.build(target, fam.config_cls()).draft_source(target)
    for prompt in prompts(3):
        expected = plain_decode(target, prompt, max_new_tokens=MAX_NEW).tokens
        assert hf_greedy(target.model, prompt, MAX_NEW) == expected
        assert speculative_decode(target, source, prompt, k=3, max_new_tokens=MAX_NEW).tokens == expected
        # the target's verify compiled: EAGLE's taps come from its hidden states instead of hooks, for chains
        # and for EAGLE-2's dynamic trees
        assert speculative_decode(target, source, prompt, k=3, max_new_tokens=MAX_NEW,
                                  compile_target=True).tokens == expected  # fmt: skip
        tree = TreeDrafting(source, DynamicTree(total_tokens=8, depth=3, top_k=3))
        assert speculative_decode(target, tree, prompt, k=3, max_new_tokens=MAX_NEW,
                                  compile_target=True).tokens == expected  # fmt: skip


def test_a_compiled_draft_decodes_the_targets_greedy_tokens(target, target_model):
    """compile=True: the draft's steps run compiled over a static cache, rolled back by position. A small
    starting room makes the cache outgrow itself mid-decode, so the copy into a larger one is checked too."""
    draft = noisy_copy(target_model, 0.2, seed=1)
    source = DraftLMSource(draft, compile=True)
    source.room = 4
    full = partial = 0
    for prompt in prompts(4)[2:]:  # 13 and 18 tokens: caches of 32, grown to 64
        out = speculative_decode(target, source, prompt, k=4, max_new_tokens=MAX_NEW)
        assert out.tokens == hf_greedy(target_model, prompt, MAX_NEW)
        full += sum(s.num_accepted == s.num_drafted == 4 for s in out.steps)  # then the draft reads 2 tokens
        partial += sum(s.num_accepted < s.num_drafted for s in out.steps)  # then it rolls back
    assert source.capacity == 64 and source._compiled_sizes == {32, 64}
    assert full > 0 and partial > 0


def test_compiled_drafts_propose_what_the_eager_ones_do(target, target_model):
    """The target's tokens are right whatever the drafts are, so the drafts' own numbers are compared here: q at
    every draft position, through rollbacks of every length and the cache outgrowing itself. Two drafts of one
    architecture are compiled side by side: each must keep its own weights and its own cache."""
    drafts = [noisy_copy(target_model, 0.2, seed=1), noisy_copy(target_model, 0.5, seed=2)]
    pairs = [(DraftLMSource(d, compile=True), DraftLMSource(d)) for d in drafts]
    prompt = prompts(4)[2]  # 13 tokens: a cache of 32, grown to 64 below
    target_out = target(prompt, logits="last")
    for compiled, eager in pairs:
        compiled.room = 4
        compiled.start(prompt, target_out)
        eager.start(prompt, target_out)
    params, g = SamplingParams(temperature=1.0), torch.Generator().manual_seed(0)
    for _ in range(14):
        pending = torch.randint(3, VOCAB, (1, 1), generator=g)
        seed = int(torch.randint(1 << 30, (1,), generator=g))
        for compiled, eager in pairs:
            ours, theirs = (s.propose(pending, 3, params, torch.Generator().manual_seed(seed)) for s in (compiled, eager))
            torch.testing.assert_close(ours.probs, theirs.probs, rtol=0, atol=1e-5)
            assert torch.equal(ours.tokens, theirs.tokens)
            kept = torch.cat([pending, theirs.tokens[:, : int(torch.randint(4, (1,), generator=g))]], dim=1)
            compiled.commit(kept, None)
            eager.commit(kept, None)
    assert [compiled.capacity for compiled, _ in pairs] == [64, 64]


def test_compiling_a_draft_needs_a_static_cache_that_rolls_back(monkeypatch, target_model):
    from specdraft.decoding import sources as sources_module

    monkeypatch.setattr(sources_module.StaticLayer, "__annotations__", {})
    with pytest.raises(SpecdraftError, match=re.escape("pip install -U 'transformers>=5.23'")):
        DraftLMSource(target_model, compile=True)


def test_a_compiled_verify_decodes_the_targets_greedy_tokens(target, target_model):
    """compile_target: every verify runs K+1 wide, compiled over a static cache. Prompt lookup proposes 0 to K
    drafts (padded steps), the draft LM rolls back by every length, and the budget's end shortens the last steps.
    Plain decoding's steps compile the same way, 1 wide."""
    for prompt in prompts(3)[1:]:
        assert plain_decode(target, prompt, max_new_tokens=MAX_NEW, compile_target=True).tokens == \
            hf_greedy(target_model, prompt, MAX_NEW)
    for source in (DraftLMSource(noisy_copy(target_model, 0.2, seed=1)), PromptLookupSource(max_ngram=3, min_ngram=1)):
        widths = set()
        for prompt in prompts(4)[1:]:
            out = speculative_decode(target, source, prompt, k=4, max_new_tokens=MAX_NEW, compile_target=True)
            assert out.tokens == hf_greedy(target_model, prompt, MAX_NEW)
            widths |= {s.num_drafted for s in out.steps}
        assert len(widths) > 2  # steps of several widths went through the one compiled shape


def test_a_compiled_verify_keeps_compiling_past_dynamos_default_limit(target):
    """A target whose decodes use more than 8 shapes (cache sizes x widths x chain or tree) still runs each new
    one compiled: dynamo's default of 8 graphs per function would run the 9th and later eager."""
    from torch._dynamo.utils import counters

    from specdraft.decoding.compiled_verify import compiled_verify

    verifier = compiled_verify(FrozenTarget(target.model), True)
    before = counters["stats"]["unique_graphs"]
    for width in range(1, 10):
        verifier.new_cache(8, width)
    assert counters["stats"]["unique_graphs"] - before >= 9


def test_the_compiled_verify_gives_the_eager_targets_outputs(target):
    """The verify's logits, final hidden states and taps (layer inputs, EAGLE's features) against the eager
    target's over the same tokens: a full-width step, a rollback of 3, then a narrower step padded to the full
    width, whose queries must not read the pad keys written beside them. Then on a cache for trees: two tree
    steps, each kept path moved into place in the static buffers, against the eager target over the same cache
    layout. A tree not drafted through TreeDrafting (nothing sizes its steps) refuses compile_target, and so
    does a target that trains adapters, also when they are declared after the verify was compiled."""
    from specdraft.decoding.compiled_verify import compiled_verify

    target = FrozenTarget(target.model, needs=TargetNeeds(taps=(0, 1), final_hidden=True))
    verifier = compiled_verify(target, True)
    g = torch.Generator().manual_seed(0)
    prompt, first, second = (torch.randint(3, VOCAB, (1, n), generator=g) for n in (9, 5, 2))
    cache = verifier.new_cache(32, 5)
    target(prompt, past_key_values=cache.static, use_cache=True, logits="none")
    cache.length = 9
    context = prompt
    for step, kept in ((first, 2), (second, 2)):
        ours = verifier(step, past_key_values=cache)
        context = torch.cat([context, step], dim=1)
        theirs = target(context)
        for field in ("logits", "final_hidden", "aux_hidden"):
            torch.testing.assert_close(getattr(ours, field), getattr(theirs, field)[:, -step.shape[1] :], rtol=0,
                                       atol=1e-5)  # fmt: skip
        assert ours.taps == (0, 1)
        assert cache.length == context.shape[1] and int(cache.static.get_seq_length()) == cache.length
        cache.crop(kept - step.shape[1])
        context = context[:, : cache.length]

    # Trees: nodes [a, b, c, d] with parents [-1, -1, 1, 2] (two branches: a; b-c-d), verified at positions
    # length + depth under the tree mask; the path b-c is kept (not a prefix: its keys move), then b alone.
    from specdraft.decoding.kv_cache import preallocated_cache
    from specdraft.decoding.kv_cache import keep_slots
    from specdraft.decoding.trees import ancestor_matrix, tree_attention_mask

    tree_cache, eager_cache = verifier.new_cache(32, 5, tree=True), preallocated_cache(target.config, 32)
    for cache_of in (tree_cache.static, eager_cache):
        target(prompt, past_key_values=cache_of, use_cache=True)
    tree_cache.length = prompt.shape[1]
    ancestors = ancestor_matrix(torch.tensor([-1, -1, 1, 2]))
    for step, path in ((torch.randint(3, VOCAB, (1, 5), generator=g), [1, 2]), (first[:, :3], [1])):
        nodes = step.shape[1] - 1
        past = tree_cache.length
        mask, positions = tree_attention_mask(ancestors[:nodes, :nodes], past), past + torch.cat(
            [torch.zeros(1, dtype=torch.long), ancestors[:nodes, :nodes].sum(1)])[None]  # fmt: skip
        ours = verifier(step, past_key_values=tree_cache, attention_mask=mask, position_ids=positions)
        theirs = target(step, attention_mask=mask, position_ids=positions, past_key_values=eager_cache, use_cache=True)
        for field in ("logits", "final_hidden", "aux_hidden"):
            torch.testing.assert_close(getattr(ours, field), getattr(theirs, field), rtol=0, atol=1e-5)
        for cache_of in (tree_cache, eager_cache):
            keep_slots(cache_of, past, [[0] + [node + 1 for node in path]], step.shape[1])
        assert tree_cache.length == eager_cache.get_seq_length() == past + 1 + len(path)
    with pytest.raises(SpecdraftError, match="made for chains or for trees"):
        verifier(first, past_key_values=tree_cache)

    class TreeLookup(PromptLookupSource):
        def propose(self, pending, k, params, generator):
            return Proposal(torch.tensor([[5, 6]]), None, torch.tensor([[-1, -1]]))

    with pytest.raises(SpecdraftError, match="sizes its steps by a TreeDrafting's tree"):
        speculative_decode(target, TreeLookup(), prompts(2)[1], k=2, max_new_tokens=8, compile_target=True)
    with pytest.raises(SpecdraftError, match="trains adapters"):
        compiled_verify(FrozenTarget(target.model, needs=TargetNeeds(trains_adapters=True)), True)
    later = FrozenTarget(target.model)
    verifier = compiled_verify(later, True)
    later.require(TargetNeeds(trains_adapters=True))  # a Medusa-2 drafter put on it after the verify was compiled
    with pytest.raises(SpecdraftError, match="trains adapters"):
        verifier.new_cache(16, 2)
