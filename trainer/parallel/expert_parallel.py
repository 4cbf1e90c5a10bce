"""Expert parallelism: routed experts split over the "ep" mesh, tokens moved by all-to-all.

``apply_expert_parallel`` keeps the model code single-device: each MoE's ``GroupedExperts``
gets DTensor parameters ``Shard(0)`` on the "ep" mesh, i.e. the global ``[E, ...]`` stacks of
which rank r holds experts ``[r * E/ep, (r+1) * E/ep)`` (names and global shapes unchanged; the
forward reads the local shard, see ``ExpertParallelGroupedExperts``), and ``MoE.dispatcher``
becomes an ``AllToAllTokenDispatcher`` over the ep group. Routing, counting
(``tokens_per_expert`` over all E experts, per rank) and the shared experts are untouched; FSDP
then shards the experts' dim 0 again over the "efsdp" mesh (2-D placements on [efsdp, ep],
trainer/parallel/fsdp.py). Checkpoints, the gradient norm and weight loading all read the ep
sharding from the placements.

Exchange, per MoE forward (the dispatcher contract in ``models/moe/dispatcher.py``):
  dispatch: sort (token, choice) rows by global expert -> rows are rank-major (experts are
  contiguous per rank) -> exchange per-expert counts (all_to_all_single, then one host sync
  for the split sizes, the only host read of the layer) -> all_to_all the rows (autograd) ->
  permute the received rows from [source rank, local expert] order to [local expert, source
  rank] order (aligned as the grouped GEMM wants on CUDA).
  combine: the inverse permutation, the reverse all_to_all, then the unsort and the
  gate-weighted K-sum. Both permutations are the gathers of ``models/moe/permutation.py``
  shared with ``LocalTokenDispatcher`` (no atomic scatter in forward or backward).
Each direction is the contract's three phases around the exchange (``dispatch_preprocess``,
``token_dispatch``, ``dispatch_postprocess``; ``combine_preprocess``, ``token_combine``,
``combine_postprocess``): ``dispatch`` and ``combine`` compose them, and the overlapped schedule
(trainer/parallel/moe_overlap.py) calls them as nodes, running the exchanges (``start_exchange``)
itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.decorators import mark_unbacked
from torch.distributed.tensor import Shard, distribute_tensor

from models.moe import MoE
from models.moe.dispatcher import TokenDispatcher
from models.moe.experts import GroupedExperts
from models.moe.permutation import (
    ExpertPermutation,
    group_align,
    permute,
    sort_by_expert,
    unpermute,
)


class _A2AContext:
    """What ``combine`` needs from ``dispatch``.

    A plain class, not a NamedTuple: the context crosses the compiled region between the two
    exchanges, and dynamo guards only the attributes compiled code reads (``send`` and
    ``top_scores``, whose shapes are fixed by the local tokens). Tuple items would all be guarded,
    and ``recv`` and the split lists change with routing: every new received row count would
    recompile the block.
    """

    __slots__ = ("send", "recv", "top_scores", "input_splits", "output_splits")

    def __init__(
        self,
        send: ExpertPermutation,
        recv: ExpertPermutation,
        top_scores: torch.Tensor,
        input_splits: list[int],
        output_splits: list[int],
    ):
        self.send = send  # (token, choice) slots -> send rows, sorted by global expert
        self.recv = recv  # received rows -> rows sorted (and aligned) by local expert
        self.top_scores = top_scores  # [T, K] fp32 gate values
        self.input_splits = input_splits  # rows sent to each ep rank
        self.output_splits = output_splits  # rows received from each ep rank


class AllToAllTokenDispatcher(TokenDispatcher):
    """Token dispatcher over an expert-parallel process group.

    Args:
        num_experts: routed experts of the layer (global).
        ep_group: the "ep" mesh's process group.
        ep_size: its size.
    """

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup, ep_size: int):
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} must be divisible by the ep degree {ep_size}")
        self.num_experts = num_experts
        self.group = ep_group
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size

    @torch.compiler.disable
    def dispatch(
        self, x: torch.Tensor, selected_experts: torch.Tensor, top_scores: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, _A2AContext]:
        routed_x, num_tokens_per_expert, ctx = super().dispatch(x, selected_experts, top_scores)
        # The received row count depends on routing. Unbacked, it is one symbol for the compiled
        # experts whatever its value: a backed (dynamic) size would be specialised when it is 0
        # or 1, and a rank whose experts receive 0 or 1 rows would recompile the block.
        mark_unbacked(routed_x, 0)
        return routed_x, num_tokens_per_expert, ctx

    def dispatch_preprocess(
        self, x: torch.Tensor, selected_experts: torch.Tensor, top_scores: torch.Tensor
    ) -> tuple[torch.Tensor, _A2AContext]:
        """The exchange's plan (both permutations and the split sizes: the counts' all-to-all and
        the layer's one host read), before any row moves, and the rows in send order."""
        # Sorted by global expert, the send rows are rank-major (experts are contiguous per rank).
        send = sort_by_expert(selected_experts.reshape(-1), self.num_experts, selected_experts.shape[1])
        recv_counts = torch.empty_like(send.counts)
        # recv_counts.view(ep, E_local)[s, e]: rows source rank s sends to my local expert e.
        dist.all_to_all_single(recv_counts, send.counts, group=self.group)
        input_splits, output_splits = self.split_sizes(send.counts, recv_counts, send.src.shape[0])
        # Received rows are [source rank][local expert]; the grouped GEMM wants [local expert].
        local_expert_of_row = torch.repeat_interleave(
            torch.arange(self.num_local_experts, device=recv_counts.device).repeat(self.ep_size),
            recv_counts,
            output_size=sum(output_splits),
        )
        recv = sort_by_expert(local_expert_of_row, self.num_local_experts, align=group_align(x))
        ctx = _A2AContext(send, recv, top_scores, input_splits, output_splits)
        return permute(x, send), ctx

    def token_dispatch(self, rows: torch.Tensor, ctx: _A2AContext) -> torch.Tensor:
        return _Exchange.apply(rows, self, ctx.output_splits, ctx.input_splits)

    def dispatch_postprocess(self, rows: torch.Tensor, ctx: _A2AContext) -> tuple[torch.Tensor, torch.Tensor]:
        return permute(rows, ctx.recv), ctx.recv.counts

    def combine_preprocess(self, routed_out: torch.Tensor, ctx: _A2AContext) -> torch.Tensor:
        return unpermute(routed_out, ctx.recv)

    def token_combine(self, rows: torch.Tensor, ctx: _A2AContext) -> torch.Tensor:
        return _Exchange.apply(rows, self, ctx.input_splits, ctx.output_splits)

    def start_exchange(self, rows: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> PendingExchange:
        """Sends ``rows`` (``input_splits`` to each ep rank) without waiting: the rows received
        (``output_splits`` from each) come from the handle's ``wait()``. Every exchange of the
        dispatcher, forward and backward, eager or overlapped, is one of these (the delay
        benchmark wraps this method)."""
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        work = dist.all_to_all_single(
            out, rows.contiguous(), output_splits, input_splits, group=self.group, async_op=True
        )
        return PendingExchange(work.get_future(), out)

    def split_sizes(
        self, send_counts: torch.Tensor, recv_counts: torch.Tensor, rows: int
    ) -> tuple[list[int], list[int]]:
        """Rows sent to and received from each ep rank (of ``rows`` sent in all), from the
        per-expert counts: the one host read per MoE layer, both lists at once (all_to_all takes
        them in Python)."""
        send_rank = send_counts.view(self.ep_size, self.num_local_experts)
        recv_rank = recv_counts.view(self.ep_size, self.num_local_experts)
        splits = torch.cat([send_rank.sum(1), recv_rank.sum(1)]).tolist()
        return splits[: self.ep_size], splits[self.ep_size :]

    def combine(self, routed_out: torch.Tensor, ctx: _A2AContext, out_shape: torch.Size) -> torch.Tensor:
        # The unsort and gate weighting compile with the block; only the exchange is eager.
        return self.combine_postprocess(self.exchange_back(routed_out, ctx), ctx, ctx.top_scores)

    @torch.compiler.disable
    def exchange_back(self, routed_out: torch.Tensor, ctx: _A2AContext) -> torch.Tensor:
        """Expert outputs back to the ranks that sent the rows, in their send order (the receive
        side's permutation reads ``ctx.recv``, whose shapes follow routing: eager too)."""
        return self.token_combine(self.combine_preprocess(routed_out, ctx), ctx)


class PendingExchange:
    """An all-to-all in flight: ``wait()`` returns the received rows.

    Holds the work's future, not the work: a wrapper can chain work onto the future
    (``future.then``), which then runs on the thread that completes the collective (gloo's worker
    thread), and ``wait()`` waits for the chained result as well.
    """

    __slots__ = ("future", "out")

    def __init__(self, future: torch.futures.Future, out: torch.Tensor):
        self.future = future
        self.out = out

    def wait(self) -> torch.Tensor:
        self.future.wait()
        return self.out


class _Exchange(torch.autograd.Function):
    """A differentiable all-to-all through ``dispatcher.start_exchange``: the gradient goes back
    by the inverse exchange (the split lists swapped). Hand-rolled instead of funcol's
    ``all_to_all_single_autograd`` so that both directions take the one exchange path the delay
    benchmark wraps."""

    @staticmethod
    def forward(ctx, rows, dispatcher, output_splits, input_splits):
        ctx.dispatcher = dispatcher
        ctx.splits = (output_splits, input_splits)
        return dispatcher.start_exchange(rows, output_splits, input_splits).wait()

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return ctx.dispatcher.start_exchange(grad, input_splits, output_splits).wait(), None, None, None


class ExpertParallelGroupedExperts(GroupedExperts):
    """``GroupedExperts`` whose ``w1``/``w2``/``w3`` are DTensors sharded over the "ep" mesh.

    ``apply_expert_parallel`` swaps an instance's class to this one (as ``fully_shard`` does with
    its own subclass): parameter names, ``init_weights`` and the state dict are unchanged, and the
    model code stays free of DTensor. The forward computes on the local shard, this rank's
    ``E / ep`` experts in the order the all-to-all dispatcher sends their rows; under FSDP2 the
    parameter it sees is the unsharded ep DTensor, and ``to_local``'s backward hands the gradient
    back as the same ``Shard(0)`` DTensor.
    """

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.w1.to_local(), self.w2.to_local(), self.w3.to_local()


def apply_expert_parallel(model: nn.Module, ep_mesh) -> list[MoE]:
    """Shards every MoE's routed experts ``Shard(0)`` over ``ep_mesh`` and swaps in the
    all-to-all dispatcher.

    Run before FSDP, on the meta-device model (real tensors work too: each rank keeps its rows,
    without communication). The parameters become DTensors of the *global* expert stack, so the
    checkpoint (DCP) saves and reshards global tensors and the gradient norm reads the ep
    sharding from their placements. Returns the MoE modules it changed.
    """
    group = ep_mesh.get_group()
    ep_size = ep_mesh.size()
    changed = []
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        dispatcher = AllToAllTokenDispatcher(module.num_experts, group, ep_size)
        experts = module.experts
        for name in ("w1", "w2", "w3"):
            param = getattr(experts, name)
            # src_data_rank=None: every rank already holds the full tensor (or meta); no scatter.
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.__class__ = ExpertParallelGroupedExperts
        experts.num_experts = dispatcher.num_local_experts
        module.dispatcher = dispatcher
        changed.append(module)
    return changed
