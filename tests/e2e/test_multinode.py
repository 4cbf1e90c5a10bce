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
from trainer.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]


def _launch(tmp_path, node_rank: int, port: int, nnodes: int, ngpu: int, *args, env: dict | None = None):
    env = {
        **os.environ,
        **(env or {}),
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


@pytest.mark.slow
def test_a_node_whose_workers_hang_at_start_is_not_called_a_failed_rendezvous(tmp_path):
    # The second node's workers are started (the rendezvous completed) but hang before the trainer
    # runs; the first node's rank gives up after comm.init_timeout_seconds and the job ends. The
    # hanging node must not blame the rendezvous, which succeeded.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, time\n"
        "if os.environ.get('LOCAL_RANK') is not None and os.environ.get('HANG_AT_START'):\n"
        "    time.sleep(600)\n"
    )
    hang = {"HANG_AT_START": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    for node in "ab":
        (tmp_path / node).mkdir()
    port = free_port()
    # The wait that ends the job: the hung node's worker never comes, so any length shows it; a
    # short one keeps the test from idling (the first node's own start-up is not under it).
    init_timeout = 4
    args = ["--training.steps", "2", "--training.device", "cpu", "--comm.init_timeout_seconds", str(init_timeout)]
    procs = [_launch(tmp_path / "a", 0, port, 2, 1, *args), _launch(tmp_path / "b", 1, port, 2, 1, *args, env=hang)]
    try:
        good, hung = (p.communicate(timeout=300)[0] for p in procs)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 2 and f"comm.init_timeout_seconds = {init_timeout} s while starting" in good, good[-3000:]
    assert procs[1].returncode == 2, hung[-3000:]
    assert f"error: node 1: the rendezvous at 127.0.0.1:{port} succeeded, but no worker of this node got ready" in hung
    assert "never started" not in hung and "Traceback" not in hung, hung[-3000:]


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
