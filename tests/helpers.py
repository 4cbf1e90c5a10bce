"""Helpers the tests of several tiers share (a test module never imports another test module).

- `flip_bytes`: damage a checkpoint file in place (tests/unit/test_checkpoint.py, tests/e2e/test_resume.py);
- `tamper_metadata`, `tamper_entry`: make a checkpoint's `.metadata`, or one of its non-tensor entries, a
  pickle that creates a sentinel file when unpickled and then gives the real value, and update the
  `COMPLETE` marker's checksums to match, as anyone who can write the folder can (same files);
- `step_trainer`, `profiled_step`, `ATOMIC_OPS`: one profiled training step of the debug model and
  what it must not do (tests/unit/test_step_sync.py, tests/distributed/step_sync_worker.py).
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import pickle
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from trainer.checkpoint import COMPLETE
from trainer.checkpoint.integrity import sha256_file
from trainer.config import load_config
from trainer.diagnostics import HostReadCounter
from trainer.trainer import Trainer

ATOMIC_OPS = ("aten::index_add", "aten::index_add_", "aten::index_put", "aten::index_put_")


def flip_bytes(path: Path, count: int = 4096) -> None:
    """Inverts `count` bytes in the middle of `path`; its size stays the same."""
    data = bytearray(path.read_bytes())
    middle = (len(data) - count) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    path.write_bytes(bytes(data))


def touch_then(sentinel: str, value):
    """What a tampered pickle calls: creates `sentinel`, returns `value`."""
    Path(sentinel).touch()
    return value


class Touches:
    """Pickles as a call of `touch_then(sentinel, value)`: unpickling it creates `sentinel` and gives `value`."""

    def __init__(self, sentinel: Path, value):
        self.sentinel, self.value = str(sentinel), value

    def __reduce__(self):
        return touch_then, (self.sentinel, self.value)


def reseal(folder: Path) -> None:
    """Records the current size and SHA-256 of every file of `folder` in its `COMPLETE` marker."""
    marker = json.loads((folder / COMPLETE).read_text())
    marker["files"] = {name: {"bytes": (folder / name).stat().st_size, "sha256": sha256_file(folder / name)}
                       for name in marker["files"]}
    (folder / COMPLETE).write_text(json.dumps(marker))


def _read_metadata(folder: Path):
    with open(folder / ".metadata", "rb") as f:
        return pickle.load(f)  # a checkpoint the test itself saved


def tamper_metadata(folder: Path, sentinel: Path) -> None:
    """`.metadata` of `folder` becomes a pickle that creates `sentinel`, then returns the real metadata."""
    metadata = _read_metadata(folder)
    (folder / ".metadata").write_bytes(pickle.dumps(Touches(sentinel, metadata)))
    reseal(folder)


def tamper_entry(folder: Path, fqn: str, sentinel: Path, as_torch_save: bool = True) -> Path:
    """The non-tensor entry `fqn` of `folder` becomes a pickle (in a torch.save archive as DCP
    writes them, or bare) that creates `sentinel`, then returns the saved value: appended to its
    shard file, with `.metadata` pointing at it. Returns the shard file."""
    metadata = _read_metadata(folder)
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    shard = folder / info.relative_path
    with open(shard, "rb") as f:
        f.seek(info.offset)
        value = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
    if as_torch_save:
        buffer = io.BytesIO()
        torch.save(Touches(sentinel, value), buffer)
        payload = buffer.getvalue()
    else:
        payload = pickle.dumps(Touches(sentinel, value))
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(folder)
    return shard


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
