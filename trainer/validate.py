"""Validation loss on the held-out split.

Every validation pass rebuilds the loader from the start of the split, so each pass
scores exactly the same batches and the values are comparable across steps. The loader reads
global batches (trainer/data/datasets.py), so every layout scores the same held-out windows, and
the loss is the sum of their token losses over the sum of their tokens, across all ranks.
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch
from torch import nn

from trainer.config import ConfigError


class Validator:
    def __init__(
        self,
        build_loader: Callable[[], object],
        max_batches: int,
        device: torch.device,
        loss_sum: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        global_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    ):
        """``build_loader()`` gives this rank's finite loader of the split, whose ``accum_steps``
        micro-batches make one global batch; a pass scores the first ``max_batches`` global
        batches. ``loss_sum(inputs, labels)`` runs the model on one micro-batch and returns this
        rank's summed next-token cross-entropy and its number of valid targets (the trainer's
        ``eval_loss_sum``, which knows the parallel layout: context split, loss parallel).
        ``global_sum(tensor)`` sums over the ranks of a parallel run in place. Every rank walks
        the same global stream, so all of them run the same number of micro-batches."""
        self.build_loader = build_loader
        self.max_batches = max_batches
        self.device = device
        self.loss_sum = loss_sum
        self.global_sum = global_sum

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> float:
        """Mean next-token cross-entropy over the first ``max_batches`` global batches (MTP excluded)."""
        was_training = model.training
        model.eval()
        # [loss sum, token count], accumulated on the device and read once at the end.
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        try:
            loader = self.build_loader()
            for inputs, labels in itertools.islice(loader, self.max_batches * loader.accum_steps):
                batch_sum, batch_tokens = self.loss_sum(inputs.to(self.device), labels.to(self.device))
                totals += torch.stack([batch_sum.double(), batch_tokens.double()])
        finally:
            model.train(was_training)
        loss_sum, n_tokens = self.global_sum(totals).tolist()
        if n_tokens == 0:
            raise ConfigError(
                "the validation split produced no batch: it is smaller than one global batch of "
                "global_batch_size x (seq_len + 1) tokens; use a smaller training.global_batch_size or "
                "training.seq_len, more validation data, or disable validation with --no-validation.enable"
            )
        return loss_sum / n_tokens
