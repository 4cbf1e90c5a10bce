"""Validation loss on the held-out split.

Every validation pass rebuilds the loader from the start of the split, so each pass
scores exactly the same batches and the values are comparable across steps.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from trainer.loss import cross_entropy_sum, count_valid


class Validator:
    def __init__(
        self,
        build_loader: Callable[[], object],
        max_batches: int,
        device: torch.device,
        autocast: Callable[[], contextlib.AbstractContextManager],
    ):
        self.build_loader = build_loader
        self.max_batches = max_batches
        self.device = device
        self.autocast = autocast

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> float:
        """Mean next-token cross-entropy over the first ``max_batches`` batches (MTP excluded)."""
        was_training = model.training
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        n_tokens = 0
        try:
            for i, (inputs, labels) in enumerate(self.build_loader()):
                if i >= self.max_batches:
                    break
                inputs, labels = inputs.to(self.device), labels.to(self.device)
                with self.autocast():
                    logits = model(inputs).logits
                loss_sum += cross_entropy_sum(logits, labels).double()
                n_tokens += count_valid(labels)
        finally:
            model.train(was_training)
        if n_tokens == 0:
            raise RuntimeError(
                "the validation split produced no batch: it is smaller than one batch of "
                "local_batch_size x (seq_len + 1) tokens; lower [validation] steps' batch needs "
                "or disable validation with --no-validation.enable"
            )
        return float(loss_sum) / n_tokens
