"""Tensor parallelism (Megatron-style, with sequence parallelism) for DeepSeek-V3, via DTensor's
`parallelize_module`.

Between blocks the residual stream is sequence-sharded over the "tp" mesh (`Shard(1)`, local
tensors); each block all-gathers it before attention / FFN and reduce-scatters the result:

* embedding: vocab rows split (`RowwiseParallel`), output sequence-sharded;
  norms (`attn_norm`, `ffn_norm`, final `norm`, MTP `enorm`/`hnorm`): `SequenceParallel`.
* MLA: heads split. `wq` (or `wq_b` after the replicated `q_norm`) and `wkv_b` are
  column-parallel, `wo` row-parallel back to `Shard(1)`. The low-rank down projection (`wqkv_a`,
  or `wkv_a` without a query bottleneck) and the norms are small and stay replicated
  (`ReplicateParallel`), as in torchtitan. MLA's single rope key (its last `qk_rope_head_dim`
  outputs) is shared by all heads, but each rank uses it only for its own heads, so its gradient
  is a partial sum over the tp ranks; the projection's output hook all-reduces exactly those
  columns in backward.
* dense FFN and MoE shared experts: `w1`/`w3` column-parallel, `w2` row-parallel.
* MoE router and routed experts are *not* split by TP: the MoE block gets the whole (all-gathered)
  sequence, and router and experts are replicated over tp (plain parameters, identical inputs,
  hence identical gradients; router counts are not multiplied by tp since they are reduced over
  the "loss" mesh only). Splitting the routed experts is expert parallelism's job: it shards
  them over "ep", which can borrow the data ranks of the same tp group. Muon pools the tp ranks'
  copies of each expert matrix and orthogonalises it once (`MuonAdamW(expert_replicas=)`).
* output head: column-parallel with the logits left vocab-sharded (a `DTensor`) for
  `loss_parallel()`: `cross_entropy_sum` (and `mtp_loss`) then run on the shards without ever
  gathering `[B, S, vocab]`. The forward *and* backward of the loss must run inside
  `loss_parallel()`; the loss it returns is a replicated DTensor (`.full_tensor()` for a scalar).

Model code uses `-1` for head counts in its views, so local heads need no change in models/.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from models.common.attention import MLA
from models.common.ffn import FeedForward
from models.moe import MoE


class _AllReduceGradColumns(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient's last-dim columns `[start:]`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, start: int, group) -> torch.Tensor:
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tail = funcol.all_reduce(grad[..., ctx.start :].contiguous(), "sum", ctx.group)
        return torch.cat([grad[..., : ctx.start], funcol.wait_tensor(tail)], dim=-1), None, None


class ReplicateParallel(ParallelStyle):
    """Keeps a module whole on every tp rank: parameters become replicated DTensors (so FSDP and
    checkpoints see one consistent layout), the input is taken as replicated and the output is
    returned as a local tensor.

    Args:
        reduce_grad_from: if set, the backward all-reduces the output gradient's last-dim columns
            from this index on (outputs consumed per local head, see the module docstring).
    """

    def __init__(self, reduce_grad_from: int | None = None):
        super().__init__()
        self.reduce_grad_from = reduce_grad_from

    @staticmethod
    def _prepare_input(module, inputs, device_mesh):
        x = inputs[0]
        if isinstance(x, DTensor):
            x = x.redistribute(device_mesh, (Replicate(),))
        else:
            x = DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)
        return (x, *inputs[1:])

    @staticmethod
    def _prepare_output(reduce_grad_from, module, outputs, device_mesh):
        out = outputs.to_local() if isinstance(outputs, DTensor) else outputs
        if reduce_grad_from is not None:
            out = _AllReduceGradColumns.apply(out, reduce_grad_from, device_mesh.get_group())
        return out

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            None,  # every parameter replicated
            self._prepare_input,
            partial(self._prepare_output, self.reduce_grad_from),
        )


def _attention_plan(attn: MLA) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {
        # (x, freqs_cis, attn_mask): only x is sharded (over the sequence).
        "": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=True,
        ),
        "kv_norm": ReplicateParallel(),
        "wkv_b": ColwiseParallel(),
        "wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    if attn.q_lora_rank == 0:
        plan.update({"wq": ColwiseParallel(), "wkv_a": ReplicateParallel(reduce_grad_from=attn.kv_lora_rank)})
    else:
        # wqkv_a's rows: [q latent | kv latent | rope key]; only the rope key is used per local head.
        rope_from = attn.q_lora_rank + attn.kv_lora_rank
        plan.update(
            {"wqkv_a": ReplicateParallel(reduce_grad_from=rope_from), "q_norm": ReplicateParallel(), "wq_b": ColwiseParallel()}
        )
    return plan


def _ffn_plan(sequence_sharded_io: bool) -> dict[str, ParallelStyle]:
    """SwiGLU split by hidden units; with `sequence_sharded_io` the module gathers its input and
    reduce-scatters its output (dense FFN), else input and output are replicated (shared experts,
    which live inside the MoE block that already works on the whole sequence)."""
    plan: dict[str, ParallelStyle] = {"w1": ColwiseParallel(), "w3": ColwiseParallel()}
    if sequence_sharded_io:
        plan[""] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
        plan["w2"] = RowwiseParallel(output_layouts=Shard(1))
    else:
        plan["w2"] = RowwiseParallel(output_layouts=Replicate())
    return plan


def _apply_block(block: nn.Module, tp_mesh) -> None:
    parallelize_module(block.attn_norm, tp_mesh, SequenceParallel())
    parallelize_module(block.ffn_norm, tp_mesh, SequenceParallel())
    for name, style in _attention_plan(block.attn).items():
        parallelize_module(block.attn.get_submodule(name) if name else block.attn, tp_mesh, style)
    ffn = block.ffn
    if isinstance(ffn, MoE):
        # Whole sequence in, (out, aux_loss) back; out re-sharded over the sequence. Router and
        # routed experts see identical tokens on every tp rank (see the module docstring).
        parallelize_module(
            ffn,
            tp_mesh,
            PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(), None),
                desired_output_layouts=(Shard(1), None),
                use_local_output=True,
            ),
        )
        if ffn.shared_experts is not None:
            for name, style in _ffn_plan(sequence_sharded_io=False).items():
                parallelize_module(ffn.shared_experts.get_submodule(name), tp_mesh, style)
    elif isinstance(ffn, FeedForward):
        for name, style in _ffn_plan(sequence_sharded_io=True).items():
            parallelize_module(ffn.get_submodule(name) if name else ffn, tp_mesh, style)
    else:
        raise TypeError(f"no tensor-parallel plan for FFN type {type(ffn).__name__}")


def apply_tensor_parallel(model: nn.Module, tp_mesh, enable_loss_parallel: bool = True) -> None:
    """Shards `model` (a `DeepSeekV3Model`, on meta or real tensors) over `tp_mesh` in place.

    With `enable_loss_parallel` the logits come back as a vocab-sharded DTensor; compute the
    loss inside `maybe_loss_parallel(True)`. Without it they are gathered to a local tensor.
    """
    tp = tp_mesh.size()
    args = model.args
    for name, value in (("n_heads", args.n_heads), ("vocab_size", args.vocab_size)):
        if value % tp:
            raise ValueError(f"tensor parallelism needs {name}={value} divisible by tp={tp}")
    if args.tie_embeddings:
        raise ValueError("tensor parallelism does not support tie_embeddings (embedding rows vs head columns)")
    parallelize_module(
        model,
        tp_mesh,
        {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if enable_loss_parallel else Replicate(),
                use_local_output=not enable_loss_parallel,
            ),
        },
    )
    for block in model.layers.values():
        _apply_block(block, tp_mesh)
    for mtp in model.mtp if model.mtp is not None else []:
        parallelize_module(mtp.enorm, tp_mesh, SequenceParallel())
        parallelize_module(mtp.hnorm, tp_mesh, SequenceParallel())
        parallelize_module(mtp.norm, tp_mesh, SequenceParallel())
        # cat([enorm(emb), hnorm(h)]) is sequence-sharded; the projection gathers it and
        # hands the block its sequence shard again.
        parallelize_module(mtp.eh_proj, tp_mesh, ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1)))
        _apply_block(mtp.block, tp_mesh)


@torch.no_grad()
def replicate_partial_grads(parameters) -> None:
    """Reduces `Partial` gradients to their parameter's placement (call after backward, before
    clipping and the optimizer step).

    Sequence-parallel norms get `Partial` gradients: the sum over tp ranks, not yet reduced. FSDP2
    redistributes them itself; without FSDP they would reach the gradient norm as per-rank partial
    sums. (A post-accumulate-grad hook would be neater, but `to_empty` on a meta-built model swaps
    the parameter tensors and loses hooks registered before it.)
    """
    for param in parameters:
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(grad.device_mesh, param.placements)


def maybe_loss_parallel(enabled: bool):
    """`loss_parallel()` when the head was sharded with loss parallelism, else a no-op context.
    Wrap both the loss computation and its `backward()`."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def replicated_value(t: torch.Tensor) -> torch.Tensor:
    """A loss computed under `loss_parallel()` is a replicated DTensor: its plain value."""
    return t.full_tensor() if isinstance(t, DTensor) else t
