"""Warmup -> stable -> decay learning-rate schedule (WSD).

The schedule is a multiplier of the optimizer's base LR, applied through
``torch.optim.lr_scheduler.LambdaLR`` so it checkpoints like any torch scheduler.

Step convention: the multiplier for the k-th optimizer step (k = 1, 2, ...) is
``lr_factor(k)``. LambdaLR evaluates its lambda with ``last_epoch`` = 0 before the
first step, so the first step uses ``lr_factor(1)``: warmup never starts at an LR of
exactly zero, which would waste a step.
"""

from __future__ import annotations

import functools
import math

import torch


def lr_factor(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    decay_ratio: float | None,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """Multiplier of the base LR at optimizer step ``step`` (1-based)."""
    warmup_steps = min(warmup_steps, total_steps)
    if step <= warmup_steps:
        return step / (warmup_steps + 1)
    after_warmup = total_steps - warmup_steps
    # decay_ratio None means classic warmup+decay: the whole post-warmup phase decays.
    decay_steps = after_warmup if decay_ratio is None else round(total_steps * decay_ratio)
    decay_steps = min(decay_steps, after_warmup)
    decay_start = total_steps - decay_steps
    if step <= decay_start or decay_steps == 0:
        return 1.0
    # progress runs over (0, 1]: the last step reaches exactly min_lr_factor.
    progress = (step - decay_start) / decay_steps
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        raise ValueError(f"lr_scheduler.decay_type must be linear, cosine or sqrt, got {decay_type!r}")
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, lr_cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over :func:`lr_factor`; ``lr_cfg`` is the ``[lr_scheduler]`` section."""
    factor = functools.partial(
        lr_factor,
        total_steps=total_steps,
        warmup_steps=lr_cfg.warmup_steps,
        decay_ratio=lr_cfg.decay_ratio,
        decay_type=lr_cfg.decay_type,
        min_lr_factor=lr_cfg.min_lr_factor,
    )
    # LambdaLR calls the lambda with the number of steps already taken (0 first).
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda taken: factor(taken + 1))
