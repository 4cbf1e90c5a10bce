"""FSDP2 / HSDP wrapping (the gradient norm across meshes is trainer/parallel/grad_norm.py).

Wrapping (``apply_fsdp``): each transformer block (and MTP block) is one FSDP unit; with expert
parallelism the routed experts of a block are sharded on the expert mesh ("efsdp", or "ehsdp"
with replication), everything else on "fsdp" ("hsdp" with replication); the root (embedding,
final norm, head) is the last unit. Where FSDP2 takes a mesh per parameter (torch >= 2.13) the
experts stay in their block's unit as a second parameter group: a unit of their own would put
FSDP's hooks, which dynamo does not trace, at the experts' call inside the compiled MoE block
and split it there (docs/compile.md). Older torch gets that unit of its own. Gradients are
*summed*, not averaged: the loss is already divided by the global number of valid tokens
(trainer/loss.py), so FSDP's default division by the data-parallel size would shrink them a
second time.

Routed experts under EP are already DTensors ``Shard(0)`` on "ep"; "efsdp"/"ehsdp" and "ep" are
dims of one root mesh ("sparse", parallel_dims.py), so ``fully_shard`` stacks its dim-0 shard on
top: placements ``(_StridedShard(0, split_factor=ep), Shard(0))`` on the [efsdp, ep] mesh (with a
leading ``Replicate()`` under HSDP), still one global ``[E, ...]`` tensor for DCP.
"""

from __future__ import annotations

import typing

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from models.moe import MoE
from trainer.config.schema import ReshardPolicy
from trainer.parallel.distributed import init_one_process_group

try:  # A mesh per parameter (documented in fully_shard's shard_placement_fn); torch >= 2.13.
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        HSDPMeshInfo,
        ShardPlacementResult,
    )
except ImportError:
    ShardPlacementResult = None

# Whether routed experts under EP share their block's FSDP unit (else they are a unit of their own).
EXPERTS_IN_BLOCK_UNIT = ShardPlacementResult is not None

RESHARD_POLICIES = typing.get_args(ReshardPolicy)


def _set_sum_reduction(module: FSDPModule) -> None:
    # torch >= 2.8 names it set_gradient_divide_factor; older releases only had the
    # reduce-scatter variant (deprecated since).
    if hasattr(module, "set_gradient_divide_factor"):
        module.set_gradient_divide_factor(1.0)
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            # A custom factor otherwise becomes ReduceOp.PREMUL_SUM, which gloo lacks; plain
            # SUM is the same reduction here (factor 1).
            module.set_force_sum_reduction_for_comms(True)
    else:
        module.set_reduce_scatter_divide_factor(1.0)


def _reshard(policy: str, is_last: bool) -> bool:
    if policy == "always":
        return True
    if policy == "never":
        return False
    # default: the last unit's parameters are needed again right away by backward.
    return not is_last


def apply_fsdp(
    model: nn.Module,
    dense_mesh,
    expert_mesh=None,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: str = "default",
    ignored_params: set[nn.Parameter] | None = None,
    root_runs_forward: bool = True,
) -> None:
    """Shards ``model`` in place.

    Args:
        dense_mesh: mesh for non-expert parameters ("fsdp" 1-D, or "hsdp" 2-D).
        expert_mesh: mesh for routed experts when EP is on ("efsdp" or "ehsdp"); None = experts
            are sharded with their block on ``dense_mesh``.
        reshard_after_forward: "default" (all but the root), "always", "never".
        ignored_params: parameters FSDP leaves alone (plain fp32 tensors, never gathered).
        root_runs_forward: False for a pipeline stage, whose model's own forward never runs (the
            stage calls its parts): the embedding, the norm and the head become units of their
            own, since only a unit's forward gathers its parameters.
    """
    if reshard_after_forward not in RESHARD_POLICIES:
        raise ValueError(f"fsdp_reshard_after_forward must be one of {RESHARD_POLICIES}, got {reshard_after_forward!r}")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = list(model.layers.values())
    if getattr(model, "mtp", None) is not None:
        blocks += [m for m in model.mtp]
    units: list[FSDPModule] = []
    expert_units: dict[int, FSDPModule] = {}
    expert_placement = _expert_placement_fn(model, expert_mesh) if expert_mesh is not None else None
    for i, block in enumerate(blocks):
        reshard = _reshard(reshard_after_forward, is_last=False)
        if expert_mesh is not None and expert_placement is None:
            for sub in block.modules():
                if isinstance(sub, MoE):
                    fully_shard(
                        sub.experts, mesh=expert_mesh, reshard_after_forward=reshard, mp_policy=mp,
                        ignored_params=ignored_params,
                    )
                    _set_sum_reduction(sub.experts)
                    expert_units[i] = sub.experts
        fully_shard(
            block, mesh=dense_mesh, reshard_after_forward=reshard, mp_policy=mp, ignored_params=ignored_params,
            shard_placement_fn=expert_placement,
        )
        _set_sum_reduction(block)
        units.append(block)
    if not root_runs_forward:
        # One unit each: a unit whose forward runs without the root's becomes a root itself,
        # and FSDP refuses a root of several modules.
        for part in (model.embed, model.norm, model.head):
            if part is not None:
                fully_shard(
                    part, mesh=dense_mesh, reshard_after_forward=_reshard(reshard_after_forward, False),
                    mp_policy=mp, ignored_params=ignored_params,
                )
                _set_sum_reduction(part)
    fully_shard(
        model, mesh=dense_mesh, reshard_after_forward=_reshard(reshard_after_forward, True), mp_policy=mp,
        ignored_params=ignored_params,
    )
    _set_sum_reduction(model)

    if expert_mesh is not None and root_runs_forward:
        # (Without the root's forward each unit initialises as a root of its own, and FSDP can
        # prefetch only units initialised under the same root.)
        # With EP the block's all-to-alls (and their host read of the split sizes) come before
        # the next block's all-gathers: fetch the next block (and its experts, where they are a
        # unit of their own) explicitly so the gathers overlap the exchange (implicit prefetch
        # would only start the next gather after the all-to-all returns).
        for i, block in enumerate(units):
            nxt = [units[i + 1]] if i + 1 < len(units) else []
            if i + 1 in expert_units:
                nxt.append(expert_units[i + 1])
            if nxt:
                block.set_modules_to_forward_prefetch(nxt)
        for i in range(len(units) - 1, 0, -1):
            prev = [units[i - 1]]
            if i - 1 in expert_units:
                prev.append(expert_units[i - 1])
            units[i].set_modules_to_backward_prefetch(prev)


def _expert_placement_fn(model: nn.Module, expert_mesh):
    """A ``shard_placement_fn`` that puts the routed experts' parameters on ``expert_mesh``
    and leaves every other parameter on the unit's mesh, or None where this torch has no mesh
    per parameter."""
    if not EXPERTS_IN_BLOCK_UNIT:
        return None
    # One mesh-info object for every expert parameter: FSDP groups parameters by it.
    if expert_mesh.ndim == 1:
        mesh_info = FSDPMeshInfo(expert_mesh, shard_mesh_dim=0)
    else:
        mesh_info = HSDPMeshInfo(expert_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    experts = {id(p) for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters()}

    def placement(param: nn.Parameter):
        return ShardPlacementResult(Shard(0), mesh_info) if id(param) in experts else None

    return placement


def set_reshard_after_backward(model: nn.Module, reshard: bool) -> None:
    """Whether FSDP frees the gathered weights after the next backward (every unit of ``model``)."""
    if isinstance(model, FSDPModule):
        model.set_reshard_after_backward(reshard)


def one_process_mesh(device_type: str):
    """A one-rank "fsdp" mesh for a single-process run, over a one-rank process group made here
    (an in-memory store: no port, no launcher) unless one exists. FSDP2 on it shards nothing;
    what it adds is the mixed-precision cast of every weight once per unshard instead of
    autocast's cast at every use."""
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device(device_type)
    init_one_process_group(device)
    return init_device_mesh(device_type, (1,), mesh_dim_names=("fsdp",))
