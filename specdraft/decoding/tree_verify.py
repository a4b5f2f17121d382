"""Exact verification of a draft *tree*: which path to keep, and the next token.

Layout (the tree form of ``specdraft.decoding.verify``'s flat layout): the draft nodes of all
rows are concatenated, and ``cu_num_nodes`` (inclusive cumsum of per-row node counts) says where
each row ends, so rows may hold different trees, including none. Row r owns flat nodes
[cu[r-1], cu[r]). ``node_parents`` are row-local (-1 = the root, the pending token) and each
row's nodes are in topological order. ``target_probs`` holds, per row, N_r + 1 consecutive rows:
p at the root, then p after each node in node order; row r's block starts at start_r + r.

One walk per row, from the root (a single pass over the row's nodes in index order suffices:
children come after their parent, and nodes whose parent is not the current node are skipped):

  greedy row:   accept the child whose token is argmax p(current) (ties -> lowest id) and move
                to it; when none matches, the final token is argmax p(current).
  sampled row:  multi-step speculative sampling (SpecInfer, Miao et al. 2023, arXiv 2305.09781,
                Sec. 4.2; for deterministic children EAGLE's evaluate_posterior / SGLang's tree
                sampling). Keep an unnormalised residual r (p' = r / m, m = sum r) at the current
                node and try its children c in index order, c drafted from q_c:
                  accept c  iff  u_c * (m * q_c(x_c)) < r(x_c)    (u < p'(x) / q_c(x), no division)
                    -> move to c: r := p(c), m := 1
                  reject c:      r := max(0, r - m * q_c)        (p' := norm(max(0, p' - q_c)))
                                 m := sum r
                When no child is accepted (or at a leaf), the final token is drawn from r by the
                exponential race argmax_x r(x) / e_x (over p(current) if r is all zero, which
                only rounding causes, as ``recover_token`` does).

Why it is lossless: at a node, each stage is one rejection-sampling step against the current
residual, and a rejected stage hands on exactly norm(max(0, p' - q_c)), so the emitted token
follows p(current) whatever the children are, as long as each child's token, given the
children before it, is distributed as its q_c. Deterministic children (top-k of the draft) have
q_c one-hot (``draft_probs=None``); sampled siblings are drawn without replacement, child k from
q with siblings 1..k-1 removed and renormalised, and that q_k is the node's ``draft_probs`` row.

Arithmetic, kept identical in ``verify_tree_reference`` and the Triton kernel
(``specdraft.kernels.tree_sampler``) so they agree token for token on the same draws:
* m starts at 1, not sum(p): p is a distribution, and with m = 1 the first test at a node is
  the chain verify's test u * (1 * q(x)) < p(x) bit for bit (and costs no V-wide sum).
* one-hot q_c: max(0, r - m * onehot(x)) only zeroes r(x) (r(x) <= m), and the mass drops by
  r(x): r(x) := 0, m := max(0, m - r(x)), a scalar update.
* draft_probs given: m := sum r needs a V-wide sum, whose float rounding depends on the order of
  the additions (torch and a Triton reduction add in different orders). It is summed in fixed
  point instead: m = float32(sum_x trunc(min(r(x), 1) * 2^S)) * 2^-S with integer (associative,
  exact) addition, so every order gives the same bits. S = 62 - bit_length(V) keeps the int64
  sum below 2^62; the truncation error is below V * 2^-S (< 1e-8 for V = 152064).
* everything else is float32 in the order written above; the kernel turns off FMA contraction
  and divides with div_rn.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from specdraft.decoding.trees import check_tree, tree_depths
from specdraft.decoding.verify import resolve_verify_backend
from specdraft.errors import SpecdraftError

PADDING_TOKEN_ID = -1  # fills output slots after a row's last emitted token
PADDING_NODE = -1  # fills accepted_nodes slots after a row's accepted path


@dataclass(frozen=True)
class TreeVerifyInputs:
    """One tree verify step's inputs for a ragged batch of trees, in the flat layout above: what ``verify_tree``,
    ``verify_tree_reference`` and ``verify_tree_triton`` read."""

    node_token_ids: torch.Tensor  # [num_nodes] long: the draft nodes of all rows, concatenated
    node_parents: torch.Tensor  # [num_nodes] long: row-local parent index, -1 = the row's root
    cu_num_nodes: torch.Tensor  # [batch] long: inclusive cumsum of per-row node counts
    draft_probs: torch.Tensor | None  # [num_nodes, V] q each node was drawn from; None = one-hot q
    target_probs: torch.Tensor  # [num_nodes + batch, V]: per row, p at the root then after each node
    uniforms: torch.Tensor  # [num_nodes] float32 U[0, 1): one coin per node
    exponentials: torch.Tensor  # [batch, V] float32 Exp(1) > 0: one race per row
    greedy: torch.Tensor  # [batch] bool
    max_depth: int  # at least the deepest tree's depth

    def unpacked(self) -> tuple:
        """The fields in order (no copies)."""
        return tuple(getattr(self, f.name) for f in fields(self))


def verify_tree(inputs: TreeVerifyInputs, check: bool = True,
                backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Returns (output_token_ids [batch, max_depth + 1], accepted_nodes [batch, max_depth], num_accepted [batch]).

    Each output row is the accepted path's tokens, then one final token, then -1 padding.
    ``accepted_nodes`` holds the path's row-local node indices (the root's child first), padded
    with -1; ``num_accepted`` counts accepted nodes (a row emits num_accepted + 1 tokens).
    ``max_depth`` must be at least the deepest tree's depth. ``check=False`` skips the checks
    that sync with the host (token and parent ranges, tree shape, depth); shapes, dtypes and
    devices are always checked. Unchecked, a node deeper than max_depth is never tested (the
    tree is cut there, which stays exact). ``backend`` (auto | triton | reference, see
    ``specdraft.decoding.verify.resolve_verify_backend``): by default the Triton kernels on CUDA
    tensors, the pure-torch reference everywhere else.
    """
    use_triton = resolve_verify_backend(backend, inputs.target_probs.device) == "triton"
    return verify_tree_triton(inputs, check=check) if use_triton else verify_tree_reference(inputs, check=check)


def verify_tree_reference(inputs: TreeVerifyInputs,
                          check: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Pure-torch tree verify: the specification the kernel is tested against. See ``verify_tree``.

    All rows walk together: step j looks at every row's j-th node (so the loop runs over node
    slots, not rows, and a batch of thousands of rows costs max N_r vectorised steps).
    """
    num_nodes_per_row = _check_inputs(inputs, check)
    (node_token_ids, node_parents, cu_num_nodes, draft_probs, target_probs, uniforms, exponentials, greedy,
     max_depth) = inputs.unpacked()  # fmt: skip
    batch = cu_num_nodes.shape[0]
    device = target_probs.device
    rows = torch.arange(batch, device=device)
    starts = cu_num_nodes.long() - num_nodes_per_row  # flat index of each row's first node
    root_rows = starts + rows  # target_probs row of each row's root
    tokens, parents = node_token_ids.long(), node_parents.long()
    sampled = ~greedy

    # Walk state per row: the current node (row-local, -1 = root), p there, the residual r and its mass m.
    current = torch.full((batch,), -1, dtype=torch.long, device=device)
    p_current = target_probs[root_rows].float()
    residual = p_current.clone()
    mass = torch.ones(batch, dtype=torch.float32, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    output = torch.full((batch, max_depth + 1), PADDING_TOKEN_ID, dtype=torch.long, device=device)
    accepted_nodes = torch.full((batch, max_depth), PADDING_NODE, dtype=torch.long, device=device)

    max_nodes = int(num_nodes_per_row.max()) if batch > 0 else 0
    for j in range(max_nodes):
        node = (starts + j).clamp_max(tokens.numel() - 1)  # rows with fewer nodes read any valid one
        # A node is tested iff its parent is the current node (and the path has room left).
        tested = (j < num_nodes_per_row) & (parents[node] == current) & (num_accepted < max_depth)
        x = tokens[node]
        r_x = residual.gather(1, x[:, None]).squeeze(1)
        q_x = torch.ones_like(r_x) if draft_probs is None else draft_probs[node, x].float()
        accept_sampled = uniforms[node].float() * (mass * q_x) < r_x
        accept_greedy = x == p_current.argmax(-1)
        accept = tested & torch.where(greedy, accept_greedy, accept_sampled)

        reject = tested & ~accept & sampled  # greedy rows keep no residual
        if reject.any():
            residual, mass = _residual_after_rejection(residual, mass, x, r_x, reject, draft_probs, node)

        if accept.any():
            at = accept.nonzero().squeeze(1)
            output[at, num_accepted[at]] = x[at]
            accepted_nodes[at, num_accepted[at]] = j
            p_node = target_probs[root_rows[at] + 1 + j].float()  # p after node j of these rows
            p_current[at] = p_node
            residual[at] = p_node
            mass[at] = 1.0
            current[at] = j
            num_accepted[at] += 1

    final = torch.where(greedy, p_current.argmax(-1), race(residual, p_current, exponentials.float()))
    output[rows, num_accepted] = final
    return output, accepted_nodes, num_accepted


def _residual_after_rejection(residual, mass, x, r_x, reject, draft_probs, node):
    """(r, m) after the rows in ``reject`` turned down their node x: r := max(0, r - m q), m := sum r.

    One-hot q (draft_probs None) zeroes r(x) and lowers m by r(x); a full q is summed in fixed
    point so that any addition order gives the same m (see the module docstring).
    """
    at = reject.nonzero().squeeze(1)
    residual = residual.clone()
    mass = mass.clone()
    if draft_probs is None:
        residual[at, x[at]] = 0.0
        mass[at] = (mass[at] - r_x[at]).clamp_min(0.0)
    else:
        q = draft_probs[node[at]].float()
        residual[at] = (residual[at] - mass[at, None] * q).clamp_min(0.0)
        mass[at] = fixed_point_mass(residual[at])
    return residual, mass


def mass_scale_bits(vocab_size: int) -> int:
    """S for the fixed-point mass: V entries of at most 2^S each sum below 2^62 (no int64 overflow)."""
    return 62 - max(vocab_size, 1).bit_length()


def fixed_point_mass(weights: torch.Tensor) -> torch.Tensor:
    """sum over the last dim, as float32(sum_x trunc(min(w, 1) * 2^S)) * 2^-S: order-independent.

    The clamp at 1 never changes a probability; it keeps a malformed input from overflowing.
    """
    bits = mass_scale_bits(weights.shape[-1])
    fixed = (weights.clamp_max(1.0) * 2.0**bits).long()  # exact scaling, then truncation toward 0
    return fixed.sum(-1).float() * 2.0**-bits


def race(residual: torch.Tensor, p: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """argmax_x r(x) / e_x: a draw from norm(r); over p instead if r is all zero (only rounding
    gets there). Ties go to the lowest id, as with torch.argmax."""
    scores = residual / exponentials
    return torch.where(scores.amax(-1) > 0, scores.argmax(-1), (p / exponentials).argmax(-1))


def verify_tree_triton(inputs: TreeVerifyInputs, check: bool = True, block_v: int | None = None,
                       num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Tree verify with the Triton kernels. Same contract as ``verify_tree``.

    ``block_v`` is how many vocabulary entries a program reads per step (a power of two in [128, 4096];
    default min(1024, next_pow2(V))), ``num_splits`` how many programs share a row's vocabulary (default:
    enough to fill the GPU). Runs on CUDA tensors, or on CPU under the Triton interpreter
    (TRITON_INTERPRET=1 set before triton is imported).
    """
    _check_inputs(inputs, check)
    resolve_verify_backend("triton", inputs.target_probs.device)  # triton importable, CUDA or the interpreter
    from specdraft.kernels.tree_sampler import tree_sample  # optional: needs triton

    return tree_sample(*inputs.unpacked(), mass_bits=mass_scale_bits(inputs.target_probs.shape[-1]),
                       block_v=block_v, num_splits=num_splits)  # fmt: skip


def _check_inputs(inputs: TreeVerifyInputs, check: bool) -> torch.Tensor:
    """Checks shared by both implementations; returns per-row node counts.

    Shapes, dtypes and devices cost nothing and are always checked. With ``check``, the values
    are too (counts, token ids, each row's tree, its depth): a bad one would make the kernel read
    or write out of bounds, and these need host syncs.
    """
    (node_token_ids, node_parents, cu_num_nodes, draft_probs, target_probs, uniforms, exponentials, greedy,
     max_depth) = inputs.unpacked()  # fmt: skip
    if target_probs.dim() != 2:
        raise SpecdraftError(
            f"verify_tree: target_probs must be [num_nodes + batch, vocab], got shape {tuple(target_probs.shape)}; "
            "stack, per row, p at the root and then p after each node."
        )
    if cu_num_nodes.dim() != 1:
        raise SpecdraftError(
            f"verify_tree: cu_num_nodes must be 1-D [batch], got shape {tuple(cu_num_nodes.shape)}; "
            "pass the inclusive cumsum of per-row node counts."
        )
    if node_token_ids.dim() != 1:
        raise SpecdraftError(
            f"verify_tree: node_token_ids must be 1-D [num_nodes], got shape {tuple(node_token_ids.shape)}; "
            "concatenate the rows' nodes into one list (see cu_num_nodes)."
        )
    num_nodes = node_token_ids.shape[0]
    batch = cu_num_nodes.shape[0]
    vocab_size = target_probs.shape[1]
    expected = {
        "node_parents": (node_parents, (num_nodes,)),
        "target_probs": (target_probs, (num_nodes + batch, vocab_size)),
        "uniforms": (uniforms, (num_nodes,)),
        "exponentials": (exponentials, (batch, vocab_size)),
        "greedy": (greedy, (batch,)),
        "cu_num_nodes": (cu_num_nodes, (batch,)),
    }
    if draft_probs is not None:
        expected["draft_probs"] = (draft_probs, (num_nodes, vocab_size))
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise SpecdraftError(
                f"verify_tree: {name} has shape {tuple(tensor.shape)}, expected {shape} "
                f"(num_nodes={num_nodes} from node_token_ids, batch={batch} from cu_num_nodes, "
                f"vocab={vocab_size} from target_probs); target_probs has one row per node plus one root row "
                "per batch row."
            )
        if tensor.device != target_probs.device:
            raise SpecdraftError(
                f"verify_tree: {name} is on {tensor.device} but target_probs on {target_probs.device}; "
                "move them to the same device."
            )
    if node_token_ids.device != target_probs.device:
        raise SpecdraftError(
            f"verify_tree: node_token_ids is on {node_token_ids.device} but target_probs on "
            f"{target_probs.device}; move them to the same device."
        )
    for name, tensor in {"node_token_ids": node_token_ids, "node_parents": node_parents,
                         "cu_num_nodes": cu_num_nodes}.items():
        if tensor.is_floating_point() or tensor.dtype == torch.bool:
            raise SpecdraftError(f"verify_tree: {name} must hold integers, got {tensor.dtype}; use .long().")
    if greedy.dtype != torch.bool:
        raise SpecdraftError(
            f"verify_tree: greedy must be a bool tensor, got {greedy.dtype}; pass `temperatures == 0`."
        )
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0:
        raise SpecdraftError(f"verify_tree: max_depth must be an int >= 0, got {max_depth!r}; pass the tree's depth.")

    num_nodes_per_row = torch.diff(cu_num_nodes.long(), prepend=cu_num_nodes.new_zeros(1).long())
    if not check:
        return num_nodes_per_row
    if batch > 0:
        if int(cu_num_nodes[-1]) != num_nodes or int(num_nodes_per_row.min()) < 0:
            raise SpecdraftError(
                f"verify_tree: cu_num_nodes={cu_num_nodes.tolist()} must be a non-decreasing inclusive cumsum "
                f"of per-row node counts ending at num_nodes={num_nodes}; build it with counts.cumsum(0)."
            )
    elif num_nodes != 0:
        raise SpecdraftError(f"verify_tree: batch is empty but there are {num_nodes} nodes.")
    if num_nodes > 0 and not (0 <= int(node_token_ids.min()) and int(node_token_ids.max()) < vocab_size):
        raise SpecdraftError(
            f"verify_tree: node token ids must be in [0, {vocab_size}); "
            "map draft-vocabulary ids to target ids first (d2t)."
        )
    bounds = torch.cat([cu_num_nodes.new_zeros(1), cu_num_nodes]).long().tolist()
    for row in range(batch):
        parents = node_parents[bounds[row] : bounds[row + 1]]
        if parents.numel() == 0:
            continue
        try:
            check_tree(parents, node_token_ids[bounds[row] : bounds[row + 1]])
        except SpecdraftError as err:
            raise SpecdraftError(f"verify_tree: row {row}: {err}") from err
        depth = int(tree_depths(parents).max())
        if depth > max_depth:
            raise SpecdraftError(
                f"verify_tree: row {row}'s tree is {depth} deep but max_depth={max_depth}; "
                "raise max_depth to the deepest tree's depth."
            )
    return num_nodes_per_row
