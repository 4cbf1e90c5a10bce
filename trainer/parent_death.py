"""Processes that die with their launcher: `python -m trainer.parent_death PARENT_PID COMMAND [ARG ...]`.

run_train.sh starts torchrun through this module (which arms the signal, then execs the command),
and every worker arms the same signal itself (`die_with_launcher`, first thing in trainer.train's
main). So when the script dies by any signal, SIGKILL included, the kernel kills torchrun, and
torchrun's death kills each worker, within milliseconds. They need it because torchrun and the
workers run in process groups of their own (the script forwards a deliberate stop to the workers
itself, so that they save: run_train.sh explains): a signal to the script's group (`kill -9 --
-PGID`, `timeout -s KILL`) reached only the script and left them training, orphans writing
checkpoints into the folder that the user's rerun writes too.

A parent-death signal (Linux's prctl(PR_SET_PDEATHSIG)) rather than a watchdog on the parent:
the kernel sends it however the parent died, at once, with no thread to keep alive and no
polling interval; a watchdog in torchrun would mean patching torchrun. Through ctypes rather than
`setpriv --pdeathsig`: torchrun, not a shell, starts the workers, so they need the call in Python
anyway, and util-linux's setpriv is not on every system. The signal fires when the parent
*thread* ends: bash has one thread, and torchrun starts (and restarts) its workers from its main
thread, which lives until torchrun exits.

SIGKILL, not SIGTERM: a launcher killed by a signal it could not catch leaves no one to wait for
a save or to report it, and a save begun then would race the rerun writing the same folder. A
deliberate stop (SIGTERM, SIGINT, SIGHUP) goes to the script, which lives until the workers saved.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

# Set by `main` for the command it runs, so torchrun's workers know their parent's pid.
LAUNCHER_PID = "TRAINER_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies; die now if the parent
    `parent_pid` is gone already (the process was reparented before the call, so no signal
    would ever come). Linux only: elsewhere the launcher's death leaves the processes running."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_PDEATHSIG): {os.strerror(error)}")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_launcher() -> None:
    """A worker started by torchrun under run_train.sh dies with torchrun; elsewhere (one process,
    a plain torchrun, a test) nothing changes. The variable is dropped once used: a process the
    worker starts has another parent."""
    launcher = os.environ.pop(LAUNCHER_PID, None)
    if launcher:
        die_with_parent(int(launcher))


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        raise SystemExit("usage: python -m trainer.parent_death PARENT_PID COMMAND [ARG ...]")
    die_with_parent(int(argv[0]))
    # exec keeps the pid: the command's children (torchrun's workers) check their parent against it.
    os.environ[LAUNCHER_PID] = str(os.getpid())
    try:
        os.execvp(argv[1], argv[1:])
    except OSError as e:
        raise SystemExit(f"cannot start {argv[1]}: {e.strerror or e}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
