"""Multi-node launch as a user runs it: two ``run_train.sh`` "nodes" on this machine form one
4-rank job (torchrun c10d rendezvous, gloo on CPU) with HSDP across the nodes and EP inside.
"""

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, node_rank: int, port: int, nnodes: int, ngpu: int, *args):
    env = {
        **os.environ,
        "NNODES": str(nnodes),
        "NGPU": str(ngpu),
        "NODE_RANK": str(node_rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    return subprocess.Popen(
        ["bash", str(REPO / "run_train.sh"), "--job.dump_folder", str(tmp_path / "run"), *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_two_nodes_train_three_steps(tmp_path):
    port = _free_port()
    args = [
        "--training.steps", "3", "--training.seq_len", "64", "--training.local_batch_size", "1",
        "--training.device", "cpu", "--metrics.log_freq", "1",
        "--validation.freq", "3", "--validation.steps", "2",
        "--parallelism.dp_replicate", "2", "--parallelism.ep", "2",
    ]
    procs = [_launch(tmp_path, rank, port, 2, 2, *args) for rank in (0, 1)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-5000:]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3], records  # one writer: rank 0
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 for r in steps)
    assert any("val_loss" in r and r["step"] == 3 for r in records)
    assert "world size 4 = dp_replicate 2 x dp_shard 2 x cp 1 x tp 1 | ep 2" in outs[0], outs[0][-3000:]


def test_impossible_layout_fails_before_process_groups(tmp_path):
    # dp_replicate 3 cannot divide 2 ranks: every rank stops in config validation, before
    # init_process_group, with the same message naming the product and what would fit.
    proc = subprocess.run(
        ["bash", str(REPO / "run_train.sh"), "--job.dump_folder", str(tmp_path / "run"),
         "--training.device", "cpu", "--parallelism.dp_replicate", "3"],
        cwd=tmp_path,
        env={**os.environ, "NGPU": "2", "MASTER_PORT": str(_free_port()), "CUDA_VISIBLE_DEVICES": "",
             "LOG_RANK": "0,1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "dp_replicate x cp x tp = 3 x 1 x 1 = 3 does not divide the world size 2" in out, out[-3000:]
    assert "config error: [parallelism]" in out
    assert not (tmp_path / "run").exists()
