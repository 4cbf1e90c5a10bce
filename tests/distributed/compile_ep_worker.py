"""Worker of tests/distributed/test_compile_ep.py: one gloo rank of a compiled 2-rank
expert-parallel model whose routing the test sets token by token.

The model is the debug model cut to one dense and one MoE block (8 experts, top-2, no expert
groups, no MTP). Its weights are edited so that the router reads one coordinate of the
residual stream that only a marker token sets:

* coordinate 0 of every embedding is 0 except the marker's (large), and the dense block's
  attention and FFN and the MoE block's attention write nothing into it;
* the router weights are 0 except expert 4's weight on coordinate 0.

So every other token scores 0.5 for all experts, and with the selection bias (0 for experts
0-3, below 0.5 for 4-7) picks two of experts 0-3, while a marker token scores ~1 for expert 4
and picks it. Rank 1 holds experts 4-7: the rows it receives in a step are exactly the marker
tokens of both ranks' batches. No optimizer step runs (the edited weights must stay as they are);
forward and backward are what compile, and both are compared with the eager copy: the losses, and
after every training step every gradient, whole.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor

from models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs
from models.moe import MoE
from trainer.diagnostics import init_local_gloo
from trainer.loss import cross_entropy_sum
from trainer.parallel.compile import apply_compile, compiled_cross_entropy_sum
from trainer.parallel.expert_parallel import apply_expert_parallel
from trainer.parallel.fsdp import apply_fsdp
from trainer.parallel.parallel_dims import ParallelDims

B, S = 2, 16
MARKER = 7  # token id that routes to expert 4 (held by ep rank 1)
EXPERT_BIAS = [0.0, 0.0, 0.0, 0.0, -0.25, -1.0, -1.0, -1.0]

# (mode, marker tokens on rank 0, marker tokens on rank 1). The first two steps warm up (one
# training and one validation trace); from then on a recompile is an error. Rank 1's experts
# receive the sum: 0 and 1 rows in training and validation, then other counts.
WARMUP = [("train", 2, 1), ("eval", 1, 2)]
ARMED = [
    ("train", 0, 0), ("eval", 1, 0), ("train", 1, 0), ("eval", 0, 0),
    ("train", 0, 1), ("eval", 0, 1), ("train", 3, 2),
]


def build_model() -> DeepSeekV3Model:
    base = DeepSeekV3ModelArgs()
    moe = dataclasses.replace(base.moe, num_expert_groups=1, num_limited_groups=1)
    args = dataclasses.replace(base, n_layers=2, n_dense_layers=1, mtp_depth=0, max_seq_len=S, moe=moe)
    torch.manual_seed(0)  # the same weights on every rank
    model = DeepSeekV3Model(args)
    model.init_weights()
    with torch.no_grad():
        model.embed.weight[:, 0] = 0.0
        model.embed.weight[MARKER, 0] = 30.0
        for block in model.layers.values():
            block.attn.wo.weight[0] = 0.0
        model.layers["0"].ffn.w2.weight[0] = 0.0
        moe = model.layers["1"].ffn
        moe.gate.weight.zero_()
        moe.gate.weight[4, 0] = 1.0
        moe.expert_bias.copy_(torch.tensor(EXPERT_BIAS))
    return model.train()


def batch(step: int, rank: int, markers: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    data = torch.randint(MARKER + 1, 8192, (B, S + 1), generator=g)
    data.view(-1)[: 3 * markers : 3] = MARKER  # spread over the first row
    return data[:, :-1], data[:, 1:]


def run_step(model, mode: str, inputs, labels, loss_fn) -> float:
    """A validation forward (no_grad, eval mode) or a training forward and backward; returns the
    loss (validation: the mean logit)."""
    if mode == "eval":
        model.eval()
        with torch.no_grad():
            value = model(inputs).logits.mean()
        model.train()
        return value.item()
    out = model(inputs, labels=labels)
    loss = loss_fn(out.logits, labels) / labels.numel()
    (loss + out.aux_loss).backward()
    return loss.item()


def grad_difference(compiled, eager) -> float:
    """Largest |compiled - eager| over every gradient, whole, relative to the largest eager
    gradient entry. The eager copy has no FSDP, so its dense gradients are summed over the ranks
    here, as FSDP sums the compiled model's (trainer/parallel/fsdp.py); expert gradients are ep
    DTensors in both. Collective: every rank calls it at the same step."""
    eager_params = dict(eager.named_parameters())
    worst, scale = 0.0, 0.0
    for name, param in compiled.named_parameters():
        got, want = param.grad.full_tensor(), eager_params[name].grad
        if isinstance(want, DTensor):
            want = want.full_tensor()
        else:
            want = want.clone()
            dist.all_reduce(want)
        worst = max(worst, (got - want).abs().max().item())
        scale = max(scale, want.abs().max().item())
    return worst / scale


def run_steps(rank: int, dims: ParallelDims) -> dict:
    """Builds, parallelises and compiles the model as the Trainer does (expert parallelism, then
    compile, then FSDP), then runs the WARMUP + ARMED steps, and the same steps on an eager
    expert-parallel copy."""
    eager = build_model()
    apply_expert_parallel(eager, dims.mesh("ep"))
    model = build_model()
    apply_expert_parallel(model, dims.mesh("ep"))
    apply_compile(model)
    apply_fsdp(model, dims.mesh("fsdp"), dims.mesh("efsdp"))
    moe = next(m for m in model.modules() if isinstance(m, MoE))

    torch._dynamo.reset()
    counters.clear()
    received = []  # (marker tokens, rows rank 1's experts received) per training step
    compiled_losses, eager_losses, grad_differences = [], [], []
    for step, (mode, *markers) in enumerate(WARMUP + ARMED):
        moe.tokens_per_expert.zero_()
        inputs, labels = batch(step, rank, markers[rank])
        with torch._dynamo.config.patch(error_on_recompile=step >= len(WARMUP)):
            compiled_losses.append(run_step(model, mode, inputs, labels, compiled_cross_entropy_sum()))
        eager_losses.append(run_step(eager, mode, inputs, labels, cross_entropy_sum))
        if mode == "train":
            to_rank1 = moe.tokens_per_expert[4:].sum()
            dist.all_reduce(to_rank1)
            received.append((sum(markers), int(to_rank1)))
            grad_differences.append(grad_difference(model, eager))
            model.zero_grad(set_to_none=True)
            eager.zero_grad(set_to_none=True)
    return {
        "received": received,
        "compiled_losses": compiled_losses,
        "eager_losses": eager_losses,
        "grad_differences": grad_differences,
        "graph_breaks": sorted(counters["graph_break"]),
        "unique_graphs": counters["stats"]["unique_graphs"],
    }


def run(rank: int, world: int, port: int, queue) -> None:
    """`run_steps` on expert parallelism under FSDP (`_on_ranks`)."""
    _on_ranks(rank, world, port, queue, run_steps)


def experts_own_unit(rank: int, dims: ParallelDims) -> dict:
    """Eager, no compile: the routed experts as an FSDP unit of their own (torch 2.11's only
    layout, forced here on any torch; the default layout on torch >= 2.13 is every other FSDP x EP
    test's), one training step's loss and gradients against the expert-parallel copy without FSDP."""
    from torch.distributed.fsdp import FSDPModule

    eager = build_model()
    apply_expert_parallel(eager, dims.mesh("ep"))
    model = build_model()
    apply_expert_parallel(model, dims.mesh("ep"))
    apply_fsdp(model, dims.mesh("fsdp"), dims.mesh("efsdp"), experts_in_block_unit=False)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    mode, *markers = ARMED[-1]  # a training step whose markers reach both ranks' experts
    inputs, labels = batch(0, rank, markers[rank])
    loss = run_step(model, mode, inputs, labels, cross_entropy_sum)
    eager_loss = run_step(eager, mode, inputs, labels, cross_entropy_sum)
    return {
        "experts_own_unit": isinstance(moe.experts, FSDPModule),
        "loss": loss,
        "eager_loss": eager_loss,
        "grad_difference": grad_difference(model, eager),
    }


def run_own_unit(rank: int, world: int, port: int, queue) -> None:
    """`experts_own_unit` on the layout of `run`, in the fast tier's shared 2-rank launch
    (tests/distributed/conftest.py)."""
    _on_ranks(rank, world, port, queue, experts_own_unit)


def _on_ranks(rank: int, world: int, port: int, queue, job) -> None:
    """`job(rank, dims)` on expert parallelism under FSDP (dp_shard = ep = 2, so efsdp = 1). Not
    without FSDP: the Trainer has no such layout (ep borrows its ranks from dp_shard x cp, so FSDP
    is on)."""
    torch.set_num_threads(1)
    init_local_gloo(rank, world, port)
    try:
        dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, ep=world, ep_as_cp=False, world_size=world)
        dims.build_meshes("cpu")
        queue.put((rank, job(rank, dims)))
    except Exception as exc:  # reported to the parent test, which fails with it
        queue.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()
