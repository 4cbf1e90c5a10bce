"""A DCP checkpoint of row-sharded Engram tables loads at another embedding-parallel degree."""

import socket

import torch.multiprocessing as mp

import engram_worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, mode: str, ckpt_dir: str) -> None:
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        engram_worker.run_checkpoint, args=(world, _free_port(), mode, ckpt_dir, queue), nprocs=world,
        join=True, start_method="spawn",
    )
    results = dict(queue.get() for _ in range(world))
    assert all(r == {"ok": True} for r in results.values()), results


def test_save_at_degree_2_load_at_4_and_1(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _launch(2, "save", ckpt)
    _launch(4, "load", ckpt)
    _launch(1, "load", ckpt)
