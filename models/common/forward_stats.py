"""Statistics a training forward records, and how to find them.

A module whose forward adds into tensors of its own (the MoE's routed-token counts, Engram's gate
sums, MLA's max logits) names them in a class attribute ``forward_statistics``. They are read and
reset once per step by the trainer's hooks, and must count each micro-batch's forward exactly once:
whatever runs a block's forward again for another purpose (activation checkpointing's
recomputation, trainer/parallel/activation_checkpoint.py) puts them back as they were before it.
"""

from __future__ import annotations

import torch
from torch import nn


def forward_statistics(module: nn.Module) -> list[torch.Tensor]:
    """The statistic tensors of `module` and its submodules, in module order (one not installed,
    still None, is left out)."""
    found = []
    for sub in module.modules():
        for name in getattr(sub, "forward_statistics", ()):
            value = getattr(sub, name)
            if value is not None:
                found.append(value)
    return found
