"""Batched decoding: B prompts of different lengths in one target forward per step. Each row's greedy output is
what that prompt gives decoded alone, for every kind of source; sampled rows follow the target; bad input."""

import pytest
import torch
from test_speculative import VOCAB, noisy_copy, prompts, target, target_model  # noqa: F401 (fixtures)

from specdraft.decoding.batched import fresh_sources, speculative_decode_batch
from specdraft.decoding.sources import DraftLMSource, PromptLookupSource
from specdraft.decoding.speculative import TreeDrafting, plain_decode, speculative_decode
from specdraft.decoding.trees import StaticTree
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


def test_bad_batches_are_refused(target):
    long = torch.ones(target.config.max_position_embeddings, dtype=torch.long)
    with pytest.raises(SpecdraftError, match="prompt 1 of the batch.*context"):
        speculative_decode_batch(target, None, [torch.tensor([1, 2]), long])
    with pytest.raises(SpecdraftError, match="one source per prompt"):
        speculative_decode_batch(target, [PromptLookupSource()], batch_prompts())
    with pytest.raises(SpecdraftError, match="at least one prompt"):
        speculative_decode_batch(target, None, [])

    class TreeLookup(PromptLookupSource):
        tree_kinds = ("static",)

        def propose_tree(self, pending, tree, params, generator):
            from specdraft.contract import Proposal

            return Proposal(torch.tensor([[5, 6]]), None, torch.tensor([[-1, -1]]))

    with pytest.raises(SpecdraftError, match="batched decoding verifies chains"):
        speculative_decode_batch(target, fresh_sources(TreeDrafting(TreeLookup(), StaticTree.chain(2)), B),
                                 batch_prompts(), max_new_tokens=4)


@pytest.mark.parametrize("family", ["medusa1", "mlp_speculator"])
def test_heads_draft_every_row_in_one_propose(family, monkeypatch):
    """Sources naming their ``row_state`` (heads reading one hidden state) draft the whole batch in one
    propose a step, and each row gets what its own source drafts alone: the same greedy drafts, the same q
    at T = 1 for every draft whose predecessors match (rows asking for fewer drafts get the start of
    their chain). Copies of different drafters are never stacked."""
    from specdraft.decoding.batched import _propose_rows
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
        for b, n in wanted.items():
            alone = sources[b].propose(pending[b].view(1, 1), n, params, torch.Generator().manual_seed(0))
            assert rows[b].tokens.shape == (1, n)
            if params.is_greedy:
                assert torch.equal(rows[b].tokens, alone.tokens)
            else:
                assert_same_q(rows[b], alone)
    calls.clear()
    mixed = _propose_rows(sources, pending, {0: 2, 3: 2}, SamplingParams(temperature=1.0), None)
    assert calls == [1, 1]  # not stacked: rows 0 and 3 hold different drafters
    assert_same_q(mixed[3], other.propose(pending[3].view(1, 1), 2, SamplingParams(temperature=1.0), None))


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
