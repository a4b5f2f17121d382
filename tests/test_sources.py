"""Draft sources: the draft LM's cache bookkeeping and vocab mapping, and prompt lookup's matching."""

import pytest
import torch
from tiny import tiny_llama, tiny_tokenizer

from specdraft.decoding.sampling import SamplingParams
from specdraft.decoding.sources import DraftLMSource, PromptLookupSource, vocab_map_from_tokenizers
from specdraft.decoding.speculative import speculative_decode
from specdraft.contract import DraftSource
from specdraft.errors import SpecdraftError
from specdraft.target import FrozenTarget

VOCAB = 300
GREEDY = SamplingParams()


def fake_target_out(length, vocab=VOCAB):
    """Sources under test only read the target's vocabulary size from its outputs."""
    from specdraft.contract import TargetOutputs

    return TargetOutputs(logits=torch.zeros(1, length, vocab), final_hidden=torch.zeros(1, length, 8))


def test_sources_satisfy_the_protocol():
    assert isinstance(DraftLMSource(tiny_llama(VOCAB)), DraftSource)
    assert isinstance(PromptLookupSource(), DraftSource)


# What a source can do is declared (``DraftSource.capabilities``), not probed for.
CAPABILITY_NAMES = {"tree", "depth", "fresh", "row_state", "propose_rows", "propose_tree", "tree_kinds"}


def test_no_caller_probes_a_source_for_what_it_can_do():
    """Callers read a source's declared ``capabilities`` (and ask ``isinstance(source, TreeDrafting)``): no
    ``hasattr`` / ``getattr`` in the package or its benchmarks names a capability."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    probes = []
    for path in sorted([*(root / "specdraft").rglob("*.py"), *(root / "eval").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("hasattr", "getattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in CAPABILITY_NAMES):  # fmt: skip
                probes.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    assert not probes, "read source.capabilities instead of probing:\n" + "\n".join(probes)


def test_draft_lm_proposes_its_own_greedy_continuation():
    model = tiny_llama(VOCAB, seed=3)
    source = DraftLMSource(model)
    prompt = torch.tensor([[1, 50, 60, 70, 80]])
    pending = torch.tensor([[90]])
    source.start(prompt, fake_target_out(5))
    proposal = source.propose(pending, 4, GREEDY, None)
    expected = model.generate(torch.cat([prompt, pending], 1), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert proposal.tokens.tolist() == [expected[0, 6:].tolist()]
    # Greedy q is one-hot on each draft, which Proposal.probs None says without forming [1, 4, V].
    assert proposal.probs is None
    # Sampling: q is the warped draft distribution, one row per draft.
    source.start(prompt, fake_target_out(5))
    sampled = source.propose(pending, 4, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert sampled.probs.shape == (1, 4, VOCAB)
    assert torch.allclose(sampled.probs.sum(-1), torch.ones(1, 4))  # to float32 rounding: allclose's rtol 1e-5
    assert (sampled.probs.gather(-1, sampled.tokens[..., None]) > 0).all()


@pytest.mark.parametrize("num_accepted", [0, 2, 4])
def test_draft_lm_state_after_commit_matches_a_fresh_run(num_accepted):
    """After commit, the next proposal equals the draft's view of the committed text read from scratch."""
    model = tiny_llama(VOCAB, seed=3)
    params = SamplingParams(temperature=1.0)
    source = DraftLMSource(model)
    prompt = torch.tensor([[1, 50, 60, 70, 80]])
    source.start(prompt, fake_target_out(5))
    pending = torch.tensor([[90]])
    proposal = source.propose(pending, 4, params, torch.Generator().manual_seed(0))
    kept = torch.cat([pending, proposal.tokens[:, :num_accepted]], dim=1)
    source.commit(kept, fake_target_out(kept.shape[1]))
    new_pending = torch.tensor([[123]])
    g = torch.Generator().manual_seed(1)
    q_next = source.propose(new_pending, 2, params, g).probs

    committed = torch.cat([prompt, kept, new_pending], dim=1)
    fresh = torch.softmax(model(committed).logits[0, -1].float(), -1)
    # Cached vs. full attention: the same float32 math in another order. They differ by
    # rounding (measured 3e-7 relative); rtol 1e-5 leaves 30x room, atol 1e-8 covers near-zeros.
    assert torch.allclose(q_next[0, 0], fresh, rtol=1e-5, atol=1e-8)
    # The cache holds exactly the committed text, the new pending token and the first new draft.
    assert source.cache.get_seq_length() == committed.shape[1] + 1


def test_draft_lm_sampled_drafts_follow_q():
    source = DraftLMSource(tiny_llama(VOCAB, seed=3))
    params = SamplingParams(temperature=1.0, top_k=5)
    source.start(torch.tensor([[1, 2, 3]]), fake_target_out(3))
    proposal = source.propose(torch.tensor([[4]]), 3, params, torch.Generator().manual_seed(0))
    q_of_drafts = proposal.probs.gather(2, proposal.tokens[..., None])
    assert (q_of_drafts > 0).all()
    assert ((proposal.probs > 0).sum(-1) == 5).all()  # top-k warping reached q


def test_vocab_mismatch_is_a_clear_error():
    target = FrozenTarget(tiny_llama(VOCAB))
    source = DraftLMSource(tiny_llama(VOCAB - 20, seed=1))
    with pytest.raises(SpecdraftError, match="vocab_map"):
        speculative_decode(target, source, torch.tensor([[1, 5, 6]]), k=2, max_new_tokens=4)
    bad_map = torch.zeros(VOCAB - 21, dtype=torch.long)
    with pytest.raises(SpecdraftError, match="vocab_map must be"):
        speculative_decode(target, DraftLMSource(tiny_llama(VOCAB - 20), bad_map), torch.tensor([[1, 5]]), k=2)


def test_mapped_vocab_stays_lossless():
    """A draft whose vocabulary is a permuted subset of the target's: drafts map back, output is the target's."""
    target_model = tiny_llama(VOCAB, seed=0)
    target = FrozenTarget(target_model)
    draft_vocab = VOCAB - 20
    g = torch.Generator().manual_seed(0)
    vocab_map = torch.randperm(VOCAB, generator=g)[:draft_vocab]  # draft id i is target id vocab_map[i]
    vocab_map[5] = -1  # and one draft token the target lacks
    # Build the draft from the target's own weights, rows permuted, so it agrees with it a lot.
    draft = tiny_llama(draft_vocab, seed=0)
    draft.load_state_dict({
        name: (w[vocab_map.clamp_min(0)] if w.shape[0] == VOCAB else w)
        for name, w in target_model.state_dict().items()
    })  # fmt: skip
    source = DraftLMSource(draft, vocab_map)
    prompt = torch.tensor([[1, 40, 41, 42, 43, 44, 45]])
    expected = target_model.generate(prompt, max_new_tokens=30, do_sample=False, pad_token_id=0)[0, 7:].tolist()
    out = speculative_decode(target, source, prompt, k=4, max_new_tokens=30)
    assert out.tokens == expected
    assert sum(s.num_accepted for s in out.steps) > 10
    # q lives in the target vocabulary and is zero on target tokens the draft lacks.
    source.start(prompt, fake_target_out(7))
    g = torch.Generator().manual_seed(0)
    proposal = source.propose(torch.tensor([[50]]), 2, SamplingParams(temperature=1.0), g)
    missing = torch.ones(VOCAB, dtype=torch.bool)
    missing[vocab_map[vocab_map >= 0]] = False
    assert proposal.probs.shape == (1, 2, VOCAB)
    assert (proposal.probs[..., missing] == 0).all()


def test_vocab_map_from_tokenizers():
    target_tok = tiny_tokenizer(300)
    draft_tok = tiny_tokenizer(280)
    vocab_map = vocab_map_from_tokenizers(draft_tok, target_tok, draft_vocab_size=len(draft_tok) + 4)
    assert vocab_map.shape == (len(draft_tok) + 4,)
    assert (vocab_map[len(draft_tok) :] == -1).all()  # padded embedding rows map nowhere
    target_tokens = target_tok.convert_ids_to_tokens(list(range(len(target_tok))))
    for draft_id, token in enumerate(draft_tok.convert_ids_to_tokens(list(range(len(draft_tok))))):
        target_id = int(vocab_map[draft_id])
        assert target_id == -1 or target_tokens[target_id] == token
    assert (vocab_map[: len(draft_tok)] >= 0).float().mean() > 0.9


def test_prompt_lookup_copies_the_continuation_of_the_first_match():
    source = PromptLookupSource(max_ngram=3, min_ngram=1)
    source.start(torch.tensor([[5, 6, 7, 8, 9, 5, 6]]), None)
    # Context ends 5 6 7: it occurred at the start, followed by 8 9 5 6 7.
    assert source.propose(torch.tensor([[7]]), 4, GREEDY, None).tokens.tolist() == [[8, 9, 5, 6]]
    assert source.propose(torch.tensor([[7]]), 2, GREEDY, None).probs is None
    # Only the 1-gram "9" matches (at index 4), so the draft is what followed it: 5 6.
    assert source.propose(torch.tensor([[9]]), 3, GREEDY, None).tokens.tolist() == [[5, 6, 9]]
    # Nothing matches: no drafts.
    assert source.propose(torch.tensor([[42]]), 3, GREEDY, None).tokens.shape == (1, 0)


def test_prompt_lookup_min_ngram_and_commit():
    source = PromptLookupSource(max_ngram=2, min_ngram=2)
    source.start(torch.tensor([[5, 6, 7, 5]]), None)
    assert source.propose(torch.tensor([[9]]), 3, GREEDY, None).tokens.shape == (1, 0)  # "5 9" never seen
    assert source.propose(torch.tensor([[6]]), 3, GREEDY, None).tokens.tolist() == [[7, 5, 6]]
    source.commit(torch.tensor([[6, 7]]), None)  # pending 6 and one accepted draft
    assert source.context.tolist() == [5, 6, 7, 5, 6, 7]


def test_prompt_lookup_bad_arguments():
    with pytest.raises(SpecdraftError, match="min_ngram"):
        PromptLookupSource(max_ngram=1, min_ngram=2)
    with pytest.raises(SpecdraftError, match="min_ngram"):
        PromptLookupSource(max_ngram=3, min_ngram=0)
