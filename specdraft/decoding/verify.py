"""The verify step of speculative decoding: which drafts to keep, and the next token.

Layout (as in vLLM's rejection sampler): the drafts of all rows are concatenated
into one flat list, and ``cu_num_draft_tokens`` (inclusive cumsum of per-row
draft counts) says where each row ends, so rows may have different numbers of
drafts, including zero. Row r owns flat positions [cu[r-1], cu[r]).

Exact speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2),
per row, walking its drafts x_1..x_k in order:
  accept x_i  if  u_i < p_i(x_i) / q_i(x_i)        (i.e. with probability min(1, p/q))
  on the first rejection, emit one token from norm(max(0, p_i - q_i)) and stop;
  if all k are accepted, emit the bonus token (already sampled from p_{k+1}).
The emitted tokens are then distributed exactly as if sampled from p.
Greedy rows accept while x_i == argmax p_i, and correct with argmax p_i.

``verify_reference`` is the spec, in plain torch. ``verify_triton`` runs the same
math in Triton kernels (``specdraft.kernels.rejection_sampler``) and must agree
with it token for token given the same random draws. ``verify`` runs the backend that
``resolve_verify_backend`` picks: by default the kernel on CUDA tensors and the reference
elsewhere.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, fields

import torch

from specdraft.errors import SpecdraftError

PADDING_TOKEN_ID = -1  # fills output slots after a row's last emitted token
VERIFY_BACKENDS = ("auto", "triton", "reference")
_warned_triton_missing = False  # auto's fallback warns once per process


def resolve_verify_backend(requested: str, device: torch.device | str) -> str:
    """"triton" or "reference": which implementation verifies tensors on ``device``.

    auto: the Triton kernels on CUDA when triton imports, else the reference (on CUDA without triton,
    with one warning per process). triton: the kernels, or a SpecdraftError naming the fix when triton
    is missing or the tensors are off CUDA (on CPU they run only under the Triton interpreter,
    TRITON_INTERPRET=1). No host sync: a decoder may resolve it every step.
    """
    global _warned_triton_missing
    if requested not in VERIFY_BACKENDS:
        raise SpecdraftError(f"verify backend must be one of {', '.join(VERIFY_BACKENDS)}; got {requested!r}")
    if requested == "reference":
        return "reference"
    on_cuda = torch.device(device).type == "cuda"
    triton_error = _triton_import_error()
    if requested == "auto":
        if not on_cuda:
            return "reference"
        if triton_error is None:
            return "triton"
        if not _warned_triton_missing:
            _warned_triton_missing = True
            warnings.warn(f"triton is not importable ({triton_error}): verifying with the pure-torch reference, which "
                          "is slower on CUDA; install it with `pip install 'specdraft[triton]'`", stacklevel=2)
        return "reference"
    if triton_error is not None:
        raise SpecdraftError(
            f"verify backend 'triton' needs triton, which does not import ({triton_error}); install it with "
            "`pip install 'specdraft[triton]'`, or verify with the backend 'auto' or 'reference'."
        )
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise SpecdraftError(
            f"verify backend 'triton' needs CUDA tensors, got {torch.device(device)} (on CPU the kernels run only "
            "under the Triton interpreter, TRITON_INTERPRET=1 set before triton is imported); use the backend "
            "'reference' (verify_reference, verify_tree_reference) or 'auto' on CPU."
        )
    return "triton"


def _triton_import_error() -> ImportError | None:
    """Why triton does not import, or None (after the first import this is a dict lookup)."""
    try:
        import triton  # noqa: F401  # optional: the triton extra
    except ImportError as err:
        return err
    return None


@dataclass(frozen=True)
class VerifyInputs:
    """One verify step's inputs for a ragged batch of chains, in the flat layout above (vLLM's
    ``SpecDecodeMetadata`` and ``SamplingMetadata`` in one object): what ``verify``, ``verify_reference``
    and ``verify_triton`` read."""

    draft_token_ids: torch.Tensor  # [num_tokens] long: drafts of all rows, concatenated
    cu_num_draft_tokens: torch.Tensor  # [batch] long: inclusive cumsum of per-row draft counts
    draft_probs: torch.Tensor | None  # [num_tokens, V] q at each draft position; None = one-hot q
    target_probs: torch.Tensor  # [num_tokens, V] p at each draft position (already warped)
    bonus_token_ids: torch.Tensor  # [batch] long: sampled from p after each row's last draft
    uniforms: torch.Tensor  # [num_tokens] float32 U[0, 1)
    exponentials: torch.Tensor  # [batch, V] float32 Exp(1) > 0
    greedy: torch.Tensor  # [batch] bool
    max_spec_len: int  # output rows hold max_spec_len + 1 tokens: at least the most drafts a row has
    lenience: float = 1.0  # LOSSY below 1, see ``verify``

    def unpacked(self) -> tuple:
        """The fields in order (no copies)."""
        return tuple(getattr(self, f.name) for f in fields(self))


def verify(inputs: VerifyInputs, check: bool = True, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (output_token_ids [batch, max_spec_len + 1] padded with -1, num_accepted [batch]).

    Each output row is: the accepted drafts, then one correction or bonus token,
    then -1. ``num_accepted`` counts accepted drafts only (so a row emits
    num_accepted + 1 tokens). ``backend`` (auto | triton | reference, see
    ``resolve_verify_backend``): by default the Triton kernels on CUDA tensors, the
    pure-torch reference everywhere else.

    lenience < 1 is LOSSY: accept while u < p / (lenience * q), correction still from
    norm(max(0, p - q)). A position then emits min(q, p / l) + (1 - sum min(q, p / l)) *
    norm(max(0, p - q)) instead of p (checked in tests/test_verify_statistics.py).

    ``check=False`` skips the input checks and their host syncs (for a caller that checked once).
    """
    triton = resolve_verify_backend(backend, inputs.target_probs.device) == "triton"
    return verify_triton(inputs, check=check) if triton else verify_reference(inputs, check=check)


def verify_reference(inputs: VerifyInputs, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch verify: the specification the kernel is tested against. See ``verify``."""
    if check:
        _check_inputs(inputs)
    (draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, bonus_token_ids, uniforms, exponentials,
     greedy, max_spec_len, lenience) = inputs.unpacked()  # fmt: skip
    num_drafts = _draft_counts(cu_num_draft_tokens)
    batch = cu_num_draft_tokens.shape[0]
    num_tokens, vocab_size = target_probs.shape
    device = target_probs.device
    starts = cu_num_draft_tokens - num_drafts
    row_of = torch.repeat_interleave(torch.arange(batch, device=device), num_drafts)  # [num_tokens]
    pos_of = torch.arange(num_tokens, device=device) - starts[row_of]  # position within its row

    # 1. The accept test at every draft position. u < p(x) / q(x) is written as
    #    u * q(x) < p(x): no division, and q(x) = 0 accepts iff p(x) > 0 (ratio inf).
    #    lenience l < 1 is lossy (Leviathan et al. 2023, appendix "Lenience"): accept iff u < p(x) / (l q(x)).
    #    Everything is float32, in this exact order, so the kernel can match it bit for bit.
    drafts = draft_token_ids.long()
    p_x = target_probs.gather(1, drafts[:, None]).squeeze(1).float()
    if draft_probs is None:
        q_x = torch.ones_like(p_x)  # deterministic drafts: q is one-hot on the draft
    else:
        q_x = draft_probs.gather(1, drafts[:, None]).squeeze(1).float()
    lenience32 = torch.tensor(lenience, dtype=torch.float32, device=device)
    accept = uniforms.float() * (lenience32 * q_x) < p_x
    if greedy.any():
        accept = torch.where(greedy[row_of], drafts == target_probs.argmax(-1), accept)

    # 2. A row keeps its drafts up to (not including) its first rejection.
    first_rejection = torch.where(accept, num_drafts[row_of], pos_of)
    num_accepted = num_drafts.clone().scatter_reduce_(0, row_of, first_rejection, reduce="amin")

    # 3. Accepted drafts, then one extra token, then padding.
    output = torch.full((batch, max_spec_len + 1), PADDING_TOKEN_ID, dtype=torch.long, device=device)
    kept = pos_of < num_accepted[row_of]
    output[row_of[kept], pos_of[kept]] = drafts[kept]

    extra = bonus_token_ids.long().clone()  # rows that accepted everything get the bonus
    rejected_rows = (num_accepted < num_drafts).nonzero().squeeze(1)
    if rejected_rows.numel() > 0:
        rejected_at = (starts + num_accepted)[rejected_rows]  # flat index of each row's rejected draft
        p = target_probs[rejected_at].float()
        if draft_probs is None:
            q = torch.nn.functional.one_hot(drafts[rejected_at], vocab_size).float()
        else:
            q = draft_probs[rejected_at].float()
        recovered = recover_token(p, q, exponentials[rejected_rows].float())
        extra[rejected_rows] = torch.where(greedy[rejected_rows], p.argmax(-1), recovered)
    output[torch.arange(batch, device=device), num_accepted] = extra
    return output, num_accepted


def recover_token(p: torch.Tensor, q: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """The token emitted at a rejection: a draw from norm(max(0, p - q)) per row.

    Exponential race: argmax_x max(0, p(x) - q(x)) / e_x with e ~ Exp(1) samples x
    with probability proportional to the residual, without normalising it.
    If the residual is all zero (a rejection then needs rounding, or a draft that
    both p and q give zero) the race is run over p instead. Ties go to the lowest
    token id, as with torch.argmax.
    """
    scores = (p - q).clamp_min(0.0) / exponentials
    fallback = p / exponentials
    return torch.where(scores.amax(-1) > 0, scores.argmax(-1), fallback.argmax(-1))


def verify_triton(inputs: VerifyInputs, check: bool = True, block_v: int | None = None,
                  num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Verify with the Triton kernels. Same contract as ``verify``.

    ``block_v`` is how many vocabulary entries a program reads per step (a power of two in
    [128, 4096]; default min(1024, next_pow2(V))), ``num_splits`` how many programs share a row's
    vocabulary (default: enough to fill the GPU). Runs on CUDA tensors, or on CPU under the Triton
    interpreter (TRITON_INTERPRET=1 set before triton is imported).
    """
    if check:
        _check_inputs(inputs)
    resolve_verify_backend("triton", inputs.target_probs.device)  # triton importable, CUDA or the interpreter
    from specdraft.kernels.rejection_sampler import rejection_sample  # optional: needs triton

    return rejection_sample(*inputs.unpacked(), block_v=block_v, num_splits=num_splits)


def _draft_counts(cu_num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """Per-row draft counts from their inclusive cumsum (on the device: no sync)."""
    return torch.diff(cu_num_draft_tokens.long(), prepend=cu_num_draft_tokens.new_zeros(1).long())


def _check_inputs(inputs: VerifyInputs) -> torch.Tensor:
    """Shape/range checks shared by both implementations; returns per-row draft counts.

    A bad count or token id would make the kernel read or write out of bounds,
    so these are checked on the host (a few tiny syncs). ``check=False`` skips them: the
    decoder checks its first verify of a call, not every step.
    """
    (draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, bonus_token_ids, uniforms, exponentials,
     greedy, max_spec_len, lenience) = inputs.unpacked()  # fmt: skip
    if target_probs.dim() != 2:
        raise SpecdraftError(
            f"verify: target_probs must be [num_tokens, vocab], got shape {tuple(target_probs.shape)}; "
            "flatten the per-row draft positions into one list (see cu_num_draft_tokens)."
        )
    if cu_num_draft_tokens.dim() != 1:
        raise SpecdraftError(
            f"verify: cu_num_draft_tokens must be 1-D [batch], got shape {tuple(cu_num_draft_tokens.shape)}; "
            "pass the inclusive cumsum of per-row draft counts."
        )
    num_tokens, vocab_size = target_probs.shape
    batch = cu_num_draft_tokens.shape[0]
    expected = {
        "draft_token_ids": (draft_token_ids, (num_tokens,)),
        "bonus_token_ids": (bonus_token_ids, (batch,)),
        "uniforms": (uniforms, (num_tokens,)),
        "exponentials": (exponentials, (batch, vocab_size)),
        "greedy": (greedy, (batch,)),
    }
    if draft_probs is not None:
        expected["draft_probs"] = (draft_probs, (num_tokens, vocab_size))
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise SpecdraftError(
                f"verify: {name} has shape {tuple(tensor.shape)}, expected {shape} "
                f"(num_tokens={num_tokens} from target_probs, batch={batch} from cu_num_draft_tokens); "
                "reshape it (e.g. bonus_token_ids is [batch], not [batch, 1])."
            )
        if tensor.device != target_probs.device:
            raise SpecdraftError(
                f"verify: {name} is on {tensor.device} but target_probs on {target_probs.device}; "
                "move them to the same device."
            )
    integer_inputs = {"draft_token_ids": draft_token_ids, "cu_num_draft_tokens": cu_num_draft_tokens,
                      "bonus_token_ids": bonus_token_ids}
    for name, tensor in integer_inputs.items():
        if tensor.is_floating_point():
            raise SpecdraftError(f"verify: {name} must hold integers, got {tensor.dtype}; use .long().")
    if greedy.dtype != torch.bool:
        raise SpecdraftError(f"verify: greedy must be a bool tensor, got {greedy.dtype}; pass `temperatures == 0`.")
    if not (0.0 < lenience <= 1.0):
        raise SpecdraftError(f"verify: lenience must be in (0, 1], got {lenience}; use 1.0 for exact verification.")
    if max_spec_len < 0:
        raise SpecdraftError(f"verify: max_spec_len must be >= 0, got {max_spec_len}.")

    num_drafts = _draft_counts(cu_num_draft_tokens)
    if batch > 0:
        if int(cu_num_draft_tokens[-1]) != num_tokens or int(num_drafts.min()) < 0:
            raise SpecdraftError(
                f"verify: cu_num_draft_tokens={cu_num_draft_tokens.tolist()} must be a non-decreasing inclusive "
                f"cumsum of per-row draft counts ending at num_tokens={num_tokens}; build it with counts.cumsum(0)."
            )
        if int(num_drafts.max()) > max_spec_len:
            raise SpecdraftError(
                f"verify: a row has {int(num_drafts.max())} drafts but max_spec_len={max_spec_len}; "
                "raise max_spec_len to the largest per-row draft count."
            )
    elif num_tokens != 0:
        raise SpecdraftError(f"verify: batch is empty but there are {num_tokens} draft tokens.")
    if num_tokens > 0 and not (0 <= int(draft_token_ids.min()) and int(draft_token_ids.max()) < vocab_size):
        raise SpecdraftError(
            f"verify: draft token ids must be in [0, {vocab_size}); "
            "map draft-vocabulary ids to target ids first (d2t)."
        )
    return num_drafts


def expected_acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha predicted: the chance a draft x ~ q is accepted against p, sum_x min(p(x), q(x)).

    Leviathan et al. 2023, Sec. 3.3 (beta = sum min(p, q) = 1 - D_LK(p, q)); Chen et al.
    2023. Reduces the last dim (vocab); p and q must be warped the same way.
    """
    return torch.minimum(p.float(), q.float()).sum(-1)


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Expected tokens emitted per verify step with k drafts, i.i.d. acceptance alpha:
    (1 - alpha^(k+1)) / (1 - alpha)  (Leviathan et al. 2023, Eq. 1)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def typical_acceptance(
    draft_token_ids: torch.Tensor,  # [..., K] candidate continuations
    target_probs: torch.Tensor,  # [..., K, V] p at each candidate position
    epsilon: float = 0.09,
    delta: float = 0.3,
) -> torch.Tensor:
    """LOSSY: Medusa's typical acceptance (Cai et al. 2024, Sec. 2.3.1). Returns the
    number of leading drafts accepted, [...].

    Accept x while p(x) > min(epsilon, delta * exp(-H(p))): a hard floor epsilon, and
    an entropy-scaled one so that flat (uncertain) p accepts more. This does NOT
    preserve the target distribution. Defaults are Medusa's posterior_threshold=0.09
    and posterior_alpha=0.3 (= sqrt(0.09)). H uses 0 log 0 = 0 (Medusa adds 1e-5 in the log).
    """
    if epsilon < 0 or delta < 0:
        raise SpecdraftError(f"typical_acceptance: epsilon and delta must be >= 0, got {epsilon}, {delta}.")
    p = target_probs.float()
    p_x = p.gather(-1, draft_token_ids.long().unsqueeze(-1)).squeeze(-1)
    entropy = torch.special.entr(p).sum(-1)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))
    accept = p_x > threshold
    return accept.long().cumprod(-1).sum(-1)
