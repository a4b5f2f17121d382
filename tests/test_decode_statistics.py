"""Speculative sampling through the whole decoder emits the target's distribution.

Tiny Llama targets (12 tokens for the draft LM and prompt lookup, 16 for EAGLE) and their
draft sources decode from a fixed prompt many times, run i with a generator seeded with i.
The first token comes from the prefill; later ones come out of verify steps (accepted
drafts, corrections, bonus tokens). Three checks, each a statistic with a derived bound
(the helpers are in tests/test_verify_statistics.py):

* marginals: the histograms of the 2nd and 3rd tokens against the target's exact marginals,
  computed by enumerating every earlier token (L1 distance, McDiarmid bound);
* draft bias: at every position where a draft was verified, the emitted token is one the
  draft over-proposes (q(x) > p(x)) with probability sum_{q > p} p given the text so far,
  so the count minus those probabilities is a martingale (Freedman bound). Drawing the
  correction from p instead of the residual emits such tokens too often; accepting with
  p(x) instead of min(1, p(x) / q(x)), too rarely;
* acceptance: accepted drafts against alpha predicted = sum min(p, q) (Freedman bound).

Seeds are fixed, so the tests are deterministic. Weights come from their own seeded
generators (``tiny.seeded_init_``), not from whatever global RNG transformers' init consumes.
tests/test_mutants_sampling.py runs the same scenarios on broken samplers.
"""

from dataclasses import dataclass
from functools import lru_cache

import pytest
import torch
from test_verify_statistics import Check, assert_all_pass, l1_check, martingale_check
from tiny import seeded_init_, tiny_llama
from transformers import LlamaConfig

from specdraft.contract import TargetNeeds
from specdraft.data.vocab import DraftVocab
from specdraft.decoding.sampling import SamplingParams, logits_to_probs
from specdraft.decoding.sources import DraftLMSource, PromptLookupSource
from specdraft.decoding.speculative import plain_decode, speculative_decode
from specdraft.drafters import get_family
from specdraft.target import FrozenTarget

PROMPT = torch.tensor([[1, 5, 9, 3, 5, 9, 7]])
SAMPLED = SamplingParams(temperature=1.0)
NUM_RUNS = 400
K = 3
NUM_TOKENS = 12  # the marginals use the first 3; every verified position feeds the draft-bias check


# ---------------------------------------------------------------- models


def small_llama(std: float, attention_scale: float = 1.0):
    """A 2-layer, 12-token Llama; weights of std 0.2-0.3 give peaked but not one-hot
    next-token distributions. ``attention_scale`` < 1 damps what attention adds to the
    residual stream, so the current token dominates the prediction."""
    model = tiny_llama(12, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    seeded_init_(model, seed=0, std=std)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(attention_scale)
    return model


@lru_cache(maxsize=None)
def draft_lm_models():
    """The target, and a draft LM that is the same network with a 3x sharper head (q ~ p^3):
    like a distilled draft it agrees on the ranking, but it over-proposes each mode and
    leaves the residual on the other tokens."""
    target = small_llama(std=0.2)
    draft = small_llama(std=0.2)
    with torch.no_grad():
        draft.lm_head.weight.mul_(3.0)
    return FrozenTarget(target), draft


@lru_cache(maxsize=None)
def prompt_lookup_setup():
    """A target that mostly reads the current token (attention damped to 0.3), and as prompt
    its own greedy text, which repeats tokens: what followed a token earlier is a likely next
    token again, so prompt lookup's drafts have substantial p and are often accepted."""
    target = FrozenTarget(small_llama(std=0.3, attention_scale=0.3))
    start = PROMPT[:, :1]
    prompt = torch.cat([start, torch.tensor([plain_decode(target, start, max_new_tokens=9).tokens])], dim=1)
    return target, prompt


EAGLE_VOCAB = 16
# EAGLE-3's reduced draft vocabulary: 10 of the 16 target ids, not a prefix, so d2t is not all zero.
EAGLE3_DRAFT_IDS = torch.tensor([2, 3, 5, 7, 8, 10, 11, 13, 14, 15])


@lru_cache(maxsize=None)
def eagle_setup(family: str):
    """A 4-layer, 16-token target tapped at layers 1-3, and an untrained EAGLE drafter.

    EAGLE-3's head starts at the target's head rows for its draft vocabulary, so its q is
    related to p, and the draft vocabulary misses 6 target tokens (q = 0 there)."""
    config = LlamaConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=EAGLE_VOCAB, max_position_embeddings=64)  # fmt: skip
    target = FrozenTarget.from_config(config, needs=TargetNeeds(taps=(1, 2, 3)), device="cpu")
    seeded_init_(target.model, seed=0, std=0.5)
    fam = get_family(family)
    torch.manual_seed(0)  # the drafter's own layers: PyTorch's default init, from a fixed seed
    if family == "eagle1":
        drafter = fam.build(target, fam.config_cls())
    else:
        vocab = DraftVocab.from_target_ids(EAGLE3_DRAFT_IDS, EAGLE_VOCAB)
        drafter = fam.build(target, fam.config_cls(ttt_steps=2, draft_vocab_size=len(EAGLE3_DRAFT_IDS)), vocab)
    return target, drafter.eval()


# ---------------------------------------------------------------- decoding


class RecordingSource:
    """A real DraftSource, passed through unchanged, that keeps each proposal's q
    (one-hot on the drafts when the source proposes deterministic drafts)."""

    def __init__(self, source, vocab_size: int):
        self.source, self.vocab_size, self.q = source, vocab_size, []

    def start(self, prompt_ids, target_out):
        self.source.start(prompt_ids, target_out)

    def propose(self, pending, k, params, generator):
        proposal = self.source.propose(pending, k, params, generator)
        q = proposal.probs
        if q is None:
            q = torch.nn.functional.one_hot(proposal.tokens, self.vocab_size).float()
        self.q.append(q[0])
        return proposal

    def commit(self, kept_ids, target_out):
        self.source.commit(kept_ids, target_out)


@dataclass
class Decodes:
    prompt: torch.Tensor  # [1, L]
    tokens: torch.Tensor  # [N, T] emitted tokens of each run
    q: torch.Tensor  # [N, T, V] the q the draft at that position was drawn from (zeros where none)
    tested: torch.Tensor  # [N, T] bool: a draft was verified there (not the prefill token, not a bonus)
    steps: list  # every StepStats of every run


def decode_many(target, make_source, params, prompt, num_runs, k=K, num_tokens=NUM_TOKENS, lenience=1.0) -> Decodes:
    """``num_runs`` decodes of ``num_tokens`` tokens, run i with a generator seeded with i, each
    through a fresh source from ``make_source``; records which q each emitted token faced."""
    vocab_size = target.vocab_size
    tokens, qs, tested, all_steps = [], [], [], []
    for seed in range(num_runs):
        source = RecordingSource(make_source(), vocab_size)
        out = speculative_decode(
            target, source, prompt, k=k, params=params, max_new_tokens=num_tokens,
            generator=torch.Generator().manual_seed(seed), lenience=lenience,
        )  # fmt: skip
        q, has_q = torch.zeros(num_tokens, vocab_size), torch.zeros(num_tokens, dtype=torch.bool)
        t = 1  # token 0 came from the prefill
        for step, step_q in zip(out.steps, source.q):
            for j in range(step.num_accepted + 1):  # the accepted drafts, then the correction or bonus
                if t < num_tokens and j < step.num_drafted:
                    q[t], has_q[t] = step_q[j], True
                t += 1
        tokens.append(out.tokens)
        qs.append(q)
        tested.append(has_q)
        all_steps.extend(out.steps)
    return Decodes(prompt, torch.tensor(tokens), torch.stack(qs), torch.stack(tested), all_steps)


def probs_after(model, prefixes: torch.Tensor, params) -> torch.Tensor:
    """[n, V] warped next-token distributions after each row of ``prefixes`` [n, L]."""
    return logits_to_probs(model(prefixes).logits[:, -1], params)


@torch.no_grad()
def exact_marginals(target, params, prompt):
    """P(x2), P(x3) of the target's own sampling from ``prompt``, by enumerating x1 and (x1, x2)."""
    L, V = prompt.shape[1], target.vocab_size
    p1 = probs_after(target, prompt, params)[0]
    x = torch.arange(V)
    seqs1 = torch.cat([prompt.expand(V, L), x[:, None]], dim=1)  # every x1
    seqs2 = torch.cat([seqs1.repeat_interleave(V, 0), x.repeat(V)[:, None]], dim=1)  # every (x1, x2)
    joint12 = p1[:, None] * probs_after(target, seqs1, params)  # [V(x1), V(x2)]
    p3_given_12 = probs_after(target, seqs2, params).view(V, V, V)
    return joint12.sum(0), (joint12[..., None] * p3_given_12).sum((0, 1))


# ---------------------------------------------------------------- the checks


def marginal_checks(decodes: Decodes, target, params) -> list[Check]:
    p2, p3 = exact_marginals(target, params, decodes.prompt)
    return [
        l1_check("2nd token vs exact marginal", decodes.tokens[:, 1], p2),
        l1_check("3rd token vs exact marginal", decodes.tokens[:, 2], p3),
    ]


@torch.no_grad()
def draft_bias_check(decodes: Decodes, target, params) -> Check:
    """Tokens the draft over-proposes (q(x) > p(x)) are emitted with probability sum_{q > p} p.

    p at every position comes from one teacher-forced target forward over the emitted text,
    independent of the decoder's cache. Given everything emitted before a position, its token
    follows p, and the q drafted there is already fixed: the outcomes minus their
    probabilities form a martingale.
    """
    prompt, tokens = decodes.prompt, decodes.tokens
    L, T = prompt.shape[1], tokens.shape[1]
    ids = torch.cat([prompt.expand(len(tokens), L), tokens], dim=1)
    p = logits_to_probs(target(ids).logits[:, L - 1 : L - 1 + T], params)  # [N, T, V]
    favoured = decodes.q > p
    emitted_favoured = favoured.gather(-1, tokens[..., None]).squeeze(-1)
    probability = (p * favoured).sum(-1)
    return martingale_check("draft-favoured tokens", emitted_favoured[decodes.tested], probability[decodes.tested])


def acceptance_check(steps) -> Check:
    """Each tested draft (the accepted ones and the rejected one, per step) is accepted with
    probability alpha = sum_x min(p, q) given its context."""
    tested = [(i < s.num_accepted) for s in steps for i in range(min(s.num_accepted + 1, s.num_drafted))]
    alphas = torch.tensor([a for s in steps for a in s.alpha_predicted])
    assert len(alphas) == len(tested)
    return martingale_check("accepted drafts vs alpha predicted", torch.tensor(tested), alphas)


def all_checks(decodes: Decodes, target, params) -> list[Check]:
    return marginal_checks(decodes, target, params) + [
        draft_bias_check(decodes, target, params),
        acceptance_check(decodes.steps),
    ]


def acceptance_per_tested_draft(steps) -> float:
    """Accepted drafts per tested draft (the accepted ones and the rejected one, per step)."""
    return sum(s.num_accepted for s in steps) / sum(min(s.num_accepted + 1, s.num_drafted) for s in steps)


# ---------------------------------------------------------------- scenarios (also run on mutants)


def draft_lm_scenario(params=SAMPLED, num_runs=NUM_RUNS, lenience=1.0):
    target, draft = draft_lm_models()
    decodes = decode_many(target, lambda: DraftLMSource(draft), params, PROMPT, num_runs, lenience=lenience)
    return all_checks(decodes, target, params), decodes


# Warped hard enough (the 2nd token's top-1 is 0.92 of the warped p, top-k keeps 5 of 12 tokens) that a q
# verified without the warping is caught by the draft-bias check at 2.8x its bound (tests/test_mutants_sampling.py).
WARPED = SamplingParams(temperature=0.5, top_k=5, top_p=0.95)


def warped_draft_lm_scenario(num_runs=300):
    return draft_lm_scenario(WARPED, num_runs=num_runs)


def prompt_lookup_scenario(num_runs=NUM_RUNS):
    target, prompt = prompt_lookup_setup()
    decodes = decode_many(target, lambda: PromptLookupSource(max_ngram=2), SAMPLED, prompt, num_runs)
    return all_checks(decodes, target, SAMPLED), decodes


def eagle_scenario(family: str, num_runs=NUM_RUNS):
    """Shorter decodes (6 tokens) than the others: an EAGLE step costs more, and the marginals,
    which catch a broken d2t map, only need the first 3 tokens."""
    target, drafter = eagle_setup(family)
    decodes = decode_many(target, lambda: drafter.draft_source(target), SAMPLED, PROMPT, num_runs, num_tokens=6)
    return all_checks(decodes, target, SAMPLED), decodes


# ---------------------------------------------------------------- tests


def assert_both_paths_ran(decodes: Decodes):
    """Accepted drafts and corrections both carry a real share of the output."""
    assert 0.1 < acceptance_per_tested_draft(decodes.steps) < 0.9


def test_draft_lm_decoding_emits_target_marginals():
    checks, decodes = draft_lm_scenario()
    assert_all_pass(checks)
    assert_both_paths_ran(decodes)


def test_warped_sampling_emits_warped_target_marginals():
    """Temperature, top-k and top-p apply to p and q alike, and the output follows the warped p."""
    checks, decodes = warped_draft_lm_scenario()
    assert_all_pass(checks)
    assert_both_paths_ran(decodes)


def test_prompt_lookup_sampling_emits_target_marginals():
    """Deterministic drafts (q one-hot, probs=None) go through the same exact test."""
    checks, decodes = prompt_lookup_scenario()
    assert_all_pass(checks)
    assert_both_paths_ran(decodes)


@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
def test_eagle_sampling_emits_target_marginals(family):
    """EAGLE drafts at T = 1, chained over K = 3 positions. EAGLE-3's q lives on a reduced draft
    vocabulary and is moved to target ids through d2t; the 6 target tokens outside it (q = 0)
    can only come out as corrections or bonus tokens."""
    checks, decodes = eagle_scenario(family)
    assert_all_pass(checks)
    assert_both_paths_ran(decodes)
    if family == "eagle3":
        _, drafter = eagle_setup(family)
        assert drafter.d2t.any()  # draft id != target id: an unmapped q or draft would show
        assert (~drafter.t2d[decodes.tokens[:, 1:3]]).any()  # the marginals cover out-of-vocabulary tokens


def test_lenience_is_lossy_and_accepts_more():
    """lenience < 1 (off by default) trades exactness for acceptance: the checks that pass for
    exact verification reject it with margin."""
    checks, _ = draft_lm_scenario(num_runs=150, lenience=0.2)
    acceptance, bias = checks[-1], checks[-2]
    assert acceptance.statistic > 2 * acceptance.bound  # far more accepted than sum min(p, q) predicts
    assert bias.statistic > 2 * bias.bound  # and the over-proposed tokens come out too often
