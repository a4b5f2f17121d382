"""verify: pinned hand-worked cases, and the Triton kernel == the torch reference, token for token."""

import itertools
import sys
import warnings

import pytest
import torch
from kernel_device import on_kernel_device

from specdraft.decoding import verify as verify_module
from specdraft.decoding.verify import (
    VerifyInputs,
    expected_acceptance_rate,
    expected_tokens_per_step,
    resolve_verify_backend,
    typical_acceptance,
    verify,
    verify_reference,
)
from specdraft.errors import SpecdraftError

verify_triton = on_kernel_device(verify_module.verify_triton)
IMPLS = {"reference": verify_reference, "triton": verify_triton}


def run(impl, drafts, counts, q, p, bonus, uniforms, exps, greedy, max_spec_len, lenience=1.0):
    """Call one implementation with plain Python lists for the small hand-worked cases."""
    t = torch.tensor
    return IMPLS[impl](VerifyInputs(
        t(drafts, dtype=torch.long),
        t(counts, dtype=torch.long).cumsum(0),
        None if q is None else t(q, dtype=torch.float32),
        t(p, dtype=torch.float32),
        t(bonus, dtype=torch.long),
        t(uniforms, dtype=torch.float32),
        t(exps, dtype=torch.float32),
        t(greedy, dtype=torch.bool),
        max_spec_len,
        lenience,
    ))


def check(result, expected_output, expected_num_accepted):
    output, num_accepted = result
    assert output.tolist() == expected_output
    assert num_accepted.tolist() == expected_num_accepted


# ---------------------------------------------------------------- hand-worked cases


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_accepts_while_draft_is_argmax_then_corrects(impl):
    p = [[0.1, 0.2, 0.6, 0.1], [0.1, 0.7, 0.1, 0.1]]  # argmax 2, then 1
    result = run(impl, [2, 3], [2], None, p, [0], [0.5, 0.5], [[1.0] * 4], [True], 2)
    check(result, [[2, 1, -1]], [1])


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_argmax_tie_goes_to_lowest_id(impl):
    p = [[0.4, 0.4, 0.2]]
    result = run(impl, [1], [1], None, p, [2], [0.0], [[1.0] * 3], [True], 1)
    check(result, [[0, -1]], [0])


@pytest.mark.parametrize("impl", IMPLS)
def test_rejection_samples_residual_by_exponential_race(impl):
    # p(2) = 0 rejects the draft; residual max(0, p - q) = [.5, .5, 0, 0];
    # race scores residual / e = [.5, 1, 0, 0] -> token 1.
    p, q = [[0.5, 0.5, 0.0, 0.0]], [[0.0, 0.0, 1.0, 0.0]]
    result = run(impl, [2], [1], q, p, [3], [0.5], [[1.0, 0.5, 1.0, 1.0]], [False], 1)
    check(result, [[1, -1]], [0])
    # Same draws but e favouring token 0: the residual's winner changes.
    result = run(impl, [2], [1], q, p, [3], [0.5], [[0.5, 1.0, 1.0, 1.0]], [False], 1)
    check(result, [[0, -1]], [0])


@pytest.mark.parametrize("impl", IMPLS)
def test_correction_is_the_residuals_winner_not_ps(impl):
    # The draft over-proposes p's mode: residual max(0, p - q) = [0, .25, .05] has its mode at
    # token 1, p at token 0. Draft 0 is rejected (u q(0) = .72 >= p(0) = .6), and with equal
    # noise the race picks the residual's mode; a draw from p would pick token 0.
    p, q = [[0.6, 0.3, 0.1]], [[0.9, 0.05, 0.05]]
    check(run(impl, [0], [1], q, p, [2], [0.8], [[1.0, 1.0, 1.0]], [False], 1), [[1, -1]], [0])


@pytest.mark.parametrize("impl", IMPLS)
def test_draft_likelier_under_p_than_q_is_always_accepted(impl):
    # p(0) = .6 > q(0) = .3: min(1, p/q) = 1, so even u = .99 accepts (.99 * .3 < .6), then the
    # bonus. Accepting with probability p(x), ignoring q, would reject it.
    p, q = [[0.6, 0.4]], [[0.3, 0.7]]
    check(run(impl, [0], [1], q, p, [1], [0.99], [[1.0, 1.0]], [False], 1), [[0, 1]], [1])


@pytest.mark.parametrize("impl", IMPLS)
def test_all_accepted_appends_bonus(impl):
    dist = [[0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]]
    # p == q: u * q < p for any u < 1, so everything is accepted.
    result = run(impl, [1, 3], [2], dist, dist, [2], [0.99, 0.99], [[1.0] * 4], [False], 3)
    check(result, [[1, 3, 2, -1]], [2])


@pytest.mark.parametrize("impl", IMPLS)
def test_lenience_accepts_what_exact_verify_rejects(impl):
    p, q = [[0.3, 0.7]], [[0.6, 0.4]]
    # Exact: 0.6 * 0.6 = 0.36 >= 0.3 rejects; residual [0, 0.3] -> token 1.
    check(run(impl, [0], [1], q, p, [1], [0.6], [[1.0, 1.0]], [False], 1), [[1, -1]], [0])
    # lenience 0.5: 0.6 * (0.5 * 0.6) = 0.18 < 0.3 accepts, then the bonus.
    check(run(impl, [0], [1], q, p, [1], [0.6], [[1.0, 1.0]], [False], 1, lenience=0.5), [[0, 1]], [1])


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic_drafts_accept_with_probability_p(impl):
    p = [[0.2, 0.8]]
    # q is one-hot on the draft: accept iff u < p(x) = 0.2.
    check(run(impl, [0], [1], None, p, [0], [0.1], [[1.0, 1.0]], [False], 1), [[0, 0]], [1])
    # Rejected: residual max(0, p - onehot(0)) = [0, 0.8] -> token 1.
    check(run(impl, [0], [1], None, p, [0], [0.5], [[1.0, 1.0]], [False], 1), [[1, -1]], [0])


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_residual_falls_back_to_p(impl):
    # Draft 3 has p = q = 0 so it is rejected (0 < 0 is false), yet p == q leaves
    # no residual: the race runs over p, scores p / e = [.25, .5, 0, 0] -> token 1.
    dist = [[0.5, 0.5, 0.0, 0.0]]
    result = run(impl, [3], [1], dist, dist, [0], [0.5], [[2.0, 1.0, 1.0, 1.0]], [False], 1)
    check(result, [[1, -1]], [0])


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_without_drafts_emit_only_the_bonus(impl):
    p = [[0.0, 1.0, 0.0]]
    result = run(impl, [1], [0, 1, 0], None, p, [2, 0, 1], [0.5], [[1.0] * 3] * 3, [False, True, False], 2)
    check(result, [[2, -1, -1], [1, 0, -1], [1, -1, -1]], [0, 1, 0])


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_step_with_no_drafts_at_all(impl):
    output, num_accepted = IMPLS[impl](VerifyInputs(
        torch.zeros(0, dtype=torch.long),
        torch.zeros(2, dtype=torch.long),
        None,
        torch.zeros(0, 5),
        torch.tensor([4, 2]),
        torch.zeros(0),
        torch.ones(2, 5),
        torch.tensor([False, True]),
        3,
    ))
    assert output.tolist() == [[4, -1, -1, -1], [2, -1, -1, -1]]
    assert num_accepted.tolist() == [0, 0]


def test_verify_dispatches_to_reference_on_cpu():
    inputs = make_inputs(seed=3, counts=[2, 3], vocab=50, mode="mixed", with_draft_probs=True)
    out, n = verify(VerifyInputs(*inputs, max_spec_len=4))
    ref_out, ref_n = verify_reference(VerifyInputs(*inputs, max_spec_len=4))
    assert torch.equal(out, ref_out) and torch.equal(n, ref_n)


# ---------------------------------------------------------------- kernel == reference


def make_inputs(seed, counts, vocab, mode, with_draft_probs, dtype=torch.float32):
    """Random verify inputs with accept runs, rejections and the edge token ids 0 and V-1."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts, dtype=torch.long)
    batch, num_tokens = len(counts), int(counts.sum())
    logits = torch.randn(num_tokens, vocab, generator=g) * 2
    logits[0::3, vocab - 1] += 6  # argmax on the last id: the tail of the last BLOCK_V chunk
    logits[1::3, 0] += 6
    p = logits.softmax(-1)
    q = (logits + torch.randn(num_tokens, vocab, generator=g)).softmax(-1)  # a close-ish drafter
    drafts = torch.multinomial(q, 1, generator=g).squeeze(1) if num_tokens else torch.zeros(0, dtype=torch.long)
    pick = torch.rand(num_tokens, generator=g)
    drafts = torch.where(pick < 0.4, p.argmax(-1), drafts)  # greedy rows get accept runs
    drafts = torch.where(pick > 0.9, torch.where(pick > 0.95, 0, vocab - 1), drafts)
    greedy = {
        "greedy": torch.ones(batch, dtype=torch.bool),
        "random": torch.zeros(batch, dtype=torch.bool),
        "mixed": torch.arange(batch) % 2 == 1,
    }[mode]
    bonus = torch.randint(0, vocab, (batch,), generator=g)
    uniforms = torch.rand(num_tokens, generator=g)
    exps = torch.empty(batch, vocab).exponential_(generator=g)
    exps[0, vocab - 1] = 1e-30  # let the race's winner land on the edge ids too
    exps[-1, 0] = 1e-30
    draft_probs = q.to(dtype) if with_draft_probs else None
    return drafts, counts.cumsum(0), draft_probs, p.to(dtype), bonus, uniforms, exps, greedy


COUNTS = [[1], [5], [3, 0, 2, 1], [0, 4], [2, 5, 1, 3], [4, 4]]
# block_v and num_splits vary: V = 257 and 1000 cross chunks (of 128 or 256) and splits (of whole chunks).
CASES = [
    (vocab, COUNTS[i % len(COUNTS)], mode, with_q, 0.6 if i % 3 == 0 else 1.0, [128, 256][i % 2], 1 + i % 3)
    for i, (vocab, mode, with_q) in enumerate(
        itertools.product([7, 100, 257, 1000], ["greedy", "random", "mixed"], [True, False])
    )
]


@pytest.mark.parametrize("vocab,counts,mode,with_q,lenience,block_v,num_splits", CASES)
def test_kernel_matches_reference(vocab, counts, mode, with_q, lenience, block_v, num_splits):
    inputs = make_inputs(seed=vocab + len(counts), counts=counts, vocab=vocab, mode=mode, with_draft_probs=with_q)
    max_spec_len = max(counts) + 1  # one slot of pure padding
    ref = verify_reference(VerifyInputs(*inputs, max_spec_len=max_spec_len, lenience=lenience))
    out = verify_triton(VerifyInputs(*inputs, max_spec_len=max_spec_len, lenience=lenience), block_v=block_v,
                        num_splits=num_splits)  # fmt: skip
    assert torch.equal(out[0], ref[0]), (out[0], ref[0])
    assert torch.equal(out[1], ref[1])


def test_kernel_matches_reference_over_many_draws():
    """Many seeds of one mixed batch, over 1 to 3 vocabulary splits; also checks the draws exercised every branch."""
    seen_accept = seen_reject = seen_bonus = seen_edge = 0
    for seed in range(16):
        inputs = make_inputs(seed, counts=[3, 1, 0, 4], vocab=300, mode="mixed", with_draft_probs=seed % 2 == 0)
        ref_out, ref_n = verify_reference(VerifyInputs(*inputs, max_spec_len=4, lenience=0.8 if seed % 4 == 1 else 1.0))
        out, n = verify_triton(VerifyInputs(*inputs, max_spec_len=4, lenience=0.8 if seed % 4 == 1 else 1.0),
                               block_v=128, num_splits=1 + seed % 3)  # fmt: skip
        assert torch.equal(out, ref_out) and torch.equal(n, ref_n)
        counts = torch.tensor([3, 1, 0, 4])
        seen_accept += int(n.sum())
        seen_reject += int((n < counts).sum())
        seen_bonus += int((n == counts).sum())
        seen_edge += int(((out == 0) | (out == 299)).sum())
    assert seen_accept > 0 and seen_reject > 0 and seen_bonus > 0 and seen_edge > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_matches_reference_for_half_precision_probs(dtype):
    inputs = make_inputs(seed=7, counts=[2, 3, 1], vocab=129, mode="mixed", with_draft_probs=True, dtype=dtype)
    ref = verify_reference(VerifyInputs(*inputs, max_spec_len=3))
    out = verify_triton(VerifyInputs(*inputs, max_spec_len=3), block_v=128, num_splits=2)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("greedy", [True, False])
def test_kernel_ties_across_vocab_chunks_go_to_lowest_id(greedy, num_splits):
    # p's maximum (greedy) and the residual race's best score (random) are tied between id 3 (first
    # BLOCK_V=128 chunk) and id 300 (third chunk; with 3 splits, the third split); torch.argmax picks 3.
    vocab = 330
    p = torch.full((1, vocab), 0.5 / (vocab - 2))
    p[0, 3] = p[0, 300] = 0.25
    q = torch.full((1, vocab), 1.0 / vocab)
    args = (torch.tensor([10]), torch.tensor([1]), q, p, torch.tensor([0]), torch.tensor([0.99]),
            torch.ones(1, vocab), torch.tensor([greedy]))
    for out, n in (verify_reference(VerifyInputs(*args, max_spec_len=1)),
                   verify_triton(VerifyInputs(*args, max_spec_len=1), block_v=128, num_splits=num_splits)):
        assert out.tolist() == [[3, -1]] and n.tolist() == [0]


@pytest.mark.parametrize("greedy", [True, False])
def test_winners_on_either_side_of_a_split_boundary(greedy):
    """V = 300 in 3 splits of 128: [0, 128), [128, 256), [256, 300). The argmax (greedy) or the race's winner
    (random) on the first or last id of a split is found, whichever split holds it."""
    vocab = 300
    for winner in (0, 127, 128, 255, 256, 299):
        p = torch.full((1, vocab), 0.5 / (vocab - 1))
        p[0, winner] = 0.5
        exps = torch.ones(1, vocab)
        exps[0, winner] = 0.01  # the race too: the winner's score is 50, every other 0.5 / 299 at most
        args = (torch.tensor([(winner + 1) % vocab]), torch.tensor([1]), None, p, torch.tensor([7]),
                torch.tensor([0.99]), exps, torch.tensor([greedy]))
        expected = [[winner, -1]]
        assert verify_reference(VerifyInputs(*args, max_spec_len=1))[0].tolist() == expected
        out = verify_triton(VerifyInputs(*args, max_spec_len=1), block_v=128, num_splits=3)
        assert out[0].tolist() == expected, winner


@pytest.mark.parametrize("lenience", [1.0, 0.7])
def test_accept_test_rounds_like_the_reference(lenience):
    """p(x) set to exactly fl32(u * fl32(l * q(x))): strict `<` must reject every draft.

    An implementation computing in float64, or dividing p/q, disagrees on about half.
    """
    drafts, cu, q, p, bonus, uniforms, exps, greedy = make_inputs(
        seed=11, counts=[1] * 32, vocab=16, mode="random", with_draft_probs=True
    )
    q_x = q.gather(1, drafts[:, None]).squeeze(1)
    boundary = uniforms * (torch.tensor(lenience, dtype=torch.float32) * q_x)
    p = p.clone()
    p[torch.arange(len(drafts)), drafts] = boundary
    args = (drafts, cu, q, p, bonus, uniforms, exps, greedy)
    ref_out, ref_n = verify_reference(VerifyInputs(*args, max_spec_len=1, lenience=lenience))
    out, n = verify_triton(VerifyInputs(*args, max_spec_len=1, lenience=lenience))
    assert ref_n.sum() == 0
    assert torch.equal(n, ref_n) and torch.equal(out, ref_out)
    # The float64 test really would differ here (so this case has teeth).
    float64_accepts = uniforms.double() * (lenience * q_x.double()) < boundary.double()
    assert float64_accepts.any()


# The compiled (sm_80, sm_90) kernels are checked in tests/test_kernels_compile.py.


# ---------------------------------------------------------------- input errors


def test_bad_inputs_raise_clear_errors():
    drafts, cu, q, p, bonus, uniforms, exps, greedy = make_inputs(
        seed=0, counts=[2, 1], vocab=10, mode="random", with_draft_probs=True
    )
    ok = dict(
        draft_token_ids=drafts, cu_num_draft_tokens=cu, draft_probs=q, target_probs=p,
        bonus_token_ids=bonus, uniforms=uniforms, exponentials=exps, greedy=greedy, max_spec_len=2,
    )
    bad_cases = [
        (dict(bonus_token_ids=bonus[:, None]), "bonus_token_ids has shape \\(2, 1\\), expected \\(2,\\)"),
        (dict(draft_token_ids=drafts.float()), "integer"),
        (dict(cu_num_draft_tokens=cu[:, None]), "1-D"),
        (dict(max_spec_len=1), "raise max_spec_len"),
        (dict(lenience=0.0), "lenience must be in \\(0, 1\\]"),
        (dict(lenience=1.5), "lenience must be in \\(0, 1\\]"),
        (dict(greedy=greedy.long()), "bool"),
        (dict(cu_num_draft_tokens=torch.tensor([2, 2])), "cumsum"),
        (dict(draft_token_ids=torch.tensor([0, 10, 1])), "d2t"),
        (dict(target_probs=p[None]), "flatten"),
        (dict(exponentials=exps[:, :5]), "exponentials has shape"),
    ]
    for impl in IMPLS.values():
        for change, message in bad_cases:
            with pytest.raises(SpecdraftError, match=message):
                impl(VerifyInputs(**{**ok, **change}))
    assert verify_reference(VerifyInputs(**ok))[0].shape == (2, 3)  # the unchanged inputs are fine


@pytest.mark.parametrize("block_v", [64, 96, 1000, 8192, 0, -128, True, 256.0])
def test_block_v_outside_the_race_free_range_names_the_range(block_v):
    inputs = make_inputs(seed=0, counts=[2], vocab=300, mode="random", with_draft_probs=True)
    with pytest.raises(SpecdraftError, match=r"block_v must be a power of two in \[128, 4096\]"):
        verify_triton(VerifyInputs(*inputs, max_spec_len=2), block_v=block_v)


@pytest.mark.parametrize("num_splits", [0, -1, 1.5])
def test_bad_num_splits_is_refused(num_splits):
    inputs = make_inputs(seed=0, counts=[2], vocab=300, mode="random", with_draft_probs=True)
    with pytest.raises(SpecdraftError, match="num_splits must be an int >= 1"):
        verify_triton(VerifyInputs(*inputs, max_spec_len=2), num_splits=num_splits)


# ---------------------------------------------------------------- backend choice


def test_auto_runs_the_kernel_on_cuda_and_the_reference_elsewhere():
    assert resolve_verify_backend("auto", "cpu") == "reference"
    assert resolve_verify_backend("auto", torch.device("cuda", 0)) == "triton"  # triton imports here
    assert resolve_verify_backend("reference", "cuda") == "reference"
    assert resolve_verify_backend("triton", "cpu") == "triton"  # TRITON_INTERPRET=1 (tests/conftest.py) on CPU


def test_verify_follows_the_backend_it_is_given(monkeypatch):
    """verify dispatches through resolve_verify_backend: "triton" runs the kernel (interpreted on CPU)."""
    inputs = make_inputs(seed=5, counts=[3, 2], vocab=300, mode="mixed", with_draft_probs=True)
    ran = []
    monkeypatch.setattr(verify_module, "verify_triton", lambda *a, **k: ran.append("triton") or verify_reference(*a, **k))
    monkeypatch.setattr(verify_module, "verify_reference", lambda *a, **k: ran.append("reference") or
                        verify_reference(*a, **k))  # fmt: skip
    for backend in ("triton", "reference", "auto"):
        verify_module.verify(VerifyInputs(*inputs, max_spec_len=3), backend=backend)
    assert ran == ["triton", "reference", "reference"]  # auto on CPU: the reference


def test_auto_falls_back_to_the_reference_with_one_warning_when_triton_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.setattr(verify_module, "_warned_triton_missing", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [resolve_verify_backend("auto", "cuda") for _ in range(3)] == ["reference"] * 3
        assert resolve_verify_backend("auto", "cpu") == "reference"
    assert len(caught) == 1 and "specdraft[triton]" in str(caught[0].message)


def test_triton_requested_without_triton_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    inputs = make_inputs(seed=0, counts=[2], vocab=50, mode="random", with_draft_probs=False)
    for call in (lambda: resolve_verify_backend("triton", "cuda"),
                 lambda: verify(VerifyInputs(*inputs, max_spec_len=2), backend="triton"),
                 lambda: verify_module.verify_triton(VerifyInputs(*inputs, max_spec_len=2))):
        with pytest.raises(SpecdraftError, match=r"needs triton.*pip install 'specdraft\[triton\]'"):
            call()


def test_triton_on_cpu_without_the_interpreter_names_the_fix(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SpecdraftError, match="needs CUDA tensors.*TRITON_INTERPRET=1.*'reference'"):
        resolve_verify_backend("triton", "cpu")


@pytest.mark.parametrize("name", ["cuda", "Triton", "", "torch"])
def test_an_unknown_backend_lists_the_choices(name):
    with pytest.raises(SpecdraftError, match="must be one of auto, triton, reference"):
        resolve_verify_backend(name, "cpu")


# ---------------------------------------------------------------- acceptance helpers


def test_expected_acceptance_rate_is_overlap_mass():
    p = torch.tensor([[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    # Sums of three float32 numbers: a few roundings, well inside allclose's rtol 1e-5.
    assert torch.allclose(expected_acceptance_rate(p, q), torch.tensor([0.7, 1.0]))
    # = 1 - total variation distance
    tv = 0.5 * (p - q).abs().sum(-1)
    assert torch.allclose(expected_acceptance_rate(p, q), 1 - tv)


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0


def test_typical_acceptance_pinned():
    # Peaked p: H = 0.5867, delta * exp(-H) = 0.1668 -> threshold min(0.09, .1668) = 0.09.
    peaked = [0.85, 0.05, 0.05, 0.05]
    # Flat p: H = ln 4, delta * exp(-H) = 0.3 / 4 = 0.075 -> threshold 0.075.
    flat = [0.25, 0.25, 0.25, 0.25]
    probs = torch.tensor([[peaked, flat, peaked], [peaked, peaked, flat]])
    drafts = torch.tensor([[0, 3, 1], [1, 0, 2]])
    # row 0: 0.85 > .09 yes, 0.25 > .075 yes, 0.05 > .09 no -> 2
    # row 1: 0.05 > .09 no -> 0 (later acceptances do not count)
    assert typical_acceptance(drafts, probs).tolist() == [2, 0]
    # A lower floor accepts the 0.05 tokens too.
    assert typical_acceptance(drafts, probs, epsilon=0.04).tolist() == [3, 3]
    # Entropy term alone (epsilon 1): flat threshold exp(-ln 4) = 0.25, and 0.25 > 0.25 is false.
    assert typical_acceptance(drafts, probs, epsilon=1.0, delta=1.0).tolist() == [1, 0]
