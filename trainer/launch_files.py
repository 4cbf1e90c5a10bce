"""What a worker tells `run_train.sh` through the folder `$TRAINER_LAUNCH_DIR` (set only by the
script, for its multi-process launches): per global rank R,

    rank<R>.pid    written once the worker's stop handlers are installed: the script sends a stop
                   signal to these processes directly (torchrun would kill a worker that takes
                   longer than its shutdown timeout to save), and to torchrun before they exist
    rank<R>.err    the one-line message of a user mistake (exit code 2), printed by the script
                   instead of the launcher's traceback, for every failing rank
    rank<R>.exit   the worker's exit code: when every worker of the node wrote 0, the run finished
                   or stopped on request, whatever torchrun's own exit code (1 after it was sent
                   the stop signal itself)
    rank<R>.fault  Python's stack of every thread if the worker dies of a fatal signal (SIGSEGV,
                   SIGFPE, SIGABRT, SIGBUS, SIGILL; `faulthandler`), which the script prints with
                   the rank and the signal: torchrun shows only LOG_RANK's stderr

Without the variable (one process, tests, a plain torchrun) nothing is written, and a user
mistake is printed to stderr.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path


def write_launch_file(kind: str, text: str) -> bool:
    """Write this rank's `rank<R>.<kind>`; False (nothing written) outside run_train.sh's launches."""
    folder, rank = os.environ.get("TRAINER_LAUNCH_DIR"), os.environ.get("RANK")
    if not folder or rank is None:
        return False
    Path(folder, f"rank{rank}.{kind}").write_text(text + "\n", encoding="utf-8")
    return True


def report_user_error(message: str) -> int:
    """Shows a user mistake as one line and returns exit code 2: every failing rank's line reaches
    the user (not only the logged ranks'), without the launcher's traceback."""
    if not write_launch_file("err", message):
        print(message, file=sys.stderr)
    return 2


def record_fault_stacks() -> bool:
    """Under run_train.sh's multi-process launches, send `faulthandler`'s stacks to this rank's
    `rank<R>.fault` (an fd, which faulthandler keeps: no file object to hold on to); False
    elsewhere (one process: run_train.sh sets PYTHONFAULTHANDLER, so they go to stderr)."""
    folder, rank = os.environ.get("TRAINER_LAUNCH_DIR"), os.environ.get("RANK")
    if not folder or rank is None:
        return False
    fd = os.open(Path(folder, f"rank{rank}.fault"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    faulthandler.enable(file=fd, all_threads=True)
    return True
