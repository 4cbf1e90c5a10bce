"""The one entry that turns the single-device model into the parallel one.

House order (`docs/architecture.md`), all on the meta-device model:

    float8 -> TP -> EP -> CP -> AC -> compile -> Engram tables -> FSDP2/HSDP   (then to_empty + init)

Each step is an ``apply_*`` of its own file; this module only decides which apply and on which
mesh. Also here: the all-reduce the MoE bias update needs, and loading a full (single-device)
state dict into the parallel model, which makes CPU runs start from exactly the weights a
single process would draw.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from trainer.parallel.activation_checkpoint import apply_activation_checkpointing
from trainer.parallel.context_parallel import apply_context_parallel
from trainer.parallel.distributed import all_reduce_sum
from trainer.parallel.engram_parallel import (
    apply_engram_parallel,
    replicate_engram_tables,
    table_row_ranges,
    tables_hidden_from_fsdp,
)
from trainer.parallel.expert_parallel import apply_expert_parallel
from trainer.parallel.fsdp import apply_fsdp
from trainer.parallel.parallel_dims import ParallelDims
from trainer.parallel.tensor_parallel import apply_tensor_parallel

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parallelize_model(model: nn.Module, parallel_dims: ParallelDims, cfg, device_type: str = "cpu") -> nn.Module:
    """Applies every configured parallelism to ``model`` in place (and returns it).

    ``cfg`` is the JobConfig; this reads ``[quantize]``, ``[parallelism]``, ``[activation_checkpoint]`` and
    ``training.compile`` / ``training.mixed_precision_param``. Meshes are built here if the
    caller has not built them yet.
    """
    dims, p = parallel_dims, cfg.parallelism
    if dims.world_size > 1:
        dims.build_meshes(device_type)
    if cfg.quantize.float8:
        # Model converters come first, so every parallelism wraps the converted modules.
        from trainer.quantize import check_float8_support, convert_to_float8

        check_float8_support(cfg.quantize, device_type, dims.tp_enabled)
        convert_to_float8(model, cfg.quantize)
    if dims.tp_enabled:
        apply_tensor_parallel(model, dims.mesh("tp"))

    ac = cfg.activation_checkpoint
    if dims.ep_enabled:
        apply_expert_parallel(model, dims.mesh("ep"))

    if dims.context_enabled:
        # The trainer splits batches with ContextParallel.for_model (train.py).
        apply_context_parallel(model, dims.mesh("context"))

    apply_activation_checkpointing(model, ac.mode, ac.selective_every)

    if cfg.training.compile:
        from trainer.parallel.compile import apply_compile

        apply_compile(model)

    if dims.engram_enabled:
        replicate = dims.mesh_or_none(dims.engram_replicate_mesh_name)
        apply_engram_parallel(model, dims.mesh(dims.engram_mesh_name), cfg.engram.precompute, replicate)
    elif dims.loss_enabled:  # embedding_parallel_degree 1: whole tables on every rank
        replicate_engram_tables(model, dims.mesh("loss"))

    if dims.data_parallel_enabled:
        dense_mesh = dims.mesh("hsdp") if dims.dp_replicate_enabled else dims.mesh("fsdp")
        expert_mesh = None
        if dims.ep_enabled:
            expert_mesh = dims.mesh("ehsdp") if dims.dp_replicate_enabled else dims.mesh("efsdp")
        with tables_hidden_from_fsdp(model):  # Engram tables stay out of FSDP
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
    return functools.partial(all_reduce_sum, mesh_or_group=mesh.get_group())


def _clean(name: str) -> str:
    # checkpoint_wrapper and torch.compile insert these into parameter names.
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copies single-device tensors (``full[name]``) into the parallel model in place: each
    DTensor (routed experts under EP included) gets its shard. Parameter identity is kept."""
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    table_rows = table_row_ranges(model, _clean)  # Engram tables may hold a row range only
    for raw_name, tensor in tensors.items():
        name = _clean(raw_name)
        if name not in full:
            continue
        src = full[name]
        if name in table_rows:
            src = src[slice(*table_rows[name])]
        if isinstance(tensor, DTensor):
            local = distribute_tensor(src.to(tensor.device), tensor.device_mesh, tensor.placements).to_local()
            tensor.to_local().copy_(local)
        else:
            tensor.copy_(src)
