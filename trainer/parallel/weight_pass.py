"""A zero-bubble schedule's weight pass (``BACKWARD_WEIGHT``), run so that a checkpointed block is
recomputed at most once for it. Its own module because both runtimes use it: the plain
pipeline step's (trainer/parallel/pipeline_step.py) and the overlapped DualPipeV one's
(trainer/parallel/pipeline_overlap.py), which extends `WeightPassRuntime`.
"""

from __future__ import annotations

from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import BACKWARD_WEIGHT, _Action
from torch.utils.checkpoint import GraphExecGroup


class WeightPassRuntime:
    """A zero-bubble schedule's ``BACKWARD_WEIGHT`` as torch runs it, but one weight pass
    (`weight_pass`), registered on ``schedule`` (``register_custom_function``: torch's runtime
    dispatches on the action type only). Private API: the runtime's bookkeeping of the action,
    redone here (torch 2.13's ``_PipelineScheduleRuntime._perform_action``): the unshard assertion
    (``_assert_unsharded``) and the backward counter (``backward_counter``, ``_n_microbatches``)
    that tells the step's last backward; the stages by index from ``_stages``."""

    def __init__(self, schedule):
        self.schedule = schedule
        self.stages = {stage.stage_index: stage for stage in schedule._stages}
        schedule.register_custom_function(BACKWARD_WEIGHT, self.backward_weight)

    def backward_weight(self, action: _Action, ctx=None) -> None:
        stage = self.stages[action.stage_index]
        self.schedule._assert_unsharded(stage)
        weight_pass(stage, action.microbatch_index, self._count_backward(stage))

    def _count_backward(self, stage) -> bool:
        """Counts a full or weight pass; whether it is the stage's last of the run."""
        self.schedule.backward_counter[stage.stage_index] += 1
        return self.schedule.backward_counter[stage.stage_index] == self.schedule._n_microbatches


def weight_pass(stage: PipelineStage, mb: int, last_backward: bool) -> None:
    """torch's weight pass of ``stage`` for micro-batch ``mb``, recomputing each checkpointed block
    at most once. torch's ``stage_backward_weight`` runs one ``autograd.grad`` per parameter group
    (a block has several), and non-reentrant checkpointing recomputes a block once per graph task,
    keeping what that call did not use until the stage's graph is freed at the pass's end: the
    block ran and was held once per group. Under one ``GraphExecGroup`` (public in
    ``torch.utils.checkpoint`` since pytorch#166536, October 2025, before torch 2.11) every call of
    the pass shares one recomputation. Its condition, that no two calls of the group use the same saved tensor, is
    torch's own: the calls free what they use (``retain_graph=False``). The calls and their inputs
    are torch's, so the gradients are too, bit for bit (tests/distributed/test_pipeline_grads.py)."""
    with GraphExecGroup():
        stage.backward_weight_one_chunk(mb, last_backward=last_backward)
