"""Aux-loss-free load balancing (DeepSeek-V3 report, section 2.1.2)."""

from collections.abc import Callable, Iterable

import torch
from torch import nn

from models.moe.moe import MoE


def moe_modules(model: nn.Module) -> list[MoE]:
    """All MoE blocks of `model`, in module (layer) order."""
    return [module for module in model.modules() if isinstance(module, MoE)]


@torch.no_grad()
def update_expert_bias(
    moe_modules: Iterable[MoE],
    reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Nudges every expert bias toward uniform load and resets the token counts.

    Call once per optimizer step, before the step. For each MoE with an `expert_bias`:
    `bias += load_balance_coeff * sign(mean(count) - count)`, in place so the buffer's
    identity is kept. Counts of every MoE are zeroed (also those without a bias, whose counts
    only feed the statistics).

    Args:
        moe_modules: the MoE blocks, e.g. `moe_modules(model)`.
        reduce_counts: maps the concatenated counts of all layers ([sum of E] fp32) to their
            global values; parallel training passes an all-reduce over the data and context
            ranks. Called exactly once per update, so one collective serves all layers.

    Returns:
        Load imbalance (max count / mean count, 1.0 = uniform) before the reset:
        `moe/load_imbalance/layer_{i}` (i = position in `moe_modules`),
        `moe/load_imbalance/max` and `moe/load_imbalance/mean` over layers.
        Empty when there are no MoE blocks.
    """
    return load_imbalance_stats(apply_expert_bias_update(moe_modules, reduce_counts))


@torch.no_grad()
def apply_expert_bias_update(
    moe_modules: Iterable[MoE],
    reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """`update_expert_bias` without reading anything back to the host: returns the per-layer
    load imbalance as a device tensor (None without MoE blocks), for `load_imbalance_stats`
    to read only when it is logged."""
    modules = list(moe_modules)
    if not modules:
        return None
    counts = torch.cat([m.tokens_per_expert for m in modules])
    if reduce_counts is not None:
        counts = reduce_counts(counts)
    per_layer = counts.split([m.tokens_per_expert.numel() for m in modules])

    ratios = []
    for module, layer_counts in zip(modules, per_layer):
        mean = layer_counts.mean()
        if module.expert_bias is not None:
            module.expert_bias.add_(module.load_balance_coeff * torch.sign(mean - layer_counts))
        module.tokens_per_expert.zero_()
        # A layer that saw no tokens reports 0 rather than 0/0.
        ratios.append(layer_counts.max() / mean.clamp_min(torch.finfo(torch.float32).tiny))
    return torch.stack(ratios)


def load_imbalance_stats(ratios: torch.Tensor | None) -> dict[str, float]:
    """The statistics of `update_expert_bias` from `apply_expert_bias_update`'s ratios (one host read)."""
    if ratios is None:
        return {}
    values = torch.cat([ratios, ratios.max().view(1), ratios.mean().view(1)]).tolist()
    stats = {f"moe/load_imbalance/layer_{i}": v for i, v in enumerate(values[:-2])}
    stats["moe/load_imbalance/max"] = values[-2]
    stats["moe/load_imbalance/mean"] = values[-1]
    return stats


def reset_expert_counts(moe_modules: Iterable[MoE]) -> None:
    """Drop the token counts of a step whose update is skipped (a non-finite step)."""
    for module in moe_modules:
        module.tokens_per_expert.zero_()
