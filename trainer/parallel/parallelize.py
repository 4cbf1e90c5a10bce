"""The one entry that turns the single-device model into the parallel one.

House order (docs: ARCHITECTURE.md section 1), all on the meta-device model:

    TP -> EP -> CP -> AC -> compile -> FSDP2/HSDP      (then the trainer runs to_empty + init)

Each step is an ``apply_*`` of its own file; this module only decides which apply and on which
mesh. Also here: the all-reduce the MoE bias update needs, and loading a full (single-device)
state dict into the parallel model, which makes CPU runs start from exactly the weights a
single process would draw.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from models.moe import MoE
from trainer.parallel.activation_checkpoint import apply_activation_checkpointing
from trainer.parallel.context_parallel import apply_context_parallel
from trainer.parallel.expert_parallel import (
    AllToAllTokenDispatcher,
    apply_expert_parallel,
    check_ep_comm_backend,
    expert_parallel_params,
)
from trainer.parallel.fsdp import apply_fsdp
from trainer.parallel.parallel_dims import ParallelDims
from trainer.parallel.tensor_parallel import apply_tensor_parallel

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parallelize_model(model: nn.Module, parallel_dims: ParallelDims, cfg, device_type: str = "cpu") -> nn.Module:
    """Applies every configured parallelism to ``model`` in place (and returns it).

    ``cfg`` is the JobConfig; this reads ``[parallelism]``, ``[activation_checkpoint]`` and
    ``training.compile`` / ``training.mixed_precision_param``. Meshes are built here if the
    caller has not built them yet.
    """
    dims, p = parallel_dims, cfg.parallelism
    if dims.world_size > 1:
        dims.build_meshes(device_type)
    if dims.tp_enabled:
        apply_tensor_parallel(model, dims.mesh("tp"))

    ac = cfg.activation_checkpoint
    if ac.mode == "op" and dims.ep_enabled and dims.data_parallel_enabled:
        # The experts' own FSDP unit sits inside the checkpointed block, and its hooks issue a
        # different number of profiler ops in recompute than in forward, which per-op SAC's
        # replay rejects.
        raise ValueError(
            "activation_checkpoint.mode = 'op' is not supported together with expert parallelism "
            "and FSDP yet; use 'full' or 'selective'"
        )
    if dims.ep_enabled:
        check_ep_comm_backend(p.expert_parallel_comm_backend, device_type)
        apply_expert_parallel(model, dims.mesh("ep"))

    if dims.context_enabled:
        # The trainer splits batches with ContextParallel.for_model (train.py).
        apply_context_parallel(model, dims.mesh("context"))

    apply_activation_checkpointing(model, ac.mode, ac.selective_every)

    if cfg.training.compile:
        from trainer.parallel.compile import apply_compile

        apply_compile(model)

    if dims.data_parallel_enabled:
        dense_mesh = dims.mesh("hsdp") if dims.dp_replicate_enabled else dims.mesh("fsdp")
        expert_mesh = None
        if dims.ep_enabled:
            expert_mesh = dims.mesh("ehsdp") if dims.dp_replicate_enabled else dims.mesh("efsdp")
        apply_fsdp(
            model,
            dense_mesh,
            expert_mesh,
            param_dtype=DTYPES[cfg.training.mixed_precision_param],
            reduce_dtype=torch.float32,
            reshard_after_forward=p.fsdp_reshard_after_forward,
        )
    return model


def build_reduce_counts(parallel_dims: ParallelDims) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The ``reduce_counts`` of ``ExpertBiasUpdater``: a sum over the "loss" mesh (every rank
    that routed different tokens), or None on one rank."""
    mesh = parallel_dims.mesh_or_none("loss")
    if mesh is None:
        return None
    group = mesh.get_group()

    def reduce_counts(counts: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        return counts

    return reduce_counts


def gradient_shard_groups(model: nn.Module) -> dict[int, list]:
    """Extra sharding of parameters that DTensor placements do not show (for ``grad_norm``)."""
    return expert_parallel_params(model)


def _global_slice(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Parameter name -> [start, stop) rows of the full tensor held under EP."""
    out = {}
    for mod_name, module in model.named_modules():
        if isinstance(module, MoE) and isinstance(module.dispatcher, AllToAllTokenDispatcher):
            prefix = f"{mod_name}.experts." if mod_name else "experts."
            for pname in ("w1", "w2", "w3"):
                out[_clean(prefix + pname)] = module.dispatcher.local_expert_range
    return out


def _clean(name: str) -> str:
    # checkpoint_wrapper and torch.compile insert these into parameter names.
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copies single-device tensors (``full[name]``) into the parallel model in place:
    EP-local experts get their rows, DTensors their shard. Parameter identity is kept."""
    slices = _global_slice(model)
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    for raw_name, tensor in tensors.items():
        name = _clean(raw_name)
        if name not in full:
            continue
        src = full[name]
        if name in slices:
            start, stop = slices[name]
            src = src[start:stop]
        if isinstance(tensor, DTensor):
            local = distribute_tensor(src.to(tensor.device), tensor.device_mesh, tensor.placements).to_local()
            tensor.to_local().copy_(local)
        else:
            tensor.copy_(src)
