"""trainer/validate.py: the loss over exactly the scored tokens, and an empty split as a config error."""

import contextlib

import pytest
import torch
from torch import nn

from trainer.config import ConfigError
from trainer.validate import Validator


class _Loader(list):
    accum_steps = 2  # micro-batches per global batch


class _Step:
    """Stand-in for the run's step object: "loss" = sum of the inputs, one token per element."""

    def __init__(self, step_sum=lambda t: t):
        self.step_sum = step_sum
        self.autocasts = 0

    def eval_loss_sum(self, inputs, labels, autocast):
        with autocast():
            self.autocasts += 1
        return inputs.float().sum(), torch.tensor(inputs.numel())


def test_mean_over_the_first_global_batches_and_the_global_sum():
    batches = [(torch.full((2, 3), float(i)), torch.zeros(2, 3)) for i in range(6)]
    summed = []

    def global_sum(t):
        summed.append(t.clone())
        return t * 2  # as if a second rank had scored the same totals

    model, step = nn.Linear(1, 1), _Step(global_sum)
    validator = Validator(model, step, contextlib.nullcontext, lambda: _Loader(batches), 2, torch.device("cpu"))
    # 2 global batches x 2 micro-batches: batches 0..3, 6 tokens each.
    assert validator.evaluate() == pytest.approx((0 + 1 + 2 + 3) * 6 / 24)
    assert summed[0].tolist() == [36.0, 24.0] and model.training
    assert step.autocasts == 4  # every micro-batch under the run's autocast


def test_an_empty_split_is_a_config_error_naming_the_fix():
    validator = Validator(nn.Linear(1, 1), _Step(), contextlib.nullcontext, lambda: _Loader(), 2, torch.device("cpu"))
    with pytest.raises(ConfigError, match="global_batch_size"):
        validator.evaluate()
