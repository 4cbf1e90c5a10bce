"""Token dispatchers: move routed tokens to their experts and back.

This is the MoE's compiler boundary. Everything whose shape or values depend on routing
(sorting by expert, per-expert counts, split sizes, all-to-all) happens inside `dispatch()`
and `combine()`, both excluded from torch.compile, so the rest of the block compiles into
static-shape graphs and a new routing never triggers a recompile.
"""

from typing import Any, NamedTuple

import torch


class TokenDispatcher:
    """Interface between the router/experts math and the token movement.

    Contract:
    - `dispatch(x [T, dim], selected_experts [T, K] int64, top_scores [T, K] fp32)` returns
      `(routed_x [N, dim], num_tokens_per_expert [E_local] int64, ctx)`: the rows this
      device's experts must process, sorted by local expert, and their counts.
    - `combine(routed_out [N, dim], ctx, out_shape)` returns `[T, dim]` (`out_shape`) in
      routed_out's dtype: for each token, the sum over its K choices of expert output times
      gate value. Gate values are applied here, not before the experts.
    - `ctx` is opaque to callers; only the same dispatcher's `combine` reads it.
    - Implementations decorate both methods with `@torch.compiler.disable` and keep them
      differentiable with respect to x, top_scores and routed_out.
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
    unsort: torch.Tensor  # [T * K]: position in the sorted rows of each (token, choice) pair
    top_scores: torch.Tensor  # [T, K] fp32 gate values


class LocalTokenDispatcher(TokenDispatcher):
    """Single-device dispatcher: all experts are local; tokens are only reordered.

    Args:
        num_experts: experts on this device (= all routed experts).
    """

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    @torch.compiler.disable
    def dispatch(
        self, x: torch.Tensor, selected_experts: torch.Tensor, top_scores: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, _LocalContext]:
        top_k = selected_experts.shape[1]
        flat_experts = selected_experts.reshape(-1)  # [T * K], token-major
        # Stable sort keeps each expert's rows in token order: deterministic and layout-independent.
        order = torch.argsort(flat_experts, stable=True)
        unsort = torch.empty_like(order).scatter_(
            0, order, torch.arange(order.numel(), device=order.device)
        )
        num_tokens_per_expert = torch.bincount(flat_experts, minlength=self.num_experts)
        routed_x = x.index_select(0, order // top_k)
        # The experts' graph traces the row count symbolically (no recompile when it changes).
        torch._dynamo.maybe_mark_dynamic(routed_x, 0)
        return routed_x, num_tokens_per_expert, _LocalContext(unsort, top_scores)

    @torch.compiler.disable
    def combine(
        self, routed_out: torch.Tensor, ctx: _LocalContext, out_shape: torch.Size
    ) -> torch.Tensor:
        num_tokens, dim = out_shape
        top_k = ctx.top_scores.shape[1]
        per_choice = routed_out.index_select(0, ctx.unsort).view(num_tokens, top_k, dim)
        # Like HF: product in fp32, rounded once to the activation dtype; the K-sum then runs
        # with fp32 accumulation inside `sum`.
        weighted = (per_choice.float() * ctx.top_scores.unsqueeze(-1)).to(routed_out.dtype)
        return weighted.sum(dim=1)
