"""EAGLE drafters as DraftSources: train/serve consistency and lossless greedy decoding.

Exact sampling at T > 0 with EAGLE sources is checked in tests/test_decode_statistics.py.
"""

import pytest
import torch
from tiny import seeded_init_
from transformers import LlamaConfig

from specdraft.contract import TargetNeeds
from specdraft.data.vocab import DraftVocab, top_tokens
from specdraft.decoding.sampling import SamplingParams
from specdraft.decoding.speculative import plain_decode, speculative_decode
from specdraft.drafters import get_family
from specdraft.masks import shift_left
from specdraft.masks import block_causal_mask
from specdraft.target import FrozenTarget

VOCAB = 256
GREEDY, SAMPLED = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
# Decoding and training compute the same float32 probabilities in different op orders (cached
# vs. full attention, one row vs. all): they differ by float32 rounding accumulated over a few
# 64-wide layers, measured under 1e-5 relative. rtol 1e-4 leaves 10x room; atol 1e-7 covers
# probabilities near zero, where a relative error means nothing.
RTOL, ATOL = 1e-4, 1e-7


def tiny_target() -> FrozenTarget:
    config = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256)
    # low, middle and high of 4 layers
    target = FrozenTarget.from_config(config, needs=TargetNeeds(taps=(1, 2, 3)), device="cpu")
    # Weights of std 0.3 from a seeded generator: peaked next-token distributions, so greedy
    # decoding is not a coin toss, whatever global RNG transformers' init consumes.
    seeded_init_(target.model, seed=0, std=0.3)
    return target


def make_drafter(family: str, target, full_vocab: bool = False, keep: torch.Tensor | None = None):
    """An untrained drafter. EAGLE-3 gets a reduced draft vocabulary, so the draft -> target id
    map is exercised: the target ids ``keep`` (default: a random half of them)."""
    torch.manual_seed(0)  # the drafter's own layers: PyTorch's default init, from a fixed seed
    fam = get_family(family)
    if family == "eagle1":
        # No feature noise when these tests train it: the noise would come from the global RNG.
        return fam.build(target, fam.config_cls(noise="none"))
    if keep is None:
        keep = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[: VOCAB // 2]
    vocab = None if full_vocab else DraftVocab.from_target_ids(keep, VOCAB)
    return fam.build(target, fam.config_cls(ttt_steps=4, draft_vocab_size=None if full_vocab else len(keep)), vocab)


def training_probs(drafter, ids, target_out):
    """Step-0 draft distributions for every row, by the training-time forward, over the target vocab."""
    T = ids.shape[1]
    hidden = drafter.draft_step(drafter.draft_input(drafter.target_features(target_out)), shift_left(ids, 1),
                                torch.arange(T)[None], mask=block_causal_mask(torch.ones(1, T)))
    return to_target_vocab(drafter, torch.softmax(drafter.draft_logits(hidden)[0], -1))


def to_target_vocab(drafter, q):
    if drafter.draft_to_target is None:
        return q
    full = torch.zeros(*q.shape[:-1], VOCAB)
    full[..., drafter.draft_to_target] = q
    return full


@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
def test_each_propose_starts_from_the_training_forward(family):
    """propose's first q after start and after each commit (n = 2 accepted, then n = 0, then k = 0)
    equals the training forward's distribution at that position."""
    target = tiny_target()
    drafter = make_drafter(family, target)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(3))
    out = target(ids)
    expected = training_probs(drafter, ids, out)
    source = drafter.draft_source(target)
    L = 6
    source.start(ids[:, :L], out.slice(slice(0, L)))
    # (drafts to ask for, how many of the true next tokens to commit as "accepted")
    for k, accepted in [(3, 2), (2, 0), (0, 0), (3, 1)]:
        proposal = source.propose(ids[:, L : L + 1], k, SAMPLED, torch.Generator().manual_seed(0))
        assert proposal.tokens.shape == (1, k) and proposal.probs.shape == (1, k, VOCAB)
        if k:
            assert torch.allclose(proposal.probs[0, 0], expected[L - 1], rtol=RTOL, atol=ATOL)
        # Verification "kept" the pending token and the next `accepted` true tokens.
        source.commit(ids[:, L : L + 1 + accepted], out.slice(slice(L, L + 1 + accepted)))
        L += 1 + accepted
    proposal = source.propose(ids[:, L : L + 1], 1, SAMPLED, torch.Generator().manual_seed(1))
    assert torch.allclose(proposal.probs[0, 0], expected[L - 1], rtol=RTOL, atol=ATOL)


def test_training_time_test_steps_equal_chained_proposals():
    """TTT step k at row i is what decoding computes for the k-th chained draft: same context
    (step-0 keys from real features + the chain's own keys), same RoPE positions."""
    target = tiny_target()
    drafter = make_drafter("eagle3", target)
    L, K = 7, 4
    prompt = torch.randint(0, VOCAB, (1, L + 1), generator=torch.Generator().manual_seed(5))
    source = drafter.draft_source(target)
    source.start(prompt[:, :L], target(prompt[:, :L]))
    proposal = source.propose(prompt[:, L:], K, SAMPLED, torch.Generator().manual_seed(1))

    # Training sees the sequence the chain read: prompt, pending, then the drafts themselves.
    ids = torch.cat([prompt, proposal.tokens], dim=1)
    T = ids.shape[1]
    steps = drafter.unroll(target(ids).aux_hidden, ids, torch.arange(T)[None], block_causal_mask(torch.ones(1, T)))
    for k in range(K):
        q_train = to_target_vocab(drafter, torch.softmax(drafter.draft_logits(steps[k][0, L - 1]), -1))
        assert torch.allclose(proposal.probs[0, k], q_train, rtol=RTOL, atol=ATOL), f"step {k}"


@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
def test_sampled_proposals_are_drawn_from_q_within_the_draft_vocabulary(family):
    target = tiny_target()
    drafter = make_drafter(family, target)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    source = drafter.draft_source(target)
    source.start(prompt[:, :8], target(prompt[:, :8]))
    params = SamplingParams(temperature=0.8, top_k=20)
    proposal = source.propose(prompt[:, 8:], 5, params, torch.Generator().manual_seed(0))
    q = proposal.probs[0]
    assert torch.allclose(q.sum(-1), torch.ones(5))  # to float32 rounding: allclose's rtol 1e-5
    assert (q.gather(1, proposal.tokens[0][:, None]) > 0).all()  # every draft had positive probability
    assert ((q > 0).sum(-1) <= 20).all()  # top-k applied to q, as to the target's p
    if family == "eagle3":
        outside = ~drafter.t2d
        assert q[:, outside].sum() == 0 and drafter.t2d[proposal.tokens[0]].all()


def greedy_reference(target, prompt, num_tokens):
    seq = prompt
    for _ in range(num_tokens):
        seq = torch.cat([seq, target(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[0, prompt.shape[1] :].tolist()


def greedy_speculative(target, source, prompt, num_tokens, k):
    """A plain greedy speculative loop (no target cache): accept drafts while they equal the target's argmax."""
    out = target(prompt)
    source.start(prompt, out)
    seq, pending, accepted = prompt, out.logits[:, -1].argmax(-1, keepdim=True), []
    while seq.shape[1] - prompt.shape[1] < num_tokens:
        drafts = source.propose(pending, k, GREEDY, None).tokens
        out = target(torch.cat([seq, pending, drafts], dim=1))
        # choice[i]: the target's token after [.., pending, d_1..d_i]
        choice = out.logits[0, seq.shape[1] :].argmax(-1)
        n = 0
        while n < k and drafts[0, n] == choice[n]:
            n += 1
        kept = torch.cat([pending, drafts[:, :n]], dim=1)
        source.commit(kept, out.slice(slice(seq.shape[1], seq.shape[1] + n + 1)))
        seq, pending = torch.cat([seq, kept], dim=1), choice[n].view(1, 1)
        accepted.append(n)
    return seq[0, prompt.shape[1] :].tolist()[:num_tokens], accepted


def overfit(drafter, target, ids, steps):
    """Train the drafter on one sequence until it predicts it: decoding then accepts drafts."""
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    target_out = target.forward_batch(batch)
    optimizer = torch.optim.AdamW(drafter.trained_module().parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        drafter.compute_loss(batch, target_out).loss.backward()
        optimizer.step()
    return drafter.eval()


@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
def test_greedy_speculative_decoding_equals_the_targets_greedy_decode(family):
    target = tiny_target()
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    reference = greedy_reference(target, prompt, 30)

    # An untrained drafter: almost every draft is rejected, the output must not change.
    tokens, _ = greedy_speculative(target, make_drafter(family, target).draft_source(target), prompt, 30, k=4)
    assert tokens == reference

    # A drafter that has learned this continuation: most drafts are accepted, same output.
    drafter = overfit(make_drafter(family, target, full_vocab=True), target,
                      torch.cat([prompt, torch.tensor([reference])], dim=1), steps=60)
    tokens, accepted = greedy_speculative(target, drafter.draft_source(target), prompt, 30, k=4)
    assert tokens == reference
    # Commits with 0 < n < k and with n = k were exercised (the untrained run covers n = 0).
    assert max(accepted) == 4 and sum(accepted) / len(accepted) >= 1.5, accepted


def train_on_own_greedy_text(family: str, target, prompts: list[torch.Tensor], steps: int):
    """A drafter trained briefly on the target's greedy continuations of ``prompts``.

    EAGLE-3's draft vocabulary is the 128 tokens most frequent in that text, as
    ``build_draft_vocab`` picks it from real data: the id map is exercised by real accepts.
    """
    text = torch.cat([torch.cat([p, torch.tensor([plain_decode(target, p, max_new_tokens=40).tokens])], dim=1)
                      for p in prompts])  # fmt: skip
    keep = top_tokens(torch.bincount(text.flatten(), minlength=VOCAB), VOCAB // 2)
    drafter = make_drafter(family, target, keep=keep)
    return overfit(drafter, target, text, steps)


@pytest.mark.parametrize("family,steps", [("eagle1", 150), ("eagle3", 60)])
def test_speculative_decode_with_an_accepting_drafter_is_greedy_decoding(family, steps):
    """Through ``speculative_decode`` and the real EAGLE DraftSource, with a drafter that accepts
    often: every emitted token is the target's greedy token. The drafter learned the target's
    continuations of these prompts (a few seconds of training), so steps accept all K drafts,
    some of them, or none, and the cache rollback and feature queue run on real accepts."""
    target = tiny_target()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (1, 6), generator=g) for _ in range(16)]
    drafter = train_on_own_greedy_text(family, target, prompts, steps)
    k, steps_taken = 3, []
    for prompt in prompts[:4]:
        expected = plain_decode(target, prompt, max_new_tokens=40).tokens
        out = speculative_decode(target, drafter.draft_source(target), prompt, k=k, max_new_tokens=40)
        assert out.tokens == expected
        steps_taken += out.steps
    accepted = [s.num_accepted for s in steps_taken]
    assert sum(accepted) / sum(s.num_drafted for s in steps_taken) >= 0.3
    assert 0 in accepted and k in accepted and any(0 < n < k for n in accepted)


@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
def test_a_batch_of_equal_length_prompts_drafts_like_each_prompt_alone(family):
    target = tiny_target()
    drafter = make_drafter(family, target)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))

    def run(rows):
        source = drafter.draft_source(target)
        source.start(rows[:, :8], target(rows[:, :8]))
        first = source.propose(rows[:, 8:9], 3, GREEDY, None).tokens
        source.commit(rows[:, 8:10], target(rows).slice(slice(8, 10)))  # pending + one accepted token
        return torch.cat([first, source.propose(rows[:, 9:10], 2, GREEDY, None).tokens], dim=1)

    batched = run(ids)
    assert torch.equal(batched[0], run(ids[:1])[0]) and torch.equal(batched[1], run(ids[1:])[0])


@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
def test_a_greedy_proposal_forms_no_q(family):
    """At temperature 0 the drafts are the argmaxes and no V-wide q is built (the decoder compares drafts with
    the target's argmaxes): the same tokens as the argmax of the q a sampled proposal carries."""
    target = tiny_target()
    drafter = make_drafter(family, target)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    greedy, sampled = drafter.draft_source(target), drafter.draft_source(target)
    for source in (greedy, sampled):
        source.start(ids[:, :8], target(ids[:, :8]))
    proposal = greedy.propose(ids[:, 8:9], 1, GREEDY, None)
    reference = sampled.propose(ids[:, 8:9], 1, SAMPLED, torch.Generator().manual_seed(0))
    assert proposal.probs is None
    assert proposal.tokens[0, 0] == reference.probs[0, 0].argmax()
