"""Losses normalised by a *global* token count.

Every micro-batch returns a sum divided by the number of valid target tokens of the
whole optimizer step (all micro-batches, all data-parallel ranks). Summing those over
micro-batches and ranks gives exactly the mean over the global batch, so gradient
accumulation and data parallelism train the same model as one big batch, even when
micro-batches hold different numbers of valid tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in fp32 over positions whose label != IGNORE_INDEX."""
    return F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def count_valid(labels: torch.Tensor) -> torch.Tensor:
    """Number of scored targets, as an int64 tensor on the labels' device (no host read)."""
    return (labels != IGNORE_INDEX).sum()
