"""Activation checkpointing, applied per transformer block (``[activation_checkpoint]``).

Modes:
    none       keep every activation.
    full       every block recomputes its forward in backward.
    selective  every ``selective_every``-th block recomputes (layers 0, N, 2N, ...: the
               cheapest trade of memory for compute at a chosen ratio).
    op         every block, per-op selective: outputs of matmuls, grouped GEMMs, attention
               kernels and all-to-alls are saved; cheap pointwise ops, norms and the rest are
               recomputed. Saving the all-to-all outputs means expert-parallel communication
               is never repeated in backward.

``checkpoint_wrapper`` keeps state-dict names unchanged (it strips its own prefix), so
checkpoints are interchangeable across modes.
"""

from __future__ import annotations

import contextlib
import functools
import typing

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from trainer.config.schema import ACMode

AC_MODES = typing.get_args(ACMode)


def _save_list() -> set:
    ops = [
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten._grouped_mm.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops._c10d_functional.all_to_all_single.default,
    ]
    # Kernels that exist only in some builds.
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention"):
        if hasattr(torch.ops.aten, name):
            ops.append(getattr(torch.ops.aten, name).default)
    if hasattr(torch.ops, "_c10d_functional_autograd"):
        ops.append(torch.ops._c10d_functional_autograd.all_to_all_single.default)
    return set(ops)


def _op_policy(save: set, ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE


class _SkipProfilerOps(TorchDispatchMode):
    """Sits right above a per-op SAC mode and runs profiler annotations past it.

    SAC replays by counting each op's calls, and must see the same calls in forward and in
    recompute. FSDP2 hooks of a unit *inside* the checkpointed block (the routed experts' own
    unit under EP on torch < 2.13, trainer/parallel/fsdp.py) annotate with ``record_function``
    a different number of times in recompute (there ``FSDP::root_pre_forward`` also runs), which
    SAC rejects, though annotations compute nothing. PyTorch has the same bypass in review upstream; until a release carries it, this
    keeps the two counts equal by hiding annotations from SAC.
    """

    @classmethod
    def ignore_compile_internals(cls):
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "profiler":
            with _pop_mode_temporarily():  # the SAC mode right below this one
                return func(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _with_profiler_ops_skipped(sac_mode):
    with sac_mode, _SkipProfilerOps():
        yield


def _op_context_fn():
    caching, cached = create_selective_checkpoint_contexts(functools.partial(_op_policy, _save_list()))
    return _with_profiler_ops_skipped(caching), _with_profiler_ops_skipped(cached)


def apply_activation_checkpointing(model: nn.Module, mode: str, selective_every: int = 1) -> int:
    """Wraps blocks of ``model.layers`` (and ``model.mtp``) in place; returns how many."""
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpoint.mode must be one of {AC_MODES}, got {mode!r}")
    if mode == "none":
        return 0
    if selective_every < 1:
        raise ValueError(f"activation_checkpoint.selective_every must be >= 1, got {selective_every}")
    kwargs = {"preserve_rng_state": False}
    if mode == "op":
        kwargs["context_fn"] = _op_context_fn
    wrapped = 0
    for index, (name, block) in enumerate(list(model.layers.items())):
        if mode == "selective" and index % selective_every:
            continue
        model.layers[name] = checkpoint_wrapper(block, **kwargs)
        wrapped += 1
    mtp = getattr(model, "mtp", None)
    if mtp is not None and mode != "selective":
        for i, module in enumerate(mtp):
            module.block = checkpoint_wrapper(module.block, **kwargs)
            wrapped += 1
    return wrapped
