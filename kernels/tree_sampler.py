"""Exact tree verification as one Triton kernel: one program per row walks its draft tree.

Same contract and same float32 arithmetic as ``specdraft.decoding.tree_verify.verify_tree_reference``
(the spec; read its module docstring first). A program makes one pass over its row's nodes in
index order, testing only the children of the current node:

  greedy row:  accept x_c iff x_c == argmax p(current); final token argmax p(current)
  random row:  accept x_c iff u_c * (m * q_c(x_c)) < r(x_c), then r := p(c), m := 1;
               on rejection r := max(0, r - m * q_c), m := sum r (fixed point, order-free);
               final token argmax_x r(x) / e_x (over p(current) if r is all zero)

The residual r lives in a per-row float32 scratch row ([batch, V], allocated by the launcher).
Recomputing it instead would replay every earlier rejection at the node (each needing its own
V-wide mass), O(k^2 V) for k rejected siblings; the scratch costs one V-wide pass per rejection.
Right after an acceptance r is p(current) itself, so the program reads target_probs directly and
only fills the scratch at the node's first rejection (``in_scratch``).

Vocabulary-wide work (argmax, residual update, race) streams BLOCK_V chunks, so any vocabulary
size works.
"""

import torch
import triton
import triton.language as tl

from specdraft.decoding.tree_verify import mass_scale_bits
from specdraft.kernels.rejection_sampler import _argmax_over_vocab, _race_over

PADDING_TOKEN_ID = -1
PADDING_NODE = -1


@triton.jit
def _race(r_row_ptr, p_row_ptr, e_row_ptr, vocab_size, BLOCK_V: tl.constexpr):
    """argmax_x r(x) / e_x (a draw from norm(r)); over p if every score is zero. Ties -> lowest id."""
    best_idx, best_score = _race_over(r_row_ptr, e_row_ptr, vocab_size, BLOCK_V)
    if best_score <= 0.0:
        # Residual all zero (only rounding gets here): race over p itself.
        best_idx, best_score = _race_over(p_row_ptr, e_row_ptr, vocab_size, BLOCK_V)
    return best_idx


@triton.jit
def _copy_row(src_row_ptr, dst_row_ptr, vocab_size, BLOCK_V: tl.constexpr):
    """dst := float32(src): the residual starts as p(current) at a node's first rejection."""
    for chunk_start in range(0, vocab_size, BLOCK_V):
        offsets = chunk_start + tl.arange(0, BLOCK_V)
        in_vocab = offsets < vocab_size
        tl.store(dst_row_ptr + offsets, tl.load(src_row_ptr + offsets, mask=in_vocab).to(tl.float32), mask=in_vocab)


@triton.jit
def _subtract_draft(r_row_ptr, q_row_ptr, mass, scratch_row_ptr, vocab_size, mass_scale, mass_unit,
                    BLOCK_V: tl.constexpr):
    """scratch := max(0, r - m * q) and return its mass, summed in 2^-S fixed point.

    Integer addition is exact and associative, so the mass has the same bits as the reference's
    whatever order the reduction adds in. (r may be the scratch row itself: each element is read
    and then written by the same lane of the same chunk.)
    """
    total = tl.zeros([], tl.int64)
    for chunk_start in range(0, vocab_size, BLOCK_V):
        offsets = chunk_start + tl.arange(0, BLOCK_V)
        in_vocab = offsets < vocab_size
        r = tl.load(r_row_ptr + offsets, mask=in_vocab, other=0.0).to(tl.float32)
        q = tl.load(q_row_ptr + offsets, mask=in_vocab, other=0.0).to(tl.float32)
        new_r = tl.maximum(r - mass * q, 0.0)
        tl.store(scratch_row_ptr + offsets, new_r, mask=in_vocab)
        # min(r, 1) * 2^S is exact (a power-of-two scale); the cast truncates toward zero, like torch's .long().
        total += tl.sum((tl.minimum(new_r, 1.0) * mass_scale).to(tl.int64), axis=0)
    return total.to(tl.float32) * mass_unit


@triton.jit
def tree_sample_kernel(
    output_ptr,  # [batch, max_depth + 1] int64, pre-filled with -1
    accepted_nodes_ptr,  # [batch, max_depth] int64, pre-filled with -1
    num_accepted_ptr,  # [batch] int64
    cu_num_nodes_ptr,  # [batch] int64
    node_token_ids_ptr,  # [num_nodes] int64
    node_parents_ptr,  # [num_nodes] int64, row-local, -1 = root
    draft_probs_ptr,  # [num_nodes, V] (unused if NO_DRAFT_PROBS)
    target_probs_ptr,  # [num_nodes + batch, V]
    uniforms_ptr,  # [num_nodes] float32
    exponentials_ptr,  # [batch, V] float32
    greedy_ptr,  # [batch] bool
    scratch_ptr,  # [batch, V] float32: the residual r of each row
    vocab_size,
    max_depth,
    output_stride,
    accepted_stride,
    mass_scale,  # float32 2^S
    mass_unit,  # float32 2^-S
    NO_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    start = tl.load(cu_num_nodes_ptr + row - 1, mask=row > 0, other=0)
    end = tl.load(cu_num_nodes_ptr + row)
    is_greedy = tl.load(greedy_ptr + row)
    root_row = start + row  # int64: target_probs row of the root; node j's p is at root_row + 1 + j
    output_row_ptr = output_ptr + row.to(tl.int64) * output_stride
    accepted_row_ptr = accepted_nodes_ptr + row.to(tl.int64) * accepted_stride
    scratch_row_ptr = scratch_ptr + row.to(tl.int64) * vocab_size

    # Walk state: current node (row-local, -1 = root), its p row, the residual's mass and home.
    current = tl.full([], -1, tl.int64)
    p_row = root_row
    mass = tl.full([], 1.0, tl.float32)
    in_scratch = False  # False: r is p(current), read from target_probs
    num_accepted = tl.zeros([], tl.int64)
    p_argmax = tl.full([], 0, tl.int64)
    if is_greedy:
        p_argmax = _argmax_over_vocab(target_probs_ptr + p_row * vocab_size, vocab_size, BLOCK_V).to(tl.int64)

    # One pass in index order (Triton has no `break`): children come after their parent.
    for j in range(end - start):
        node = start + j  # int64 (under the interpreter j is a Python int, node a tensor)
        local = node - start  # j as an int64 tensor
        parent = tl.load(node_parents_ptr + node)
        if (parent == current) & (num_accepted < max_depth):
            x = tl.load(node_token_ids_ptr + node)
            if is_greedy:
                accept = x == p_argmax
            else:
                if in_scratch:
                    r_x = tl.load(scratch_row_ptr + x)
                else:
                    r_x = tl.load(target_probs_ptr + p_row * vocab_size + x).to(tl.float32)
                if NO_DRAFT_PROBS:
                    q_x = 1.0
                else:
                    q_x = tl.load(draft_probs_ptr + node * vocab_size + x).to(tl.float32)
                u = tl.load(uniforms_ptr + node)
                accept = u * (mass * q_x) < r_x
                if not accept:
                    # r := max(0, r - m q), m := sum r
                    if NO_DRAFT_PROBS:
                        # One-hot q: zero r(x), drop the mass by r(x); the scratch needs p first.
                        if not in_scratch:
                            _copy_row(target_probs_ptr + p_row * vocab_size, scratch_row_ptr, vocab_size, BLOCK_V)
                            tl.debug_barrier()  # the copy's lanes are not the lane storing r(x)
                        tl.store(scratch_row_ptr + x, 0.0)
                        mass = tl.maximum(mass - r_x, 0.0)
                    else:
                        q_row_ptr = draft_probs_ptr + node * vocab_size
                        if in_scratch:
                            mass = _subtract_draft(scratch_row_ptr, q_row_ptr, mass, scratch_row_ptr, vocab_size,
                                                   mass_scale, mass_unit, BLOCK_V)
                        else:
                            mass = _subtract_draft(target_probs_ptr + p_row * vocab_size, q_row_ptr, mass,
                                                   scratch_row_ptr, vocab_size, mass_scale, mass_unit, BLOCK_V)
                    tl.debug_barrier()  # later reads of the scratch, by any lane, see these writes
                    in_scratch = True
            if accept:
                tl.store(output_row_ptr + num_accepted, x)
                tl.store(accepted_row_ptr + num_accepted, local)
                num_accepted += 1
                current = local
                p_row = root_row + 1 + local
                mass = 1.0
                in_scratch = False
                if is_greedy:
                    p_argmax = _argmax_over_vocab(target_probs_ptr + p_row * vocab_size, vocab_size,
                                                  BLOCK_V).to(tl.int64)

    # The final token: p's argmax (greedy), else a draw from the residual at the current node.
    p_row_ptr = target_probs_ptr + p_row * vocab_size
    if is_greedy:
        final = p_argmax
    else:
        e_row_ptr = exponentials_ptr + row.to(tl.int64) * vocab_size
        if in_scratch:
            final = _race(scratch_row_ptr, p_row_ptr, e_row_ptr, vocab_size, BLOCK_V).to(tl.int64)
        else:
            final = _race(p_row_ptr, p_row_ptr, e_row_ptr, vocab_size, BLOCK_V).to(tl.int64)
    tl.store(output_row_ptr + num_accepted, final)
    tl.store(num_accepted_ptr + row, num_accepted)


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
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the kernel. Inputs are assumed checked (``specdraft.decoding.tree_verify.verify_tree_triton`` does)."""
    batch = cu_num_nodes.shape[0]
    vocab_size = target_probs.shape[1]
    device = target_probs.device
    output = torch.full((batch, max_depth + 1), PADDING_TOKEN_ID, dtype=torch.long, device=device)
    accepted_nodes = torch.full((batch, max_depth), PADDING_NODE, dtype=torch.long, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    if batch == 0:
        return output, accepted_nodes, num_accepted
    if block_v is None:
        block_v = min(1024, triton.next_power_of_2(vocab_size))
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two (e.g. 256 or 1024), got {block_v}")

    bits = mass_scale_bits(vocab_size)
    target_probs = target_probs.contiguous()
    scratch = torch.empty(batch, vocab_size, dtype=torch.float32, device=device)
    tree_sample_kernel[(batch,)](
        output,
        accepted_nodes,
        num_accepted,
        cu_num_nodes.long().contiguous(),
        node_token_ids.long().contiguous(),
        node_parents.long().contiguous(),
        # Never read without draft probs; any valid pointer keeps the signature fixed.
        target_probs if draft_probs is None else draft_probs.contiguous(),
        target_probs,
        uniforms.float().contiguous(),
        exponentials.float().contiguous(),
        greedy.contiguous(),
        scratch,
        vocab_size,
        max_depth,
        output.stride(0),
        # A [batch, 0] tensor (max_depth 0) is never written; its stride is still a valid int.
        max(accepted_nodes.stride(0), 1),
        2.0**bits,
        2.0**-bits,
        NO_DRAFT_PROBS=draft_probs is None,
        BLOCK_V=block_v,
        num_warps=4,
        enable_fp_fusion=False,  # no a * b + c -> fma contraction: keep torch's float32 rounding
    )
    return output, accepted_nodes, num_accepted
