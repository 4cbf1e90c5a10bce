"""The pre-launch check of `[job] dump_folder` (torch-free): refused before any process starts
if it can be neither created nor written. trainer/run_folder.py creates the run's folder in it."""

from __future__ import annotations

import os
from pathlib import Path

from trainer.config.fields import ConfigError

FIX = "pass --job.dump_folder a folder you can write to"


def check_dump_folder(dump_folder: str | os.PathLike) -> None:
    """Refuse a dump folder that cannot be created or written, without creating anything: its
    nearest existing ancestor must be a writable folder."""
    folder = Path(dump_folder).expanduser()
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"job.dump_folder = {str(dump_folder)!r} cannot be created: {existing} is a file; {FIX}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"job.dump_folder = {str(dump_folder)!r} cannot be written: {existing} is read-only; {FIX}")
