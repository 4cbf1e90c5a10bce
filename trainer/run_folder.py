"""Where a run writes: its run folder under `[job] dump_folder`.

- A fresh run (checkpoint.enable = false) gets a new folder of its own, `<dump_folder>/<YYYYmmdd-HHMMSS>`
  (`-2`, `-3`, ... when that name is taken), so rerunning a command never needs anything deleted and
  each run's `train.log` and metrics file stand alone (torchtitan names its TensorBoard folders so).
- A resumable run (checkpoint.enable = true) writes into `<dump_folder>` itself: it is the folder
  its checkpoints live in, and every rerun of the command continues it.

Global rank 0 picks the name and every rank uses it (the caller passes how to share it), so the
ranks of one job agree however far apart they started. Torch-free; the pre-launch check's test of
the folder is trainer/config/dump_folder.py.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Callable, TypeVar

from trainer.config.dump_folder import FIX as _FIX
from trainer.config.fields import ConfigError

_T = TypeVar("_T")
_RUN_NAME = re.compile(r"(\d{8}-\d{6})(?:-(\d+))?")


def _make_folder(path: Path, dump_folder: str, *, exist_ok: bool) -> None:
    try:
        path.mkdir(parents=True, exist_ok=exist_ok)
    except FileExistsError:
        if not exist_ok and path.is_dir():
            raise
        raise ConfigError(f"job.dump_folder = {dump_folder!r} cannot be created: {path} is a file; {_FIX}") from None
    except OSError as e:
        raise ConfigError(f"job.dump_folder = {dump_folder!r} cannot be created ({e.strerror or e}); {_FIX}") from None


def _create_fresh(dump_folder: str) -> Path:
    root = Path(dump_folder).expanduser()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        path = root / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            _make_folder(path, dump_folder, exist_ok=False)
        except FileExistsError:
            continue
        return path
    raise ConfigError(f"job.dump_folder = {dump_folder!r}: 999 runs started in the second {stamp}; {_FIX}")


def open_run_folder(
    dump_folder: str, resumable: bool, is_rank0: bool, share: Callable[[_T], _T] = lambda value: value
) -> Path:
    """Create this run's folder (see the module docstring) and return it on every rank.

    `share(value)` returns rank 0's `value` on every rank (a broadcast; the identity on one
    process). A folder rank 0 cannot create is a `ConfigError` on every rank, so no rank waits
    for the others in vain.
    """
    path, error = None, None
    if is_rank0:
        try:
            if resumable:
                path = Path(dump_folder).expanduser()
                _make_folder(path, dump_folder, exist_ok=True)
            else:
                path = _create_fresh(dump_folder)
        except ConfigError as e:
            error = str(e)
    path, error = share((None if path is None else str(path), error))
    if error is not None:
        raise ConfigError(error)
    path = Path(path)
    # Other nodes may write to a disk of their own.
    _make_folder(path, dump_folder, exist_ok=True)
    return path


def latest_run_folder(dump_folder: str | os.PathLike) -> Path:
    """The folder of the newest run under `dump_folder`: its newest timestamped run folder, or
    `dump_folder` itself when it holds none (a resumable run writes there)."""
    root = Path(dump_folder)
    runs = []
    if root.is_dir():
        for path in root.iterdir():
            match = _RUN_NAME.fullmatch(path.name)
            if match and path.is_dir():
                runs.append(((match.group(1), int(match.group(2) or 1)), path))
    return max(runs)[1] if runs else root
