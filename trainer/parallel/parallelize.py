"""The one entry that turns the single-device model into the parallel one, in two levels.

`parallelize_model` splits the model into this rank's pipeline stages (`apply_pipeline`, when
pp > 1), runs the house order on what the rank holds (`parallelize_stage`, the same with or
without pipelining), and builds the step object (`build_step`). House order (`docs/architecture.md`),
all on the meta-device model:

    PP split -> float8 -> TP -> EP -> CP -> AC -> compile -> Engram tables -> FSDP2/HSDP
        (then to_empty + init)

Each step is an ``apply_*`` of its own file; this module only decides which apply and on which
mesh, and hands the step's layout work to a ``ParallelStep``. The other build-time work on the
parallelized model is here too: ``materialize`` (storage and initial weights) and
``build_loss_function``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from models.engram import NgramHasher, engram_table_params
from trainer.config import ActivationCheckpoint, Engram, Parallelism, Quantize, Training
from trainer.config.pipeline_layout import StageSpec
from trainer.loss import cross_entropy_sum
from trainer.parallel.activation_checkpoint import apply_activation_checkpointing
from trainer.parallel.compile import compiled_cross_entropy_sum
from trainer.parallel.context_parallel import ContextParallel, apply_context_parallel
from trainer.parallel.engram_parallel import (
    apply_engram_parallel,
    replicate_engram_tables,
    tables_hidden_from_fsdp,
)
from trainer.parallel.expert_parallel import apply_expert_parallel
from trainer.parallel.fsdp import apply_fsdp, one_process_mesh
from trainer.parallel.moe_overlap import MoEOverlapStep
from trainer.parallel.parallel_dims import ParallelDims
from trainer.parallel.pipeline import StageModule, apply_pipeline
from trainer.parallel.pipeline_step import PipelineStep, activation_meta, check_zero_bubble_stages
from trainer.parallel.step import ParallelStep
from trainer.parallel.tensor_parallel import apply_tensor_parallel
from trainer.parallel.weight_init import init_model_weights

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

logger = logging.getLogger("trainer")


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
    ``mixed_precision_param``, ``one_process_cast`` and (pipelined) the batch shape. Meshes are
    built here if the caller has not built them yet.
    """
    dims = parallel_dims
    if dims.world_size > 1:
        dims.build_meshes(device_type)
    specs = None
    if dims.pp_enabled:  # PP first: every later step sees only this rank's stages
        specs = apply_pipeline(model, dims, training.seq_len)
        if engram_hasher is not None:  # this rank hashes for its own Engram layers only
            engram_hasher = engram_hasher.select(model.engram_layer_ids)
    stage = parallelize_stage(
        model, dims, parallelism, training, activation_checkpoint, quantize, engram, device_type, specs
    )
    return model, build_step(model, dims, training, stage, engram_hasher, parallelism.moe_overlap)


@dataclass
class ParallelizedStage:
    """What `parallelize_stage` leaves for the step besides the model."""

    context_parallel: ContextParallel | None
    """The batch splitter under context parallelism."""
    stages: list[StageModule] | None
    """This rank's pipeline stages (None without pipeline parallelism)."""
    param_dtype: torch.dtype | None
    """The dtype FSDP gathers weights in (None: no FSDP, they compute as stored)."""
    one_process_cast: bool
    """FSDP only casts (a one-rank mesh): its weights may stay gathered across micro-batches."""


def parallelize_stage(
    model: nn.Module,
    dims: ParallelDims,
    parallelism: Parallelism,
    training: Training,
    activation_checkpoint: ActivationCheckpoint,
    quantize: Quantize,
    engram: Engram,
    device_type: str,
    specs: list[StageSpec] | None = None,
) -> ParallelizedStage:
    """The house order on ``model`` (the whole model, or this rank's share of a pipeline whose
    stages are ``specs``): float8 -> TP -> EP -> CP -> AC -> compile -> Engram tables -> FSDP.
    A new parallelism joins here, at its place in the order."""
    if quantize.float8:
        # Model converters come first, so every parallelism wraps the converted modules.
        from trainer.quantize import check_float8_support, convert_to_float8

        check_float8_support(quantize, device_type, dims.tp_enabled)
        convert_to_float8(model, quantize)
    if dims.tp_enabled:
        apply_tensor_parallel(model, dims.mesh("tp"))
    if dims.ep_enabled:
        apply_expert_parallel(model, dims.mesh("ep"))
    context_parallel = apply_context_parallel(model, dims.mesh("context")) if dims.context_enabled else None
    apply_activation_checkpointing(
        model, activation_checkpoint.mode, activation_checkpoint.selective_every, activation_checkpoint.recompute_modules
    )
    if training.compile:
        from trainer.parallel.compile import apply_compile

        apply_compile(model)
    if dims.engram_enabled:
        replicate = dims.mesh_or_none(dims.engram_replicate_mesh_name)
        apply_engram_parallel(model, dims.mesh(dims.engram_mesh_name), engram.precompute, replicate)
    elif dims.loss_enabled:  # embedding_parallel_degree 1: whole tables on every rank
        replicate_engram_tables(model, dims.mesh("loss"))
    # After every apply_* that replaces blocks (AC wraps them), before FSDP (which makes each the root).
    stages = [StageModule(model, spec) for spec in specs] if specs is not None else None

    # One process (or one rank per pipeline stage), bf16: FSDP2 on a one-rank mesh casts each
    # weight to bf16 once per step (kept from forward to backward), where autocast alone casts fp32
    # weights at every use. Master weights, gradients and optimizer state stay fp32.
    one_process_cast = (
        dims.world_size == dims.pp and training.mixed_precision_param == "bfloat16"
        and training.one_process_cast == "fsdp"
    )
    if not (dims.data_parallel_enabled or one_process_cast):
        return ParallelizedStage(context_parallel, stages, None, False)
    param_dtype = DTYPES[training.mixed_precision_param]
    reshard = "never" if one_process_cast else parallelism.fsdp_reshard_after_forward
    if stages is not None and dims.pipeline.zero_bubble and reshard != "never":
        logger.info(
            "pipeline %s: FSDP keeps every unit's parameters gathered from forward to the step's gradient "
            "reduction (reshard_after_forward=False, torch's split backward needs them), so both local "
            "stages hold unsharded %s parameters and fp32 gradient accumulators through the step (ZeRO-2-like)",
            dims.pipeline.pp_schedule, training.mixed_precision_param,
        )
        reshard = "never"
    if one_process_cast:
        dense_mesh = dims.mesh("fsdp") if dims.pp_enabled else one_process_mesh(device_type)
        expert_mesh = None
    else:
        dense_mesh = dims.mesh("hsdp") if dims.dp_replicate_enabled else dims.mesh("fsdp")
        expert_mesh = None
        if dims.ep_enabled:
            expert_mesh = dims.mesh("ehsdp") if dims.dp_replicate_enabled else dims.mesh("efsdp")
    # Engram tables stay out of FSDP: plain fp32 (a lookup reads a few rows, a cast of the whole
    # table would cost more), and a row-sharded table is no FSDP parameter at all.
    tables = set(engram_table_params(model))
    with tables_hidden_from_fsdp(model):
        apply_fsdp(
            model, dense_mesh, expert_mesh, param_dtype=param_dtype, reduce_dtype=torch.float32,
            reshard_after_forward=reshard, ignored_params=tables, stages=stages,
        )
    return ParallelizedStage(context_parallel, stages, param_dtype, one_process_cast)


def build_step(
    model: nn.Module,
    dims: ParallelDims,
    training: Training,
    stage: ParallelizedStage,
    engram_hasher: NgramHasher | None = None,
    moe_overlap: bool = False,
) -> ParallelStep:
    """The step object for the layout: a `PipelineStep` over the rank's stages, else a `ParallelStep`
    (a `MoEOverlapStep` under ``moe_overlap``: trainer/parallel/moe_overlap.py; with pipelining,
    DualPipeV's overlapped actions: trainer/parallel/pipeline_overlap.py)."""
    if stage.stages is None:
        step_class = MoEOverlapStep if moe_overlap else ParallelStep
        return step_class(
            model, dims, stage.context_parallel, keep_weights_between_microbatches=stage.one_process_cast,
            engram_hasher=engram_hasher,
        )
    if dims.pipeline.zero_bubble:
        check_zero_bubble_stages(stage.stages, dims.pipeline.pp_schedule)
    activation = activation_meta(training, dims, model.args.dim, stage.param_dtype)
    return PipelineStep(
        model, dims, stage.stages, activation, moe_overlap, context_parallel=stage.context_parallel,
        engram_hasher=engram_hasher,
    )


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
