"""Local gloo process groups for the distributed tests and the benchmarks: a free port, joining
the group, and ``spawn_local``, which runs a function on N spawned ranks and collects what they
queue (torchrun is for the trainer itself; these tests need a function per rank and its results).
"""

from __future__ import annotations

import os
import queue as queue_lib
import shutil
import socket
import subprocess
import time
import traceback
from typing import Any, Callable, NoReturn

import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.distributed import exit_process


def free_port() -> int:
    """A TCP port of 127.0.0.1 that is free now, for the rendezvous of a local process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lighthouse(port: int, *flags: str) -> subprocess.Popen:
    """torchft's lighthouse binary on ``port`` of this machine, in a session of its own, once it
    accepts connections (its start imports torch: seconds); ``flags`` add to torchft's example ones."""
    proc = subprocess.Popen(
        [shutil.which("torchft_lighthouse"), "--min_replicas", "1", "--quorum_tick_ms", "100", *flags,
         "--bind", f"[::]:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the torchft lighthouse did not start on port {port}") from None
            time.sleep(0.2)


def init_local_gloo(rank: int, world: int, port: int) -> None:
    """Join the `world`-rank gloo default group of this machine that meets at `port`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def set_torchrun_env(rank: int, world: int, port: int) -> None:
    """The environment torchrun gives one of ``world`` workers on this machine meeting at ``port``
    (rank, local rank, world sizes, master address and port): what a `Trainer` in a spawned rank
    initialises its process group from (env://), as under run_train.sh."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )


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


def spawn_local_jobs(jobs: dict[str, tuple], world: int, timeout: float = 600) -> dict[str, list[Any]]:
    """Several `spawn_local` targets in one spawn of `world` ranks: each rank runs the jobs
    (name -> (target, args) or (target, args, job_world)) one after another, each as
    `target(rank, job_world, port, *args, queue)` on the first `job_world` ranks (default `world`)
    with a port of its own (a target joins a group there and destroys it when done), and returns
    what each job queued (one item per rank it ran on) by name. Starting the ranks (an import of
    torch each) costs more than a short check, so checks of up to the same world size share one
    start."""
    names = list(jobs)
    specs = [(job[0], job[1], job[2] if len(job) > 2 else world) for job in jobs.values()]
    assert all(1 <= job_world <= world for _, _, job_world in specs), specs
    ports: list[int] = []
    while len(ports) < len(names) - 1:  # the first job gets `spawn_local`'s own port
        port = free_port()
        if port not in ports:
            ports.append(port)
    expected = sum(job_world for _, _, job_world in specs)
    items = spawn_local(_run_jobs, world, ports, specs, results=expected, timeout=timeout)
    out: dict[str, list[Any]] = {name: [] for name in names}
    for index, item in items:
        out[names[index]].append(item)
    return out


class _JobQueue:
    """What a `spawn_local_jobs` target sees as its queue: puts carry the job's index."""

    def __init__(self, queue, index: int):
        self._queue, self._index = queue, index

    def put(self, item: Any) -> None:
        self._queue.put((self._index, item))


def _run_jobs(
    rank: int, world: int, port: int, ports: list[int], jobs: list[tuple[Callable, tuple, int]], queue
) -> None:
    for index, ((target, args, job_world), job_port) in enumerate(zip(jobs, [port, *ports], strict=True)):
        if rank < job_world:
            target(rank, job_world, job_port, *args, _JobQueue(queue, index))


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
