"""`CONFIG_FILE=train_configs/debug_engram.toml ./run_train.sh` trains on one CPU process and on
two (sharded table, offloaded optimizer state, checkpoint resumed at another degree)."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from models.engram import find_primes
from trainer.config import load_config
from trainer.parallel.distributed import free_port
from trainer.run_folder import latest_run_folder
from trainer.train import build_model_args

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_debug_engram_trains(tmp_path):
    env = {**os.environ, "NGPU": "1", "CONFIG_FILE": "train_configs/debug_engram.toml", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", str(REPO / "run_train.sh"), "--job.dump_folder", str(tmp_path / "run"),
         "--training.steps", "30", "--training.seq_len", "128", "--validation.freq", "30",
         "--validation.steps", "4", "--metrics.log_freq", "10", "--no-job.print_config"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "engram: layers [1, 3]" in proc.stdout
    metrics = latest_run_folder(tmp_path / "run") / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert val[30] <= 0.85 * val[0], val
    last = records[-1]
    for layer in (1, 3):
        assert 0 < last[f"engram/gate_mean/layer{layer}"] < 1
        assert last[f"engram/gate_std/layer{layer}"] > 0
    assert last["engram/table_rows_per_rank"] > 8 * 4099
    assert last["engram/table_bytes_per_rank"] == 4 * 16 * last["engram/table_rows_per_rank"]


@pytest.mark.slow
def test_two_processes_sharded_table_trains(tmp_path):
    """NGPU=2 with FSDP2: the tables split over both ranks (embedding_parallel_degree 2), their
    Adam state on the CPU, a checkpoint saved. (Resuming at other degrees with the same losses:
    tests/distributed/test_engram_checkpoint.py.)"""
    run = tmp_path / "run"
    env = {**os.environ, "NGPU": "2", "CONFIG_FILE": "train_configs/debug_engram.toml", "OMP_NUM_THREADS": "1",
           "MASTER_PORT": str(free_port())}
    proc = subprocess.run(
        ["bash", str(REPO / "run_train.sh"), "--job.dump_folder", str(run), "--training.steps", "6",
         "--training.seq_len", "64", "--training.local_batch_size", "2", "--no-validation.enable",
         "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--no-job.print_config",
         "--engram.embedding_parallel_degree", "2", "--engram.offload_optimizer_state",
         "--checkpoint.enable", "--checkpoint.interval", "6"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "engram 2" in proc.stdout and "checkpoint step 6 saved" in proc.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    loss = {r["step"]: r["loss"] for r in records}
    assert loss[6] <= 0.95 * loss[1], loss  # measured 9.55 -> 8.86
    # Rank 0 holds the first half (rounded up) of each table's rows.
    engram = build_model_args(load_config(["--config", str(REPO / "train_configs/debug_engram.toml")]), 8192, 0).engram
    primes = find_primes(engram)
    assert records[-1]["engram/table_rows_per_rank"] == sum(math.ceil(sum(primes[i]) / 2) for i in engram.layer_ids)
