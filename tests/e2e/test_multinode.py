"""Multi-node launch as a user runs it: two ``run_train.sh`` "nodes" on this machine form one
4-rank job (torchrun c10d rendezvous, gloo on CPU): TP 2 inside each node, and across the nodes
FSDP 2 whose ranks also form the expert mesh used as context parallelism (EP-as-CP), with per-op
activation checkpointing. Every rank
reads the same sequences (data-parallel degree 1), so the training and validation losses must
equal those of one process, which also checks validation under TP and CP.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.diagnostics import free_port
from trainer.run_folder import latest_run_folder
from trainer.train import Trainer

REPO = Path(__file__).resolve().parents[2]


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


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_nodes_train_and_validate_like_one_process(tmp_path):
    port = free_port()
    args = [
        "--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "1",
        "--training.device", "cpu", "--metrics.log_freq", "1", "--job.print_config=false",
        "--validation.freq", "2", "--validation.steps", "2",
    ]
    layout = [
        "--parallelism.dp_shard", "2", "--parallelism.ep", "2", "--parallelism.ep_as_cp", "--parallelism.tp", "2",
        # per-op SAC around MoE blocks (on torch < 2.13 their routed experts are their own FSDP
        # unit, whose hooks run inside the recomputed region)
        "--activation_checkpoint.mode", "op",
    ]
    procs = [_launch(tmp_path, rank, port, 2, 2, *args, *layout) for rank in (0, 1)]
    # The one-process reference runs meanwhile (same config, same data, same initial weights).
    config = ["--config", str(REPO / "train_configs/debug_model.toml")]  # run_train.sh's default
    reference = Trainer(load_config([*config, *args, "--job.dump_folder", str(tmp_path / "single")]))
    try:
        reference.train()
    finally:
        reference.close()
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
    # The c10d rendezvous hands out node ranks in arrival order: global rank 0 (the one that logs)
    # may be on either "node".
    header = "world size 4 = pp 1 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 2 | ep 2, ep_as_cp"
    assert any(header in out for out in outs), [out[-3000:] for out in outs]
    records, expected = _records(latest_run_folder(tmp_path / "run")), _records(reference.run_dir)
    assert [r["step"] for r in records if "loss" in r] == [1, 2], records  # one writer: rank 0
    for key in ("loss", "val_loss"):
        got = {r["step"]: r[key] for r in records if key in r}
        want = {r["step"]: r[key] for r in expected if key in r}
        assert sorted(got) == sorted(want) and got, (key, got, want)
        for step in want:
            # fp32 on both sides; only the order of the sums differs between the layouts.
            assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (key, step, got[step], want[step])


def test_impossible_layout_fails_before_process_groups(tmp_path):
    # dp_replicate 3 cannot divide 2 ranks: run_train.sh's pre-launch check stops before any
    # process starts, with one message naming the product and what would fit.
    proc = subprocess.run(
        ["bash", str(REPO / "run_train.sh"), "--job.dump_folder", str(tmp_path / "run"),
         "--training.device", "cpu", "--parallelism.dp_replicate", "3"],
        cwd=tmp_path,
        env={**os.environ, "NGPU": "2", "MASTER_PORT": str(free_port()), "CUDA_VISIBLE_DEVICES": "",
             "LOG_RANK": "0,1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2
    assert "dp_replicate x cp x tp = 3 x 1 x 1 = 3 does not divide the world size 2" in out, out[-3000:]
    assert proc.stderr.startswith("config error: cannot infer parallelism.dp_shard") and "Traceback" not in out
    assert not (tmp_path / "run").exists()
