"""benchmarks/kernel_bits.py runs and reports, and whatever kernels this CPU takes, the batched
Newton-Schulz gives each matrix the same bits at every position of its batch (docs/numerics.md)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.numerics  # docs/numerics.md

REPO = Path(__file__).resolve().parents[2]


def test_kernel_bits_reports_and_the_batched_ns_is_position_independent():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kernel_bits.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip()
    assert line.startswith("ATen ") and "| fp32 GEMM bits " in line and "contiguous bmm position-independent: " in line
    assert line.endswith("batched_newton_schulz position-independent: True"), line
