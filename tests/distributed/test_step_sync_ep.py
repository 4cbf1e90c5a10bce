"""Under expert parallelism a training step may read the device once more per MoE layer and
micro-batch: the all-to-all split sizes, the one documented sync of the EP dispatcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.diagnostics import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("step_sync_ep") / "reads.json"
    cmd = [sys.executable, "-m", "tests.distributed.step_sync_worker", "--out", str(out), "--port", str(free_port())]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_ep_step_reads_the_device_once_per_moe_layer_beyond_three(ranks):
    assert len(ranks) == 2
    for r in ranks:
        assert r["moe_layers"] > 0 and r["loss"] > 0
        allowed = 3 + r["moe_layers"] * r["micro_batches"]
        assert sum(r["reads"].values()) <= allowed, r


def test_ep_step_has_no_atomic_scatter(ranks):
    assert not any(r["atomic_ops"] for r in ranks), ranks
