"""DualPipeV's ``OVERLAP_F_B`` with the MoE all-to-all hidden (``[parallelism] moe_overlap`` under
``pp_schedule = "DualPipeV"``): the forward of one (stage, micro-batch) runs beside the full
backward of another, MoE node by MoE node, with the node code of the step without PP
(trainer/parallel/moe_overlap.py: ``NodeRun``, ``pair``, ``ExchangeLane``) over the stage's forward
plan (``StageModule.forward_plan``, trainer/parallel/pipeline.py).

torch's runtime runs an ``OVERLAP_F_B`` action's two halves one after the other unless a function
is registered for it (``register_custom_function``). The interleave needs both micro-batches in
node form (each node with detached inputs), and a backward in node form needs that micro-batch's
forward to have run in node form. DualPipeV's forward halves are mostly micro-batches whose
backward is *not* an ``OVERLAP_F_B``'s: with the fewest micro-batches (one per stage) no
micro-batch has both halves overlapped, so running in node form only the micro-batches whose
backward is overlapped would hide nothing. Hence every forward of a stage holding MoE blocks runs
in node form, and this module gives the runtime its own FORWARD, FULL_BACKWARD, BACKWARD_INPUT and
BACKWARD_WEIGHT as well (stages without MoE blocks take torch's path, redone here: the runtime
dispatches on the action type only; their weight pass is `WeightPassRuntime`'s, which recomputes a
checkpointed block once, trainer/parallel/pipeline_step.py). A node-form input pass computes the
stage's weight gradients too but keeps them aside; its weight pass adds them into ``.grad``, so
every parameter receives each micro-batch's gradient at the point of the schedule where torch's
weight pass adds it, in the same order (fp32 sums are order-sensitive: the overlap on and off agree
bit for bit, tests/distributed/test_moe_overlap.py).

Collective order: the ranks of one ep group hold the same stages (``ep`` borrows from
``dp_shard``, inside one pp rank) and run the same action list, so the pairs' exchanges keep the
step without PP's argument (one in flight at a time on the ep group, every action ends with none
in flight); the pipeline's sends and receives are on the pp group.

Private API: a custom function must redo the runtime's bookkeeping (torch 2.13's
``_PipelineScheduleRuntime._step_microbatches``, ``_perform_action``): the receive waits (none
between a rank's two adjacent V stages, which hand over with ``set_local_fwd_input`` /
``set_local_bwd_input``), the unshard assertion, the backward counter, the loss
(``_maybe_compute_loss`` / ``_maybe_get_loss``), the stage's ``fwd_cache`` (what SEND_F sends) and
``bwd_cache`` (what SEND_B sends). All of that coupling is in ``OverlapRuntime`` and the
`WeightPassRuntime` it extends.

FSDP: every unit of a stage is gathered by the schedule's UNSHARD and stays so until REDUCE_GRAD
(zero-bubble, trainer/parallel/pipeline_step.py); node-form gradients land in the gathered
parameters' ``.grad`` as FSDP's hooks would leave them; after each node-form backward this runs
what FSDP's end-of-backward callback does in a no-sync backward (it accumulates in the reduce
dtype under mixed precision), and REDUCE_GRAD reduces once per step, as without the overlap.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    ScheduleDualPipeV,
    _Action,
    _wait_batch_p2p,
)

from trainer.parallel.fsdp import ManualReduction, finish_backward, lazy_init
from trainer.parallel.moe_overlap import ExchangeLane, NodeRun, check_overlap_blocks, pair
from trainer.parallel.pipeline import StageModule
from trainer.parallel.weight_pass import WeightPassRuntime, weight_pass


class StageNodes(NodeRun):
    """One micro-batch through one pipeline stage's plan (``StageModule.forward_plan``): the head's
    outputs are the stage's, ``(h, aux)`` or on the last stage ``(logits, aux, *mtp_logits)``.

    ``acts``: the stage's received inputs ``(h, aux)`` (autograd leaves), or the first stage's
    tokens; ``kwargs``: the stage's keyword inputs for this micro-batch. Before ``backward_head``
    the caller sets ``loss`` (last stage) or ``output_grads``; after ``backward_pre``,
    ``input_grads`` are the received inputs' gradients."""

    def __init__(self, module: StageModule, acts: tuple, kwargs: dict, lane: ExchangeLane):
        # REDUCE_GRAD reduces, once per step.
        super().__init__(module.forward_plan(*acts, **kwargs), nullcontext, lane, ManualReduction(None))
        self.acts = acts

    def finish_forward(self, out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        self.out = out
        return out

    def finish_backward(self) -> None:
        # The received inputs' gradients, taken off them as torch's stage_backward does.
        self.input_grads = tuple(t.grad for t in self.acts)
        for t in self.acts:
            t.grad = None
        self.acts = None


class OverlapRuntime(WeightPassRuntime):
    """DualPipeV's runtime with ``OVERLAP_F_B`` interleaved (module doc), registered on ``schedule``
    (a ``ScheduleDualPipeV`` over ``modules``, this rank's stages).

    The step binds the loss keyword arguments to the schedule's loss function for the run
    (``pipeline_step._run_schedule``), so ``_maybe_compute_loss`` is called as torch 2.11 and 2.13
    both take it. The step always runs with ``return_outputs=False``, so the last stage keeps no
    output chunks here either.
    """

    def __init__(self, schedule, modules: list[StageModule]):
        if not isinstance(schedule, ScheduleDualPipeV):
            raise ValueError(f"moe_overlap with pp needs pp_schedule DualPipeV, got {type(schedule).__name__}")
        super().__init__(schedule)
        self.node_form = set()
        for module in modules:
            if any(block.moe_enabled for block in module.blocks):
                check_overlap_blocks(list(module.blocks))
                self.node_form.add(module.spec.index)
        self.lane = ExchangeLane()
        self.runs: dict[tuple[int, int], StageNodes] = {}  # node-form forwards awaiting their backward
        self.weight_grads: dict[tuple[int, int], list] = {}  # (param, grad) kept from an input pass
        for kind, fn in (
            (FORWARD, self.forward), (FULL_BACKWARD, self.full_backward), (BACKWARD_INPUT, self.backward_input),
            (OVERLAP_F_B, self.overlap),
        ):
            schedule.register_custom_function(kind, fn)

    # ------------------------------------------------------------------ the actions
    def forward(self, action: _Action, ctx) -> None:
        stage, mb = self._forward_start(action)
        if action.stage_index not in self.node_form:
            output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=False)
            self._forward_finish(stage, mb, output, ctx)
            return
        nodes = self._nodes(stage, mb, ctx)
        self._forward_finish(stage, mb, nodes.forward_alone(), ctx, nodes)

    def full_backward(self, action: _Action, ctx=None) -> None:
        self._backward(action, full=True)

    def backward_input(self, action: _Action, ctx=None) -> None:
        self._backward(action, full=False)

    def backward_weight(self, action: _Action, ctx=None) -> None:
        stage, mb = self.stages[action.stage_index], action.microbatch_index
        self.schedule._assert_unsharded(stage)
        last_backward = self._count_backward(stage)
        if action.stage_index not in self.node_form:
            weight_pass(stage, mb, last_backward)
            return
        with torch.no_grad():
            for p, grad in self.weight_grads.pop((action.stage_index, mb)):
                if grad is None:
                    continue
                if p.grad is None:
                    p.grad = grad
                else:
                    p.grad += grad
        self._node_backward_finish(stage)

    def overlap(self, action: _Action, ctx) -> None:
        """The forward half beside the backward half, MoE node by MoE node, where both stages hold
        MoE blocks; else the two halves one after the other, as torch runs them."""
        f_action, b_action = action.sub_actions
        if not {f_action.stage_index, b_action.stage_index} <= self.node_form:
            self.forward(f_action, ctx)
            self.full_backward(b_action, ctx)
            return
        f_stage, f_mb = self._forward_start(f_action)
        f_nodes = self._nodes(f_stage, f_mb, ctx)
        b_stage, b_mb = self._backward_start(b_action)
        self._count_backward(b_stage)
        b_nodes = self._backward_nodes(b_stage, b_mb)
        output = pair(b_nodes, f_nodes)
        self._forward_finish(f_stage, f_mb, output, ctx, f_nodes)
        self._node_backward_finish(b_stage)
        self._backward_finish(b_stage, b_mb, b_nodes)

    def _backward(self, action: _Action, full: bool) -> None:
        """A full backward, or an input pass (``full`` False) whose weight pass comes later."""
        stage, mb = self._backward_start(action)
        last_backward = self._count_backward(stage) if full else False
        if action.stage_index not in self.node_form:
            loss = self.schedule._maybe_get_loss(stage, mb)
            stage.backward_one_chunk(mb, loss=loss, full_backward=full, last_backward=last_backward)
            self._backward_finish(stage, mb)
            return
        nodes = self._backward_nodes(stage, mb)
        if full:
            nodes.backward_alone()
            self._node_backward_finish(stage)
        else:
            # The weight gradients computed now are set aside for the weight pass (module doc).
            params = list(stage.submod.parameters())
            kept = [p.grad for p in params]
            for p in params:
                p.grad = None
            nodes.backward_alone()
            self.weight_grads[(stage.stage_index, mb)] = [(p, p.grad) for p in params]
            for p, grad in zip(params, kept, strict=True):
                p.grad = grad
        self._backward_finish(stage, mb, nodes)

    # ------------------------------------------------------------------ the runtime's bookkeeping
    def _forward_start(self, action: _Action):
        """The unshard assertion and the wait for the stage's received inputs."""
        stage, mb = self.stages[action.stage_index], action.microbatch_index
        self.schedule._assert_unsharded(stage)
        if not stage.is_first and stage.stage_index - 1 not in self.stages:
            _wait_batch_p2p(self.schedule.fwd_recv_ops.pop((stage.stage_index, mb)))
        return stage, mb

    def _nodes(self, stage, mb: int, ctx) -> StageNodes:
        """The micro-batch's node-form run of ``stage`` (not started)."""
        lazy_init(stage.submod)  # the root's pre-forward hook never runs in node form
        acts = ctx.arg_mbs[mb] if stage.is_first else stage._retrieve_recv_activations(mb)
        return StageNodes(stage.submod, acts, ctx.kwarg_mbs[mb], self.lane)

    def _forward_finish(self, stage, mb: int, output, ctx, nodes: StageNodes | None = None) -> None:
        """The loss on the last stage, the outputs where SEND_F (or the next local stage) finds them."""
        if nodes is not None:
            # torch's forward_one_chunk caches (outputs, inputs); the inputs live in the nodes here.
            stage.fwd_cache[mb] = (tuple(output), [])
            self.runs[(stage.stage_index, mb)] = nodes
        self.schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
        if stage.stage_index + 1 in self.stages:
            self.stages[stage.stage_index + 1].set_local_fwd_input(output, mb)

    def _backward_start(self, action: _Action):
        stage, mb = self.stages[action.stage_index], action.microbatch_index
        self.schedule._assert_unsharded(stage)
        if not stage.is_last and stage.stage_index + 1 not in self.stages:
            _wait_batch_p2p(self.schedule.bwd_recv_ops.pop((stage.stage_index, mb)))
        return stage, mb

    def _backward_nodes(self, stage, mb: int) -> StageNodes:
        """The micro-batch's node-form run, given its loss or its outputs' gradients."""
        nodes = self.runs.pop((stage.stage_index, mb))
        stage.fwd_cache.pop(mb)
        _no_sync(stage.submod)
        if stage.is_last:
            nodes.loss = self.schedule._maybe_get_loss(stage, mb)
        else:
            nodes.output_grads = stage._retrieve_recv_grads(mb)
        return nodes

    def _backward_finish(self, stage, mb: int, nodes: StageNodes | None = None) -> None:
        """The input gradients where SEND_B (or the previous local stage) finds them."""
        if nodes is not None and not stage.is_first:
            stage.bwd_cache[mb] = nodes.input_grads
        if stage.stage_index - 1 in self.stages:
            self.stages[stage.stage_index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)

    def _node_backward_finish(self, stage) -> None:
        """FSDP's end of a no-sync backward (module doc), which its hooks run on torch's path."""
        finish_backward(stage.submod)


def _no_sync(module) -> None:
    """What torch's stage sets before every backward (``backward_maybe_with_nosync``): no reshard
    and no reduction until REDUCE_GRAD. FSDP's hooks still run in node form where a unit is called
    whole (the MTP block in the head), and its end-of-backward callback then runs over every unit."""
    if isinstance(module, FSDPModule):
        module.set_is_last_backward(False)
        module.set_reshard_after_backward(False)
        module.set_requires_gradient_sync(False)
