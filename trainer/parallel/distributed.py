"""Process-group setup/teardown and the few reductions the training loop needs.

Everything here is a no-op on one process, so the single-process trainer calls it unguarded.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank_from_env() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def init_distributed(device: torch.device) -> None:
    """Initialises the default process group (torchrun's env:// variables) when WORLD_SIZE > 1.

    gloo serves CPU tensors, NCCL CUDA tensors; on a GPU machine both backends are registered
    (``cpu:gloo,cuda:nccl``) so small CPU-side collectives keep working.
    """
    if world_size_from_env() == 1 or dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend=backend, **kwargs)


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    """Whether a default process group is up (False in a single-process run)."""
    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def global_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_rank0() -> bool:
    return global_rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_ranks_any(flag: bool) -> bool:
    """True when `flag` is true on any rank (a MAX all-reduce; the identity without a process group)."""
    if not is_distributed():
        return flag
    # A CPU tensor when gloo is registered (also as `cpu:gloo,cuda:nccl`); NCCL alone needs CUDA.
    backend = str(dist.get_backend())
    on_cuda = "nccl" in backend and "gloo" not in backend
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def all_reduce_sum(tensor: torch.Tensor, mesh) -> torch.Tensor:
    """In-place sum over ``mesh`` (a 1-D DeviceMesh, or None for a no-op); returns the tensor."""
    if mesh is not None and mesh.size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return tensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a plain tensor unchanged)."""
    return t.to_local() if isinstance(t, DTensor) else t
