"""Process-group setup/teardown and the few reductions the training loop needs.

Everything here is a no-op on one process, so the single-process trainer calls it unguarded.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


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


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def all_reduce_sum(tensor: torch.Tensor, mesh) -> torch.Tensor:
    """In-place sum over ``mesh`` (a 1-D DeviceMesh, or None for a no-op); returns the tensor."""
    if mesh is not None and mesh.size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return tensor
