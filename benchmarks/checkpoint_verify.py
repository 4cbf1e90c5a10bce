"""What checkpoint checksums cost: hashing at save, verifying at load, next to DCP's own save/load.

One process saves a state of `--mib` MiB of fp32 tensors with `torch.distributed.checkpoint`,
once with DCP's `FileSystemWriter` and once with the trainer's `ChecksumWriter` (which also
hashes each file it wrote: the save-side cost, paid in the background thread under async
saves), then times the load-side check (`checksum_problems`: size and SHA-256 of every file
against the record the trainer puts into the `COMPLETE` marker) next to the trainer's load of the
same folder (`dcp_load`: `dcp.load` through the reader that runs no code from the files). Loads are timed twice: with the files in the page cache (a resume right after the save)
and after dropping them from it with `posix_fadvise(DONTNEED)` (a resume on a fresh node reads
from the disk; on Linux this needs no privileges). Median of `--repeats` rounds, in wall-clock
seconds and in CPU seconds of the process (`time.process_time`), which another process on the
same cores moves much less than the wall clock.

In a multi-process run each rank hashes only the files it wrote, and the check deals the files
out over the ranks, so the per-rank cost is this figure for the rank's share of the checkpoint.

    python benchmarks/checkpoint_verify.py                     # 1024 MiB
    python benchmarks/checkpoint_verify.py --mib 64 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from trainer.checkpoint.folder import dcp_load
from trainer.checkpoint.integrity import ChecksumWriter, checksum_problems, record_checksums


def drop_page_cache(folder: Path) -> None:
    for path in folder.iterdir():
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def timed(fn) -> tuple[float, float]:
    """(wall, CPU) seconds of `fn()`."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def one_round(state: dict, root: Path, hash_first: bool) -> dict[str, tuple[float, float]]:
    plain, checked = root / "plain", root / "checked"
    for path in (plain, checked):
        shutil.rmtree(path, ignore_errors=True)
    saves = [
        ("save_s", lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(str(plain)), no_dist=True)),
        ("save_with_hash_s", lambda: dcp.save(state, storage_writer=ChecksumWriter(str(checked)), no_dist=True)),
    ]
    # The second save of a round writes while the first one's pages fill the page cache: the
    # order alternates over the rounds so that neither variant always pays for it.
    out = {key: timed(save) for key, save in (saves[::-1] if hash_first else saves)}
    files = record_checksums(checked)
    target = {k: torch.empty_like(v) for k, v in state.items()}
    for cache in ("warm", "cold"):
        if cache == "cold":
            drop_page_cache(checked)
        out[f"verify_{cache}_s"] = timed(lambda: checksum_problems(checked, files))
        if cache == "cold":
            drop_page_cache(checked)
        out[f"load_{cache}_s"] = timed(lambda: dcp_load(target, checked))
    assert not checksum_problems(checked, files)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1024, help="checkpoint size in MiB (fp32 tensors of 16 MiB)")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    generator = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(4 << 20, generator=generator) for i in range(max(1, a.mib // 16))}
    mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    with tempfile.TemporaryDirectory(prefix="ckpt_verify_", dir=a.dir) as tmp:
        rounds = [one_round(state, Path(tmp), hash_first=i % 2 == 1) for i in range(a.repeats)]
    med = {k: statistics.median(r[k][0] for r in rounds) for k in rounds[0]}
    cpu = {k: statistics.median(r[k][1] for r in rounds) for k in rounds[0]}
    result = {
        "mib": round(mib, 1), "repeats": a.repeats, "torch": torch.__version__,
        "load_average": round(os.getloadavg()[0], 2),
        "wall": {k: round(v, 3) for k, v in med.items()},
        "cpu": {k: round(v, 3) for k, v in cpu.items()},
        "hash_overhead_at_save": round(med["save_with_hash_s"] / med["save_s"] - 1, 3),
        "verify_over_load_warm": round(med["verify_warm_s"] / med["load_warm_s"], 3),
        "verify_over_load_cold": round(med["verify_cold_s"] / med["load_cold_s"], 3),
    }
    print(json.dumps(result))
    print()
    print(f"| {mib:.0f} MiB, median of {a.repeats} | wall s | MiB/s | CPU s |")
    print("|---|---|---|---|")
    rows = [
        ("DCP save", "save_s"), ("DCP save + SHA-256 of each file", "save_with_hash_s"),
        ("verify, files in the page cache", "verify_warm_s"), ("DCP load, files in the page cache", "load_warm_s"),
        ("verify, files read from the disk", "verify_cold_s"), ("DCP load, files read from the disk", "load_cold_s"),
    ]
    for label, key in rows:
        print(f"| {label} | {med[key]:.3f} | {mib / med[key]:,.0f} | {cpu[key]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
