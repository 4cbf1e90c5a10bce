"""trainer/validate.py: the loss over exactly the scored tokens, an empty split as a config error, and the
score of the parameter EMA's weights (`ema.validate`)."""

import contextlib

import pytest
import torch
from torch import nn

from trainer.config import ConfigError
from trainer.optim.ema import ParameterEMA
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


class _WeightStep(_Step):
    """Stand-in whose "loss" per token is the model's one weight."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def eval_loss_sum(self, inputs, labels, autocast):
        return self.model.weight.sum() * inputs.numel(), torch.tensor(inputs.numel())


def test_ema_scores_the_averaged_weights_and_gives_the_trained_ones_back():
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(2.0)
    ema = ParameterEMA(model, 0.75, 1)  # averages 2.0
    ema.before_forward(1)
    with torch.no_grad():
        model.weight.fill_(6.0)
    ema.after_optimizer(stepped=True)  # owes 0.75 * 2 + 0.25 * 6 = 3
    batches = [(torch.zeros(2, 3), torch.zeros(2, 3))] * 2
    validator = Validator(
        model, _WeightStep(model), contextlib.nullcontext, lambda: _Loader(batches), 1, torch.device("cpu"), ema
    )
    assert validator.record() == {"val_loss": 6.0, "val_loss_ema": 3.0}
    assert model.weight.item() == 6.0
