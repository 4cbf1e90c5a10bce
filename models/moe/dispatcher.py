"""Token dispatchers: move routed tokens to their experts and back.

The local dispatcher has static shapes and reads nothing on the host (the sort, counts and
gathers of models/moe/permutation.py), so a whole MoE block compiles into one graph and a new
routing never triggers a recompile. Expert parallelism's all-to-all needs its split sizes in
Python: that dispatcher keeps the exchanges out of torch.compile (`torch.compiler.disable`),
and they are the only graph breaks of its MoE blocks.
"""

from typing import Any, NamedTuple

import torch

from models.moe.permutation import (
    ExpertPermutation,
    gate_weighted_sum,
    group_align,
    permute,
    sort_by_expert,
    unpermute,
)


class TokenDispatcher:
    """Interface between the router/experts math and the token movement.

    Contract:
    - `dispatch(x [T, dim], selected_experts [T, K] int64, top_scores [T, K] fp32)` returns
      `(routed_x [N, dim], num_tokens_per_expert [E_local] int64, ctx)`: the rows this
      device's experts must process, sorted by local expert, and their counts. The counts
      may include alignment padding and sum to at most N; rows past their sum are padding.
    - `combine(routed_out [N, dim], ctx, out_shape)` returns `[T, dim]` (`out_shape`) in
      routed_out's dtype: for each token, the sum over its K choices of expert output times
      gate value. Gate values are applied here, not before the experts.
    - `ctx` is opaque to callers but for `ctx.top_scores` (the gate values it was given); only
      the same dispatcher's methods read the rest.
    - Both methods stay differentiable with respect to x, top_scores and routed_out; code
      whose shapes depend on routing values is kept out of torch.compile
      (`@torch.compiler.disable`), the rest compiles with the block.

    Phases: `dispatch` and `combine` are each three phases around the token exchange, the seam
    where rows cross devices (Megatron-Core's token dispatcher has the same six):
    `dispatch_preprocess` (sort the rows for sending), `token_dispatch` (the exchange),
    `dispatch_postprocess` (order the received rows for the experts); `combine_preprocess`,
    `token_combine` (the exchange back), `combine_postprocess` (unsort, gate-weighted K-sum).
    Whatever runs the MoE block in pieces (the overlapped schedule, trainer/parallel/moe_overlap.py)
    calls these phases and does the exchanges itself, so the math is written once, here.
    The single-device model uses `LocalTokenDispatcher` (no exchange); expert parallelism replaces
    the `MoE.dispatcher` attribute with an all-to-all implementation of the same contract.
    """

    def dispatch(
        self, x: torch.Tensor, selected_experts: torch.Tensor, top_scores: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        rows, ctx = self.dispatch_preprocess(x, selected_experts, top_scores)
        routed_x, num_tokens_per_expert = self.dispatch_postprocess(self.token_dispatch(rows, ctx), ctx)
        return routed_x, num_tokens_per_expert, ctx

    def combine(self, routed_out: torch.Tensor, ctx: Any, out_shape: torch.Size) -> torch.Tensor:
        rows = self.token_combine(self.combine_preprocess(routed_out, ctx), ctx)
        return self.combine_postprocess(rows, ctx, ctx.top_scores)

    def dispatch_preprocess(
        self, x: torch.Tensor, selected_experts: torch.Tensor, top_scores: torch.Tensor
    ) -> tuple[torch.Tensor, Any]:
        """`(rows, ctx)`: `x`'s rows (each repeated per choice) in the order they are sent, and
        the context every later phase reads (`ctx.send`: the slots' `ExpertPermutation`)."""
        raise NotImplementedError

    def token_dispatch(self, rows: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The sent rows, received where their experts live (differentiable)."""
        raise NotImplementedError

    def dispatch_postprocess(self, rows: torch.Tensor, ctx: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Received rows -> `(routed_x, num_tokens_per_expert)` as `dispatch` returns them."""
        raise NotImplementedError

    def combine_preprocess(self, routed_out: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Expert outputs -> rows in the order they were received."""
        raise NotImplementedError

    def token_combine(self, rows: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The rows back where they were sent from, in their send order (differentiable)."""
        raise NotImplementedError

    def combine_postprocess(self, rows: torch.Tensor, ctx: Any, top_scores: torch.Tensor) -> torch.Tensor:
        """Rows in send order -> `[T, dim]`: unsorted to slot order, summed over the K choices
        weighted by `top_scores` (a node of the overlapped schedule passes its own copy)."""
        return gate_weighted_sum(unpermute(rows, ctx.send), top_scores)


class _LocalContext(NamedTuple):
    send: ExpertPermutation
    top_scores: torch.Tensor  # [T, K] fp32 gate values


class LocalTokenDispatcher(TokenDispatcher):
    """Single-device dispatcher: all experts are local; tokens are only reordered.

    Static shapes and no host reads (see models/moe/permutation.py): the rows handed to the
    experts are `T * K` plus, on CUDA, the worst-case alignment padding. The exchanges are the
    identity: the sent rows are already sorted (and aligned) by expert.

    Args:
        num_experts: experts on this device (= all routed experts).
    """

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch_preprocess(
        self, x: torch.Tensor, selected_experts: torch.Tensor, top_scores: torch.Tensor
    ) -> tuple[torch.Tensor, _LocalContext]:
        perm = sort_by_expert(
            selected_experts.reshape(-1), self.num_experts, selected_experts.shape[1], group_align(x)
        )
        return permute(x, perm), _LocalContext(perm, top_scores)

    def token_dispatch(self, rows: torch.Tensor, ctx: _LocalContext) -> torch.Tensor:
        return rows

    def dispatch_postprocess(self, rows: torch.Tensor, ctx: _LocalContext) -> tuple[torch.Tensor, torch.Tensor]:
        return rows, ctx.send.counts

    def combine_preprocess(self, routed_out: torch.Tensor, ctx: _LocalContext) -> torch.Tensor:
        return routed_out

    def token_combine(self, rows: torch.Tensor, ctx: _LocalContext) -> torch.Tensor:
        return rows
