"""Validation loss on the held-out split.

Every validation pass rebuilds the loader from the start of the split, so each pass
scores exactly the same batches and the values are comparable across steps.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class Validator:
    def __init__(
        self,
        build_loader: Callable[[], object],
        max_batches: int,
        device: torch.device,
        loss_sum: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, int]],
        all_reduce: Callable[[torch.Tensor, str], torch.Tensor] | None = None,
    ):
        """``loss_sum(inputs, labels)`` runs the model on one full batch and returns this
        rank's summed next-token cross-entropy and its number of valid targets (the trainer's
        ``eval_loss_sum``, which knows the parallel layout: context split, loss parallel).
        ``all_reduce(tensor, op)`` (op "sum" or "min") combines ranks in a parallel run:
        every rank then runs the same number of batches (the fewest any rank has, since the
        model's collectives need all of them) and returns the global mean."""
        self.build_loader = build_loader
        self.max_batches = max_batches
        self.device = device
        self.loss_sum = loss_sum
        self.all_reduce = all_reduce

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> float:
        """Mean next-token cross-entropy over the first ``max_batches`` batches (MTP excluded)."""
        was_training = model.training
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        n_tokens = 0
        try:
            batches = iter(self.build_loader())
            for _ in range(self.max_batches):
                batch = next(batches, None)
                if self.all_reduce is not None:
                    have = torch.tensor(float(batch is not None), device=self.device)
                    if self.all_reduce(have, "min").item() == 0:
                        break
                if batch is None:
                    break
                inputs, labels = batch
                batch_sum, batch_tokens = self.loss_sum(inputs.to(self.device), labels.to(self.device))
                loss_sum += batch_sum.double()
                n_tokens += batch_tokens
        finally:
            model.train(was_training)
        if self.all_reduce is not None:
            totals = self.all_reduce(torch.stack([loss_sum, loss_sum.new_tensor(n_tokens)]), "sum")
            loss_sum, n_tokens = totals[0], int(totals[1].item())
        if n_tokens == 0:
            raise RuntimeError(
                "the validation split produced no batch: it is smaller than one batch of "
                "local_batch_size x (seq_len + 1) tokens; lower [validation] steps' batch needs "
                "or disable validation with --no-validation.enable"
            )
        return float(loss_sum) / n_tokens
