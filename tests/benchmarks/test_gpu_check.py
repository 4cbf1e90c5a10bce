"""benchmarks/gpu_check.sh: skips without CUDA, and its commands and table work (dry run on CPU)."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


def _run(tmp_path, **env):
    env = {**os.environ, "GPU_CHECK_OUT": str(tmp_path), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without a CUDA device")
def test_skips_with_a_clear_message_without_cuda(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device here" in proc.stdout and "GPU_CHECK_DRY_RUN=1" in proc.stdout
    assert not list(tmp_path.iterdir())  # nothing ran


@pytest.mark.slow
def test_dry_run_runs_every_measurement_and_prints_one_table(tmp_path):
    proc = _run(tmp_path, GPU_CHECK_DRY_RUN="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = proc.stdout[proc.stdout.index("| measurement | figure | value |"):]
    for figure in ("tokens/s", "MFU %", "estimate / measured peak", "kernel launches per step",
                   "host syncs per step", "time / dense ideal", "skipped", "weight casts MiB per step",
                   "tokens/s ratio (keep FSDP2 on one process only if > 1.03)", "step time on / off", "optimizer step ms",
                   "host reads per optimizer step", "optimizer step time ratio"):
        assert f"| {figure} |" in table, figure
    assert "n_layers=2" in table and "failed" not in table
    a = json.loads((tmp_path / "A.json").read_text())
    assert a["variants"]["eager"]["kernel_launches"] > 0
    assert (tmp_path / "traces" / "eager_step0.json").exists()
    # bf16 on one process: FSDP2 casts each weight once per step (trainer/diagnostics/weight_casts.py).
    assert json.loads((tmp_path / "E.json").read_text())["variants"]["eager"]["weight_cast_bytes"] > 0
    assert "eager_float8" in json.loads((tmp_path / "D.json").read_text())["skipped"]
    # F: the one-process cast policies side by side, each with its own tokens/s and peak memory.
    f = json.loads((tmp_path / "F.json").read_text())["variants"]
    assert list(f) == ["eager", "eager_autocast"] and all(r["peak_mem_mib"] > 0 for r in f.values())
    assert "| F debugmodel bf16 1x32 eager_autocast | peak memory MiB |" in table
    # H: the optimizer step of AdamW fp32 / bf16 states and Muon (issue 32).
    h = json.loads((tmp_path / "H.json").read_text())
    assert [(r["optimizer"], r["state_dtype"]) for r in h] == [("AdamW", "float32"), ("AdamW", "bfloat16"),
                                                              ("muon", "float32")]
    assert all(r["step_ms"] > 0 and r["host_reads"] == 0 for r in h) and h[2]["ns_calls_max"] > 0
    # Batched vs per-matrix expert NS: a figure, not a verdict (fp32 on a CPU with several threads
    # may differ in the last bits, docs/optimizers.md).
    assert "| bitwise equal |" in table and "| max abs difference |" in table
