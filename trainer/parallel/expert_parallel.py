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
  for the split sizes) -> all_to_all the rows (autograd) -> permute the received rows from
  [source rank, local expert] order to [local expert, source rank] order for the grouped GEMM.
  combine: the inverse permutation, the reverse all_to_all, then the local unsort and the
  gate-weighted K-sum exactly as ``LocalTokenDispatcher`` does it (same numbers per token).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from torch.distributed.tensor import Shard, distribute_tensor

from models.moe import MoE
from models.moe.dispatcher import TokenDispatcher
from models.moe.experts import GroupedExperts

EP_COMM_BACKENDS = ("all_to_all", "deepep")


class _A2AContext(NamedTuple):
    unsort: torch.Tensor  # [T * K] position of each (token, choice) in the sorted send rows
    top_scores: torch.Tensor  # [T, K] fp32 gate values
    expert_major: torch.Tensor  # [N_recv] received row index of each expert-major row
    input_splits: list[int]  # rows sent to each ep rank
    output_splits: list[int]  # rows received from each ep rank


class AllToAllTokenDispatcher(TokenDispatcher):
    """Token dispatcher over an expert-parallel process group.

    Args:
        num_experts: routed experts of the layer (global).
        ep_group: the "ep" mesh's process group.
        ep_rank, ep_size: this rank's index in it and its size.
    """

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup, ep_rank: int, ep_size: int):
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} must be divisible by the ep degree {ep_size}")
        self.num_experts = num_experts
        self.group = ep_group
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size

    @property
    def local_expert_range(self) -> tuple[int, int]:
        """[first, last) global expert ids held by this rank: the ``Shard(0)`` chunk of the
        expert weights on the ep mesh, in the order ``dispatch`` sends their rows."""
        start = self.ep_rank * self.num_local_experts
        return start, start + self.num_local_experts

    @torch.compiler.disable
    def dispatch(
        self, x: torch.Tensor, selected_experts: torch.Tensor, top_scores: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, _A2AContext]:
        top_k = selected_experts.shape[1]
        flat_experts = selected_experts.reshape(-1)  # [T * K], token-major
        # Stable: each expert's rows stay in token order, as in LocalTokenDispatcher.
        order = torch.argsort(flat_experts, stable=True)
        unsort = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        send_counts = torch.bincount(flat_experts, minlength=self.num_experts)  # [E], rank-major
        recv_counts = torch.empty_like(send_counts)
        # recv_counts.view(ep, E_local)[s, e]: rows source rank s sends to my local expert e.
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_rank = send_counts.view(self.ep_size, self.num_local_experts)
        recv_rank = recv_counts.view(self.ep_size, self.num_local_experts)
        # One host sync for both split lists (the all-to-all needs them in Python).
        splits = torch.cat([send_rank.sum(1), recv_rank.sum(1)]).tolist()
        input_splits, output_splits = splits[: self.ep_size], splits[self.ep_size :]

        send_x = x.index_select(0, order // top_k)
        recv_x = funcol.all_to_all_single_autograd(send_x, output_splits, input_splits, self.group)
        # Received rows are [source rank][local expert]; the grouped GEMM wants [local expert].
        local_expert_of_row = torch.repeat_interleave(
            torch.arange(self.num_local_experts, device=x.device).repeat(self.ep_size), recv_counts
        )
        expert_major = torch.argsort(local_expert_of_row, stable=True)
        routed_x = recv_x.index_select(0, expert_major)
        torch._dynamo.maybe_mark_dynamic(routed_x, 0)
        num_tokens_per_expert = recv_rank.sum(0)
        return routed_x, num_tokens_per_expert, _A2AContext(unsort, top_scores, expert_major, input_splits, output_splits)

    @torch.compiler.disable
    def combine(self, routed_out: torch.Tensor, ctx: _A2AContext, out_shape: torch.Size) -> torch.Tensor:
        num_tokens, dim = out_shape
        top_k = ctx.top_scores.shape[1]
        source_major = torch.empty_like(ctx.expert_major).scatter_(
            0, ctx.expert_major, torch.arange(ctx.expert_major.numel(), device=routed_out.device)
        )
        back = funcol.all_to_all_single_autograd(
            routed_out.index_select(0, source_major), ctx.input_splits, ctx.output_splits, self.group
        )
        per_choice = back.index_select(0, ctx.unsort).view(num_tokens, top_k, dim)
        # Same rounding as LocalTokenDispatcher: fp32 product, one cast, K-sum.
        weighted = (per_choice.float() * ctx.top_scores.unsqueeze(-1)).to(routed_out.dtype)
        return weighted.sum(dim=1)


def check_ep_comm_backend(backend: str, device_type: str) -> None:
    """Fails with a clear message for a backend that cannot run here."""
    if backend not in EP_COMM_BACKENDS:
        raise ValueError(
            f"parallelism.expert_parallel_comm_backend must be one of {EP_COMM_BACKENDS}, got {backend!r}"
        )
    if backend == "deepep":
        problems = []
        if device_type != "cuda":
            problems.append("it needs CUDA devices (this run is on " + device_type + ")")
        try:
            import deep_ep  # noqa: F401
        except ImportError:
            problems.append("the deep_ep package is not installed (https://github.com/deepseek-ai/DeepEP)")
        problems.append("and the DeepEP dispatcher is not implemented in this trainer yet")
        raise ValueError(
            "parallelism.expert_parallel_comm_backend = 'deepep' cannot run: "
            + "; ".join(problems)
            + "; use 'all_to_all'"
        )


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
    ep_rank, ep_size = ep_mesh.get_local_rank(), ep_mesh.size()
    changed = []
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        dispatcher = AllToAllTokenDispatcher(module.num_experts, group, ep_rank, ep_size)
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

