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
    - `ctx` is opaque to callers; only the same dispatcher's `combine` reads it.
    - Both methods stay differentiable with respect to x, top_scores and routed_out; code
      whose shapes depend on routing values is kept out of torch.compile
      (`@torch.compiler.disable`), the rest compiles with the block.
    The single-device model uses `LocalTokenDispatcher`; expert parallelism replaces the
    `MoE.dispatcher` attribute with an all-to-all implementation of the same contract.
    """

    def dispatch(
        self, x: torch.Tensor, selected_experts: torch.Tensor, top_scores: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        raise NotImplementedError

    def combine(self, routed_out: torch.Tensor, ctx: Any, out_shape: torch.Size) -> torch.Tensor:
        raise NotImplementedError


class _LocalContext(NamedTuple):
    perm: ExpertPermutation
    top_scores: torch.Tensor  # [T, K] fp32 gate values


class LocalTokenDispatcher(TokenDispatcher):
    """Single-device dispatcher: all experts are local; tokens are only reordered.

    Static shapes and no host reads (see models/moe/permutation.py): the rows handed to the
    experts are `T * K` plus, on CUDA, the worst-case alignment padding.

    Args:
        num_experts: experts on this device (= all routed experts).
    """

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(
        self, x: torch.Tensor, selected_experts: torch.Tensor, top_scores: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, _LocalContext]:
        perm = sort_by_expert(
            selected_experts.reshape(-1), self.num_experts, selected_experts.shape[1], group_align(x)
        )
        return permute(x, perm), perm.counts, _LocalContext(perm, top_scores)

    def combine(
        self, routed_out: torch.Tensor, ctx: _LocalContext, out_shape: torch.Size
    ) -> torch.Tensor:
        return gate_weighted_sum(unpermute(routed_out, ctx.perm), ctx.top_scores)
