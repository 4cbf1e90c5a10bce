"""Local dataset files (``dataset`` json/text/parquet/auto with ``dataset_path``): the files a path
names and the HF builder that reads them.

Torch-free, so that the pre-launch check (trainer/config/check.py) refuses a path that names no
file, or an empty file, in a second, before any process starts; the loader
(trainer/data/datasets.py) reads the same list.
"""

from __future__ import annotations

import glob
from pathlib import Path

# Extension -> HF builder for local files; a compression suffix after it is handled by HF.
EXTENSION_BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text", ".parquet": "parquet"}
COMPRESSION_SUFFIXES = {".gz", ".bz2", ".xz", ".zst", ".lz4"}


def local_format(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSION_SUFFIXES:
        suffixes.pop()
    return EXTENSION_BUILDERS.get(suffixes[-1]) if suffixes else None


def resolve_local_files(fmt: str, dataset_path: str | None) -> tuple[str, list[str]]:
    """Expand ``dataset_path`` (file, glob or directory) to files and pick the HF builder; a
    missing path or an empty file is refused."""
    if not dataset_path:
        raise ValueError(f"dataset={fmt!r} needs dataset_path (a file, a glob or a directory)")
    path = Path(dataset_path).expanduser()
    if glob.has_magic(dataset_path):
        files = [Path(f) for f in sorted(glob.glob(str(path), recursive=True)) if Path(f).is_file()]
        if not files:
            raise FileNotFoundError(f"no files match dataset_path {dataset_path!r}")
    elif path.is_dir():
        wanted = set(EXTENSION_BUILDERS.values()) if fmt == "auto" else {fmt}
        files = sorted(f for f in path.rglob("*") if f.is_file() and local_format(f) in wanted)
        if not files:
            kinds = "/".join(ext for ext, b in EXTENSION_BUILDERS.items() if fmt in ("auto", b))
            raise FileNotFoundError(f"dataset_path directory {path} has no {kinds} files")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"dataset_path does not exist: {path}")
    empty = [f for f in files if f.stat().st_size == 0]
    if empty:
        raise ValueError(f"dataset file {empty[0]} is empty: no documents to train on; fill it or point dataset_path "
                         "at files that hold data")
    if fmt != "auto":
        return fmt, [str(f) for f in files]
    formats = {local_format(f) for f in files}
    if len(formats) != 1 or None in formats:
        raise ValueError(
            f"cannot auto-detect the format of {dataset_path!r} (found {sorted(map(str, formats))}); "
            f"use files ending in {sorted(EXTENSION_BUILDERS)} (optionally compressed) or pass dataset='json'/'text'/'parquet'"
        )
    return formats.pop(), [str(f) for f in files]
