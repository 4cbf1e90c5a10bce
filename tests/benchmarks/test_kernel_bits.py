"""benchmarks/kernel_bits.py runs and reports, and whatever kernels this CPU takes, the batched
Newton-Schulz gives each matrix the same bits at every position of its batch (docs/numerics.md).

The script runs as `__main__` in this process (runpy): a process of its own would only add an
import of torch (the kernels are the process's settings, ATEN_CPU_CAPABILITY and MKL's, which
this process shares)."""

import runpy
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.numerics  # docs/numerics.md

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_bits.py"


def test_kernel_bits_reports_and_the_batched_ns_is_position_independent(capsys):
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(BENCH), run_name="__main__")  # sets one thread, as run_train.sh runs on CPU
    finally:
        torch.set_num_threads(threads)
    line = capsys.readouterr().out.strip()
    assert line.startswith("ATen ") and "| fp32 GEMM bits " in line and "contiguous bmm position-independent: " in line
    assert line.endswith("batched_newton_schulz position-independent: True"), line
