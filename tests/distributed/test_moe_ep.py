"""Expert parallelism over 2 gloo ranks: the all-to-all dispatcher gives the single-process
MoE's outputs and gradients, and reads the host once per MoE layer (the split sizes)."""

import socket

import torch.multiprocessing as mp

import moe_ep_worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ep2_matches_single_process_with_one_host_read_per_layer():
    world = 2
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        moe_ep_worker.run, args=(world, _free_port(), queue), nprocs=world, join=True, start_method="spawn"
    )
    results = dict(queue.get() for _ in range(world))
    for rank, r in results.items():
        assert isinstance(r, dict), f"rank {rank}: {r}"
        assert r["reads"] == ["tolist"] * moe_ep_worker.N_LAYERS, r
