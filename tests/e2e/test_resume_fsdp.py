"""FSDP2 (2 gloo processes via run_train.sh/torchrun): exact resume at the same layout, and a
2-process checkpoint resharded by DCP into a single-process run."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from trainer.checkpoint import list_checkpoints

REPO = Path(__file__).resolve().parents[2]
ARGS = [
    "--training.steps", "4", "--training.seq_len", "64", "--training.local_batch_size", "2",
    "--training.mixed_precision_param", "float32", "--training.deterministic", "--no-validation.enable",
    "--metrics.log_freq", "1", "--job.print_config=false",
    "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0",
]


def run(run_dir: Path, nproc: int, *extra: str) -> str:
    env = {**os.environ, "NGPU": str(nproc), "MASTER_PORT": str(29500 + os.getpid() % 1000)}
    proc = subprocess.run(
        ["bash", str(REPO / "run_train.sh"), *ARGS, "--job.dump_folder", str(run_dir), *extra],
        cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r]


@pytest.mark.slow
def test_fsdp2_exact_resume_and_reshard_to_one_process(tmp_path):
    fsdp = tmp_path / "fsdp"
    run(fsdp, 2, "--parallelism.dp_shard", "2")
    straight = dict(losses(fsdp))
    assert sorted(straight) == [1, 2, 3, 4]
    single = tmp_path / "single"
    shutil.copytree(fsdp / "checkpoint", single / "checkpoint")

    # Lose the last checkpoint: the rerun resumes from step 2 and must repeat steps 3-4 exactly.
    shutil.rmtree(fsdp / "checkpoint" / "step-4")
    out = run(fsdp, 2, "--parallelism.dp_shard", "2")
    assert "resumed from" in out and "step-2 (step 2)" in out
    resumed = losses(fsdp)[4:]
    assert resumed == [(3, straight[3]), (4, straight[4])]

    # The sharded checkpoint loads into one process (DCP reshards); the data position cannot carry over.
    shutil.rmtree(single / "checkpoint" / "step-4")
    out = run(single, 1, "--training.steps", "3")
    assert "resumed from" in out and "data loader position not restored" in out
    assert [c.step for c in list_checkpoints(single / "checkpoint")] == [3, 2]
