"""Optimizer construction and the once-per-step MoE bias update hook."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from models.moe import moe_modules, update_expert_bias


def _implementation_kwargs(implementation: str, params: list[torch.Tensor]) -> dict:
    if implementation == "fused":
        return {"fused": True}
    if implementation == "foreach":
        return {"foreach": True}
    if implementation == "for-loop":
        return {"foreach": False}
    # auto: the fused kernels exist for CUDA and (since torch 2.4) CPU; meta or mixed
    # devices fall back to torch's own default choice.
    devices = {p.device.type for p in params}
    if len(devices) == 1 and devices <= {"cuda", "cpu"}:
        return {"fused": True}
    return {}


def build_optimizer(model: nn.Module, opt_cfg) -> torch.optim.Optimizer:
    """AdamW/Adam from the ``[optimizer]`` section.

    Matrices and embeddings decay; 1-D parameters (norm scales) do not, as in Megatron
    and nanoGPT: decaying a norm scale towards zero only fights the next layer.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": opt_cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kwargs = dict(
        lr=opt_cfg.lr,
        betas=(opt_cfg.beta1, opt_cfg.beta2),
        eps=opt_cfg.eps,
        **_implementation_kwargs(opt_cfg.implementation, decay + no_decay),
    )
    if opt_cfg.name == "AdamW":
        return torch.optim.AdamW(groups, **kwargs)
    if opt_cfg.name == "Adam":
        # Adam's weight_decay is L2 added to the gradient, not decoupled.
        return torch.optim.Adam(groups, **kwargs)
    raise ValueError(f"optimizer.name must be AdamW or Adam, got {opt_cfg.name!r}")


class ExpertBiasUpdater:
    """Runs the aux-loss-free bias update once per optimizer step.

    Registered as an optimizer step pre-hook so it fires exactly when the parameters
    change, regardless of how many micro-batches accumulated counts. ``reduce_counts``
    is where a parallel run sums the counts over data and context ranks.
    """

    def __init__(self, model: nn.Module, reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.modules = list(moe_modules(model))
        self.reduce_counts = reduce_counts
        self.last_stats: dict = {}

    def __call__(self, optimizer, args, kwargs) -> None:
        if self.modules:
            self.last_stats = update_expert_bias(self.modules, self.reduce_counts)

    def register(self, optimizer: torch.optim.Optimizer):
        return optimizer.register_step_pre_hook(self)
