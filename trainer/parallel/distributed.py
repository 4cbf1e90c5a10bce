"""Process-group setup/teardown, rank queries and the few reductions the training loop needs.

Everything the trainer calls here is a no-op on one process, so it calls it unguarded. The end
of the file starts local gloo process groups for the distributed tests and the benchmarks.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue as queue_lib
import socket
import sys
import time
import traceback
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank_from_env() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_distributed() -> bool:
    """Whether a default process group is up (False in a single-process run)."""
    return dist.is_available() and dist.is_initialized()


def init_distributed(device: torch.device) -> None:
    """Initialises the default process group (torchrun's env:// variables) when WORLD_SIZE > 1.

    gloo serves CPU tensors, NCCL CUDA tensors; on a GPU machine both backends are registered
    (``cpu:gloo,cuda:nccl``) so small CPU-side collectives keep working.
    """
    if world_size_from_env() == 1 or is_distributed():
        return
    dist.init_process_group(**_group_options(device))


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


def free_port() -> int:
    """A TCP port of 127.0.0.1 that is free now, for the rendezvous of a local process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_local_gloo(rank: int, world: int, port: int) -> None:
    """Join the `world`-rank gloo default group of this machine that meets at `port`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def spawn_local(target: Callable, world: int, *args, results: int | None = None, timeout: float = 600) -> list[Any]:
    """Run `target(rank, world, port, *args, queue)` in `world` spawned processes (a fresh port
    for `init_local_gloo`) and return the first `results` items (default: one per rank) they put
    on `queue`. A rank that exits with an error fails the call at once instead of leaving the
    others waiting on the queue until `timeout`."""
    ctx = mp.get_context("spawn")
    out_queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_run_rank, args=(target, rank, world, port, args, out_queue)) for rank in range(world)
    ]
    for p in procs:
        p.start()
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < (world if results is None else results):
            try:
                out.append(out_queue.get(timeout=1.0))
            except queue_lib.Empty:
                failed = {rank: p.exitcode for rank, p in enumerate(procs) if p.exitcode not in (None, 0)}
                if failed:
                    raise RuntimeError(f"ranks exited with errors (rank: exit code): {failed}") from None
                if all(p.exitcode is not None for p in procs):
                    raise RuntimeError(f"all {world} ranks exited after putting {len(out)} results") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no result from the {world} ranks within {timeout:.0f}s") from None
    except BaseException:
        # The other ranks would wait for the failed one in their next collective.
        for p in procs:
            p.terminate()
        raise
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.terminate()
                p.join()
    codes = [p.exitcode for p in procs]
    if any(code != 0 for code in codes):
        raise RuntimeError(f"ranks exited with {codes} (a rank still running 120 s after the results is terminated)")
    return out


def _run_rank(target: Callable, rank: int, world: int, port: int, args: tuple, out_queue) -> NoReturn:
    """One `spawn_local` rank: runs `target`, sends what it queued, and ends through
    `exit_process` (with the SystemExit code `target` raised, or 1 after the traceback of any
    other exception)."""
    code = 0
    try:
        target(rank, world, port, *args, out_queue)
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    # The queue's feeder thread writes in the background: wait for it before os._exit.
    out_queue.close()
    out_queue.join_thread()
    exit_process(code)
