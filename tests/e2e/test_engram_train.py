"""train_configs/debug_engram.toml trains on one CPU process, and `CONFIG_FILE=train_configs/debug_engram.toml
NGPU=2 ./run_train.sh` (sharded tables, offloaded optimizer state, a checkpoint) as on one.

The one-process runs are in this process (tests/e2e/in_process.py)."""

import math
import os
import subprocess
from pathlib import Path

import pytest
from in_process import metrics_by_step, run_main

from models.engram import find_primes
from trainer.config import load_config
from trainer.diagnostics import free_port
from trainer.model_args import build_model_args

pytestmark = pytest.mark.numerics  # docs/numerics.md

REPO = Path(__file__).resolve().parents[2]
ENGRAM_CONFIG = REPO / "train_configs/debug_engram.toml"


@pytest.mark.slow
def test_debug_engram_trains(tmp_path, capsys):
    assert run_main(
        tmp_path, "--job.config_file", str(ENGRAM_CONFIG), "--job.dump_folder", str(tmp_path / "run"),
        "--training.steps", "30", "--training.seq_len", "128", "--validation.freq", "30",
        "--validation.steps", "4", "--metrics.log_freq", "10", "--no-job.print_config",
    ) == 0
    assert "engram: layers [1, 3]" in capsys.readouterr().out
    records = list(metrics_by_step(tmp_path / "run").values())
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert val[30] <= 0.85 * val[0], val
    last = records[-1]
    for layer in (1, 3):
        assert 0 < last[f"engram/gate_mean/layer{layer}"] < 1
        assert last[f"engram/gate_std/layer{layer}"] > 0
    assert last["engram/table_rows_per_rank"] > 8 * 4099
    assert last["engram/table_bytes_per_rank"] == 4 * 16 * last["engram/table_rows_per_rank"]


# Shared by the runs compared below: fp32 (the config's), deterministic, global batch 4.
PARITY = [
    "--training.steps", "10", "--training.seq_len", "64", "--training.local_batch_size", "2",
    "--training.global_batch_size", "4", "--training.deterministic", "--no-validation.enable",
    "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--no-job.print_config",
]


def _run(run: Path, nproc: int, *args: str) -> tuple[str, dict[int, dict]]:
    env = {**os.environ, "NGPU": str(nproc), "CONFIG_FILE": "train_configs/debug_engram.toml",
           "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run(
        ["bash", str(REPO / "run_train.sh"), "--job.dump_folder", str(run), *PARITY, *args],
        cwd=run.parent, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, metrics_by_step(run)


@pytest.mark.slow
def test_two_processes_sharded_match_one_process(tmp_path):
    """NGPU=2 with FSDP2, tables split over both ranks (embedding_parallel_degree 2, Adam state
    on the CPU, a checkpoint saved): 10 steps equal one process that splits the global batch the
    same way (2 micro-batches of 2), loss and gradient norm within 1e-5. One process taking the
    whole batch at once drifts further: the Engram gate amplifies fp32 rounding (docs/engram.md,
    "Parity with one process"). Whole tables on each of 2 ranks (degree 1) give the losses and
    gradient norms of sharded ones in tests/distributed/test_engram_checkpoint.py (which also
    resumes at other degrees), and through run_train.sh in
    tests/e2e/test_layout_parity.py::test_engram_pipeline_matches_one_process (engram_pp_2)."""
    sharded_out, sharded = _run(
        tmp_path / "sharded", 2, "--engram.embedding_parallel_degree", "2", "--engram.offload_optimizer_state",
        "--checkpoint.enable", "--checkpoint.interval", "10",
    )
    assert "engram 2" in sharded_out and "checkpoint step 10 saved" in sharded_out
    assert run_main(tmp_path, "--job.config_file", str(ENGRAM_CONFIG), "--job.dump_folder", str(tmp_path / "single"),
                    *PARITY) == 0
    single = metrics_by_step(tmp_path / "single")
    for step in range(1, 11):
        for key in ("loss", "grad_norm"):
            want = single[step][key]
            assert abs(sharded[step][key] - want) <= 1e-5 * abs(want), (step, key, sharded[step][key], want)
    assert sharded[10]["loss"] <= 0.95 * sharded[1]["loss"], sharded  # measured 9.64 -> 8.03
    # Rank 0 holds the first half (rounded up) of each table's rows.
    engram = build_model_args(load_config(["--config", str(ENGRAM_CONFIG)]), 8192, 0).engram
    primes = find_primes(engram)
    assert sharded[10]["engram/table_rows_per_rank"] == sum(math.ceil(sum(primes[i]) / 2) for i in engram.layer_ids)
