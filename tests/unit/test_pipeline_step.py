"""The pipeline step's refusal of a schedule in which a stage computes with a parameter after the
stage owning it had its gradients reduced (trainer/parallel/pipeline_step.py)."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from trainer.config.pipeline_layout import StageSpec
from trainer.parallel.pipeline_step import check_shared_params_reduced_last

F, I, W, REDUCE = (_ComputationType.FORWARD, _ComputationType.BACKWARD_INPUT, _ComputationType.BACKWARD_WEIGHT,
                   _ComputationType.REDUCE_GRAD)


class _Stage(nn.Module):
    def __init__(self, index: int, *modules: nn.Module):
        super().__init__()
        self.spec = StageSpec(index, (index,), first=index == 0, last=index == 3)
        self.parts = nn.ModuleList(modules)


def _order(*actions: tuple[int, _ComputationType]) -> list[_Action]:
    return [_Action(stage, kind, None if kind == REDUCE else 0) for stage, kind in actions]


def test_a_shared_parameter_reduced_after_its_last_use_passes():
    embed = nn.Embedding(4, 2)
    stages = [_Stage(0, embed), _Stage(3, embed, nn.Linear(2, 2))]
    order = _order((0, F), (3, F), (3, I), (3, W), (3, REDUCE), (0, I), (0, W), (0, REDUCE))
    check_shared_params_reduced_last(order, stages, "DualPipeV")


def test_a_shared_parameter_used_after_its_reduction_is_refused():
    embed = nn.Embedding(4, 2)
    stages = [_Stage(0, embed), _Stage(3, embed, nn.Linear(2, 2))]
    order = _order((0, F), (3, F), (0, I), (0, W), (0, REDUCE), (3, I), (3, W), (3, REDUCE))
    with pytest.raises(ValueError, match="stage 3 uses parameters of stage 0 after DualPipeV reduced"):
        check_shared_params_reduced_last(order, stages, "DualPipeV")


def test_stages_that_share_nothing_may_run_in_any_order():
    stages = [_Stage(0, nn.Embedding(4, 2)), _Stage(3, nn.Linear(2, 2))]
    order = _order((0, F), (3, F), (0, I), (0, W), (0, REDUCE), (3, I), (3, W), (3, REDUCE))
    check_shared_params_reduced_last(order, stages, "DualPipeV")
