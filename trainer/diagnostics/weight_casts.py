"""How many bytes of low-precision weight copies a step makes.

Under autocast alone an fp32 weight is cast to bf16 at every use (every forward of every
micro-batch, and again where activation checkpointing recomputes); with FSDP2's
``MixedPrecisionPolicy`` (the bf16 path, also on one process: ``parallelize_model``) it is cast
once when FSDP gathers it. ``weight_cast_bytes`` measures which of the two a step does, so a
benchmark can report it next to tokens/s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.distributed import local_tensor

_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


def _storage(t: torch.Tensor) -> int:
    return local_tensor(t).untyped_storage().data_ptr()


class _WeightCasts(TorchDispatchMode):
    """Sums the bytes written by dtype-changing copies whose source is a parameter's storage
    (FSDP's sharded parameter buffer, or the parameter itself under autocast)."""

    def __init__(self, storages: set[int]):
        super().__init__()
        self.storages = storages
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _COPIES:
            src, dst = (args[0], out) if func is torch.ops.aten._to_copy.default else (args[1], args[0])
            if src.dtype != dst.dtype and _storage(src) in self.storages:
                self.bytes += dst.numel() * dst.element_size()
        return out


def weight_cast_bytes(model: nn.Module, fn: Callable[[], object]) -> int:
    """Runs ``fn()`` (e.g. one ``Trainer.train_step``) and returns the bytes of the
    lower-precision copies of ``model``'s parameters it made (local shards on this rank)."""
    storages = {_storage(p) for p in model.parameters()}
    mode = _WeightCasts(storages)
    with mode:
        fn()
    return mode.bytes
