"""`torch.compile` per transformer block, with the MoE token split as the only graph break.

House order (`docs/architecture.md`): ... -> AC -> compile -> FSDP -> to_empty -> init.
Compilation is lazy: `apply_compile` only installs compiled callables; tracing happens at the
first forward, after `to_empty`/`init_weights` have materialised the parameters, so compiling
the meta-device model is fine.

What is compiled (`docs/compile.md` has the long version):

* every block of `model.layers` and every MTP block (`model.mtp[k].block`), one compiled
  `forward` per block. Dense blocks are compiled with `fullgraph=True` (a graph break is an
  error). On one device an MoE block is one graph too (the local dispatcher has static shapes,
  models/moe/permutation.py). Under expert parallelism it breaks exactly twice, at the
  all-to-all dispatcher's `dispatch()` and `exchange_back()` (`torch.compiler.disable`d); the
  routed experts' ep-DTensor weights add none, and under FSDP they share their block's unit
  (trainer/parallel/fsdp.py), whose hooks run outside the compiled `forward` (on torch < 2.13
  they are a unit of their own, whose hooks FSDP2 keeps out of dynamo: one more break).
* the loss (`compiled_cross_entropy_sum`), which fuses the fp32 upcast into the softmax.

Per block, not the whole model: a whole-model compile would split at every MoE boundary and
re-trace the rest of the model after each one; per-block compiles are traced once per block
and give activation checkpointing and FSDP their per-block units.

The block's `forward` is replaced (an instance attribute), not its `__call__`, so module hooks
(FSDP2's unshard/reshard, checkpoint wrappers) run eagerly around the compiled region and the
state-dict names stay unchanged (no `_orig_mod.`). Blocks already wrapped by
`checkpoint_wrapper` have their inner block compiled: compiling the wrapper itself would trace
the checkpoint as one higher-order op, which cannot contain the MoE graph breaks, so the whole
MoE block would fall back to eager.

Dynamo settings, applied only while a compiled block runs (`torch._dynamo.config.patch` around
each call, so other compiled code in the process keeps its defaults):

* `capture_scalar_outputs=True`: fp32 MoE experts run the per-expert loop under compile (the
  `torch._grouped_mm` meta kernel is bf16-only), whose `num_tokens_per_expert.tolist()` would
  otherwise be a graph break; captured, the split sizes are unbacked symbols, so any routing,
  zero-token experts included, runs the same graph.
* `nested_graph_breaks=True` (where this torch has it): the expert-parallel breaks inside
  `MoE.forward` resume inside the nested frame instead of also splitting the calling block at
  `self.ffn(...)`.

The all-to-all dispatcher marks its received-row dim unbacked (`mark_unbacked` on `routed_x`),
so expert parallelism's varying row counts, 0 and 1 included, do not recompile either.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from trainer.loss import cross_entropy_sum


def compile_dynamo_config() -> dict[str, bool]:
    """The dynamo settings compiled blocks are traced with (see the module docstring)."""
    # Both settings exist in torch 2.11 and 2.13.
    return {"capture_scalar_outputs": True, "nested_graph_breaks": True}


def _with_dynamo_config(fn: Callable, options: dict[str, bool]) -> Callable:
    """`fn` run under `torch._dynamo.config.patch(**options)`; dynamo reads its config while it
    traces, i.e. inside the call, and the previous values are restored on return."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch._dynamo.config.patch(**options):
            return fn(*args, **kwargs)

    return call


def _unwrap_checkpoint(module: nn.Module) -> nn.Module:
    # `checkpoint_wrapper` keeps the wrapped block here (and strips the name from state dicts).
    return getattr(module, "_checkpoint_wrapped_module", module)


def compile_block(block: nn.Module, backend: str = "inductor") -> None:
    """Compiles one transformer block's `forward` in place (see the module docstring).

    A block with an MoE FFN (`block.moe_enabled`) is compiled with graph breaks allowed (the
    dispatcher boundary); every other block must trace as one graph (`fullgraph=True`).
    """
    inner = _unwrap_checkpoint(block)
    if "forward" in vars(inner):
        raise ValueError(f"block {getattr(inner, 'layer_id', '?')} already has a compiled forward")
    fullgraph = not getattr(inner, "moe_enabled", False)
    compiled = torch.compile(inner.forward, backend=backend, fullgraph=fullgraph)
    inner.forward = _with_dynamo_config(compiled, compile_dynamo_config())


def apply_compile(model: nn.Module, backend: str = "inductor") -> int:
    """Compiles every block of `model.layers` and `model.mtp` in place; returns how many.

    Works on plain blocks and on blocks wrapped by `checkpoint_wrapper` (apply activation
    checkpointing first, as the house order says). Pair it with `compiled_cross_entropy_sum`
    for the loss.
    """
    blocks = list(model.layers.values())
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        blocks += [module.block for module in mtp]
    for block in blocks:
        compile_block(block, backend)
    return len(blocks)


@functools.cache
def compiled_cross_entropy_sum() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`trainer.loss.cross_entropy_sum`, compiled once per process (it holds no state).

    Compiled, the fp32 upcast of the logits is fused into the log-softmax instead of
    materialising an fp32 copy of `[B, S, vocab]`.
    """
    return torch.compile(cross_entropy_sum, fullgraph=True)
