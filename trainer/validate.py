"""Validation loss on the held-out split.

`scores` gives the run's validation figures: ``val_loss``, and with ``ema.validate`` also
``val_loss_ema``, the same batches scored with the parameter EMA's weights swapped in
(`trainer.optim.ema.ParameterEMA.swapped_in`; the training weights come back bit for bit).

Every validation pass rebuilds the loader from the start of the split, so each pass
scores exactly the same batches and the values are comparable across steps. The loader reads
global batches (trainer/data/datasets.py), so every layout scores the same held-out windows, and
the loss is the sum of their token losses over the sum of their tokens, across all ranks. A
mixture (``training.dataset_mix``) is validated source by source (``MixtureValidator``).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Callable

import torch
from torch import nn

from trainer.config import ConfigError
from trainer.optim.ema import ParameterEMA
from trainer.parallel import ParallelStep


class Validator:
    def __init__(
        self,
        model: nn.Module,
        step: ParallelStep,
        autocast: Callable[[], contextlib.AbstractContextManager],
        build_loader: Callable[[], object],
        max_batches: int,
        device: torch.device,
        ema: ParameterEMA | None = None,
    ):
        """Scores ``model`` (the run's, as ``parallelize_model`` laid it out) through its step
        object: ``step.eval_loss_sum(inputs, labels, autocast)`` runs one micro-batch in the run's
        layout (context split, loss parallel, pipeline schedule) and returns this rank's summed
        next-token cross-entropy and its number of valid targets; ``step.step_sum`` sums them
        over the ranks. ``build_loader()`` gives this rank's finite loader of the split, whose
        ``accum_steps`` micro-batches make one global batch; a pass scores the first
        ``max_batches`` global batches. Every rank walks the same global stream, so all of them
        run the same number of micro-batches. ``ema``: also score its averaged weights (`scores`)."""
        self.model = model
        self.step = step
        self.autocast = autocast
        self.build_loader = build_loader
        self.max_batches = max_batches
        self.device = device
        self.ema = ema

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean next-token cross-entropy over the first ``max_batches`` global batches (MTP excluded)."""
        model = self.model
        was_training = model.training
        model.eval()
        # [loss sum, token count], accumulated on the device and read once at the end.
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        try:
            loader = self.build_loader()
            for inputs, labels in itertools.islice(loader, self.max_batches * loader.accum_steps):
                batch_sum, batch_tokens = self.step.eval_loss_sum(
                    inputs.to(self.device), labels.to(self.device), self.autocast
                )
                totals += torch.stack([batch_sum.double(), batch_tokens.double()])
        finally:
            model.train(was_training)
        loss_sum, n_tokens = self.step.step_sum(totals).tolist()
        if n_tokens == 0:
            raise ConfigError(
                "the validation split produced no batch: it is smaller than one global batch of "
                "global_batch_size x (seq_len + 1) tokens; use a smaller training.global_batch_size or "
                "training.seq_len, more validation data, or disable validation with --no-validation.enable"
            )
        return loss_sum / n_tokens

    def record(self) -> dict[str, float]:
        """The metrics of one validation pass: ``val_loss``, and ``val_loss_ema`` with the averaged
        weights when there is an ``ema``."""
        scores = {"val_loss": self.evaluate()}
        if self.ema is not None:
            with self.ema.swapped_in():
                scores["val_loss_ema"] = self.evaluate()
        return scores


class MixtureValidator:
    """Validation of a mixture: each source's held-out split scored by its own ``Validator``
    (``val_loss/<name>``), and ``val_loss`` their mean weighted as the mixture draws the sources,
    the expected loss of a window of the mixture."""

    def __init__(self, validators: dict[str, tuple[float, Validator]]):
        self.validators = validators

    def record(self) -> dict[str, float]:
        records = {name: validator.record() for name, (_, validator) in self.validators.items()}
        total_weight = sum(weight for weight, _ in self.validators.values())
        out = {}
        for key in next(iter(records.values())):  # val_loss, and val_loss_ema with an EMA
            out[key] = sum(weight * records[name][key] for name, (weight, _) in self.validators.items()) / total_weight
            out.update({f"{key}/{name}": record[key] for name, record in records.items()})
        return out
