"""`python -m trainer.parent_death PARENT_PID COMMAND ...` (how run_train.sh starts torchrun): the
command runs as the same process, knows its pid as TRAINER_LAUNCHER_PID (for torchrun's workers),
and the kernel kills it when its parent dies, however the parent died; a parent that is gone
before the signal was armed kills it at once."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GUARD = [sys.executable, "-m", "trainer.parent_death"]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")


def running(pid: int) -> bool:
    """Not yet ended (a zombie has: only its exit status is left for its new parent to collect)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_command_is_the_same_process_and_knows_its_pid():
    out = subprocess.run(
        [*GUARD, str(os.getpid()), "sh", "-c", 'echo "$$ $TRAINER_LAUNCHER_PID"'],
        env=ENV, capture_output=True, text=True, timeout=60, check=True,
    ).stdout.split()
    assert out[0] == out[1]


def test_the_command_dies_by_sigkill_with_its_parent():
    # bash stands for run_train.sh: it starts the guarded command, then is killed by SIGKILL.
    parent = subprocess.Popen(
        ["bash", "-c", f'{" ".join(GUARD)} $$ sleep 300 & echo $!; wait'],
        env=ENV, stdout=subprocess.PIPE, text=True,
    )
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 60
    while b"sleep" not in Path(f"/proc/{child}/cmdline").read_bytes():  # armed, then exec'd
        assert time.monotonic() < deadline, "the command did not start"
        time.sleep(0.05)
    parent.kill()
    parent.wait(timeout=60)
    parent.stdout.close()
    deadline = time.monotonic() + 10
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    if running(child):
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the command outlived its parent by 10 s")


def test_a_parent_gone_before_the_signal_was_armed_kills_at_once():
    # Its parent (this process) is not pid 1: as if pid 1 were the launcher that died, leaving it
    # reparented before it could arm the signal.
    proc = subprocess.run([*GUARD, "1", "sleep", "300"], env=ENV, timeout=60)
    assert proc.returncode == -signal.SIGKILL


def test_a_command_that_cannot_start_is_one_line():
    proc = subprocess.run(
        [*GUARD, str(os.getpid()), "no-such-command-xyz"], env=ENV, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1 and proc.stderr == "cannot start no-such-command-xyz: No such file or directory\n"
