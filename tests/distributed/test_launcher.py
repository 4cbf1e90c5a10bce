"""The local gloo launcher (`spawn_local`, `spawn_local_jobs`: trainer/diagnostics/launch.py) and the
collective helpers of trainer/distributed.py."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer.diagnostics import init_local_gloo, spawn_local, spawn_local_jobs
from trainer.distributed import all_ranks_any, all_reduce_sum, global_rank, global_world_size, is_distributed

REPO = Path(__file__).resolve().parents[2]


def _sum_ranks(rank: int, world: int, port: int, flag_rank: int, queue) -> None:
    init_local_gloo(rank, world, port)
    try:
        total = all_reduce_sum(torch.tensor([float(rank)]), torch.distributed.group.WORLD)
        queue.put((global_rank(), global_world_size(), total.item(), all_ranks_any(rank == flag_rank)))
    finally:
        torch.distributed.destroy_process_group()


def _rank1_dies(rank: int, world: int, port: int, error: BaseException, queue) -> None:
    if rank == 1:
        raise error
    time.sleep(600)  # rank 0 would wait for rank 1 in its next collective


def test_helpers_are_identities_on_one_process():
    assert not is_distributed() and global_rank() == 0 and global_world_size() == 1
    t = torch.ones(2)
    assert all_reduce_sum(t, None) is t and t.tolist() == [1.0, 1.0]
    assert all_ranks_any(True) and not all_ranks_any(False)


def test_spawn_local_returns_every_rank_result_and_runs_jobs_in_turn():
    # Two jobs in one spawn (`spawn_local_jobs`, through `spawn_local`), each in a process group of
    # its own: only rank 1 raises its flag in the first, no rank in the second; every rank learns
    # whether some rank did, and each job's results come back under its name.
    results = spawn_local_jobs({"rank 1 flags": (_sum_ranks, (1,)), "none flags": (_sum_ranks, (2,))}, 2)
    assert {name: sorted(items) for name, items in results.items()} == {
        "rank 1 flags": [(0, 2, 1.0, True), (1, 2, 1.0, True)],
        "none flags": [(0, 2, 1.0, False), (1, 2, 1.0, False)],
    }


@pytest.mark.parametrize("error, code", [(SystemExit(3), 3), (ValueError("bad shard"), 1)])
def test_spawn_local_fails_fast_when_a_rank_dies(error, code):
    # Rank 0 never puts a result: waiting out the timeout would raise TimeoutError, not this.
    with pytest.raises(RuntimeError, match=rf"rank: exit code\): \{{1: {code}\}}"):
        spawn_local(_rank1_dies, 2, error, timeout=300)


def test_exit_process_destroys_groups_runs_atexit_flushes_and_keeps_the_code(tmp_path):
    marker = tmp_path / "atexit.txt"
    script = "\n".join([
        "import atexit, sys, torch",
        "import torch.distributed as dist",
        "from trainer.distributed import exit_process, init_one_process_group",
        "init_one_process_group(torch.device('cpu'))",
        f"atexit.register(lambda: open({str(marker)!r}, 'w').write(f'initialized={{dist.is_initialized()}}'))",
        "sys.stdout.write('unflushed line')",
        "exit_process(3)",
    ])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "unflushed line"
    # The handlers ran, and after the process group was gone.
    assert marker.read_text() == "initialized=False"
