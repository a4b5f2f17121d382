"""Speculative-decoding verify as two Triton kernels: vocabulary-split partials, then a per-row combine.

Same contract and same float32 arithmetic as ``specdraft.decoding.verify.verify_reference``
(the spec; read it first). Per row, walking its drafts in order:

  greedy row:  accept x_i while x_i == argmax p_i; correction = argmax p_i
  random row:  accept x_i while u_i * (lenience * q_i(x_i)) < p_i(x_i)
               (Leviathan et al. 2023 Alg. 1: u < p/q, without the division)
               correction = argmax_x max(0, p(x) - q(x)) / e_x   (exponential race
               = a draw from norm(max(0, p - q)); over p if the residual is all zero)
  all accepted: append the bonus token.

Only the vocabulary-wide work (argmaxes, the race) is heavy, and it splits: the vocabulary is cut
into ``num_splits`` ranges of whole BLOCK_V chunks, so that a batch of one row still spreads over
many SMs (one program per row swept V = 152k on one SM).

  1. ``rejection_partials_kernel``, grid (batch, num_splits): program (row, s) computes its range's
     best (value, id) of every argmax the row may need (greedy: p at each draft position) or of the
     race at the row's rejected position (random: the accept tests are scalar, so every program
     replays them, and split 0 records num_accepted). The race keeps two bests: over the residual,
     and over p for the all-zero fallback, from the same loads.
  2. ``rejection_combine_kernel``, grid (batch,): takes the best over the splits (strictly greater
     wins, so a tie goes to the lowest split, i.e. the lowest id, as within a range), walks the
     greedy rows, and writes each output row whole (drafts, the extra token, -1 padding).

Bit-identical to the reference: every value compared is computed as the reference computes it
(float32, div_rn, no FMA contraction), and an argmax over ranges of an argmax is the argmax.

Race-free: neither kernel reads anything written in its own launch (the partials and num_accepted
are written by launch 1 and read by launch 2, in stream order), so every lane of a program sees
the same values and takes the same branches.
"""

import functools

import torch
import triton
import triton.language as tl

from specdraft.errors import SpecdraftError

PADDING_TOKEN_ID = -1
NUM_WARPS = 4
# BLOCK_V bounds. At least 32 * NUM_WARPS: each element of a chunk then has one owning lane (a smaller
# block repeats elements across warps). At most 4096: 8192 already needs 252 registers and 32768 spills.
MIN_BLOCK_V = 32 * NUM_WARPS
MAX_BLOCK_V = 4096
DEFAULT_BLOCK_V = 1024
PROGRAMS_PER_SM = 2  # default splits: about this many programs per SM in all
BLOCK_S = 64  # splits combined per step
BLOCK_OUT = 16  # output slots written per step


@triton.jit
def _keep_best(best_val, best_idx, vals, chunk_start):
    """Fold one chunk into a running (max, first index of the max): strictly greater wins, so on a
    tie the earlier chunk keeps it, and within a chunk the lowest index (as torch.argmax)."""
    chunk_val, chunk_idx = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    better = chunk_val > best_val
    return tl.where(better, chunk_val, best_val), tl.where(better, chunk_start + chunk_idx, best_idx)


@triton.jit
def _argmax_range(row_ptr, lo, hi, BLOCK_V: tl.constexpr):
    """(largest value, its first index) of row[lo:hi] in float32; (-inf, 0) for an empty range."""
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for chunk_start in range(lo, hi, BLOCK_V):
        offsets = chunk_start + tl.arange(0, BLOCK_V)
        vals = tl.load(row_ptr + offsets, mask=offsets < hi, other=float("-inf")).to(tl.float32)
        best_val, best_idx = _keep_best(best_val, best_idx, vals, chunk_start)
    return best_val, best_idx


@triton.jit
def _chunk(w_row_ptr, e_row_ptr, chunk_start, hi, BLOCK_V: tl.constexpr):
    """One chunk of a race: (offsets, in range, w in float32, e); outside the range w = 0 and e = 1."""
    offsets = chunk_start + tl.arange(0, BLOCK_V)
    in_range = offsets < hi
    w = tl.load(w_row_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
    return offsets, in_range, w, tl.load(e_row_ptr + offsets, mask=in_range, other=1.0)


@triton.jit
def _scores(w, e, in_range):
    """w / e as the race scores it, -1 outside the range (every real score is >= 0). div_rn: IEEE
    round-to-nearest division, so the GPU equals torch's `/` bit for bit (a plain `/` lowers to the
    approximate div.full.f32 on NVIDIA)."""
    return tl.where(in_range, tl.div_rn(w, e), -1.0)


@triton.jit
def _no_race():
    """(best score, its id) before any chunk: below every real score."""
    return tl.full([], -1.0, tl.float32), tl.full([], 0, tl.int32)


@triton.jit
def _race_over(w_row_ptr, e_row_ptr, lo, hi, BLOCK_V: tl.constexpr):
    """(best score, its id) of the exponential race argmax_x w(x) / e_x over x in [lo, hi), w >= 0:
    a draw from norm(w). Ties -> lowest id; the score is 0 when w is all zero, -1 for an empty range."""
    best_score, best_idx = _no_race()
    for chunk_start in range(lo, hi, BLOCK_V):
        offsets, in_range, w, e = _chunk(w_row_ptr, e_row_ptr, chunk_start, hi, BLOCK_V)
        best_score, best_idx = _keep_best(best_score, best_idx, _scores(w, e, in_range), chunk_start)
    return best_score, best_idx


@triton.jit
def _residual_race(p_row_ptr, q_row_ptr, draft_token, e_row_ptr, lo, hi, NO_DRAFT_PROBS: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    """Over x in [lo, hi): the race over the residual max(0, p - q) and the race over p (the fallback
    when the whole residual is zero), in one pass. Returns (score, id, fallback score, fallback id)."""
    best_score, best_idx = _no_race()
    fallback_score, fallback_idx = _no_race()
    for chunk_start in range(lo, hi, BLOCK_V):
        offsets, in_range, p, e = _chunk(p_row_ptr, e_row_ptr, chunk_start, hi, BLOCK_V)
        if NO_DRAFT_PROBS:
            q = tl.where(offsets == draft_token, 1.0, 0.0)  # one-hot q of a deterministic draft
        else:
            q = tl.load(q_row_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
        best_score, best_idx = _keep_best(best_score, best_idx, _scores(tl.maximum(p - q, 0.0), e, in_range),
                                          chunk_start)  # fmt: skip
        fallback_score, fallback_idx = _keep_best(fallback_score, fallback_idx, _scores(p, e, in_range), chunk_start)
    return best_score, best_idx, fallback_score, fallback_idx


@triton.jit
def _combine_splits(val_ptr, idx_ptr, slot, num_splits, count, BLOCK_S: tl.constexpr):
    """(best value, its id) over the first ``count`` of a slot's ``num_splits`` partials: strictly greater
    wins, so a tie goes to the lowest split, whose ids are the lowest."""
    base = slot.to(tl.int64) * num_splits
    best_val = tl.full([], float("-inf"), tl.float32)
    best_split = tl.full([], 0, tl.int32)
    for s0 in range(0, count, BLOCK_S):
        offsets = s0 + tl.arange(0, BLOCK_S)
        vals = tl.load(val_ptr + base + offsets, mask=offsets < count, other=float("-inf"))
        best_val, best_split = _keep_best(best_val, best_split, vals, s0)
    return best_val, tl.load(idx_ptr + base + best_split)


@triton.jit
def _row_span(cu_ptr, row):
    """(first flat index, count) of a row's drafts or nodes, from their inclusive cumsum."""
    start = tl.load(cu_ptr + row - 1, mask=row > 0, other=0)
    return start, tl.load(cu_ptr + row) - start


@triton.jit
def _write_row(row_ptr, values_ptr, num_values, last, extra, length, BLOCK_OUT: tl.constexpr):
    """row[:length] := values[:num_values], then ``extra`` at ``last`` (if last < length), then -1."""
    for c in range(0, length, BLOCK_OUT):
        offsets = c + tl.arange(0, BLOCK_OUT)
        values = tl.load(values_ptr + offsets, mask=offsets < num_values, other=-1)
        values = tl.where(offsets < num_values, values, tl.where(offsets == last, extra, -1))
        tl.store(row_ptr + offsets, values, mask=offsets < length)


@triton.jit
def _accepted_drafts(draft_token_ids_ptr, draft_probs_ptr, target_probs_ptr, uniforms_ptr, start, num_drafts,
                     lenience, vocab_size, NO_DRAFT_PROBS: tl.constexpr):
    """A random row's accepted drafts: u_i * (lenience * q_i(x_i)) < p_i(x_i) until the first failure."""
    num_accepted = tl.zeros([], tl.int64)
    rejected = False
    for i in range(num_drafts):  # Triton has no `break`
        if not rejected:
            token_idx = start + i  # int64: token_idx * vocab_size may exceed 2^31
            draft = tl.load(draft_token_ids_ptr + token_idx)
            p_x = tl.load(target_probs_ptr + token_idx * vocab_size + draft).to(tl.float32)
            if NO_DRAFT_PROBS:
                q_x = 1.0
            else:
                q_x = tl.load(draft_probs_ptr + token_idx * vocab_size + draft).to(tl.float32)
            u = tl.load(uniforms_ptr + token_idx)
            if u * (lenience * q_x) < p_x:
                num_accepted += 1
            else:
                rejected = True
    return num_accepted


@triton.jit(do_not_specialize=["split_size", "num_splits"])
def rejection_partials_kernel(
    partial_val_ptr,  # [2 * batch + num_tokens, num_splits] float32 (slots: see rejection_sample)
    partial_idx_ptr,  # [2 * batch + num_tokens, num_splits] int32
    num_accepted_ptr,  # [batch] int64: written here for random rows (by split 0)
    cu_num_draft_tokens_ptr,  # [batch] int64
    draft_token_ids_ptr,  # [num_tokens] int64
    draft_probs_ptr,  # [num_tokens, V] (unused if NO_DRAFT_PROBS)
    target_probs_ptr,  # [num_tokens, V]
    uniforms_ptr,  # [num_tokens] float32
    exponentials_ptr,  # [batch, V] float32
    greedy_ptr,  # [batch] bool
    lenience,  # float32
    vocab_size,
    split_size,  # vocabulary entries per split, a multiple of BLOCK_V
    num_splits,
    NO_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    batch = tl.num_programs(0)
    start, num_drafts = _row_span(cu_num_draft_tokens_ptr, row)
    lo = split * split_size
    hi = tl.minimum(lo + split_size, vocab_size)
    if tl.load(greedy_ptr + row):
        # Every position's argmax over this range (the walk needs them one after another).
        for i in range(num_drafts):
            token_idx = start + i
            val, idx = _argmax_range(target_probs_ptr + token_idx * vocab_size, lo, hi, BLOCK_V)
            slot = (2 * batch + token_idx) * num_splits + split
            tl.store(partial_val_ptr + slot, val)
            tl.store(partial_idx_ptr + slot, idx)
    else:
        num_accepted = _accepted_drafts(draft_token_ids_ptr, draft_probs_ptr, target_probs_ptr, uniforms_ptr, start,
                                        num_drafts, lenience, vocab_size, NO_DRAFT_PROBS)  # fmt: skip
        if split == 0:
            tl.store(num_accepted_ptr + row, num_accepted)
        if num_accepted < num_drafts:
            token_idx = start + num_accepted
            score, idx, fallback_score, fallback_idx = _residual_race(
                target_probs_ptr + token_idx * vocab_size, draft_probs_ptr + token_idx * vocab_size,
                tl.load(draft_token_ids_ptr + token_idx), exponentials_ptr + row.to(tl.int64) * vocab_size,
                lo, hi, NO_DRAFT_PROBS, BLOCK_V,
            )  # fmt: skip
            slot = 2 * row * num_splits + split
            tl.store(partial_val_ptr + slot, score)
            tl.store(partial_idx_ptr + slot, idx)
            tl.store(partial_val_ptr + slot + num_splits, fallback_score)
            tl.store(partial_idx_ptr + slot + num_splits, fallback_idx)


@triton.jit(do_not_specialize=["output_stride", "max_spec_len", "num_splits"])
def rejection_combine_kernel(
    output_ptr,  # [batch, max_spec_len + 1] int64, written whole
    num_accepted_ptr,  # [batch] int64: read for random rows, written for greedy rows
    cu_num_draft_tokens_ptr,  # [batch] int64
    draft_token_ids_ptr,  # [num_tokens] int64
    bonus_token_ids_ptr,  # [batch] int64
    greedy_ptr,  # [batch] bool
    partial_val_ptr,
    partial_idx_ptr,
    output_stride,
    max_spec_len,
    num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
):
    row = tl.program_id(0)
    batch = tl.num_programs(0)
    start, num_drafts = _row_span(cu_num_draft_tokens_ptr, row)
    extra = tl.load(bonus_token_ids_ptr + row)  # the bonus, unless a draft is rejected
    if tl.load(greedy_ptr + row):
        num_accepted = tl.zeros([], tl.int64)
        rejected = False
        for i in range(num_drafts):
            if not rejected:
                _, target_argmax = _combine_splits(partial_val_ptr, partial_idx_ptr, 2 * batch + start + i,
                                                   num_splits, num_splits, BLOCK_S)  # fmt: skip
                if tl.load(draft_token_ids_ptr + start + i) == target_argmax:
                    num_accepted += 1
                else:
                    rejected = True
                    extra = target_argmax.to(tl.int64)
        tl.store(num_accepted_ptr + row, num_accepted)
    else:
        num_accepted = tl.load(num_accepted_ptr + row)
        if num_accepted < num_drafts:
            score, token = _combine_splits(partial_val_ptr, partial_idx_ptr, 2 * row, num_splits, num_splits, BLOCK_S)
            if score <= 0.0:
                # Residual all zero (only rounding gets here): the race over p itself.
                score, token = _combine_splits(partial_val_ptr, partial_idx_ptr, 2 * row + 1, num_splits, num_splits,
                                               BLOCK_S)
            extra = token.to(tl.int64)
    _write_row(output_ptr + row.to(tl.int64) * output_stride, draft_token_ids_ptr + start, num_accepted,
               num_accepted, extra, max_spec_len + 1, BLOCK_OUT)  # fmt: skip


def check_block_v(block_v: int | None, vocab_size: int) -> int:
    """The chunk width: ``block_v`` if valid, else a SpecdraftError naming the valid range; None picks
    min(DEFAULT_BLOCK_V, next_pow2(V)), at least MIN_BLOCK_V."""
    if block_v is None:  # plain int arithmetic: triton.next_power_of_2 costs microseconds per call
        return max(MIN_BLOCK_V, min(DEFAULT_BLOCK_V, 1 << (max(vocab_size, 1) - 1).bit_length()))
    if isinstance(block_v, bool) or not isinstance(block_v, int) or block_v & (block_v - 1) or not (
            MIN_BLOCK_V <= block_v <= MAX_BLOCK_V):  # fmt: skip
        raise SpecdraftError(
            f"block_v must be a power of two in [{MIN_BLOCK_V}, {MAX_BLOCK_V}] (e.g. 1024), got {block_v!r}; "
            f"below {MIN_BLOCK_V} ({NUM_WARPS} warps x 32 lanes) lanes would repeat elements, above "
            f"{MAX_BLOCK_V} the kernel runs out of registers. Leave it unset for the default."
        )
    return block_v


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def vocab_splits(batch: int, vocab_size: int, block_v: int, device: torch.device,
                 num_splits: int | None = None) -> tuple[int, int]:  # fmt: skip
    """(number of splits, entries per split): ranges of whole BLOCK_V chunks, none empty. By default
    about PROGRAMS_PER_SM programs per SM on CUDA (1 split per row off CUDA, e.g. under the interpreter)."""
    if num_splits is None:
        num_splits = 1
        if device.type == "cuda":
            num_splits = max(1, PROGRAMS_PER_SM * _sm_count(device.index or torch.cuda.current_device()) // batch)
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise SpecdraftError(f"num_splits must be an int >= 1 (or None for the default), got {num_splits!r}")
    num_chunks = max(1, -(-vocab_size // block_v))  # ceiling divisions in plain ints (triton.cdiv is slower)
    chunks_per_split = -(-num_chunks // min(num_splits, num_chunks))
    return -(-num_chunks // chunks_per_split), chunks_per_split * block_v


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
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the two kernels. Inputs are assumed checked (``specdraft.decoding.verify.verify_triton`` does).

    Partial slots, each ``num_splits`` wide: row r's race at 2r, its fallback race at 2r + 1, then
    the argmax of draft position t at 2 * batch + t."""
    batch = cu_num_draft_tokens.shape[0]
    num_tokens, vocab_size = target_probs.shape
    device = target_probs.device
    block_v = check_block_v(block_v, vocab_size)
    num_splits, split_size = vocab_splits(batch, vocab_size, block_v, device, num_splits)
    output = torch.empty((batch, max_spec_len + 1), dtype=torch.long, device=device)
    num_accepted = torch.empty(batch, dtype=torch.long, device=device)
    if batch == 0:
        return output, num_accepted
    partial_val = torch.empty((2 * batch + num_tokens) * num_splits, dtype=torch.float32, device=device)
    partial_idx = torch.empty((2 * batch + num_tokens) * num_splits, dtype=torch.int32, device=device)
    target_probs = target_probs.contiguous()
    cu_num_draft_tokens = cu_num_draft_tokens.long().contiguous()
    draft_token_ids = draft_token_ids.long().contiguous()
    rejection_partials_kernel[(batch, num_splits)](
        partial_val,
        partial_idx,
        num_accepted,
        cu_num_draft_tokens,
        draft_token_ids,
        # Never read without draft probs; any valid pointer keeps the signature fixed.
        target_probs if draft_probs is None else draft_probs.contiguous(),
        target_probs,
        uniforms.float().contiguous(),
        exponentials.float().contiguous(),
        greedy.contiguous(),
        float(lenience),
        vocab_size,
        split_size,
        num_splits,
        NO_DRAFT_PROBS=draft_probs is None,
        BLOCK_V=block_v,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # no a * b + c -> fma contraction: keep torch's float32 rounding
    )
    rejection_combine_kernel[(batch,)](
        output,
        num_accepted,
        cu_num_draft_tokens,
        draft_token_ids,
        bonus_token_ids.long().contiguous(),
        greedy.contiguous(),
        partial_val,
        partial_idx,
        output.stride(0),
        max_spec_len,
        num_splits,
        BLOCK_S=BLOCK_S,
        BLOCK_OUT=BLOCK_OUT,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # no float arithmetic here; set, as above, so no default applies
    )
    return output, num_accepted
