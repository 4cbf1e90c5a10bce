"""The global gradient norm and the clip by it, for parameters spread over any meshes.

``torch.nn.utils.clip_grad_norm_`` cannot serve this trainer: it refuses DTensors that live on
different meshes (dense weights on "fsdp", routed experts on [efsdp, ep]), it cannot see that a
row-sharded Engram table (a plain tensor, trainer/parallel/engram_parallel.py) holds only its
rank's rows, and it knows nothing of pipeline stages. Here each gradient's squared norm is
summed over exactly the process groups its local values are disjoint pieces of:

- a DTensor's ``Shard`` / ``_StridedShard`` mesh dims (``Replicate`` dims count once);
- ``row_group`` for the Engram tables named in ``row_sharded`` (None: whole tables here, or
  replicas whose gradients were already summed);
- ``pp``: every pipeline stage holds other parameters, so the stages' totals add up.

Numerics: the per-tensor norms are fp32, the sums of their squares fp64 (all the way through the
all-reduces), so the total does not depend on how the tensors are split or in which order the
ranks add. On CPU torch's fp32 norm kernel accumulates a whole tensor sequentially and loses up
to 1e-2 (relative) on a 129280 x 1024 gradient; it is exact to ~1e-9 over one row of a few
thousand elements, so CPU takes the norm of every row (the last dim; FSDP, EP and the Engram
tables shard dim 0, so a sharded tensor has the same rows as the whole one) and sums the rows'
squares in fp64: a fraction of the time of fp64 norms, a small multiple of fp32
``torch._foreach_norm`` (benchmarks/grad_norm_bench.py, figures in benchmarks/RESULTS.md). CUDA's
``foreach`` norm reduces as a tree and is accurate in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from trainer.distributed import all_reduce_sum, is_shard, local_tensor


def _shard_groups(param: torch.Tensor) -> tuple:
    """Process groups over which the local values of ``param`` are disjoint pieces."""
    groups = []
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        for dim, placement in enumerate(param.placements):
            if is_shard(placement) and mesh.size(dim) > 1:
                groups.append(mesh.get_group(dim))
    return tuple(groups)


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """fp64 sum of the squared L2 norms of ``grads`` (see the module docstring)."""
    if grads[0].is_cuda:
        norms = torch.stack(torch._foreach_norm(grads, 2.0))
    else:
        # Empty local shards (a short last shard) have no rows to take.
        rows = [
            torch.linalg.vector_norm(g.reshape(-1, g.shape[-1] if g.dim() else 1), dim=-1) for g in grads if g.numel()
        ]
        norms = torch.cat(rows) if rows else grads[0].new_zeros(0)
    return norms.double().square().sum()


@torch.no_grad()
def grad_norm(
    parameters: Iterable[torch.Tensor],
    row_sharded: Iterable[torch.Tensor] = (),
    row_group=None,
    pp=None,
) -> torch.Tensor:
    """Global L2 norm (fp32 scalar) of the gradients of ``parameters``, wherever they live.

    Args:
        parameters: this rank's parameters; those without a gradient are skipped.
        row_sharded: plain-tensor parameters among ``parameters`` whose rows are split over
            ``row_group`` (the Engram tables under embedding parallelism).
        row_group: ProcessGroup or 1-D DeviceMesh of ``row_sharded``; None = nothing to sum.
        pp: ProcessGroup or 1-D DeviceMesh of the pipeline stages; None = one stage.
    """
    row_ids = {id(p) for p in row_sharded} if row_group is not None else set()
    by_groups: dict[tuple, list[torch.Tensor]] = {}
    device = None
    for p in parameters:
        if p.grad is None:
            continue
        g = local_tensor(p.grad)
        device = g.device
        key = (row_group,) if id(p) in row_ids else _shard_groups(p)
        by_groups.setdefault(key, []).append(g)
    # A stage without gradients still joins the pipeline's sum.
    total = torch.zeros((), dtype=torch.float64, device=device)
    for groups, grads in by_groups.items():
        sq = _sum_of_squares(grads)
        for group in groups:
            all_reduce_sum(sq, group)
        total += sq
    return all_reduce_sum(total, pp).sqrt().float()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What gradients with global norm ``norm`` are multiplied by to clip them to ``max_norm``
    (1.0 when under the limit). No host sync: the coefficient stays a tensor."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    row_sharded: Iterable[torch.Tensor] = (),
    row_group=None,
    pp=None,
) -> torch.Tensor:
    """Scales the gradients of ``parameters`` so their global norm (``grad_norm``, same
    arguments) is at most ``max_norm`` (``inf``: only measure); returns the norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    norm = grad_norm(params, row_sharded, row_group, pp)
    if math.isfinite(max_norm) and params:
        coef = clip_coefficient(norm, max_norm)
        torch._foreach_mul_([local_tensor(p.grad) for p in params], coef.to(local_tensor(params[0].grad).device))
    return norm
