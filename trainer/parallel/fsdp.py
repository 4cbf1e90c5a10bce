"""FSDP2 / HSDP wrapping (the gradient norm across meshes is trainer/parallel/grad_norm.py).

Wrapping (``apply_fsdp``): each transformer block (and MTP block) is one FSDP unit; with expert
parallelism the routed experts of a block are sharded on the expert mesh ("efsdp", or "ehsdp"
with replication), everything else on "fsdp" ("hsdp" with replication); the root (embedding,
final norm, head) is the last unit: the model, or under pipeline parallelism each stage module,
whose gradients torch's schedules then reduce once per step (`apply_fsdp`). Where FSDP2 takes a mesh per parameter (torch >= 2.13) the
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
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.tensor import Shard

from models.moe import MoE
from trainer.config.schema import ReshardPolicy
from trainer.distributed import init_one_process_group

try:  # A mesh per parameter (documented in fully_shard's shard_placement_fn); torch >= 2.13.
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        HSDPMeshInfo,
        ShardPlacementResult,
    )
except ImportError:
    ShardPlacementResult = None

# Whether routed experts under EP can share their block's FSDP unit (else they are a unit of their
# own): apply_fsdp's default; the other layout stays selectable so that torch 2.13 tests run it too.
EXPERTS_IN_BLOCK_UNIT = ShardPlacementResult is not None

RESHARD_POLICIES = typing.get_args(ReshardPolicy)


def _set_sum_reduction(module: FSDPModule) -> None:
    module.set_gradient_divide_factor(1.0)
    # A custom factor otherwise becomes ReduceOp.PREMUL_SUM, which gloo lacks; plain SUM is the
    # same reduction here (factor 1). Both setters exist in torch 2.11 and 2.13.
    module.set_force_sum_reduction_for_comms(True)


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
    stages: list[nn.Module] | None = None,
    experts_in_block_unit: bool = EXPERTS_IN_BLOCK_UNIT,
) -> None:
    """Shards ``model`` in place.

    Args:
        dense_mesh: mesh for non-expert parameters ("fsdp" 1-D, or "hsdp" 2-D).
        expert_mesh: mesh for routed experts when EP is on ("efsdp" or "ehsdp"); None = experts
            are sharded with their block on ``dense_mesh``.
        reshard_after_forward: "default" (all but the root), "always", "never".
        ignored_params: parameters FSDP leaves alone (plain fp32 tensors, never gathered).
        stages: under pipeline parallelism, this rank's stage modules (trainer/parallel/pipeline.py),
            which the schedule runs instead of ``model``: each becomes the root of its blocks'
            units and holds its embedding / norm / head in its own group. torch's pipelining then
            defers every unit's reduction to the stage's ``REDUCE_GRAD`` (the zero-bubble schedules
            are correct only so: docs/parallelism.md). A parameter that two local stages share
            (the embedding, which MTP on the last stage reads, under a V schedule) belongs to the
            first; the second leaves it to that one.
        experts_in_block_unit: with ``expert_mesh``, the routed experts' parameters join their
            block's unit on their own mesh (torch >= 2.13) rather than forming a unit of their own
            (the only layout torch 2.11 has; tests/distributed/test_compile_ep.py runs it on 2.13).
    """
    if reshard_after_forward not in RESHARD_POLICIES:
        raise ValueError(f"fsdp_reshard_after_forward must be one of {RESHARD_POLICIES}, got {reshard_after_forward!r}")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    ignored_params = set(ignored_params or ())
    in_block = expert_mesh is not None and experts_in_block_unit
    expert_placement = _expert_placement_fn(model, expert_mesh) if in_block else None
    units: dict[nn.Module, list[FSDPModule]] = {}
    for block in _blocks(model):
        experts = None
        if expert_mesh is not None and not in_block:
            for sub in block.modules():
                if isinstance(sub, MoE):
                    fully_shard(
                        sub.experts, mesh=expert_mesh, reshard_after_forward=_reshard(reshard_after_forward, False),
                        mp_policy=mp, ignored_params=ignored_params,
                    )
                    _set_sum_reduction(sub.experts)
                    experts = sub.experts
        fully_shard(
            block, mesh=dense_mesh, reshard_after_forward=_reshard(reshard_after_forward, False), mp_policy=mp,
            ignored_params=ignored_params, shard_placement_fn=expert_placement,
        )
        _set_sum_reduction(block)
        units[block] = [block] + ([experts] if experts is not None else [])
    roots = [model] if stages is None else stages
    # A stage's inputs are the residual stream (already in the compute dtype) and the running fp32
    # balance loss, which a cast to param_dtype would round: its units cast their own inputs.
    root_mp = mp if stages is None else MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    claimed: set[nn.Parameter] = set()
    for root in roots:
        fully_shard(
            root, mesh=dense_mesh, reshard_after_forward=_reshard(reshard_after_forward, True), mp_policy=root_mp,
            ignored_params=ignored_params | claimed,
        )
        _set_sum_reduction(root)
        claimed |= set(root.parameters())
        if expert_mesh is not None:
            _prefetch_in_order([units[b] for b in _blocks(root)])


def _blocks(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a model or a pipeline stage, in the order its forward runs them."""
    blocks = list(module.layers.values()) if hasattr(module, "layers") else list(getattr(module, "blocks", ()))
    if getattr(module, "mtp", None) is not None:
        blocks += list(module.mtp)
    return blocks


def _prefetch_in_order(units: list[list[FSDPModule]]) -> None:
    """Explicit prefetch of the next (forward) and previous (backward) block's units.

    With EP the block's all-to-alls (and their host read of the split sizes) come before the next
    block's all-gathers: fetching the next block (and its experts, where they are a unit of their
    own) explicitly lets the gathers overlap the exchange, where implicit prefetch would only start
    the next gather after the all-to-all returns. Only units under one root can prefetch each other.
    """
    for i, block in enumerate(units):
        if i + 1 < len(units):
            block[0].set_modules_to_forward_prefetch(units[i + 1])
        if i > 0:
            block[0].set_modules_to_backward_prefetch(units[i - 1])


def _expert_placement_fn(model: nn.Module, expert_mesh):
    """A ``shard_placement_fn`` that puts the routed experts' parameters on ``expert_mesh``
    and leaves every other parameter on the unit's mesh (torch >= 2.13)."""
    # One mesh-info object for every expert parameter: FSDP groups parameters by it.
    if expert_mesh.ndim == 1:
        mesh_info = FSDPMeshInfo(expert_mesh, shard_mesh_dim=0)
    else:
        mesh_info = HSDPMeshInfo(expert_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    experts = {id(p) for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters()}

    def placement(param: nn.Parameter):
        return ShardPlacementResult(Shard(0), mesh_info) if id(param) in experts else None

    return placement


def reshards_after_forward(module: FSDPModule) -> bool:
    """Whether the FSDP unit ``module`` frees its gathered parameters after forward. FSDP2 has a
    setter for this but no getter: read off its parameter groups (one per mesh on torch >= 2.13,
    one in all before)."""
    return any(group.post_forward_mesh_info is not None for group in _param_groups(module._get_fsdp_state()))


def _param_groups(state) -> list:
    """An FSDP state's parameter groups: one per mesh on torch >= 2.13, at most one before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return groups


class ManualReduction:
    """FSDP's gradient reduction for a step that calls the blocks' modules itself, so that FSDP's
    hooks never run (trainer/parallel/moe_overlap.py): what the post-backward hooks would do.

    FSDP2 has no public call for a unit's gradient reduction: this drives its parameter groups the
    way torch's pipelining does at ``REDUCE_GRAD`` (``_PipelineStageBase.perform_reduce_grad``).
    Without FSDP (``root`` None) both calls do nothing.
    """

    def __init__(self, root: FSDPModule | None):
        self.root = root

    def unit_done(self, module: nn.Module) -> None:
        """``module``'s gradients of this micro-batch are complete: reduce-scatter them now (summed
        into the sharded gradients), as its post-backward hook would, beside the compute that follows."""
        if self.root is None:
            return
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                for group in _param_groups(unit._get_fsdp_state()):
                    group.post_backward()

    def micro_batch_done(self) -> None:
        """Reduces every unit not reduced yet and waits for the reductions, as FSDP's end-of-backward
        callback does."""
        if self.root is None:
            return
        state = self.root._get_fsdp_state()
        for each in state._state_ctx.all_states:
            for group in _param_groups(each):
                if group._training_state != TrainingState.POST_BACKWARD:
                    group.post_backward()
        finish_backward(self.root)


def lazy_init(root: nn.Module) -> None:
    """What the FSDP root's first pre-forward hook does (mesh and stream set-up, the root's state
    over all its units), for a step that calls the blocks' modules itself and so never runs that
    hook. FSDP2 has no public call for it."""
    if isinstance(root, FSDPModule):
        root._get_fsdp_state()._lazy_init()


def finish_backward(root: nn.Module) -> None:
    """FSDP's end-of-backward callback on ``root`` (waits for the reductions, reshards where asked,
    resets the units' states), which torch queues from a post-backward hook that a step calling
    the modules itself never runs. FSDP2 has no public call for it."""
    if isinstance(root, FSDPModule):
        root._get_fsdp_state()._root_post_backward_final_callback()


@contextmanager
def gathered_through_step(model: nn.Module) -> Iterator[ManualReduction]:
    """Every FSDP unit of ``model`` gathered for a step that calls the blocks' modules itself
    (trainer/parallel/moe_overlap.py); yields the ``ManualReduction`` of its gradients, and
    reshards every unit at the end."""
    if not isinstance(model, FSDPModule):
        yield ManualReduction(None)
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    lazy_init(model)
    for unit in units:
        unit.set_reshard_after_backward(False, recurse=False)
        unit.unshard()
    try:
        yield ManualReduction(model)
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_backward(True, recurse=False)


def cast_forward_inputs(module: nn.Module, *args):
    """``args`` as FSDP unit ``module``'s pre-forward hook casts them (mixed precision's
    ``param_dtype``), for a step that calls the unit's submodules itself (moe_overlap.py): the
    block's input and its rope table would otherwise stay in fp32. FSDP2 has no public call for it."""
    if not isinstance(module, FSDPModule):
        return args
    cast, _ = module._get_fsdp_state()._cast_forward_inputs(args, {})
    return cast


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
