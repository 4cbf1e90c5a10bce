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
  again): every rank holds whole expert matrices and orthogonalises its own experts, no
  communication; the work is spread over the expert owners.
* any other sharded matrix is gathered one at a time (`DTensor.full_tensor`), orthogonalised,
  and each rank keeps its shard of the result: at most one full matrix per rank at once, and
  the same full matrix, hence the same update, as one process.

AdamW's update is written out (`_adamw_`) because `torch.optim.AdamW` keeps its moments in the
parameter dtype; here they are stored in `state_dtype` and computed in fp32 (DeepSeek-V3 kept
them in bf16 with fp32 master weights). In fp32 it is `torch.optim.AdamW`'s arithmetic.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# torch >= 2.9 (this trainer needs 2.11): the Newton-Schulz kernel behind torch.optim.Muon.
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz

from models.moe.experts import GroupedExperts
from trainer.distributed import full_from_local, holds_whole_matrices, local_part, local_tensor

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
    exists because CPUs without bf16 matrix units (AVX2) multiply bf16 about 5x slower than fp32."""
    if dtype == torch.bfloat16:
        return _zeropower_via_newtonschulz(matrix, NS_COEFFICIENTS, ns_steps, EPS)
    a, b, c = NS_COEFFICIENTS
    tall = matrix.shape[0] > matrix.shape[1]
    x = matrix.T if tall else matrix
    x = x.to(dtype) / x.norm().clamp(min=EPS).to(dtype)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def orthogonalize(update: torch.Tensor, ns_steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Newton-Schulz of each matrix of `update` (`[A, B]` or a stack `[E, A, B]`), in `dtype`."""
    if update.ndim == 2:
        return newton_schulz(update, ns_steps, dtype)
    out = torch.empty_like(update, dtype=dtype)
    for i in range(update.shape[0]):  # one matrix at a time: the same kernel as an unsharded run
        out[i] = newton_schulz(update[i], ns_steps, dtype)
    return out


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the param groups tagged `"muon": True`, AdamW on the others (see the module docstring).

    State per parameter: Muon `momentum_buffer`; AdamW `step`, `exp_avg`, `exp_avg_sq` (the names
    of `torch.optim.Muon` / `AdamW`). Buffers are created like the parameter (DTensors with its
    placements), so DCP reshards them into any layout; their dtype is `state_dtype`.
    """

    def __init__(
        self, params, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
        momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, state_dtype: torch.dtype = torch.float32,
        ns_dtype: torch.dtype = torch.bfloat16,
    ):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum,
                        nesterov=nesterov, ns_steps=ns_steps, muon=False)
        super().__init__(params, defaults)
        self.state_dtype = state_dtype
        self.ns_dtype = ns_dtype
        self.register_load_state_dict_post_hook(_restore_state_dtype)

    BUFFERS = ("momentum_buffer", "exp_avg", "exp_avg_sq")

    def _buffer(self, p: torch.Tensor, name: str) -> torch.Tensor:
        state = self.state[p]
        if name not in state:
            state[name] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        return local_tensor(state[name])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else torch.enable_grad()(closure)()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    (self._muon_ if group["muon"] else self._adamw_)(p, group)
        return loss

    def _muon_(self, p: torch.Tensor, group: dict) -> None:
        mu, lr = group["momentum"], group["lr"]
        grad = local_tensor(p.grad)
        stored = self._buffer(p, "momentum_buffer")
        buf = stored.float() if stored.dtype != torch.float32 else stored
        buf.lerp_(grad, 1 - mu)
        if buf is not stored:
            stored.copy_(buf)
        update = grad.lerp(buf, mu) if group["nesterov"] else buf
        steps, dtype = group["ns_steps"], self.ns_dtype
        if holds_whole_matrices(p):
            ortho = orthogonalize(update, steps, dtype)
        else:
            ortho = local_part(orthogonalize(full_from_local(update, p), steps, dtype), p)
        weight = local_tensor(p)
        weight.mul_(1 - lr * group["weight_decay"])
        weight.add_(ortho, alpha=-lr * rms_matched_scale(p.shape))

    def _adamw_(self, p: torch.Tensor, group: dict) -> None:
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
        state["step"] += 1
        step = state["step"].item()
        grad = local_tensor(p.grad)
        stored = [self._buffer(p, "exp_avg"), self._buffer(p, "exp_avg_sq")]
        exp_avg, exp_avg_sq = (s.float() if s.dtype != torch.float32 else s for s in stored)
        weight = local_tensor(p)
        weight.mul_(1 - lr * group["weight_decay"])
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        for s, computed in zip(stored, (exp_avg, exp_avg_sq)):
            if s is not computed:
                s.copy_(computed)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
        weight.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))


def _restore_state_dtype(optimizer: MuonAdamW) -> None:
    """``load_state_dict`` post-hook: torch's loader casts floating-point state to its parameter's
    dtype (fp32 here), which would turn bf16 states fp32 at the first resume: more memory than the
    job was sized for, and a resume that is no longer exact. The saved values are bf16, so casting
    them back loses nothing."""
    for state in optimizer.state.values():
        for name in MuonAdamW.BUFFERS:
            if name in state and state[name].dtype != optimizer.state_dtype:
                state[name] = state[name].to(optimizer.state_dtype)
