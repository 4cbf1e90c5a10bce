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

A recomputation records nothing: the statistics a block's forward adds into (the MoE's routed-token
counts behind the bias update and ``moe_imbalance``, Engram's gate sums, QK-clip's max logits:
``models.common.forward_stats``) are put back as they were when it ends, so every micro-batch
counts once whatever the schedule recomputes. Counting on would not: a zero-bubble schedule's
split backward recomputes a block in its input pass and again in its weight pass (torch's own
weight pass once per parameter group; the trainer's once, trainer/parallel/pipeline_step.py
`weight_pass`), DualPipeV gives some micro-batches a split backward and others a full one, and the
bias update then moves the wrong experts. The put-back runs in the checkpoint's recompute context, around the block's
call, so it holds for a compiled block too (its graph adds, eagerly restored after it).

A block is recomputed as often as its backward is split: ``op`` replays the saved outputs of its
per-op policy on every recomputation (torch's selective checkpoint hands each one out once and
refuses a second backward), so a zero-bubble schedule's weight pass sees the same values as its
input pass. The saved outputs then live until the block's autograd graph is freed (after
the weight pass) rather than until the first recomputation takes them: never longer than a run
without checkpointing keeps the same tensors.
"""

from __future__ import annotations

import functools
import typing

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from models.common.forward_stats import forward_statistics
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


class _Modes:
    """Dispatch modes entered in order and left in reverse, as often as the checkpoint asks: a
    recompute context is entered once per backward that needs the block (module docstring), which
    a generator's one-shot context manager cannot be."""

    def __init__(self, *modes: TorchDispatchMode):
        self.modes = modes

    def __enter__(self):
        for mode in self.modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self.modes):
            mode.__exit__(*exc)
        return False


class _Recomputation(_Modes):
    """The recompute context of one checkpointed call of ``block``: each recomputation leaves the
    block's statistics as it found them and, under ``op`` (``modes``: torch's replaying mode and
    the profiler bypass above it), replays every saved output of the forward."""

    def __init__(self, block: nn.Module, *modes: TorchDispatchMode):
        super().__init__(*modes)
        self.block = block
        self.saved_outputs: dict | None = None
        self.stats: list[torch.Tensor] = []
        self.before: list[torch.Tensor] = []

    def __enter__(self):
        self.stats = forward_statistics(self.block)
        with torch.no_grad():
            self.before = [t.clone() for t in self.stats]
        if self.modes:
            # The replaying mode marks each saved output consumed as it hands it out: give every
            # pass the forward's entries.
            storage = self.modes[0].storage
            if self.saved_outputs is None:
                self.saved_outputs = {key: dict(entries) for key, entries in storage.items()}
            storage.update({key: dict(entries) for key, entries in self.saved_outputs.items()})
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        with torch.no_grad():
            for stat, before in zip(self.stats, self.before):
                stat.copy_(before)
        self.stats, self.before = [], []
        return False


def _contexts(block: nn.Module, per_op: bool) -> tuple[_Modes, _Recomputation]:
    """``context_fn`` of ``block``'s checkpoint, called at each forward: (forward context,
    recompute context)."""
    if not per_op:
        return _Modes(), _Recomputation(block)
    caching, cached = create_selective_checkpoint_contexts(functools.partial(_op_policy, _save_list()))
    return _Modes(caching, _SkipProfilerOps()), _Recomputation(block, cached, _SkipProfilerOps())


def apply_activation_checkpointing(model: nn.Module, mode: str, selective_every: int = 1) -> int:
    """Wraps blocks of ``model.layers`` (and ``model.mtp``) in place; returns how many."""
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpoint.mode must be one of {AC_MODES}, got {mode!r}")
    if mode == "none":
        return 0
    if selective_every < 1:
        raise ValueError(f"activation_checkpoint.selective_every must be >= 1, got {selective_every}")

    def wrap(block: nn.Module) -> nn.Module:
        context_fn = functools.partial(_contexts, block, mode == "op")
        return checkpoint_wrapper(block, preserve_rng_state=False, context_fn=context_fn)

    wrapped = 0
    for index, (name, block) in enumerate(list(model.layers.items())):
        if mode == "selective" and index % selective_every:
            continue
        model.layers[name] = wrap(block)
        wrapped += 1
    mtp = getattr(model, "mtp", None)
    if mtp is not None and mode != "selective":
        for module in mtp:
            module.block = wrap(module.block)
            wrapped += 1
    return wrapped
