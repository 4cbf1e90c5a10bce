"""The local gloo launcher (`spawn_local`) and the collective helpers of trainer/parallel/distributed.py."""

import time

import pytest
import torch

from trainer.parallel.distributed import (
    all_ranks_any,
    all_reduce_sum,
    global_rank,
    global_world_size,
    init_local_gloo,
    is_distributed,
    spawn_local,
)


def _sum_ranks(rank: int, world: int, port: int, flag_rank: int, queue) -> None:
    init_local_gloo(rank, world, port)
    try:
        total = all_reduce_sum(torch.tensor([float(rank)]), torch.distributed.group.WORLD)
        queue.put((global_rank(), global_world_size(), total.item(), all_ranks_any(rank == flag_rank)))
    finally:
        torch.distributed.destroy_process_group()


def _rank1_dies(rank: int, world: int, port: int, queue) -> None:
    if rank == 1:
        raise SystemExit(3)
    time.sleep(600)  # rank 0 would wait for rank 1 in its next collective


def test_helpers_are_identities_on_one_process():
    assert not is_distributed() and global_rank() == 0 and global_world_size() == 1
    t = torch.ones(2)
    assert all_reduce_sum(t, None) is t and t.tolist() == [1.0, 1.0]
    assert all_ranks_any(True) and not all_ranks_any(False)


def test_spawn_local_returns_every_rank_result():
    # Only rank 1 raises its flag: every rank learns that some rank did.
    results = sorted(spawn_local(_sum_ranks, 2, 1))
    assert results == [(0, 2, 1.0, True), (1, 2, 1.0, True)]


def test_spawn_local_fails_fast_when_a_rank_dies():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank: exit code\): \{1: 3\}"):
        spawn_local(_rank1_dies, 2, timeout=300)
    assert time.monotonic() - start < 120
