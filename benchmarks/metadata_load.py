"""What reading `.metadata` with the allow-list unpickler costs, next to plain `pickle.load`.

A DCP checkpoint's `.metadata` indexes every chunk of every tensor and every non-tensor entry, so
it grows with the model and the number of ranks that wrote it. This builds a synthetic one of the
size the 671B dry run's layout would write (the 671B flavor's state dict, built on the meta device;
pp 16 x FSDP 128 with EP 64 on 2048 ranks, so each tensor of a stage in 128 chunks), with the
entries a checkpoint of this trainer holds per parameter (the weight; AdamW's `step`, `exp_avg`,
`exp_avg_sq`; 12 param-group values) and per rank (`rank_state_R`: the data position and RNG
states), pickles it as DCP does, and times reading it back with `pickle.load` (DCP's
`FileSystemReader.read_metadata`) and with `trainer.checkpoint.safe_load.read_metadata` (the
allow-list unpickler every load of the trainer uses). Each read runs in a fresh process, as a
resume reads `.metadata` once at its start: with the 2 million objects of another copy alive,
Python's garbage collector would take seconds of its own, landing on whichever read triggers it.
Median of `--repeats` reads of each, alternating, with the file in the page cache; wall-clock
and CPU seconds of the read alone (not the child's start-up).

Then the other half of a safe load: the CPU time per non-tensor entry of `torch.load` with
`weights_only=True` and `ENTRY_GLOBALS` (`WeightsOnlyLoadPlanner`) next to `weights_only=False`
(DCP's default planner), for the values a checkpoint holds: an AdamW param group's 12 values, a
data-loader position, and the python and numpy RNG states; and how many such entries one rank of
the layout loads (its pipeline stage's param-group values and its own rank state).

    python benchmarks/metadata_load.py                           # the 671B layout
    python benchmarks/metadata_load.py --flavor debugmodel --chunks 2 --ranks 2
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from models.deepseek_v3 import DeepSeekV3Model, get_flavor
from trainer.checkpoint.safe_load import ENTRY_GLOBALS, read_metadata

# What this trainer's AdamW checkpoint holds per parameter besides the weight (a debug-model checkpoint's keys).
OPTIMIZER_TENSORS = ("step", "exp_avg", "exp_avg_sq")
PARAM_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                    "differentiable", "fused", "decoupled_weight_decay", "initial_lr")
RANK_BYTES = ("dataloader.version", "dataloader.epoch", "dataloader.doc_pos", "dataloader.buffer",
              "dataloader.stream_state", "dataloader.rows_served", "rng.python", "rng.numpy")
RANK_TENSORS = ("rng.torch", "rng.cuda")
OTHER_BYTES = ("lr_scheduler.base_lrs", "lr_scheduler.last_epoch", "lr_scheduler._step_count",
               "lr_scheduler._is_initial", "lr_scheduler._get_lr_called_within_step", "lr_scheduler._last_lr",
               "lr_scheduler.lr_lambdas", "train_state.step", "train_state.skipped_total", "train_state.seq_len",
               "train_state.global_batch_size")


class _Builder:
    """Accumulates the three maps of a DCP `Metadata` and where each entry's bytes would lie."""

    def __init__(self, ranks: int):
        self.ranks = ranks
        self.entries, self.storage, self.planner = {}, {}, {}
        self.next_rank = 0
        self.offsets = [0] * ranks

    def _place(self, index: MetadataIndex, length: int) -> None:
        rank = self.next_rank
        self.next_rank = (rank + 1) % self.ranks
        self.storage[index] = _StorageInfo(f"__{rank}_0.distcp", self.offsets[rank], length)
        self.offsets[rank] += length

    def tensor(self, fqn: str, shape: tuple[int, ...], dtype: torch.dtype, chunks: int) -> None:
        size = torch.Size(shape)
        rows = shape[0] if shape else 1
        pieces = []
        for i in range(min(chunks, rows)):
            start, stop = rows * i // chunks, rows * (i + 1) // chunks
            if stop > start:
                offsets = torch.Size((start, *([0] * (len(shape) - 1)))) if shape else torch.Size(())
                sizes = torch.Size((stop - start, *shape[1:])) if shape else torch.Size(())
                pieces.append(ChunkStorageMetadata(offsets, sizes))
                self._place(MetadataIndex(fqn, offsets, len(pieces) - 1), sizes.numel() * dtype.itemsize)
        self.entries[fqn] = TensorStorageMetadata(TensorProperties(dtype), size, pieces)
        self.planner[fqn] = tuple(fqn.split(".", 1))

    def bytes(self, fqn: str) -> None:
        self.entries[fqn] = BytesStorageMetadata()
        self._place(MetadataIndex(fqn), 900)  # a torch.save archive of one small value
        self.planner[fqn] = tuple(fqn.split(".", 1))


def synthetic_metadata(flavor: str, chunks: int, ranks: int) -> Metadata:
    with torch.device("meta"):
        model = DeepSeekV3Model(get_flavor(flavor))
    params = dict(model.named_parameters())
    b = _Builder(ranks)
    for name, tensor in model.state_dict().items():
        b.tensor(f"model.{name}", tuple(tensor.shape), torch.float32, chunks)
        if name not in params:
            continue  # a buffer (the MoE routing bias): no optimizer state
        b.tensor(f"optimizer.state.{name}.step", (), torch.float32, 1)
        for moment in OPTIMIZER_TENSORS[1:]:
            b.tensor(f"optimizer.state.{name}.{moment}", tuple(tensor.shape), torch.float32, chunks)
        for key in PARAM_GROUP_KEYS:
            b.bytes(f"optimizer.param_groups.{name}.{key}")
    for key in OTHER_BYTES:
        b.bytes(key)
    for rank in range(ranks):
        for key in RANK_BYTES:
            b.bytes(f"rank_state_{rank}.{key}")
        b.tensor(f"rank_state_{rank}.rng.torch", (5056,), torch.uint8, 1)
        b.tensor(f"rank_state_{rank}.rng.cuda", (16,), torch.uint8, 1)
    return Metadata(b.entries, planner_data=b.planner, storage_data=b.storage,
                    storage_meta=StorageMeta(checkpoint_id=Path("/checkpoints/step-1000.tmp"), save_id="synthetic"),
                    version="1.0.0")


def timed(fn) -> tuple[float, float]:
    """(wall, CPU) seconds of `fn()`."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def plain_load(file: Path):
    with open(file, "rb") as f:
        return pickle.load(f)


READERS = {"pickle_load": plain_load, "allow_list": read_metadata}


def entry_values() -> dict[str, list]:
    """The non-tensor values of a checkpoint, by kind (as `torch.save` archives when loaded)."""
    group = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3).param_groups[0]
    group["initial_lr"] = 1e-3
    position = {"version": 2, "epoch": 0, "doc_pos": 123456, "buffer": list(range(40)), "stream_state": None,
                "rows_served": 0}
    return {"param_group": [v for k, v in group.items() if k != "params"],
            "rank_state": [*position.values(), random.getstate(), np.random.get_state()]}


def entry_cpu_us(values: list, weights_only: bool, rounds: int = 100) -> float:
    """CPU microseconds per `torch.load` of one of `values`, saved as DCP saves a non-tensor entry."""
    archives = []
    for value in values:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        archives.append(buffer.getvalue())
    start = time.process_time()
    for _ in range(rounds):
        for archive in archives:
            if weights_only:
                with torch.serialization.safe_globals(ENTRY_GLOBALS):
                    torch.load(io.BytesIO(archive), weights_only=True)
            else:
                torch.load(io.BytesIO(archive), weights_only=False)
    return (time.process_time() - start) / (rounds * len(archives)) * 1e6


def read_in_child(reader: str, file: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of one `READERS[reader]` read of `file` in a fresh process."""
    out = subprocess.run([sys.executable, __file__, "--child", reader, str(file)], check=True,
                         capture_output=True, text=True).stdout
    return tuple(json.loads(out))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="671B")
    p.add_argument("--chunks", type=int, default=128, help="chunks per tensor (the ranks of a pipeline stage)")
    p.add_argument("--ranks", type=int, default=2048, help="ranks that wrote it (one rank_state_R each)")
    p.add_argument("--pp", type=int, default=16, help="pipeline stages (a rank loads its stage's param groups)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--child", nargs=2, metavar=("READER", "FILE"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(timed(lambda: READERS[a.child[0]](Path(a.child[1])))))
        return 0
    start = time.perf_counter()
    metadata = synthetic_metadata(a.flavor, a.chunks, a.ranks)
    built_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory(prefix="metadata_load_") as tmp:
        file = Path(tmp) / ".metadata"
        with open(file, "wb") as f:
            pickle.dump(metadata, f)  # as DCP's FileSystemWriter writes it
        assert read_metadata(file) == plain_load(file) == metadata
        entries, chunks = len(metadata.state_dict_metadata), len(metadata.storage_data)
        group_entries = sum(k.startswith("optimizer.param_groups.") for k in metadata.state_dict_metadata)
        del metadata
        times = {name: [] for name in READERS}
        for i in range(a.repeats):
            for name in list(READERS)[:: 1 if i % 2 == 0 else -1]:
                times[name].append(read_in_child(name, file))
        size_mib = file.stat().st_size / 2**20
    result = {
        "flavor": a.flavor, "chunks_per_tensor": a.chunks, "ranks": a.ranks, "entries": entries, "chunks": chunks,
        "metadata_mib": round(size_mib, 1), "build_s": round(built_s, 1), "repeats": a.repeats,
        "torch": torch.__version__, "load_average": round(os.getloadavg()[0], 2),
        **{f"{name}_wall_s": round(statistics.median(t[0] for t in ts), 3) for name, ts in times.items()},
        **{f"{name}_cpu_s": round(statistics.median(t[1] for t in ts), 3) for name, ts in times.items()},
    }
    result["allow_list_over_pickle_cpu"] = round(result["allow_list_cpu_s"] / result["pickle_load_cpu_s"], 3)
    result["entries_per_rank"] = round(group_entries / a.pp) + len(RANK_BYTES)
    for kind, values in entry_values().items():
        for weights_only in (False, True):
            us = statistics.median(entry_cpu_us(values, weights_only) for _ in range(a.repeats))
            result[f"{kind}_entry_{'weights_only' if weights_only else 'full'}_cpu_us"] = round(us, 1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
