"""Speculative-decoding verify as one Triton kernel: one program per row.

Same contract and same float32 arithmetic as ``specdraft.decoding.verify.verify_reference``
(the spec; read it first). A program walks its row's drafts in order:

  greedy row:  accept x_i while x_i == argmax p_i; correction = argmax p_i
  random row:  accept x_i while u_i * (lenience * q_i(x_i)) < p_i(x_i)
               (Leviathan et al. 2023 Alg. 1: u < p/q, without the division)
               correction = argmax_x max(0, p(x) - q(x)) / e_x   (exponential race
               = a draw from norm(max(0, p - q)); over p if the residual is all zero)
  all accepted: append the bonus token.

Vocabulary-wide work (argmax, race) streams the row in BLOCK_V chunks, so any
vocabulary size works (not just powers of two). Only the one correction a row
needs is computed, never a recovered token per position.
"""

import torch
import triton
import triton.language as tl

PADDING_TOKEN_ID = -1


@triton.jit
def _argmax_over_vocab(row_ptr, vocab_size, BLOCK_V: tl.constexpr):
    """First index of the largest entry of one vocabulary row (ties -> lowest id, like torch)."""
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for chunk_start in range(0, vocab_size, BLOCK_V):
        offsets = chunk_start + tl.arange(0, BLOCK_V)
        vals = tl.load(row_ptr + offsets, mask=offsets < vocab_size, other=float("-inf")).to(tl.float32)
        chunk_val, chunk_idx = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
        # Strictly greater: on a tie the earlier chunk keeps the win.
        better = chunk_val > best_val
        best_idx = tl.where(better, chunk_start + chunk_idx, best_idx)
        best_val = tl.where(better, chunk_val, best_val)
    return best_idx


@triton.jit
def _recover_token(
    p_row_ptr, q_row_ptr, draft_token, e_row_ptr, vocab_size, NO_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr
):
    """Exponential race over the residual max(0, p - q); over p if the residual is all zero."""
    best_score = tl.full([], -1.0, tl.float32)  # every real score is >= 0
    best_idx = tl.full([], 0, tl.int32)
    for chunk_start in range(0, vocab_size, BLOCK_V):
        offsets = chunk_start + tl.arange(0, BLOCK_V)
        in_vocab = offsets < vocab_size
        p = tl.load(p_row_ptr + offsets, mask=in_vocab, other=0.0).to(tl.float32)
        if NO_DRAFT_PROBS:
            q = tl.where(offsets == draft_token, 1.0, 0.0)  # one-hot q of a deterministic draft
        else:
            q = tl.load(q_row_ptr + offsets, mask=in_vocab, other=0.0).to(tl.float32)
        e = tl.load(e_row_ptr + offsets, mask=in_vocab, other=1.0)
        # div_rn: IEEE round-to-nearest division, so the GPU result equals torch's `/`
        # bit for bit (a plain `/` lowers to the approximate div.full.f32 on NVIDIA).
        score = tl.where(in_vocab, tl.div_rn(tl.maximum(p - q, 0.0), e), -1.0)
        chunk_score, chunk_idx = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = chunk_score > best_score
        best_idx = tl.where(better, chunk_start + chunk_idx, best_idx)
        best_score = tl.where(better, chunk_score, best_score)

    if best_score <= 0.0:
        # Residual all zero (only rounding gets here): race over p itself.
        best_idx, best_score = _race_over(p_row_ptr, e_row_ptr, vocab_size, BLOCK_V)
    return best_idx


@triton.jit
def _race_over(w_row_ptr, e_row_ptr, vocab_size, BLOCK_V: tl.constexpr):
    """(argmax_x w(x) / e_x, its score) over one row of weights w >= 0: a draw from norm(w), the
    exponential race. Ties -> lowest id; the score is 0 when w is all zero."""
    best_score = tl.full([], -1.0, tl.float32)  # every real score is >= 0
    best_idx = tl.full([], 0, tl.int32)
    for chunk_start in range(0, vocab_size, BLOCK_V):
        offsets = chunk_start + tl.arange(0, BLOCK_V)
        in_vocab = offsets < vocab_size
        w = tl.load(w_row_ptr + offsets, mask=in_vocab, other=0.0).to(tl.float32)
        e = tl.load(e_row_ptr + offsets, mask=in_vocab, other=1.0)
        # div_rn: IEEE division, so the GPU matches torch's `/` bit for bit.
        score = tl.where(in_vocab, tl.div_rn(w, e), -1.0)
        chunk_score, chunk_idx = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = chunk_score > best_score  # strictly: on a tie the earlier chunk keeps the win
        best_idx = tl.where(better, chunk_start + chunk_idx, best_idx)
        best_score = tl.where(better, chunk_score, best_score)
    return best_idx, best_score


@triton.jit
def rejection_sample_kernel(
    output_ptr,  # [batch, max_spec_len + 1] int64, pre-filled with -1
    num_accepted_ptr,  # [batch] int64
    cu_num_draft_tokens_ptr,  # [batch] int64
    draft_token_ids_ptr,  # [num_tokens] int64
    draft_probs_ptr,  # [num_tokens, V] (unused if NO_DRAFT_PROBS)
    target_probs_ptr,  # [num_tokens, V]
    bonus_token_ids_ptr,  # [batch] int64
    uniforms_ptr,  # [num_tokens] float32
    exponentials_ptr,  # [batch, V] float32
    greedy_ptr,  # [batch] bool
    lenience,  # float32
    vocab_size,
    output_stride,
    NO_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    start = tl.load(cu_num_draft_tokens_ptr + row - 1, mask=row > 0, other=0)
    end = tl.load(cu_num_draft_tokens_ptr + row)
    num_drafts = end - start
    is_greedy = tl.load(greedy_ptr + row)
    output_row_ptr = output_ptr + row.to(tl.int64) * output_stride

    # Walk the drafts until the first rejection (Triton has no `break`).
    num_accepted = tl.zeros([], tl.int64)
    rejected = False
    for i in range(num_drafts):
        if not rejected:
            token_idx = start + i  # int64: token_idx * vocab_size may exceed 2^31
            draft = tl.load(draft_token_ids_ptr + token_idx)
            if is_greedy:
                target_argmax = _argmax_over_vocab(target_probs_ptr + token_idx * vocab_size, vocab_size, BLOCK_V)
                accept = draft == target_argmax
            else:
                p_x = tl.load(target_probs_ptr + token_idx * vocab_size + draft).to(tl.float32)
                if NO_DRAFT_PROBS:
                    q_x = 1.0
                else:
                    q_x = tl.load(draft_probs_ptr + token_idx * vocab_size + draft).to(tl.float32)
                u = tl.load(uniforms_ptr + token_idx)
                accept = u * (lenience * q_x) < p_x
            if accept:
                tl.store(output_row_ptr + i, draft)
                num_accepted += 1
            else:
                rejected = True

    # One extra token: the bonus if every draft was accepted, else the correction.
    if num_accepted == num_drafts:
        extra = tl.load(bonus_token_ids_ptr + row)
    else:
        token_idx = start + num_accepted
        p_row_ptr = target_probs_ptr + token_idx * vocab_size
        if is_greedy:
            extra = _argmax_over_vocab(p_row_ptr, vocab_size, BLOCK_V).to(tl.int64)
        else:
            draft = tl.load(draft_token_ids_ptr + token_idx)
            extra = _recover_token(
                p_row_ptr,
                draft_probs_ptr + token_idx * vocab_size,
                draft,
                exponentials_ptr + row.to(tl.int64) * vocab_size,
                vocab_size,
                NO_DRAFT_PROBS,
                BLOCK_V,
            ).to(tl.int64)
    tl.store(output_row_ptr + num_accepted, extra)
    tl.store(num_accepted_ptr + row, num_accepted)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
    greedy: torch.Tensor,
    max_spec_len: int,
    lenience: float = 1.0,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel. Inputs are assumed checked (``specdraft.decoding.verify.verify_triton`` does)."""
    batch = cu_num_draft_tokens.shape[0]
    vocab_size = target_probs.shape[1]
    device = target_probs.device
    output = torch.full((batch, max_spec_len + 1), PADDING_TOKEN_ID, dtype=torch.long, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    if batch == 0:
        return output, num_accepted
    if block_v is None:
        block_v = min(1024, triton.next_power_of_2(vocab_size))
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two (e.g. 256 or 1024), got {block_v}")

    target_probs = target_probs.contiguous()
    rejection_sample_kernel[(batch,)](
        output,
        num_accepted,
        cu_num_draft_tokens.long().contiguous(),
        draft_token_ids.long().contiguous(),
        # Never read without draft probs; any valid pointer keeps the signature fixed.
        target_probs if draft_probs is None else draft_probs.contiguous(),
        target_probs,
        bonus_token_ids.long().contiguous(),
        uniforms.float().contiguous(),
        exponentials.float().contiguous(),
        greedy.contiguous(),
        float(lenience),
        vocab_size,
        output.stride(0),
        NO_DRAFT_PROBS=draft_probs is None,
        BLOCK_V=block_v,
        num_warps=4,
        enable_fp_fusion=False,  # no a * b + c -> fma contraction: keep torch's float32 rounding
    )
    return output, num_accepted
