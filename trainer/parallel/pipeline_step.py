"""`PipelineStep`: a step whose forward and backward run a `torch.distributed.pipelining`
schedule over this rank's stages (trainer/parallel/pipeline.py); nothing here schedules
micro-batches itself.

Data reaches the schedule through its arguments. Each run gets the rows of one accumulation
micro-batch (cut into ``pp_microbatches`` chunks by torch, every keyword input by rows), the
targets, and ``loss_kwargs``: the step's objective, its balance-loss scale and a `LossTerms`
recorder of that run, which the training loss function fills with each chunk's next-token and
MTP terms. Validation has its own loss function, whose per-chunk sums come back through the
schedule's ``losses``.

Zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) split each backward into
an input pass and a weight pass. With FSDP, torch defers every stage's gradient reduction to one
``REDUCE_GRAD`` action after the stage's last backward; that is correct only when the stage module
is itself an FSDP module and none of its units reshards its parameters after forward
(docs/parallelism.md, "Zero-bubble schedules under FSDP"). `parallelize_stage` sets both up;
`check_zero_bubble_stages` refuses a stage that breaks either before the first step. The weight
pass is torch's, run so that a checkpointed block is recomputed once for it
(trainer/parallel/weight_pass.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import (
    BACKWARD_WEIGHT,
    _Action,
    _add_send_recv,
    _add_unshard_reshard,
    _ComputationType,
)

from models.deepseek_v3.model import ModelOutput
from trainer.distributed import all_reduce_sum, local_tensor
from trainer.loss import count_valid, cross_entropy_sum
from trainer.parallel.fsdp import reshards_after_forward
from trainer.parallel.grad_norm import clip_coefficient
from trainer.parallel.parallel_dims import ParallelDims
from trainer.parallel.pipeline import StageModule
from trainer.parallel.step import MicroBatch, ParallelStep, Targets
from trainer.parallel.tensor_parallel import replicated_value
from trainer.parallel.weight_pass import WeightPassRuntime

if TYPE_CHECKING:
    from trainer.parallel.pipeline_overlap import OverlapRuntime


@dataclass
class LossTerms:
    """One schedule run's next-token and MTP loss terms, one entry per chunk, filled on the
    rank holding the last stage (empty elsewhere)."""

    loss: list[torch.Tensor] = field(default_factory=list)
    mtp: list[torch.Tensor] = field(default_factory=list)

    def add(self, loss: torch.Tensor, mtp: torch.Tensor) -> None:
        self.loss.append(loss.detach())
        self.mtp.append(mtp.detach())

    def sums(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        zero = torch.zeros((), device=device)
        return sum(self.loss, zero), sum(self.mtp, zero)


def _train_loss(output: tuple, target: torch.Tensor, *, objective: Callable, aux_scale: float, terms: LossTerms):
    """The trainer's objective on the last stage's outputs for one chunk. Under context
    parallelism ``target`` stacks the labels and the MTP targets (`_targets`)."""
    logits, aux, *mtp_logits = output
    if target.dim() == 3:
        labels, *mtp_labels = target.unbind(1)
        targets = Targets(labels, mtp_labels)
    else:
        targets = Targets(target)
    total, loss, mtp = objective(ModelOutput(logits, mtp_logits, aux), targets, aux_scale)
    terms.add(replicated_value(loss), replicated_value(mtp))
    return total


def _eval_loss(output: tuple, target: torch.Tensor) -> torch.Tensor:
    """The summed next-token cross-entropy of one chunk (validation; MTP does not run)."""
    return replicated_value(cross_entropy_sum(output[0], target))


class PipelineStep(ParallelStep):
    """`ParallelStep` whose forward and backward run a `torch.distributed.pipelining` schedule.

    Each accumulation micro-batch of the step is one schedule run over ``pp_microbatches`` chunks
    of its rows. The objective is the same sum-reduced one as without pipelining (the trainer's,
    with the global valid-token counts), computed by the schedule's loss function on the last
    stage, so torch's ``scale_grads`` stays off. With ``moe_overlap`` (DualPipeV) the training
    schedule runs its ``OVERLAP_F_B`` actions MoE node by MoE node (trainer/parallel/pipeline_overlap.py).
    """

    def __init__(
        self,
        model: nn.Module,
        dims: ParallelDims,
        stages: list[StageModule],
        activation: tuple[tuple[int, ...], torch.dtype],
        moe_overlap: bool = False,
        **kwargs,
    ):
        super().__init__(model, dims, pp=dims.mesh("pp"), **kwargs)
        self.moe_overlap = moe_overlap
        self.overlap: OverlapRuntime | None = None
        self.stages = stages
        self.pp_mesh = dims.mesh("pp")
        self.activation_shape, self.activation_dtype = activation
        self.holds_first = any(s.spec.first for s in stages)
        self.holds_last = any(s.spec.last for s in stages)
        self._schedules: dict[bool, object] = {}
        self.embedding_group = self._embedding_replica_group()

    def _embedding_replica_group(self):
        """The group of this pipeline's first and last stage ranks when both hold the embedding
        (MTP without the V placement), else None. Every rank makes every pipeline's group
        (``new_group`` is collective), in the same order."""
        if self.model.args.mtp_depth == 0 or self.dims.pipeline.v_shaped:
            return None
        world = self.dims.mesh("world").mesh
        mine = None
        for first, last in zip(world[0].flatten().tolist(), world[-1].flatten().tolist()):
            group = dist.new_group([first, last])
            if dist.get_rank() in (first, last):
                mine = group
        return mine

    # ----------------------------------------------------------------- the schedule
    def schedule(self, device: torch.device, train: bool):
        """The schedule over this rank's stages, made at its first use (on the run's device).
        Validation has its own: a stage's receive buffers are made once, and need gradients only
        for training."""
        if train not in self._schedules:
            plan = self.dims.pipeline
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
                    module, module.spec.index, plan.n_stages, device,
                    input_args=(tokens,) if module.spec.first else (h, aux),
                    output_args=last_outputs if module.spec.last else (h, aux),
                    group=self.pp_mesh.get_group(),
                )
                for module in self.stages
            ]
            cls = getattr(torch_schedules, plan.facts.torch_class)
            single = plan.facts.family == "single"
            schedule = cls(
                stages[0] if single else stages, n_microbatches=plan.pp_microbatches,
                loss_fn=_train_loss if train else _eval_loss, scale_grads=False,
            )
            if train and plan.zero_bubble and plan.pp_max_deferred_weight_passes >= 0:
                cap_deferred_weight_passes(schedule.pipeline_order_with_comms, plan.pp_max_deferred_weight_passes)
            if not single and isinstance(self.stages[0], FSDPModule):
                check_shared_params_reduced_last(
                    schedule.pipeline_order_with_comms[schedule.rank], self.stages, plan.pp_schedule
                )
            if not train and plan.zero_bubble:
                _forward_only(schedule, plan.pp_microbatches)
            if train and self.moe_overlap:
                # Imported here: it leans on the pipelining runtime's private names (checked on
                # torch 2.13), which no other pipelined run should depend on.
                from trainer.parallel.pipeline_overlap import OverlapRuntime

                self.overlap = OverlapRuntime(schedule, self.stages)
            elif train and plan.zero_bubble:
                WeightPassRuntime(schedule)
            self._schedules[train] = schedule
        return self._schedules[train]

    def _run(self, mb: MicroBatch, train: bool, loss_kwargs: dict | None = None) -> list[torch.Tensor]:
        """One schedule run over ``mb``'s rows; returns the last stage's per-chunk losses (empty on
        other ranks)."""
        rows = mb.inputs.shape[0]
        kwargs = {"tokens": mb.inputs}
        for name, value in mb.model_kwargs.items():
            if value is None:
                continue
            # torch cuts every keyword tensor by rows: what all rows share gets a row each (views).
            if name == "positions":  # [S] -> [rows, S]
                value = value.expand(rows, -1)
            elif name == "attn_mask" and isinstance(value, torch.Tensor) and value.shape[0] == 1:
                value = value.expand(rows, *value.shape[1:])  # broadcast over the batch
            kwargs[name] = value
        target = mb.labels
        if train:
            kwargs["labels"] = mb.labels
            if mb.targets.mtp_labels is not None:
                # torch cuts one target tensor by rows; the MTP targets of a context shard were
                # shifted on the whole sequence, so they travel with the labels.
                target = torch.stack([mb.labels, *mb.targets.mtp_labels], dim=1)
        schedule = self.schedule(mb.inputs.device, train)
        args = (mb.inputs,) if self.holds_first else ()
        losses: list[torch.Tensor] = []
        _run_schedule(schedule, train, args, kwargs, target, losses, loss_kwargs or {})
        return losses

    def forward_backward(self, micro, objective, autocast):
        """One schedule run per micro-batch; its objective is computed by the schedule's loss."""
        device = micro[0].labels.device
        loss_total, mtp_total = torch.zeros((), device=device), torch.zeros((), device=device)
        aux_scale = self.aux_scale(len(micro))
        for mb in micro:
            terms = LossTerms()
            with autocast():
                self._run(mb, train=True, loss_kwargs={"objective": objective, "aux_scale": aux_scale, "terms": terms})
            loss, mtp = terms.sums(device)
            loss_total += loss
            mtp_total += mtp
        return loss_total, mtp_total

    def aux_scale(self, n_micro: int) -> float:
        return 1.0 / (n_micro * self.dims.pipeline.pp_microbatches * self.loss_degree)

    def eval_loss_sum(self, inputs, labels, autocast):
        """The last stage's sums (zeros elsewhere: `step_sum` adds the pipeline up)."""
        mb = self.prepare_batch(inputs, labels)
        with autocast(), self.loss_context():
            losses = self._run(mb, train=False)
        zero = torch.zeros((), dtype=torch.float64, device=labels.device)
        if not self.holds_last:
            return zero, zero
        return sum(loss.double() for loss in losses), count_valid(mb.labels).double()

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
        if self.holds_first:
            return super().finish_grads(params, max_norm)
        norm = super().finish_grads([p for p in params if p is not embed], max_norm)
        if max_norm > 0:
            local_tensor(embed.grad).mul_(clip_coefficient(norm, max_norm))
        return norm


def _run_schedule(schedule, train: bool, args: tuple, kwargs: dict, target, losses: list, loss_kwargs: dict) -> None:
    """``schedule.step`` (training) or ``eval`` with the run's loss keyword arguments bound to the
    schedule's loss function for the run; the last stage's outputs stay unmerged (the loss function
    has taken what it needs). Binding rather than ``step(loss_kwargs=...)``: torch 2.11's schedules
    call the loss with (output, target) only, 2.13's with no keywords when given none, so one path
    serves both (every caller of the loss, the overlap's runtime included, sees the bound function)."""
    run = schedule.step if train else schedule.eval
    base = schedule._loss_fn
    if loss_kwargs:
        schedule._loss_fn = functools.partial(base, **loss_kwargs)
    try:
        run(*args, target=target, losses=losses, return_outputs=False, **kwargs)
    finally:
        schedule._loss_fn = base


def cap_deferred_weight_passes(orders: dict[int, list[_Action]], cap: int) -> None:
    """Rewrites each rank's action order (in place) so that at most ``cap`` weight passes wait at
    any point: when an input pass would make ``cap`` + 1, the oldest waiting one becomes a full
    backward where its input pass stood and its weight pass goes. A waiting weight pass holds its
    micro-batch's gradient at every use of a weight (the ``grads`` torch's input pass keeps for
    it: about half a block's activations per block, with or without checkpointing), and DualPipeV
    ends rank r's step with r + 1 of them waiting (torch's step 8, ``W`` x (r + 1)): 16 on the 671B
    layout's pp rank 15, 49 GiB (docs/parallelism.md). Taking the oldest keeps every stage's
    weight gradients accumulating in micro-batch order (the queue is first in, first out), so the
    gradients are bitwise those of the schedule's own order (tests/distributed/test_pipeline_grads.py);
    the price is the input gradient sent later by a weight pass's time at those backwards."""
    for rank, order in orders.items():
        waiting: list[int] = []  # positions of input passes whose weight pass has not run
        taken: set[tuple[int, int]] = set()  # (stage, micro-batch) whose weight pass goes
        for i, action in enumerate(order):
            kind = action.computation_type
            if kind == _ComputationType.BACKWARD_INPUT:
                waiting.append(i)
                if len(waiting) > cap:
                    j = waiting.pop(0)
                    oldest = order[j]
                    order[j] = _Action(oldest.stage_index, _ComputationType.FULL_BACKWARD, oldest.microbatch_index)
                    taken.add((oldest.stage_index, oldest.microbatch_index))
            elif kind == BACKWARD_WEIGHT:
                key = (action.stage_index, action.microbatch_index)
                waiting = [j for j in waiting if (order[j].stage_index, order[j].microbatch_index) != key]
        orders[rank] = [
            a for a in order
            if not (a.computation_type == BACKWARD_WEIGHT and (a.stage_index, a.microbatch_index) in taken)
        ]


def check_zero_bubble_stages(stages: list[nn.Module], schedule: str) -> None:
    """Refuses stages that torch's zero-bubble runtime would give wrong or missing gradients:
    FSDP units in a stage that is not itself an FSDP module (its units would reduce their
    gradients at the input pass, before the weight pass), or a unit that reshards its parameters
    after forward (the weight pass then differentiates the sharded parameters, which the forward
    never used). tests/distributed/test_zero_bubble.py shows the second giving wrong gradients."""
    for stage in stages:
        units = [m for m in stage.modules() if isinstance(m, FSDPModule)]
        if units and not isinstance(stage, FSDPModule):
            raise ValueError(
                f"pipeline stage {stage.spec.index} holds FSDP units but is not an FSDP module itself: "
                f"{schedule} would reduce its gradients before the weight pass; fully_shard the stage module last"
            )
        resharding = [type(m).__name__ for m in units if reshards_after_forward(m)]
        if resharding:
            raise ValueError(
                f"pipeline stage {stage.spec.index} has FSDP units that reshard after forward ({', '.join(resharding)}): "
                f"{schedule}'s weight pass would miss their gradients; shard them with reshard_after_forward=False"
            )


def check_shared_params_reduced_last(order: list[_Action], stages: list[nn.Module], schedule: str) -> None:
    """A parameter two local FSDP stages use (the embedding under a V schedule with MTP) is
    reduced at its owning stage's ``REDUCE_GRAD`` (the first of them: `apply_fsdp`): refuses a
    rank's action ``order`` in which the other stage still computes after that."""
    flat = []
    for action in order:
        flat += action.sub_actions if action.sub_actions else [action]
    for i, owner in enumerate(stages):
        for other in stages[i + 1 :]:
            if not set(owner.parameters()) & set(other.parameters()):
                continue
            reduce = [j for j, a in enumerate(flat) if a.stage_index == owner.spec.index
                      and a.computation_type == _ComputationType.REDUCE_GRAD]
            uses = [j for j, a in enumerate(flat) if a.stage_index == other.spec.index]
            if reduce and uses and reduce[0] < uses[-1]:
                raise ValueError(
                    f"pipeline stage {other.spec.index} uses parameters of stage {owner.spec.index} after "
                    f"{schedule} reduced their gradients; use another parallelism.pp_schedule"
                )


def _forward_only(schedule, n_microbatches: int) -> None:
    """Gives a zero-bubble schedule a forward-only order for validation. torch has no public one:
    its runtime runs the backward actions even in ``eval()``, and between the two stages of a rank
    they fail ("can't steal_bwd_input if this stage doesn't have backward", torch 2.13). Each rank
    runs its stages in index order, every micro-batch of one before the next (a breadth-first
    order, so no rank waits on itself), lowered to FSDP unshards and to sends and receives by
    torch's own passes (private API, as of torch 2.13; its public loader validates that every
    micro-batch has a backward)."""
    ranks = schedule.stage_index_to_group_rank
    order = {
        rank: _add_unshard_reshard([
            _Action(stage, _ComputationType.FORWARD, mb)
            for stage in sorted(s for s, r in ranks.items() if r == rank)
            for mb in range(n_microbatches)
        ])
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
    rows = training.local_batch_size // dims.pipeline.pp_microbatches
    seq = training.seq_len // dims.context_degree // dims.tp
    return (rows, seq, dim), param_dtype or torch.float32
