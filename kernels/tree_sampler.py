"""Exact tree verification as two Triton kernels: vocabulary-split partials, then a per-row combine.

Same contract and same float32 arithmetic as ``specdraft.decoding.tree_verify.verify_tree_reference``
(the spec; read its module docstring first). A row walks its nodes once, in index order, testing
only the children of the current node:

  greedy row:  accept x_c iff x_c == argmax p(current); final token argmax p(current)
  random row:  accept x_c iff u_c * (m * q_c(x_c)) < r(x_c), then r := p(c), m := 1;
               on rejection r := max(0, r - m * q_c), m := sum r (fixed point, order-free);
               final token argmax_x r(x) / e_x (over p(current) if r is all zero)

The vocabulary is cut into ``num_splits`` ranges of whole BLOCK_V chunks (see rejection_sampler), so
that one row spreads over many SMs:

  1. ``tree_partials_kernel``, grid (batch, num_splits), program (row, s):
     * greedy row: the best (value, id) over its range of p at the root and after every node (the
       walk then needs no vocabulary-wide work).
     * random row, deterministic drafts (q one-hot: every tree source of specdraft): a rejection
       zeroes r(x) and lowers m by r(x), scalar work, so every program replays the walk and the
       residual is never stored: r = p(current) with the tokens of the current node's rejected
       children zeroed. Split 0 records the path; each program races over its range (the residual
       and, for the all-zero fallback, p).
     * random row with draft probs: m := sum r is a vocabulary-wide sum that the next accept test
       needs, so a split walk would need one grid-wide synchronisation per rejection (a launch each,
       and how many the host cannot know without a sync). Split 0 walks alone, as one program per
       row did before, with the residual in a [batch, 2, V] float32 scratch kept across calls.
  2. ``tree_combine_kernel``, grid (batch,): the best over the splits, the greedy walk, the final
     token, and the -1 padding of both outputs.

Race-free: the residual of a draft-probs row alternates between its two scratch rows, so a pass reads
one and writes the other and no lane ever reads an element that another lane has already rewritten
(the old in-place update did, when BLOCK_V < 32 * num_warps repeated elements across warps: warps
then disagreed on m and on the next accept, and reached the barrier apart). Every value a lane
branches on is then an input, a scratch element read after the barrier that follows its pass, or a
reduction (tl.sum, which hands every lane the same result) of a buffer not written in that pass: so
all lanes take the same branches, and the barrier before each pass (no lane still reads the row it
overwrites) and after it (every lane sees the new residual) is reached by all. The combine reads
only what the first launch wrote.
"""

import torch
import triton
import triton.language as tl
from specdraft.kernels.rejection_sampler import (
    BLOCK_OUT,
    BLOCK_S,
    NUM_WARPS,
    _argmax_range,
    _chunk,
    _combine_splits,
    _keep_best,
    _no_race,
    _race_over,
    _row_span,
    _scores,
    _write_row,
    check_block_v,
    vocab_splits,
)

PADDING_TOKEN_ID = -1
PADDING_NODE = -1

# Draft-probs scratch ([batch, 2, V] float32) per device, reused across calls and grown when too small.
_SCRATCH: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _subtract_draft(r_row_ptr, q_row_ptr, mass, out_row_ptr, vocab_size, mass_scale, mass_unit,
                    BLOCK_V: tl.constexpr):
    """out := max(0, r - m * q) and return its mass, summed in 2^-S fixed point. ``out`` is never ``r``.

    Integer addition is exact and associative, so the mass has the same bits as the reference's
    whatever order the reduction adds in.
    """
    total = tl.zeros([], tl.int64)
    for chunk_start in range(0, vocab_size, BLOCK_V):
        offsets = chunk_start + tl.arange(0, BLOCK_V)
        in_vocab = offsets < vocab_size
        r = tl.load(r_row_ptr + offsets, mask=in_vocab, other=0.0).to(tl.float32)
        q = tl.load(q_row_ptr + offsets, mask=in_vocab, other=0.0).to(tl.float32)
        new_r = tl.maximum(r - mass * q, 0.0)
        tl.store(out_row_ptr + offsets, new_r, mask=in_vocab)
        # min(r, 1) * 2^S is exact (a power-of-two scale); the cast truncates toward zero, like torch's .long().
        total += tl.sum((tl.minimum(new_r, 1.0) * mass_scale).to(tl.int64), axis=0)
    return total.to(tl.float32) * mass_unit


@triton.jit
def _walk(node_token_ids_ptr, node_parents_ptr, draft_probs_ptr, target_probs_ptr, uniforms_ptr, scratch_row_ptr,
          start, num_nodes, root_row, vocab_size, max_depth, mass_scale, mass_unit, output_row_ptr, accepted_row_ptr,
          write_path, NO_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
    """A random row's walk: one pass over its nodes in index order (no `break`; children come after their
    parent). ``write_path``: store the accepted path. Returns (num_accepted, p row of the final node, the final
    node, then where its residual r is):
      * NO_DRAFT_PROBS: [lo, hi), the node indices holding its rejected children, whose tokens r has zeroed
        (r is p(current) otherwise; scalar work only, so any number of programs may replay it);
      * draft probs: whether r is in the scratch, and which of its two rows (one program per row).
    """
    current = tl.full([], -1, tl.int64)
    p_row = root_row
    mass = tl.full([], 1.0, tl.float32)
    num_accepted = tl.zeros([], tl.int64)
    zeroed_lo = tl.zeros([], tl.int64)
    zeroed_hi = tl.zeros([], tl.int64)
    in_scratch = False  # False: r is p(current), read from target_probs
    buffer = tl.zeros([], tl.int64)
    for j in range(num_nodes):
        node = start + j
        local = node - start  # j as an int64 tensor (under the interpreter j is a Python int)
        if (tl.load(node_parents_ptr + node) == current) & (num_accepted < max_depth):
            x = tl.load(node_token_ids_ptr + node)
            if NO_DRAFT_PROBS:
                q_x = 1.0  # as the reference multiplies by its one-hot q(x)
                r_x = tl.load(target_probs_ptr + p_row * vocab_size + x).to(tl.float32)
                # A sibling with the token of a rejected one (only an unchecked tree has them) sees r(x) = 0.
                for k in range(zeroed_lo, zeroed_hi):
                    if (tl.load(node_parents_ptr + start + k) == current) & \
                            (tl.load(node_token_ids_ptr + start + k) == x):  # fmt: skip
                        r_x = 0.0
            else:
                q_x = tl.load(draft_probs_ptr + node * vocab_size + x).to(tl.float32)
                if in_scratch:
                    r_x = tl.load(scratch_row_ptr + buffer * vocab_size + x)
                else:
                    r_x = tl.load(target_probs_ptr + p_row * vocab_size + x).to(tl.float32)
            accept = tl.load(uniforms_ptr + node) * (mass * q_x) < r_x
            if accept:
                if write_path:
                    tl.store(output_row_ptr + num_accepted, x)
                    tl.store(accepted_row_ptr + num_accepted, local)
                num_accepted += 1
                current = local
                p_row = root_row + 1 + local
                mass = 1.0
                zeroed_lo = zeroed_hi  # an empty range: no rejected child at the new node yet
                in_scratch = False
            elif NO_DRAFT_PROBS:  # r(x) := 0, m := max(0, m - r(x))
                mass = tl.maximum(mass - r_x, 0.0)
                if zeroed_hi == zeroed_lo:
                    zeroed_lo = local
                zeroed_hi = local + 1
            else:  # r := max(0, r - m q) into the other scratch row, m := sum r
                tl.debug_barrier()  # no lane still reads the row this pass overwrites
                q_row_ptr = draft_probs_ptr + node * vocab_size
                out_row_ptr = scratch_row_ptr + (1 - buffer) * vocab_size
                if in_scratch:
                    mass = _subtract_draft(scratch_row_ptr + buffer * vocab_size, q_row_ptr, mass, out_row_ptr,
                                           vocab_size, mass_scale, mass_unit, BLOCK_V)  # fmt: skip
                else:
                    mass = _subtract_draft(target_probs_ptr + p_row * vocab_size, q_row_ptr, mass, out_row_ptr,
                                           vocab_size, mass_scale, mass_unit, BLOCK_V)  # fmt: skip
                tl.debug_barrier()  # every lane sees the new residual
                buffer = 1 - buffer
                in_scratch = True
    return num_accepted, p_row, current, zeroed_lo, zeroed_hi, in_scratch, buffer


@triton.jit
def _one_hot_residual_race(p_row_ptr, e_row_ptr, lo, hi, node_token_ids_ptr, node_parents_ptr, start, current,
                           zeroed_lo, zeroed_hi, BLOCK_V: tl.constexpr):  # fmt: skip
    """Over x in [lo, hi): the race over r = p with the current node's rejected children's tokens zeroed,
    and over p (the fallback). Returns (score, id, fallback score, fallback id)."""
    best_score, best_idx = _no_race()
    fallback_score, fallback_idx = _no_race()
    for chunk_start in range(lo, hi, BLOCK_V):
        offsets, in_range, p, e = _chunk(p_row_ptr, e_row_ptr, chunk_start, hi, BLOCK_V)
        score = _scores(p, e, in_range)
        fallback_score, fallback_idx = _keep_best(fallback_score, fallback_idx, score, chunk_start)
        for k in range(zeroed_lo, zeroed_hi):  # r(x) = 0 there: score 0 / e_x = 0
            zeroed = tl.load(node_parents_ptr + start + k) == current
            score = tl.where(zeroed & (offsets == tl.load(node_token_ids_ptr + start + k)), 0.0, score)
        best_score, best_idx = _keep_best(best_score, best_idx, score, chunk_start)
    return best_score, best_idx, fallback_score, fallback_idx


@triton.jit(do_not_specialize=["max_depth", "output_stride", "accepted_stride", "split_size", "num_splits"])
def tree_partials_kernel(
    partial_val_ptr,  # [2 * batch + num_nodes + batch, num_splits] float32 (slots: see tree_sample)
    partial_idx_ptr,  # int32, same shape
    output_ptr,  # [batch, max_depth + 1] int64: the path of random rows (split 0)
    accepted_nodes_ptr,  # [batch, max_depth] int64: likewise
    num_accepted_ptr,  # [batch] int64: random rows (split 0)
    cu_num_nodes_ptr,  # [batch] int64
    node_token_ids_ptr,  # [num_nodes] int64
    node_parents_ptr,  # [num_nodes] int64, row-local, -1 = root
    draft_probs_ptr,  # [num_nodes, V] (unused if NO_DRAFT_PROBS)
    target_probs_ptr,  # [num_nodes + batch, V]
    uniforms_ptr,  # [num_nodes] float32
    exponentials_ptr,  # [batch, V] float32
    greedy_ptr,  # [batch] bool
    scratch_ptr,  # [batch, 2, V] float32: the residual of draft-probs rows (unused if NO_DRAFT_PROBS)
    vocab_size,
    max_depth,
    output_stride,
    accepted_stride,
    mass_scale,  # float32 2^S
    mass_unit,  # float32 2^-S
    split_size,
    num_splits,
    NO_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    batch = tl.num_programs(0)
    start, num_nodes = _row_span(cu_num_nodes_ptr, row)
    root_row = start + row  # int64: target_probs row of the root; node j's p is at root_row + 1 + j
    output_row_ptr = output_ptr + row.to(tl.int64) * output_stride
    accepted_row_ptr = accepted_nodes_ptr + row.to(tl.int64) * accepted_stride
    e_row_ptr = exponentials_ptr + row.to(tl.int64) * vocab_size
    race_slot = 2 * row * num_splits + split
    lo = split * split_size
    hi = tl.minimum(lo + split_size, vocab_size)

    if tl.load(greedy_ptr + row):
        for j in range(num_nodes + 1):  # p at the root, then after each node
            val, idx = _argmax_range(target_probs_ptr + (root_row + j) * vocab_size, lo, hi, BLOCK_V)
            slot = (2 * batch + root_row + j) * num_splits + split
            tl.store(partial_val_ptr + slot, val)
            tl.store(partial_idx_ptr + slot, idx)
    elif NO_DRAFT_PROBS:  # every split replays the scalar walk; split 0 records the path
        num_accepted, p_row, current, zeroed_lo, zeroed_hi, _, _ = _walk(
            node_token_ids_ptr, node_parents_ptr, draft_probs_ptr, target_probs_ptr, uniforms_ptr, scratch_ptr, start,
            num_nodes, root_row, vocab_size, max_depth, mass_scale, mass_unit, output_row_ptr, accepted_row_ptr,
            split == 0, NO_DRAFT_PROBS, BLOCK_V,
        )  # fmt: skip
        if split == 0:
            tl.store(num_accepted_ptr + row, num_accepted)
        score, idx, fallback_score, fallback_idx = _one_hot_residual_race(
            target_probs_ptr + p_row * vocab_size, e_row_ptr, lo, hi, node_token_ids_ptr, node_parents_ptr, start,
            current, zeroed_lo, zeroed_hi, BLOCK_V,
        )  # fmt: skip
        tl.store(partial_val_ptr + race_slot, score)
        tl.store(partial_idx_ptr + race_slot, idx)
        tl.store(partial_val_ptr + race_slot + num_splits, fallback_score)
        tl.store(partial_idx_ptr + race_slot + num_splits, fallback_idx)
    elif split == 0:  # draft probs: one program walks the row, the residual in its two scratch rows
        scratch_row_ptr = scratch_ptr + row.to(tl.int64) * 2 * vocab_size
        num_accepted, p_row, _, _, _, in_scratch, buffer = _walk(
            node_token_ids_ptr, node_parents_ptr, draft_probs_ptr, target_probs_ptr, uniforms_ptr, scratch_row_ptr,
            start, num_nodes, root_row, vocab_size, max_depth, mass_scale, mass_unit, output_row_ptr,
            accepted_row_ptr, True, NO_DRAFT_PROBS, BLOCK_V,
        )  # fmt: skip
        tl.store(num_accepted_ptr + row, num_accepted)
        p_row_ptr = target_probs_ptr + p_row * vocab_size
        if in_scratch:
            score, idx = _race_over(scratch_row_ptr + buffer * vocab_size, e_row_ptr, 0, vocab_size, BLOCK_V)
        else:
            score, idx = _race_over(p_row_ptr, e_row_ptr, 0, vocab_size, BLOCK_V)
        tl.store(partial_val_ptr + race_slot, score)
        tl.store(partial_idx_ptr + race_slot, idx)
        if score <= 0.0:  # the fallback is read only then
            score, idx = _race_over(p_row_ptr, e_row_ptr, 0, vocab_size, BLOCK_V)
            tl.store(partial_val_ptr + race_slot + num_splits, score)
            tl.store(partial_idx_ptr + race_slot + num_splits, idx)


@triton.jit(do_not_specialize=["max_depth", "output_stride", "accepted_stride", "num_splits", "race_splits"])
def tree_combine_kernel(
    output_ptr,  # [batch, max_depth + 1] int64
    accepted_nodes_ptr,  # [batch, max_depth] int64
    num_accepted_ptr,  # [batch] int64: read for random rows, written for greedy rows
    cu_num_nodes_ptr,
    node_token_ids_ptr,
    node_parents_ptr,
    greedy_ptr,
    partial_val_ptr,
    partial_idx_ptr,
    max_depth,
    output_stride,
    accepted_stride,
    num_splits,
    race_splits,  # splits holding a random row's race: num_splits, or 1 (split 0 walks draft-probs rows alone)
    BLOCK_S: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
):
    row = tl.program_id(0)
    batch = tl.num_programs(0)
    start, num_nodes = _row_span(cu_num_nodes_ptr, row)
    root_row = start + row
    output_row_ptr = output_ptr + row.to(tl.int64) * output_stride
    accepted_row_ptr = accepted_nodes_ptr + row.to(tl.int64) * accepted_stride
    if tl.load(greedy_ptr + row):
        _, p_argmax = _combine_splits(partial_val_ptr, partial_idx_ptr, 2 * batch + root_row, num_splits, num_splits,
                                      BLOCK_S)
        current = tl.full([], -1, tl.int64)
        num_accepted = tl.zeros([], tl.int64)
        for j in range(num_nodes):
            node = start + j
            local = node - start
            if (tl.load(node_parents_ptr + node) == current) & (num_accepted < max_depth):
                x = tl.load(node_token_ids_ptr + node)
                if x == p_argmax:
                    tl.store(output_row_ptr + num_accepted, x)
                    tl.store(accepted_row_ptr + num_accepted, local)
                    num_accepted += 1
                    current = local
                    _, p_argmax = _combine_splits(partial_val_ptr, partial_idx_ptr, 2 * batch + root_row + 1 + local,
                                                  num_splits, num_splits, BLOCK_S)  # fmt: skip
        tl.store(num_accepted_ptr + row, num_accepted)
        final = p_argmax.to(tl.int64)
    else:
        num_accepted = tl.load(num_accepted_ptr + row)
        score, final = _combine_splits(partial_val_ptr, partial_idx_ptr, 2 * row, num_splits, race_splits, BLOCK_S)
        if score <= 0.0:
            # Residual all zero (only rounding gets here): the race over p(current) itself.
            score, final = _combine_splits(partial_val_ptr, partial_idx_ptr, 2 * row + 1, num_splits, race_splits,
                                           BLOCK_S)
        final = final.to(tl.int64)
    # The path [0, num_accepted) is written; then the final token and -1 padding.
    _write_row(output_row_ptr + num_accepted, output_row_ptr, 0, 0, final, max_depth + 1 - num_accepted, BLOCK_OUT)
    _write_row(accepted_row_ptr + num_accepted, accepted_row_ptr, 0, -1, 0, max_depth - num_accepted, BLOCK_OUT)


def _scratch(batch: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """A [batch, 2, V] float32 scratch: the device's cached one if large enough, else a new one cached (the
    old one is freed). Calls on one device share it, so they must not overlap (two streams at once), and a CUDA
    graph that captured a draft-probs tree verify must not outlive a larger call. Deterministic drafts (every
    specdraft tree source) never use it."""
    numel = batch * 2 * vocab_size
    cached = _SCRATCH.get(device)
    if cached is None or cached.numel() < numel:
        cached = _SCRATCH[device] = torch.empty(numel, dtype=torch.float32, device=device)
    return cached


def tree_sample(
    node_token_ids: torch.Tensor,
    node_parents: torch.Tensor,
    cu_num_nodes: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
    greedy: torch.Tensor,
    max_depth: int,
    mass_bits: int,
    block_v: int | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the two kernels. Inputs are assumed checked (``specdraft.decoding.tree_verify.verify_tree_triton`` does).
    ``mass_bits`` is the fixed-point scale of the residual masses, the reference's
    (``specdraft.decoding.tree_verify.mass_scale_bits(V)``), so kernel and reference sum alike.

    Partial slots, each ``num_splits`` wide: row r's race at 2r, its fallback race at 2r + 1, then
    the argmax of target_probs row t at 2 * batch + t."""
    batch = cu_num_nodes.shape[0]
    vocab_size = target_probs.shape[1]
    device = target_probs.device
    block_v = check_block_v(block_v, vocab_size)
    num_splits, split_size = vocab_splits(batch, vocab_size, block_v, device, num_splits)
    output = torch.empty((batch, max_depth + 1), dtype=torch.long, device=device)
    accepted_nodes = torch.empty((batch, max_depth), dtype=torch.long, device=device)
    num_accepted = torch.empty(batch, dtype=torch.long, device=device)
    if batch == 0:
        return output, accepted_nodes, num_accepted
    slots = 2 * batch + target_probs.shape[0]
    partial_val = torch.empty(slots * num_splits, dtype=torch.float32, device=device)
    partial_idx = torch.empty(slots * num_splits, dtype=torch.int32, device=device)
    bits = mass_bits
    target_probs = target_probs.contiguous()
    uniforms = uniforms.float().contiguous()
    cu_num_nodes = cu_num_nodes.long().contiguous()
    node_token_ids = node_token_ids.long().contiguous()
    node_parents = node_parents.long().contiguous()
    greedy = greedy.contiguous()
    # A [batch, 0] tensor (max_depth 0) is never written; its stride is still a valid int.
    accepted_stride = max(accepted_nodes.stride(0), 1)
    rows = (output, accepted_nodes, num_accepted, cu_num_nodes, node_token_ids, node_parents)  # both kernels' first
    tree_partials_kernel[(batch, num_splits)](
        partial_val,
        partial_idx,
        *rows,
        # Never read without draft probs; any valid pointer of the same kind keeps the signature fixed.
        target_probs if draft_probs is None else draft_probs.contiguous(),
        target_probs,
        uniforms,
        exponentials.float().contiguous(),
        greedy,
        uniforms if draft_probs is None else _scratch(batch, vocab_size, device),
        vocab_size,
        max_depth,
        output.stride(0),
        accepted_stride,
        2.0**bits,
        2.0**-bits,
        split_size,
        num_splits,
        NO_DRAFT_PROBS=draft_probs is None,
        BLOCK_V=block_v,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # no a * b + c -> fma contraction: keep torch's float32 rounding
    )
    tree_combine_kernel[(batch,)](
        *rows,
        greedy,
        partial_val,
        partial_idx,
        max_depth,
        output.stride(0),
        accepted_stride,
        num_splits,
        num_splits if draft_probs is None else 1,
        BLOCK_S=BLOCK_S,
        BLOCK_OUT=BLOCK_OUT,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # no float arithmetic here; set, as above, so no default applies
    )
    return output, accepted_nodes, num_accepted
