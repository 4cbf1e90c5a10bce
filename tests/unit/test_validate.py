"""trainer/validate.py: the loss over exactly the scored tokens, and an empty split as a config error."""

import pytest
import torch
from torch import nn

from trainer.config import ConfigError
from trainer.validate import Validator


class _Loader(list):
    accum_steps = 2  # micro-batches per global batch


def _loss_sum(inputs, labels):
    # Stand-in for Trainer.eval_loss_sum: "loss" = sum of the inputs, one token per element.
    return inputs.float().sum(), torch.tensor(inputs.numel())


def test_mean_over_the_first_global_batches_and_the_global_sum():
    batches = [(torch.full((2, 3), float(i)), torch.zeros(2, 3)) for i in range(6)]
    summed = []

    def global_sum(t):
        summed.append(t.clone())
        return t * 2  # as if a second rank had scored the same totals

    model = nn.Linear(1, 1)
    validator = Validator(lambda: _Loader(batches), 2, torch.device("cpu"), _loss_sum, global_sum)
    # 2 global batches x 2 micro-batches: batches 0..3, 6 tokens each.
    assert validator.evaluate(model) == pytest.approx((0 + 1 + 2 + 3) * 6 / 24)
    assert summed[0].tolist() == [36.0, 24.0] and model.training


def test_an_empty_split_is_a_config_error_naming_the_fix():
    validator = Validator(lambda: _Loader(), 2, torch.device("cpu"), _loss_sum)
    with pytest.raises(ConfigError, match="global_batch_size"):
        validator.evaluate(nn.Linear(1, 1))
