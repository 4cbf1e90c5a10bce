"""The ground floor of distributed helpers: process-group setup and teardown, rank queries, the few
reductions the training loop needs, and the DTensor helpers every floor above uses (a rank's part
of a tensor, the whole tensor from it, which placements shard).

Everything the trainer calls here is a no-op on one process, so it calls it unguarded. Nothing here
imports the rest of the trainer. The local gloo launcher of the distributed tests and the
benchmarks is trainer/diagnostics/launch.py.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import sys
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

# FSDP over a TP- or EP-sharded dim places a _StridedShard, which is not a Shard subclass in every
# torch and has no public name: this module is the one place that knows it (`is_shard`, `shard_on`).
from torch.distributed.tensor.placement_types import _StridedShard


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank_from_env() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_distributed() -> bool:
    """Whether a default process group is up (False in a single-process run)."""
    return dist.is_available() and dist.is_initialized()


def init_distributed(device: torch.device, timeout_seconds: float, fake: tuple[int, int] | None = None) -> None:
    """Initialises the default process group (torchrun's env:// variables) when WORLD_SIZE > 1.

    gloo serves CPU tensors, NCCL CUDA tensors; on a GPU machine both backends are registered
    (``cpu:gloo,cuda:nccl``) so small CPU-side collectives keep working. ``timeout_seconds``
    bounds the rendezvous store's waits (joining, making every later group) and the default
    group's collectives, until `set_collective_timeout` changes the latter.

    ``fake``: (rank, world size) of a dry run (``job.dry_run``, trainer/dry_run.py): this one
    process is that rank, on torch's fake backend, whose collectives return at once without
    exchanging anything; every group of every mesh exists. Its store answers without peers.
    """
    if is_distributed():
        return
    if fake is not None:
        # torch's own fake store (a testing module: no public one); importing it also registers the
        # fake backend in a torch that does not register it itself.
        from torch.testing._internal.distributed.fake_pg import FakeStore

        rank, world_size = fake
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        return
    if world_size_from_env() == 1:
        return
    dist.init_process_group(timeout=timedelta(seconds=timeout_seconds), **_group_options(device))


def set_collective_timeout(seconds: float) -> None:
    """From now on, a collective of this process waits at most ``seconds`` for the other ranks, in
    every process group it belongs to: the default group, each DeviceMesh dim's group and those
    made with ``new_group`` (pipeline, tokenisation, async checkpoint), also those torch made
    itself. A no-op without a process group or on the fake one. gloo then raises a RuntimeError naming the timeout
    (`is_collective_timeout`); NCCL's watchdog ends the process.

    Groups made later start with torch's backend default (30 min gloo, 10 min NCCL): call again.
    torch has no public list of a process's groups; ``_world.pg_map`` (the same in torch 2.11 and
    2.13) is the registry ``init_process_group`` and ``new_group`` fill, holding only the groups
    this rank is in. ``ProcessGroup.set_timeout`` (both versions) sets every backend of a group
    (gloo and NCCL), as the private ``_set_pg_timeout`` does.
    """
    if not is_distributed() or dist.get_backend() == dist.Backend.FAKE:
        return  # the fake backend (a dry run) waits for nothing
    timeout = timedelta(seconds=seconds)
    for group in list(dist.distributed_c10d._world.pg_map):
        group.set_timeout(timeout)


def is_collective_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a collective that timed out: gloo's RuntimeError ("Timed out waiting
    ...ms for recv operation"), or a c10d error (``DistError``: NCCL with blocking wait, the
    rendezvous store) that names a timeout."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("timed out" in text or "timeout" in text) and (
        isinstance(error, dist.DistError) or "gloo" in text
    )


# What a collective raises when a peer's process is gone: gloo's socket errors, NCCL's abort.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "remote process exited")


def is_peer_lost(error: BaseException) -> bool:
    """Whether ``error`` is a collective that lost its connection to a rank that died: the
    launcher names that rank and its signal, so this rank's traceback would only bury that."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(words in text for words in _PEER_LOST)


def collective_timeout_message(error: BaseException, key: str, seconds: float, when: str) -> str:
    """The one line of a collective that timed out (`is_collective_timeout`), naming the
    timeout in force, ``comm.<key>`` (the trainer's ``[comm]`` section), and torch's own words
    without gloo's source location."""
    detail = re.sub(r"^\[[^]]*\]\s*", "", " ".join(str(error).split()))
    return (
        f"error: a collective waited longer than comm.{key} = {seconds:g} s {when}: another rank stopped "
        f"calling collectives (it hangs or died) or lags this far behind. Where a rank may lag that long (slow "
        f"checkpoint storage, a long compile), raise --comm.{key}; docs/checkpoints.md ('When a run hangs') "
        f"finds the rank. torch: {detail[:200]}"
    )


def init_one_process_group(device: torch.device) -> None:
    """A one-rank default process group over an in-memory store (no port, no launcher), for
    single-process code that needs one (FSDP2's mixed precision); none is made if one exists."""
    if not is_distributed():
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **_group_options(device))


def _group_options(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"backend": "cpu:gloo,cuda:nccl", "device_id": device}
    return {"backend": "gloo"}


def destroy_distributed() -> None:
    if is_distributed():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """Ends this process with `code`: destroys the process groups, runs the atexit handlers
    (logging, wandb, compile workers), flushes stdout/stderr, then leaves through ``os._exit``.

    Why not a plain ``sys.exit``: gloo process groups outlive ``destroy_process_group``. Some are
    held by torch itself (the functional collectives that DTensor and FSDP2 use), others by the
    run's modules (FSDP2's state, the EP dispatcher), whose reference cycles only the garbage
    collection of the interpreter's teardown frees. Their C++ worker threads run on into that
    teardown, and now and then the process dies there with ``terminate called without an active
    exception`` (SIGABRT, exit -6; the aborting thread holds a Python thread state but no Python
    frame) after a run that finished, and torchrun then stops the other ranks.
    ``benchmarks/exit_race.py`` reproduces it. Everything a run writes is closed or flushed
    before this point, so skipping the teardown loses nothing.
    """
    destroy_distributed()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def global_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def global_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_rank0() -> bool:
    return global_rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank (a picklable object; the identity without a process group)."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's picklable `obj`, in rank order (`[obj]` without a process group)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(tensor: torch.Tensor, mesh_or_group) -> torch.Tensor:
    """In-place sum over a 1-D DeviceMesh or a ProcessGroup (None: a no-op); returns the tensor."""
    group = mesh_or_group.get_group() if hasattr(mesh_or_group, "get_group") else mesh_or_group
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a plain tensor unchanged)."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_from_local(local: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The whole tensor of which ``local`` is this rank's part, laid out like ``like`` (a collective)."""
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    ).full_tensor()


def local_part(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's part of ``full`` in ``like``'s layout (a local slice, no communication)."""
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def is_shard(placement) -> bool:
    """Whether a DTensor placement cuts a tensor dim (``Shard`` or FSDP's strided shard)."""
    return isinstance(placement, (Shard, _StridedShard))


def shard_on(placement, dim: int):
    """A shard placement (`is_shard`) moved to tensor dim ``dim``, its stride kept."""
    if isinstance(placement, _StridedShard):
        return _StridedShard(dim, split_factor=placement.split_factor)
    return Shard(dim)


def holds_whole_matrices(p: torch.Tensor) -> bool:
    """Whether this rank's part of ``p`` is made of whole matrices: a plain tensor, a replicated
    DTensor, or a stack of matrices (experts) sharded on its dim 0 only."""
    if not isinstance(p, DTensor):
        return True
    if p.ndim == 2:
        return all(isinstance(pl, Replicate) for pl in p.placements)
    return all(isinstance(pl, Replicate) or (is_shard(pl) and pl.dim == 0) for pl in p.placements)


def mesh_ranks(mesh, same_as_me: str | None = None) -> list[int]:
    """The global ranks of a DeviceMesh, ascending (a process group's rank order); with
    ``same_as_me``, a dim name, only those whose coordinate on it is this rank's."""
    ranks = mesh.mesh
    if same_as_me is not None:
        dim = mesh.mesh_dim_names.index(same_as_me)
        ranks = ranks.select(dim, mesh.get_coordinate()[dim])
    return sorted(ranks.flatten().tolist())


def is_first_replica(p: DTensor) -> bool:
    """Whether this rank's part of ``p`` is its first copy: coordinate 0 on every mesh dim that
    replicates it. The first copies of all ranks make the whole tensor, each element once."""
    coordinate = p.device_mesh.get_coordinate()
    return all(c == 0 for c, pl in zip(coordinate, p.placements) if not is_shard(pl))


def local_flat_indices(p: DTensor) -> torch.Tensor:
    """Where each element of this rank's part of the 2-D ``p`` sits in the whole tensor (flat,
    row-major indices, int64, in the local part's order), read from DTensor's own slicing
    (`local_part`) of row and column index grids: any placements, strided or uneven shards. The
    grids are broadcast views, so only the local part is materialised."""
    rows, cols = p.shape
    r = torch.arange(rows, device=p.device).view(-1, 1).expand(rows, cols)
    c = torch.arange(cols, device=p.device).view(1, -1).expand(rows, cols)
    return (local_part(r, p) * cols + local_part(c, p)).reshape(-1)
