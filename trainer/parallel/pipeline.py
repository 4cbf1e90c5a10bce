"""Pipeline parallelism on `torch.distributed.pipelining` (its `PipelineStage` and schedules;
nothing here schedules micro-batches itself).

A rank's share of the model is the single-device model with the blocks of other ranks' stages
deleted and `embed` / `norm` / `head` / `mtp` set to None where it holds none of its stages'
(`split_model`). The `layers` dict keeps the blocks' names, so parameter names, and with them DCP
checkpoints and the layout-invariant initial weights, are those of the whole model: a checkpoint
reshards across pp degrees. `parallelize_model` runs the usual `apply_*` chain on that share, on
the stage's own sub-meshes (every mesh but "world" and "pp" lies inside one stage).

Each local stage is a `StageModule`: a view over the rank's model that runs its pieces of
`DeepSeekV3Model.forward` (embedding, a run of blocks, head + MTP). Between stages flow the
residual stream and the running sum of the MoE balance losses, so the loss on the last stage
holds every stage's balance term and its gradient reaches every stage through the schedule.

MTP on the last stage embeds the labels: with a V schedule the last stage shares the first
stage's rank and its embedding; otherwise the last stage's rank holds a replica of the embedding
whose gradient is summed with the first stage's before the norm and the optimizer step, so both
copies take identical steps (Megatron's way). Engram blocks are looked up on whatever stage holds
them, with the ids the step hashed for that stage's blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    _Action,
    _add_send_recv,
    _ComputationType,
    get_schedule_class,
)

from models.deepseek_v3.model import ModelOutput
from trainer.config.pipeline_layout import V_SCHEDULES, ZERO_BUBBLE_SCHEDULES, StageSpec, rank_stages, split_stages
from trainer.loss import count_valid, cross_entropy_sum
from trainer.parallel.distributed import all_reduce_sum, local_tensor
from trainer.parallel.grad_norm import clip_coefficient
from trainer.parallel.parallel_dims import ParallelDims
from trainer.parallel.step import MicroBatch, ParallelStep


def local_stage_specs(dims: ParallelDims, n_layers: int, mtp_depth: int) -> list[StageSpec]:
    """The stages this rank runs (`rank_stages`)."""
    specs = split_stages(n_layers, mtp_depth, dims.pp_stages, dims.pp_layout)
    return rank_stages(specs, dims.pp_schedule, dims.pp, dims.mesh("pp").get_local_rank())


def split_model(model: nn.Module, specs: list[StageSpec]) -> None:
    """Keeps only what ``specs``' stages run (in place, before any parallelism)."""
    keep = {str(i) for spec in specs for i in spec.layers}
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    first, last = any(s.first for s in specs), any(s.last for s in specs)
    if not (first or (last and model.mtp is not None)):
        model.embed = None
    if not last:
        model.norm, model.head, model.mtp = None, None, None


class StageModule(nn.Module):
    """One stage's forward over the rank's (split) model, whose modules it shares.

    It registers only its own modules, so ``parameters()`` is what this stage computes with (what
    the zero-bubble schedules take weight gradients of); the rank's model stays the owner that the
    optimizer, checkpoints and FSDP see.

    Inputs: the first stage takes the tokens, the others ``(h, aux)`` from the previous stage;
    every stage gets the tokens (for the attention mask), the labels (MTP), the Engram ids of
    its blocks and, under context parallelism, the shard's global positions and attention mask
    as keyword arguments. Outputs: ``(h, aux)``, or on the last stage ``(logits, aux, *mtp_logits)``.
    """

    def __init__(self, model: nn.Module, spec: StageSpec):
        super().__init__()
        self.spec = spec
        self.blocks = nn.ModuleList(model.layers[str(i)] for i in spec.layers)
        if spec.first:
            self.embed = model.embed
        if spec.last:
            self.norm, self.head, self.mtp = model.norm, model.head, model.mtp
            if model.mtp is not None:
                self.mtp_embed = model.embed
        # The model's forward pieces, without registering the model (it holds other stages too).
        self._model = (model,)
        # The rank's Engram ids have a slot per Engram block of the rank; these are this stage's.
        rank_engram = list(model.engram_layer_ids)
        self.engram_slots = [rank_engram.index(i) for i in spec.layers if i in rank_engram]

    def forward(self, *acts, tokens, labels=None, engram_ids=None, positions=None, attn_mask=None):
        model = self._model[0]
        freqs_cis, attn_mask = model.rope_and_mask(tokens, positions, attn_mask)
        if self.spec.first:
            h, aux = model.embed(tokens), None
        else:
            h, aux = acts
        engram_ids = engram_ids[:, :, self.engram_slots] if self.engram_slots else None
        h, block_aux = model.forward_blocks(h, freqs_cis, attn_mask, tokens, engram_ids, self.blocks)
        aux = block_aux if aux is None else aux + block_aux
        if not self.spec.last:
            return h, aux
        logits, mtp_logits, mtp_aux = model.forward_head(h, labels, freqs_cis, attn_mask)
        return (logits, aux + mtp_aux, *mtp_logits)


class PipelineStep(ParallelStep):
    """`ParallelStep` whose forward and backward run a `torch.distributed.pipelining` schedule.

    Each accumulation micro-batch of the step is one schedule run over ``pp_microbatches`` chunks
    of its rows. The objective is the same sum-reduced one as without pipelining (the trainer's,
    with the global valid-token counts), computed by the schedule's loss function on the last
    stage, so torch's ``scale_grads`` stays off.
    """

    def __init__(
        self,
        model: nn.Module,
        dims: ParallelDims,
        specs: list[StageSpec],
        activation: tuple[tuple[int, ...], torch.dtype],
        **kwargs,
    ):
        super().__init__(model, dims, pp=dims.mesh("pp"), **kwargs)
        self.specs = specs
        self.pp_mesh = dims.mesh("pp")
        self.stage_modules = [StageModule(model, spec) for spec in specs]
        self.activation_shape, self.activation_dtype = activation
        self._schedules: dict[bool, object] = {}
        self._objective: Callable | None = None
        self._totals: list[torch.Tensor] = []
        self.embedding_group = self._embedding_replica_group()

    def _embedding_replica_group(self):
        """The group of this pipeline's first and last stage ranks when both hold the embedding
        (MTP without the V placement), else None. Every rank makes every pipeline's group
        (``new_group`` is collective), in the same order."""
        if self.model.args.mtp_depth == 0 or self.dims.pp_schedule in V_SCHEDULES:
            return None
        world = self.dims.mesh("world").mesh
        mine = None
        for first, last in zip(world[0].flatten().tolist(), world[-1].flatten().tolist()):
            group = dist.new_group([first, last])
            if dist.get_rank() in (first, last):
                mine = group
        return mine

    # ----------------------------------------------------------------- the schedule
    def schedule(self, device: torch.device, train: bool, kwargs: dict):
        """The schedule over this rank's stages, made at its first use (on the run's device)
        for inputs like ``kwargs``. Validation has its own: a stage's receive buffers are made
        once, and need gradients only for training."""
        if train not in self._schedules:
            d = self.dims
            shape, dtype = self.activation_shape, self.activation_dtype
            # requires_grad marks what gradients flow back through (torch reads it off the examples).
            h = torch.empty(shape, dtype=dtype, device="meta", requires_grad=train)
            aux = torch.empty((), dtype=torch.float32, device="meta", requires_grad=train)
            tokens = torch.empty(shape[:2], dtype=torch.long, device="meta")
            # The last stage's outputs go to the loss, never to another rank: only their count matters.
            logits = torch.empty((*shape[:2], self.model.args.vocab_size), device="meta")
            last_outputs = (logits, aux) + (logits,) * self.model.args.mtp_depth
            stages = [
                PipelineStage(
                    module, spec.index, d.pp_stages, device,
                    input_args=(tokens,) if spec.first else (h, aux),
                    output_args=last_outputs if spec.last else (h, aux),
                    group=self.pp_mesh.get_group(),
                )
                for spec, module in zip(self.specs, self.stage_modules)
            ]
            cls = get_schedule_class(d.pp_schedule)
            single = issubclass(cls, PipelineScheduleSingle)
            schedule = cls(
                stages[0] if single else stages, n_microbatches=d.pp_microbatches,
                loss_fn=self._stage_loss, kwargs_chunk_spec=_kwargs_chunk_spec(kwargs), scale_grads=False,
            )
            if not train and d.pp_schedule in ZERO_BUBBLE_SCHEDULES:
                _forward_only(schedule, d.pp_microbatches)
            self._schedules[train] = schedule
        return self._schedules[train]

    def _stage_loss(self, output: tuple, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss on the last stage: the trainer's objective while training (its
        loss and MTP terms are added to the step's totals); the summed cross-entropy in validation."""
        logits, aux, *mtp_logits = output
        if target.dim() == 3:  # context parallelism: the labels and the MTP targets, stacked (`_run`)
            target, *mtp_targets = target.unbind(1)
        else:
            mtp_targets = None
        if not self.model.training:
            loss_sum = self.value(cross_entropy_sum(logits, target))
            self._totals.append(torch.stack([loss_sum.double(), count_valid(target).double()]))
            return loss_sum
        # The objective reads only the micro-batch's labels (the schedule holds its inputs).
        objective, loss, mtp = self._objective(
            ModelOutput(logits, mtp_logits, aux), MicroBatch(target, target, mtp_labels=mtp_targets)
        )
        self._totals.append(torch.stack([self.value(loss.detach()), self.value(mtp.detach())]))
        return objective

    def _run(self, mb: MicroBatch, train: bool) -> list[torch.Tensor]:
        kwargs = {"tokens": mb.inputs, **{k: v for k, v in mb.model_kwargs.items() if v is not None}}
        target = mb.labels
        if train:
            kwargs["labels"] = mb.labels
            if mb.mtp_labels is not None:
                # The schedule cuts one target tensor by rows; the MTP targets of a context shard
                # were shifted on the whole sequence, so they travel with the labels.
                target = torch.stack([mb.labels, *mb.mtp_labels], dim=1)
        schedule = self.schedule(mb.inputs.device, train, kwargs)
        self._totals = []
        args = (mb.inputs,) if any(s.first for s in self.specs) else ()
        run = schedule.step if train else schedule.eval
        # The last stage's outputs stay unmerged: the loss function has taken what it needs.
        run(*args, target=target, return_outputs=False, **kwargs)
        totals, self._totals = self._totals, []
        return totals

    def forward_backward(self, micro, objective, autocast):
        """One schedule run per micro-batch; the objective is computed by `_stage_loss`."""
        self._objective = lambda out, mb: objective(out, mb, self.aux_scale(len(micro)))
        totals = torch.zeros(2, device=micro[0].labels.device)
        for mb in micro:
            with autocast():
                for t in self._run(mb, train=True):
                    totals += t
        return totals.unbind()

    def aux_scale(self, n_micro: int) -> float:
        return 1.0 / (n_micro * self.dims.pp_microbatches * self.loss_degree)

    def eval_loss_sum(self, inputs, labels, autocast):
        """The last stage's sums (zeros elsewhere: `step_sum` adds the pipeline up)."""
        mb = self.prepare_batch(inputs, labels)
        with autocast(), self.loss_context():
            totals = self._run(mb, train=False)
        total = torch.stack(totals).sum(0) if totals else torch.zeros(2, dtype=torch.float64, device=labels.device)
        return total[0], total[1]

    def per_stage(self, name: str, value: float) -> dict[str, float]:
        """Every pipeline rank's figure (``{name}_pp{r}``) and the largest as ``name``: stages
        differ (the last holds the head and the logits). A collective and a host read: for
        logging steps."""
        device = local_tensor(next(self.model.parameters())).device
        values = torch.zeros(self.dims.pp, dtype=torch.float64, device=device)
        values[self.pp_mesh.get_local_rank()] = value
        values = all_reduce_sum(values, self.pp_mesh).tolist()
        return {name: max(values), **{f"{name}_pp{r}": v for r, v in enumerate(values)}}

    # ----------------------------------------------------------------- after backward
    def step_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Step values live on the last stage: summed over the data ranks, then the pipeline."""
        return all_reduce_sum(super().step_sum(tensor), self.pp_mesh)

    def finish_grads(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """The embedding replica's gradient summed with the first stage's, then the usual
        finishing and clip, with the norm summed over the pipeline (each parameter once: the
        replica is left to the first stage and clipped with the same coefficient)."""
        if self.embedding_group is None:
            return super().finish_grads(params, max_norm)
        embed = self.model.embed.weight
        dist.all_reduce(local_tensor(embed.grad), group=self.embedding_group)
        if any(s.first for s in self.specs):
            return super().finish_grads(params, max_norm)
        norm = super().finish_grads([p for p in params if p is not embed], max_norm)
        if max_norm > 0:
            local_tensor(embed.grad).mul_(clip_coefficient(norm, max_norm))
        return norm


def _kwargs_chunk_spec(kwargs: dict) -> dict:
    """How the schedule cuts each keyword input into micro-batches: by rows, except what every
    sequence shares, which each micro-batch gets whole: a context shard's positions (one per
    token of the shard) and an attention mask broadcast over the batch (torch cuts a BlockMask
    with one row that way itself). torch has no public spec for an input every micro-batch gets
    whole: `_Replicate` is private, passed as the class, which old and new torch versions accept."""
    spec = {name: TensorChunkSpec(0) for name in kwargs}
    if "positions" in kwargs:
        spec["positions"] = _Replicate
    mask = kwargs.get("attn_mask")
    if isinstance(mask, torch.Tensor) and mask.shape[0] == 1:
        spec["attn_mask"] = _Replicate
    return spec


def _forward_only(schedule, n_microbatches: int) -> None:
    """Gives a zero-bubble schedule a forward-only order for validation: torch's runtime runs
    their backward actions even in ``eval()``. Each rank runs its stages in index order, every
    micro-batch of one before the next (a breadth-first order, so no rank waits on itself),
    lowered to sends and receives by torch's own pass (private API, as of torch 2.13; its
    public loader validates that every micro-batch has a backward)."""
    ranks = schedule.stage_index_to_group_rank
    order = {
        rank: [
            _Action(stage, _ComputationType.FORWARD, mb)
            for stage in sorted(s for s, r in ranks.items() if r == rank)
            for mb in range(n_microbatches)
        ]
        for rank in set(ranks.values())
    }
    schedule.pipeline_order_with_comms = _add_send_recv(
        order, stage_to_rank=lambda s: ranks[s], num_stages=len(ranks)
    )


def activation_meta(
    training, dims: ParallelDims, dim: int, param_dtype: torch.dtype | None
) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of the residual stream between stages: one pipeline micro-batch's rows,
    the sequence as this rank holds it (split by context and, sequence-parallel, by tensor
    parallelism), in the dtype the blocks compute in (FSDP's param dtype, else fp32)."""
    rows = training.local_batch_size // dims.pp_microbatches
    seq = training.seq_len // dims.context_degree // dims.tp
    return (rows, seq, dim), param_dtype or torch.float32

