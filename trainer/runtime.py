"""Process-level setup shared by the trainer, benchmarks and scripts: device choice,
seeding and determinism, host memory reuse on CPU, repository-relative paths, and the facts
the run log records."""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import os
import platform
import random
import subprocess
import sys
from pathlib import Path

import torch

from trainer.config import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent


def resolve_path(path: str | os.PathLike) -> Path:
    """A user path as given if it exists relative to the working directory, else relative
    to the repository root, so the bundled defaults (assets/...) work from any directory."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    candidate = REPO_ROOT / p
    return candidate if candidate.exists() else p


def select_device(requested: str, local_rank: int = 0) -> torch.device:
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError(
                "training.device = 'cuda' but no CUDA device is visible; use --training.device cpu "
                "(or auto) to train on the CPU"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def set_seed_and_determinism(seed: int, deterministic: bool) -> None:
    """Seeds every generator the trainer touches; ``deterministic`` also forbids
    non-deterministic kernels, so two runs give bit-identical losses."""
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace to be reproducible; it must be set before the
        # first cuBLAS call, which is why this runs before the model is built.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_host_memory() -> bool:
    """Let glibc malloc keep the memory a training step frees, for the next step to reuse.

    PyTorch's CPU allocator is plain malloc. By default glibc serves every large block (an
    activation, a gradient) with its own mmap and unmaps it on free, and gives the heap's free
    top back to the OS, so each step page-faults its whole working set in again: 57k minor
    faults per step for the debug model at 4 x 256 tokens, on a VM where their cost also drifts
    from minute to minute (benchmarks/RESULTS.md). With both thresholds at mallopt's largest
    value, freed blocks stay in the heap and are reused, as with jemalloc or tcmalloc; the resident
    set no longer shrinks between steps (debug model: 1.08 instead of 1.00 GiB peak). Those would need an LD_PRELOAD before the process starts; this
    is glibc's own documented knob, set from inside the process. Returns False (and changes
    nothing) where the C library is not glibc.
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    largest = 2**31 - 1  # mallopt takes a C int
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, largest)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, largest))


def git_revision() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def versions() -> dict[str, str]:
    info = {"python": platform.python_version(), "torch": torch.__version__}
    # Read from package metadata: importing torchao or transformers just to print a
    # version costs seconds and fills the log with their import-time warnings.
    for name in ("torchao", "tiktoken", "datasets", "transformers"):
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    if torch.version.cuda:
        info["cuda"] = torch.version.cuda
    return info


def setup_logging(log_file: Path) -> None:
    """The "trainer" logger to stdout and the run's log file, nothing else (a rerun in the same
    process replaces the handlers of the last)."""
    root = logging.getLogger("trainer")
    root.setLevel(logging.INFO)
    root.propagate = False
    if root.handlers:
        for h in list(root.handlers):
            root.removeHandler(h)
            h.close()
    fmt = logging.Formatter("[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    for handler in (logging.StreamHandler(sys.stdout), logging.FileHandler(log_file, encoding="utf-8")):
        handler.setFormatter(fmt)
        root.addHandler(handler)
