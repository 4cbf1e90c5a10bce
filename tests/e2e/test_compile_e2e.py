"""`run_train.sh --training.compile` as a user runs it (CPU, debug model)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from trainer.run_folder import latest_run_folder

pytestmark = pytest.mark.numerics  # docs/numerics.md

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_run_train_with_compile(tmp_path):
    # Batch 2 x 64 tokens: the shapes of tests/unit/test_compile.py, so the two share their
    # graphs through the session's inductor cache (tests/conftest.py). No validation: its
    # no-grad graphs would add a third of this test's compile time on a 2-core CI machine.
    args = [
        "--training.compile", "--training.steps", "20", "--training.seq_len", "64",
        "--training.local_batch_size", "2", "--metrics.log_freq", "5", "--no-validation.enable",
    ]
    proc = subprocess.run(
        ["bash", str(REPO / "run_train.sh"), "--job.dump_folder", str(tmp_path / "run"), *args],
        cwd=tmp_path,
        env={**os.environ, "NGPU": "1"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = latest_run_folder(tmp_path / "run")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 5, 10, 15, 20]
    assert all(r["loss"] == r["loss"] and r["loss"] < 10.0 for r in train)  # finite, sane
    # Step 1 is ~9.5 (ln 8192 = 9.01 plus init noise); 20 steps at the debug LR reach ~7.6.
    assert train[-1]["loss"] < 0.9 * train[0]["loss"]
    config = (run_dir / "config.toml").read_text()
    assert "compile = true" in config
    # The first step compiles for a while: the log says so before it.
    assert "compiling ..." in proc.stdout and proc.stdout.index("compiling ...") < proc.stdout.index("step  1/20")
