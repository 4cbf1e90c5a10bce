"""The one entry that turns the single-device model into the parallel one.

House order (`docs/architecture.md`), all on the meta-device model:

    float8 -> TP -> EP -> CP -> AC -> compile -> Engram tables -> FSDP2/HSDP   (then to_empty + init)

Each step is an ``apply_*`` of its own file; this module only decides which apply and on which
mesh, and hands the step's layout work to a ``ParallelStep``. The other build-time work on the
parallelized model is here too: ``materialize`` (storage and initial weights) and
``build_loss_function``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from models.engram import NgramHasher, engram_table_params
from trainer.config import ActivationCheckpoint, Engram, Parallelism, Quantize, Training
from trainer.loss import cross_entropy_sum
from trainer.parallel.activation_checkpoint import apply_activation_checkpointing
from trainer.parallel.compile import compiled_cross_entropy_sum
from trainer.parallel.context_parallel import apply_context_parallel
from trainer.parallel.engram_parallel import (
    apply_engram_parallel,
    replicate_engram_tables,
    tables_hidden_from_fsdp,
)
from trainer.parallel.expert_parallel import apply_expert_parallel
from trainer.parallel.fsdp import apply_fsdp, one_process_mesh
from trainer.parallel.parallel_dims import ParallelDims
from trainer.parallel.pipeline import PipelineStep, activation_meta, local_stage_specs, split_model
from trainer.parallel.step import ParallelStep
from trainer.parallel.tensor_parallel import apply_tensor_parallel
from trainer.parallel.weight_init import init_model_weights

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parallelize_model(
    model: nn.Module,
    parallel_dims: ParallelDims,
    parallelism: Parallelism,
    training: Training,
    activation_checkpoint: ActivationCheckpoint,
    quantize: Quantize,
    engram: Engram,
    device_type: str = "cpu",
    engram_hasher: NgramHasher | None = None,
) -> tuple[nn.Module, ParallelStep]:
    """Applies every configured parallelism to ``model`` in place; returns it and the
    ``ParallelStep`` that does the step's layout work (trainer/parallel/step.py), which hashes
    the batches with ``engram_hasher`` (required when ``model`` has Engram layers).

    Takes the config sections it reads, as torchtitan does; of ``training`` it reads ``compile``,
    ``mixed_precision_param`` and (pipelined) the batch shape. Meshes are built here if the
    caller has not built them yet.
    """
    dims = parallel_dims
    if dims.world_size > 1:
        dims.build_meshes(device_type)
    specs = None
    if dims.pp_enabled:  # PP first: every later step sees only this rank's stages
        specs = local_stage_specs(dims, model.args.n_layers, model.args.mtp_depth)
        split_model(model, specs)
        if engram_hasher is not None:  # this rank hashes for its own Engram layers only
            engram_hasher = engram_hasher.select(model.engram_layer_ids)
    if quantize.float8:
        # Model converters come first, so every parallelism wraps the converted modules.
        from trainer.quantize import check_float8_support, convert_to_float8

        check_float8_support(quantize, device_type, dims.tp_enabled)
        convert_to_float8(model, quantize)
    if dims.tp_enabled:
        apply_tensor_parallel(model, dims.mesh("tp"))

    if dims.ep_enabled:
        apply_expert_parallel(model, dims.mesh("ep"))

    context_parallel = None
    if dims.context_enabled:
        context_parallel = apply_context_parallel(model, dims.mesh("context"))

    apply_activation_checkpointing(model, activation_checkpoint.mode, activation_checkpoint.selective_every)

    if training.compile:
        from trainer.parallel.compile import apply_compile

        apply_compile(model)

    if dims.engram_enabled:
        replicate = dims.mesh_or_none(dims.engram_replicate_mesh_name)
        apply_engram_parallel(model, dims.mesh(dims.engram_mesh_name), engram.precompute, replicate)
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
                param_dtype=DTYPES[training.mixed_precision_param],
                reduce_dtype=torch.float32,
                reshard_after_forward=parallelism.fsdp_reshard_after_forward,
                root_runs_forward=specs is None,
            )
    one_process_fsdp = (
        dims.world_size == 1 and training.mixed_precision_param == "bfloat16" and training.one_process_cast == "fsdp"
    )
    if one_process_fsdp:
        # One process, bf16: FSDP2 on a one-rank mesh casts each weight to bf16 once per step
        # (kept from forward to backward), where autocast alone casts fp32 weights at every use.
        # Master weights, gradients and optimizer state stay fp32. Engram tables stay plain
        # fp32: a lookup reads a few rows, casting the whole table would cost more.
        apply_fsdp(
            model,
            one_process_mesh(device_type),
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            reshard_after_forward="never",
            ignored_params=set(engram_table_params(model)),
        )
    if specs is not None:
        param_dtype = DTYPES[training.mixed_precision_param] if dims.data_parallel_enabled else None
        activation = activation_meta(training, dims, model.args.dim, param_dtype)
        step = PipelineStep(
            model, dims, specs, activation, context_parallel=context_parallel, engram_hasher=engram_hasher
        )
    else:
        step = ParallelStep(
            model, dims, context_parallel, keep_weights_between_microbatches=one_process_fsdp,
            engram_hasher=engram_hasher,
        )
    return model, step


def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocates the parallelized (meta) model on ``device`` and draws its initial weights,
    the same in every layout (keyed by the seed and each parameter's global name)."""
    model.to_empty(device=device)
    init_model_weights(model, seed)
    # The global generator is seeded again for whatever draws from it later.
    torch.manual_seed(seed)


def build_loss_function(
    parallel_dims: ParallelDims, compile: bool
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The summed cross-entropy, compiled under ``training.compile`` (its blocks were compiled
    by ``parallelize_model``); not under TP, whose logits are vocab-sharded DTensors."""
    if compile and not parallel_dims.tp_enabled:
        return compiled_cross_entropy_sum()
    return cross_entropy_sum
