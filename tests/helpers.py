"""Helpers the tests of several tiers share (a test module never imports another test module).

- `flip_bytes`: damage a checkpoint file in place (tests/unit/test_checkpoint.py, tests/e2e/test_resume.py);
- `step_trainer`, `profiled_step`, `ATOMIC_OPS`: one profiled training step of the debug model and
  what it must not do (tests/unit/test_step_sync.py, tests/distributed/step_sync_worker.py).
"""

from __future__ import annotations

import collections
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from trainer.config import load_config
from trainer.diagnostics import HostReadCounter
from trainer.train import Trainer

ATOMIC_OPS = ("aten::index_add", "aten::index_add_", "aten::index_put", "aten::index_put_")


def flip_bytes(path: Path, count: int = 4096) -> None:
    """Inverts `count` bytes in the middle of `path`; its size stays the same."""
    data = bytearray(path.read_bytes())
    middle = (len(data) - count) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    path.write_bytes(bytes(data))


def step_trainer(tmp_path: Path, *extra: str) -> Trainer:
    """The debug model (grouped mm, fp32, seq_len 64, local batch 2) for two steps, run from the
    repository root."""
    cfg = load_config(
        [
            "--job.config_file", "train_configs/debug_model.toml",
            "--job.dump_folder", str(tmp_path / "run"),
            "--model.use_grouped_mm",
            "--training.seq_len", "64",
            "--training.local_batch_size", "2",
            "--training.mixed_precision_param", "float32",
            "--training.steps", "2",
            "--no-validation.enable",
            "--no-job.print_config",
            *extra,
        ]
    )
    return Trainer(cfg)


def profiled_step(trainer: Trainer):
    """Profiles and counts the second step (the first creates the optimizer state): its stats,
    host reads by kind and profiler op counts."""
    trainer.step = 1
    trainer.train_step(trainer.next_microbatches()[0])
    trainer.step = 2
    batches, _ = trainer.next_microbatches()
    reads = HostReadCounter("cpu")
    with profile(activities=[ProfilerActivity.CPU]) as prof, reads:
        stats = trainer.train_step(batches)
    ops = collections.Counter()
    for event in prof.events():
        ops[event.name] += 1
    return stats, reads.counts, ops
