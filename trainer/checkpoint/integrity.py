"""Checksums of a checkpoint's files: recorded with its `COMPLETE` marker, verified before a load.

A shard whose bytes changed while its size did not (a disk or copy fault, a partial overwrite)
is still a well-formed DCP file: `dcp.load` reads the damaged values without an error, and the
run trains on garbage. So every complete checkpoint records the size and SHA-256 of each of its
files in the marker, and every load checks them first.

Who hashes what, so that no rank reads the whole checkpoint:
- saving: each rank hashes the shard files it wrote, right after writing them (still in the page
  cache), inside DCP's write (`ChecksumWriter`; in async mode that is the background thread), and
  leaves each digest in a `<file>.sha256` file beside it. DCP writes `.metadata` only after every
  rank's write returned, so when rank 0 seals the folder all of them exist; it moves them into
  the marker and hashes itself only what has none (`.metadata`, `model_args.json`, or the files
  of a storage writer that does not hash).
- loading: the files are dealt out over the ranks, each checks its share, and every rank learns
  every problem, so all of them fall back to the same older checkpoint.

SHA-256 rather than CRC-32: hashlib's runs on the CPU's SHA extensions where present (1.25 GiB
per CPU-second on the development machine, about what DCP spends loading the same bytes;
`benchmarks/checkpoint_verify.py`), and with 256 bits no damage goes unnoticed by chance, where
a 32-bit CRC misses one damaged file in four billion.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch.distributed.checkpoint as dcp

from trainer.distributed import all_gather_objects, global_rank, global_world_size

DIGEST_SUFFIX = ".sha256"
_CHUNK = 8 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


class ChecksumWriter(dcp.FileSystemWriter):
    """DCP's file writer that also leaves the SHA-256 of each file it wrote next to it."""

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        for name in sorted({result.storage_data.relative_path for result in future.wait()}):
            file = Path(self.path) / name
            file.with_name(name + DIGEST_SUFFIX).write_text(sha256_file(file))
        return future


def record_checksums(folder: Path) -> dict[str, dict]:
    """`{file name: {"bytes", "sha256"}}` for every file of a written checkpoint folder, taking
    the digests its writers left and removing those files."""
    files = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.suffix != DIGEST_SUFFIX):
        left = path.with_name(path.name + DIGEST_SUFFIX)
        digest = left.read_text().strip() if left.is_file() else sha256_file(path)
        files[path.name] = {"bytes": path.stat().st_size, "sha256": digest}
    for left in folder.glob(f"*{DIGEST_SUFFIX}"):
        left.unlink()
    return files


def _problem(path: Path, recorded: dict) -> str | None:
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != recorded["bytes"]:
        return f"{path} has {size} bytes, {recorded['bytes']} when saved"
    if sha256_file(path) != recorded["sha256"]:
        return f"{path} differs from the SHA-256 recorded when it was saved (damaged)"
    return None


def checksum_problems(folder: Path, files: dict[str, dict]) -> list[str]:
    """Every file of `folder` whose size or SHA-256 differs from `files` (a marker's record).
    Collective in a multi-process run: each rank hashes every world-size-th file, all return
    the same list."""
    names = sorted(files)
    mine = [p for name in names[global_rank()::global_world_size()] if (p := _problem(folder / name, files[name]))]
    return sorted(p for problems in all_gather_objects(mine) for p in problems)
