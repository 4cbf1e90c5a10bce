"""Muon on the block matrices, AdamW on the rest, optimizer states in fp32 or bf16.

Muon (Keller Jordan; Moonlight, "Muon is Scalable for LLM Training") replaces a matrix's update by
the orthogonalised Nesterov momentum: `B <- mu B + (1 - mu) G`, `U = NS((1 - mu) G + mu B)` (five
quintic Newton-Schulz iterations in bf16, torch's `torch.optim.Muon` kernel; fp32 on CPUs, see
`newton_schulz`), then decoupled weight decay `W <- W (1 - lr wd)` and
`W <- W - lr 0.2 sqrt(max(A, B)) U`. The factor matches the update's RMS to AdamW's (Moonlight),
so AdamW's LR schedule and weight decay carry over.
Which parameters are matrices is `muon_params`' rule (docs/optimizers.md).

`torch.optim.Muon` itself takes only plain 2-D parameters and runs Newton-Schulz on whatever tensor
it is given; here parameters are FSDP2 dim-0 shards (DTensors), TP shards, and `[E, A, B]` expert
stacks, so only its Newton-Schulz kernel and constants are reused and the step is this module's:

* a routed-expert stack is sharded on its expert dim only (EP, and FSDP over efsdp shards dim 0
  again), so its matrices are whole wherever they are held. A stack a rank holds whole and alone
  (no efsdp shard, no replica) is orthogonalised there in one batched call, no communication.
  Where several ranks hold the stack's expert-parallel slice (efsdp shards, replicas, and the tp
  ranks, which all hold the same routed experts: `expert_replicas`), each of its expert matrices
  is orthogonalised once, by an owner among those ranks (trainer/optim/muon_owners.py): efsdp can
  exceed the experts per EP rank, leaving ranks with none, and replicas would each repeat their
  experts.
* any other matrix held by several ranks (sharded or replicated) is orthogonalised once, by its
  owner among all ranks (trainer/optim/muon_owners.py): it moves there whole, in buckets, and each holder
  gets back its part of the result. The owner's matrix is the gathered one, so the update is one
  process's.

AdamW's update is written out (`_adamw_`) because `torch.optim.AdamW` keeps its moments in the
parameter dtype; here they are stored in `state_dtype` and computed in fp32 (DeepSeek-V3 kept
them in bf16 with fp32 master weights). In fp32 it is `torch.optim.AdamW`'s arithmetic. The
element-wise parts of both are `torch._foreach_*` calls over a param group, and the step count
is one Python int per group: a step reads nothing back from the device.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

# torch >= 2.9 (this trainer needs 2.11): the Newton-Schulz kernel behind torch.optim.Muon.
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz

from models.moe.experts import GroupedExperts
from trainer.distributed import full_from_local, holds_whole_matrices, local_part, local_tensor, mesh_ranks
from trainer.optim.muon_owners import OwnedExchange, consecutive_runs, expert_group, ns_flops

NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def muon_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters Muon updates: every `nn.Linear` weight but the output head (attention
    projections, dense and shared-expert FFNs, MTP `eh_proj`, Engram key/value projections) and
    each routed-expert stack (`[E, A, B]`: E matrices). The router's gate is not an `nn.Linear`
    and stays with AdamW, as do embedding, head, norms and Engram tables."""
    head = getattr(model, "head", None)
    found: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear) and module is not head:
            found[id(module.weight)] = module.weight
        elif isinstance(module, GroupedExperts):
            found.update({id(w): w for w in (module.w1, module.w2, module.w3)})
    return [p for p in found.values() if p.requires_grad]


def rms_matched_scale(shape: torch.Size) -> float:
    """Moonlight's update scale for an `A x B` matrix (the last two dims): `0.2 sqrt(max(A, B))`
    gives the orthogonalised update (singular values ~1) AdamW's typical RMS of 0.2."""
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


def newton_schulz(matrix: torch.Tensor, ns_steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The quintic Newton-Schulz iteration `X <- aX + (b XX^T + c (XX^T)^2) X` from `X = G / |G|_F`
    (on the wide orientation), computed in `dtype`. bf16 is torch.optim.Muon's own kernel; fp32
    exists because CPUs without bf16 matrix units multiply bf16 slower than fp32
    (`trainer.optim.ns_dtype_for`)."""
    if dtype == torch.bfloat16:
        return _zeropower_via_newtonschulz(matrix, NS_COEFFICIENTS, ns_steps, EPS)
    return _iterate(matrix, ns_steps, dtype)


def batched_newton_schulz(stack: torch.Tensor, ns_steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`newton_schulz` of each matrix of the stack `[E, A, B]` in one batched computation (`bmm`,
    `baddbmm` over the expert dim): torch's kernel's operations in the same order, each matrix
    scaled by its own Frobenius norm, and each matrix's result independent of the batch it is in
    (`_apart`). docs/optimizers.md says how it compares with one matrix at a time."""
    return _iterate(stack, ns_steps, dtype)


# Where a batched call lays each matrix of its results. MKL's small-matrix GEMM (the AVX2 paths
# at least) rounds a product differently when its output does not start on a 16-byte boundary;
# in a contiguous `[E, A, B]` with `A * B` not a multiple of 4 floats, matrix e starts at
# `4 e A B` bytes, so the same matrix got other bits in a batch of another size or at another
# position (an owner's bucket vs one process's whole stack, tests/unit/test_muon.py). 64 bytes is
# the alignment torch's own allocations have, on CPU and on GPU.
MATRIX_ALIGN_BYTES = 64


def _apart(like: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """An empty `[E, rows, cols]` like `like`, each matrix row-major and starting
    MATRIX_ALIGN_BYTES after a multiple of them, as every lone matrix does. Where `rows * cols`
    fills whole alignment units (every real model's shape) this is the contiguous layout."""
    unit = MATRIX_ALIGN_BYTES // like.element_size()
    stride = -(-rows * cols // unit) * unit
    flat = torch.empty(like.shape[0] * stride, dtype=like.dtype, device=like.device)
    return flat.as_strided((like.shape[0], rows, cols), (stride, cols, 1))


def _iterate(x: torch.Tensor, ns_steps: int, dtype: torch.dtype) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    tall = x.shape[-2] > x.shape[-1]
    x = x.to(dtype)
    if tall:
        x = x.mT
    rows, cols = x.shape[-2:]
    if x.ndim == 3:
        norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
        mm, product, out = torch.baddbmm, torch.bmm, lambda r, c: _apart(x, r, c)
    else:
        norm = x.norm()
        mm, product, out = torch.addmm, torch.mm, lambda r, c: None
    x = torch.div(x, norm.clamp(min=EPS), out=out(rows, cols))
    for _ in range(ns_steps):
        gram = product(x, x.mT, out=out(rows, rows))
        x = mm(x, mm(gram, gram, gram, beta=b, alpha=c, out=out(rows, rows)), x, beta=a, out=out(rows, cols))
    return x.mT if tall else x


def orthogonalize(update: torch.Tensor, ns_steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Newton-Schulz of each matrix of `update` (`[A, B]`, or a stack `[E, A, B]` in one batched
    call), in `dtype`."""
    fn = newton_schulz if update.ndim == 2 else batched_newton_schulz
    return fn(update, ns_steps, dtype)


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the param groups tagged `"muon": True`, AdamW on the others (see the module docstring).

    State: per parameter, Muon's `momentum_buffer` and AdamW's `exp_avg`, `exp_avg_sq` (the names of
    `torch.optim.Muon` / `AdamW`); per param group, its AdamW `step` count (a Python int: the bias
    corrections need no read of the device). Buffers are created like the parameter (DTensors with
    its placements), so DCP reshards them into any layout; their dtype is `state_dtype`.
    `bucket_bytes` caps the whole matrices one collective moves to their NS owners
    (`trainer.optim.muon_owners`); `chunk_numel` the elements of one run of foreach calls (`_chunks`).
    `expert_replicas` is the mesh whose ranks hold the same routed-expert stacks outside the
    stacks' own mesh (TP's: trainer/parallel/tensor_parallel.py leaves the routed experts whole on
    every tp rank, with identical gradients), so that their expert matrices are pooled over it too.
    """

    def __init__(
        self, params, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
        momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, state_dtype: torch.dtype = torch.float32,
        ns_dtype: torch.dtype = torch.bfloat16, bucket_bytes: int = 256 * 2**20, chunk_numel: int = 2**20,
        expert_replicas: DeviceMesh | None = None,
    ):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum,
                        nesterov=nesterov, ns_steps=ns_steps, muon=False, step=0)
        super().__init__(params, defaults)
        self.state_dtype = state_dtype
        self.ns_dtype = ns_dtype
        self.bucket_bytes = bucket_bytes
        self.chunk_numel = chunk_numel
        self.expert_replicas = tuple(mesh_ranks(expert_replicas)) if expert_replicas is not None else ()
        self._exchanges: dict[int, OwnedExchange] = {}
        self._pooled: dict[int, list[torch.Tensor]] = {}  # per param group: its `_pooled` parameters
        self.register_load_state_dict_post_hook(_restore_state_dtype)

    BUFFERS = ("momentum_buffer", "exp_avg", "exp_avg_sq")

    def _buffers(self, params: list[torch.Tensor], name: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The local tensors of `params`' state `name` (made at first use), and fp32 tensors to
        compute in: the same tensors in fp32, upcast copies in bf16 (`_store` rounds them back)."""
        stored = []
        for p in params:
            state = self.state[p]
            if name not in state:
                state[name] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
            stored.append(local_tensor(state[name]))
        if self.state_dtype == torch.float32:
            return stored, stored
        return stored, [s.float() for s in stored]

    @staticmethod
    def _store(stored: list[torch.Tensor], computed: list[torch.Tensor]) -> None:
        if stored is not computed:
            torch._foreach_copy_(stored, computed)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else torch.enable_grad()(closure)()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                (self._muon_ if group["muon"] else self._adamw_)(params, group)
        return loss

    def _muon_(self, params: list[torch.Tensor], group: dict) -> None:
        mu, lr = group["momentum"], group["lr"]
        updates = []
        for chunk in _chunks(params, self.chunk_numel):
            grads = [local_tensor(p.grad) for p in chunk]
            stored, bufs = self._buffers(chunk, "momentum_buffer")
            torch._foreach_lerp_(bufs, grads, 1 - mu)
            self._store(stored, bufs)
            updates += torch._foreach_lerp(grads, bufs, mu) if group["nesterov"] else bufs
        orthos = self._orthogonalize(group, params, updates)
        weights = [local_tensor(p) for p in params]
        torch._foreach_mul_(weights, 1 - lr * group["weight_decay"])
        for weight, ortho, p in zip(weights, orthos, params):  # torch.optim.Muon's add, one scale per shape
            weight.add_(ortho, alpha=-lr * rms_matched_scale(p.shape))

    def _orthogonalize(self, group: dict, params: list[torch.Tensor], updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each parameter's part of its orthogonalised update. A plain tensor, or a stack of whole
        expert matrices this rank holds alone: here. A matrix held by several ranks (a 2-D DTensor
        sharded or replicated, an expert matrix of a stack sharded or replicated within its
        `expert_group` or over `expert_replicas`): on its owner (`trainer.optim.muon_owners`), with every such matrix of the group,
        whether or not this step gave it a gradient (zeros then, and the result unused): all ranks
        agree on what moves. A stack sharded inside its matrices (not a layout this trainer
        makes): gathered here."""
        steps, dtype = group["ns_steps"], self.ns_dtype
        key = self.param_groups.index(group)
        if key not in self._pooled:  # once: telling a pooled stack reads its mesh's ranks
            self._pooled[key] = [p for p in group["params"] if _pooled(p, self.expert_replicas)]
        pooled = self._pooled[key]
        ids = {id(p) for p in pooled}
        out: dict[int, torch.Tensor] = {}
        for p, update in zip(params, updates):
            if id(p) in ids:
                continue
            if holds_whole_matrices(p):
                out[id(p)] = orthogonalize(update, steps, dtype)
            else:
                out[id(p)] = local_part(orthogonalize(full_from_local(update, p), steps, dtype), p)
        if pooled:
            given = {id(p): u for p, u in zip(params, updates)}
            moved = [given[id(p)] if id(p) in given else torch.zeros_like(local_tensor(p)) for p in pooled]
            parts = self._exchange(key, group, pooled).run(
                moved, lambda m: newton_schulz(m, steps, dtype), lambda s: batched_newton_schulz(s, steps, dtype), dtype)
            out.update(zip(map(id, pooled), parts))
        return [out[id(p)] for p in params]

    def _exchange(self, key: int, group: dict, pooled: list[torch.Tensor]) -> OwnedExchange:
        """The owner plan of the group's pooled matrices, built at its first step (a collective of
        all ranks) and kept: owners and index maps depend only on shapes and placements. The NS
        work a rank does anyway (stacks it holds alone, plain matrices) is balanced against."""
        if key not in self._exchanges:
            ids = {id(p) for p in pooled}
            base = sum(ns_flops(local_tensor(p).shape, group["ns_steps"]) for p in group["params"] if id(p) not in ids)
            self._exchanges[key] = OwnedExchange(pooled, base, group["ns_steps"], self.bucket_bytes, self.expert_replicas)
        return self._exchanges[key]

    def _adamw_(self, params: list[torch.Tensor], group: dict) -> None:
        group["step"] += 1
        for chunk in _chunks(params, self.chunk_numel):
            self._adamw_chunk(chunk, group)

    def _adamw_chunk(self, params: list[torch.Tensor], group: dict) -> None:
        beta1, beta2 = group["betas"]
        lr, step = group["lr"], group["step"]
        grads = [local_tensor(p.grad) for p in params]
        weights = [local_tensor(p) for p in params]
        stored_avg, exp_avgs = self._buffers(params, "exp_avg")
        stored_sq, exp_avg_sqs = self._buffers(params, "exp_avg_sq")
        torch._foreach_mul_(weights, 1 - lr * group["weight_decay"])
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        self._store(stored_avg, exp_avgs)
        self._store(stored_sq, exp_avg_sqs)
        # torch.optim.AdamW's single-tensor arithmetic: (sqrt(v) / sqrt(1 - beta2^t) + eps), then
        # p += -lr / (1 - beta1^t) * m / denom.
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, math.sqrt(1 - beta2**step))
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_addcdiv_(weights, exp_avgs, denom, value=-lr / (1 - beta1**step))


def _chunks(params: list[torch.Tensor], numel: int) -> list[list[torch.Tensor]]:
    """`params` in consecutive runs of at most `numel` elements (or one tensor): the foreach
    temporaries (fp32 copies of bf16 states, AdamW's denominators) of one run at a time. Whole-group
    temporaries cost a CPU 1.4x on a 58M-parameter model (page faults, cache); a GPU still gets a
    few kernels per run."""
    return [[params[i] for i in run] for run in consecutive_runs([local_tensor(p).numel() for p in params], numel)]


def _pooled(p: torch.Tensor, expert_replicas: tuple[int, ...] = ()) -> bool:
    """Whether `p`'s matrices are orthogonalised on owners (`trainer.optim.muon_owners`): a 2-D DTensor
    on a mesh of several ranks, or an expert stack of whole matrices (a plain tensor included)
    whose `expert_group` has several ranks (efsdp shards, replicas) or that several
    `expert_replicas` hold. A stack this rank holds whole and alone stays here."""
    if p.ndim == 3 and holds_whole_matrices(p):
        return len(expert_replicas) > 1 or (isinstance(p, DTensor) and len(expert_group(p)) > 1)
    return p.ndim == 2 and isinstance(p, DTensor) and p.device_mesh.size() > 1


def _restore_state_dtype(optimizer: MuonAdamW) -> None:
    """``load_state_dict`` post-hook: torch's loader casts floating-point state to its parameter's
    dtype (fp32 here), which would turn bf16 states fp32 at the first resume: more memory than the
    job was sized for, and a resume that is no longer exact. The saved values are bf16, so casting
    them back loses nothing."""
    for state in optimizer.state.values():
        for name in MuonAdamW.BUFFERS:
            if name in state and state[name].dtype != optimizer.state_dtype:
                state[name] = state[name].to(optimizer.state_dtype)
