"""Sorting routed rows by expert and back, as gathers in both directions.

Both token dispatchers (the local one and expert parallelism's all-to-all one) move rows with
this module. Every move is a gather whose backward is again a gather, through the inverse
permutation: no `index_add`, `index_put(accumulate=True)` or `scatter_add` on token rows, which
on a GPU are atomic scatters (the single largest MoE cost in the H100 profile). The K copies of
a token are summed as a `[T, K, dim]` view, and every shape is static (the row count is
`num_slots + num_experts * (align - 1)`, rounded up to a multiple of `align`), so nothing reads
a device value on the host.
"""

from typing import NamedTuple

import torch

# Rows per expert group start at a multiple of this on CUDA, where the grouped GEMM kernels
# (bf16, and torchao's float8 ones) expect aligned group starts; 16 covers both.
CUDA_GROUP_ALIGN = 16


def group_align(x: torch.Tensor) -> int:
    """The row alignment of expert groups for activations `x`."""
    return CUDA_GROUP_ALIGN if x.is_cuda else 1


class ExpertPermutation(NamedTuple):
    """Where each routed slot goes in the expert-sorted (and aligned) row buffer.

    A slot is one (row, choice) pair of a `[rows, group]` selection, numbered row-major.
    """

    src: torch.Tensor  # [M] int64: slot of each sorted row; padding rows hold num_slots
    dest: torch.Tensor  # [num_slots] int64: sorted row of each slot (the inverse of src)
    counts: torch.Tensor  # [E] int64: rows per expert group, alignment padding included
    group: int  # slots per source row (top_k for tokens, 1 for already expanded rows)


def sort_by_expert(
    expert_of_slot: torch.Tensor, num_experts: int, group: int = 1, align: int = 1
) -> ExpertPermutation:
    """Stable sort of slots by expert, each expert's group starting at an `align` multiple.

    Args:
        expert_of_slot: [num_slots] int64 expert ids in [0, num_experts).
        num_experts: groups in the output.
        group: consecutive slots that come from one source row (see `permute`).
        align: row alignment of each expert group (1 = packed).

    Stable, so each expert's rows stay in slot order: deterministic and layout-independent.
    """
    num_slots = expert_of_slot.numel()
    order = torch.argsort(expert_of_slot, stable=True)
    sorted_experts = expert_of_slot.gather(0, order)
    ends = torch.searchsorted(
        sorted_experts, torch.arange(num_experts, device=order.device), right=True
    )
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded_counts = (counts + align - 1) // align * align
    # Sorted row i of expert e moves by the padding of the groups before e.
    shift = torch.cumsum(padded_counts - counts, dim=0) - (padded_counts - counts)
    sorted_dest = torch.arange(num_slots, device=order.device) + shift.gather(0, sorted_experts)
    dest = torch.empty_like(order).scatter_(0, order, sorted_dest)
    # Worst-case padding, rounded so that the buffer itself is a whole number of aligned blocks.
    num_rows = -(-(num_slots + num_experts * (align - 1)) // align) * align
    src = order.new_full((num_rows,), num_slots).scatter_(0, sorted_dest, order)
    return ExpertPermutation(src, dest, padded_counts, group)


class _Permute(torch.autograd.Function):
    """`x [S / group, dim]` -> sorted rows `[M, dim]`; backward gathers through `dest` and sums
    each source row's `group` slots as a view."""

    @staticmethod
    def forward(ctx, x, src, dest, group):
        ctx.save_for_backward(dest)
        ctx.group = group
        if x.shape[0] == 0:
            # Only padding rows (an EP rank that received no token, CUDA alignment): zeros.
            return x.new_zeros(src.shape[0], x.shape[-1])
        # Padding rows (src = num_slots) read the last source row: finite values whose outputs
        # are never read and whose gradients are zero, so they add exactly 0 to weight grads.
        rows = (src // group).clamp_max(x.shape[0] - 1)
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):
        (dest,) = ctx.saved_tensors
        per_slot = grad.index_select(0, dest)
        if ctx.group > 1:
            per_slot = per_slot.view(-1, ctx.group, grad.shape[-1]).sum(dim=1)
        return per_slot, None, None, None


class _Unpermute(torch.autograd.Function):
    """Sorted rows `[M, dim]` -> slot order `[S, dim]`; backward gathers through `src`, padding
    rows getting zero gradient."""

    @staticmethod
    def forward(ctx, y, src, dest):
        ctx.save_for_backward(src)
        ctx.num_rows = y.shape[0]
        return y.index_select(0, dest)

    @staticmethod
    def backward(ctx, grad):
        (src,) = ctx.saved_tensors
        if ctx.num_rows > grad.shape[0]:
            grad = torch.cat([grad, grad.new_zeros(1, grad.shape[-1])])
        return grad.index_select(0, src), None, None


def permute(x: torch.Tensor, perm: ExpertPermutation) -> torch.Tensor:
    """Rows of `x` (each repeated `perm.group` times) in expert order: `[M, dim]`."""
    return _Permute.apply(x, perm.src, perm.dest, perm.group)


def unpermute(y: torch.Tensor, perm: ExpertPermutation) -> torch.Tensor:
    """Expert-ordered rows back in slot order: `[num_slots, dim]` (padding rows dropped)."""
    return _Unpermute.apply(y, perm.src, perm.dest)


def gate_weighted_sum(per_slot: torch.Tensor, top_scores: torch.Tensor) -> torch.Tensor:
    """`[T * K, dim]` expert outputs in slot order -> `[T, dim]`: sum over K of output x gate.

    Like HF: the product in fp32, rounded once to the activation dtype; the K-sum then runs with
    fp32 accumulation inside `sum`.
    """
    num_tokens, top_k = top_scores.shape
    per_choice = per_slot.view(num_tokens, top_k, per_slot.shape[-1])
    weighted = (per_choice.float() * top_scores.unsqueeze(-1)).to(per_slot.dtype)
    return weighted.sum(dim=1)
