"""What a worker tells `run_train.sh` through the folder `$TRAINER_LAUNCH_DIR` (set only by the
script, for its multi-process launches): per torchrun attempt K (`TORCHELASTIC_RESTART_COUNT`: 0,
then one more per restart), in `attempt<K>/`, per global rank R,

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

The script reads the last attempt's files only: what a restart cured is history, not the run's
outcome. A restarted worker reads why the attempt before it failed (`previous_attempt_failure`).
Without the variable (one process, tests, a plain torchrun) nothing is written, and a user
mistake is printed to stderr.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import sys
from pathlib import Path


def _attempt_folder(attempt: int | None = None) -> Path | None:
    """`attempt<K>/` of this launch (K: this process's attempt by default); None outside
    run_train.sh's launches. The writers make it."""
    folder = os.environ.get("TRAINER_LAUNCH_DIR")
    if not folder or os.environ.get("RANK") is None:
        return None
    if attempt is None:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return Path(folder, f"attempt{attempt}")


def _own_file(kind: str) -> Path | None:
    """This rank's `rank<R>.<kind>` in its attempt's folder (made here), or None outside
    run_train.sh's launches."""
    folder = _attempt_folder()
    if folder is None:
        return None
    folder.mkdir(exist_ok=True)
    return folder / f"rank{os.environ['RANK']}.{kind}"


def write_launch_file(kind: str, text: str) -> bool:
    """Write this rank's `rank<R>.<kind>`; False (nothing written) outside run_train.sh's launches."""
    file = _own_file(kind)
    if file is None:
        return False
    file.write_text(text + "\n", encoding="utf-8")
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
    file = _own_file("fault")
    if file is None:
        return False
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    faulthandler.enable(file=fd, all_threads=True)
    return True


# torchrun's line for a worker that failed (torch 2.11 and 2.13), which the script keeps in launcher.log.
_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: \d+ \(pid: (\d+)\)")


def previous_attempt_failure() -> str | None:
    """Why torchrun restarted this worker, in a few words: which rank of the attempt before failed,
    and how (the signal it died of, its one-line error, or its exit code); None in a first attempt
    or outside run_train.sh's launches. The rank is found by its pid in that attempt's
    rank<R>.pid, since torchrun's line names the local rank only."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    folder = _attempt_folder(attempt - 1) if attempt else None
    if folder is None or not folder.is_dir():
        return None
    try:
        log = Path(os.environ["TRAINER_LAUNCH_DIR"], "launcher.log").read_text(encoding="utf-8", errors="replace")
    except OSError:
        log = ""
    failed = _FAILED.findall(log)
    if not failed:
        return None
    code, pid = int(failed[-1][0]), failed[-1][1]
    ranks = [f.stem for f in folder.glob("rank*.pid") if f.read_text().strip() == pid]
    who = ranks[0].replace("rank", "rank ") if ranks else f"the worker with pid {pid}"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        return f"{who} died of {name}"
    err = folder / f"{ranks[0]}.err" if ranks else None
    if err is not None and err.exists():
        return f"{who} stopped: {err.read_text().strip()}"
    return f"{who} exited with code {code}"
