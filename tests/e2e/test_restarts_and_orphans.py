"""What happens to an NGPU=2 run_train.sh job when a process of it dies by SIGKILL.

- The script's whole process group (`kill -9 -- -PGID`, `timeout -s KILL`): torchrun and the
  workers, in process groups of their own, die with it (trainer/parent_death.py) within 10 s, and
  no checkpoint appears after that.
- A worker: with RESTARTS=1, torchrun restarts both workers, which resume from the newest complete
  checkpoint (saved every 2 steps) on their own and name it in the log; the job exits 0 and the
  steps trained after the restart have the losses of the same run uninterrupted.

Launches are the cost: the uninterrupted run is the killed one (a warmup, then a constant LR, so
a run's LR at a step does not depend on training.steps; the checkpoint interval changes no loss),
killed once it has trained past the restarted run's last step (`killed`, one launch for both tests).
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from in_process import descendants, processes, start, worker_of_rank

from trainer.checkpoint import list_checkpoints

REPO = Path(__file__).resolve().parents[2]
ARGS = [
    "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32",
    "--training.deterministic", "--no-validation.enable", "--metrics.log_freq", "1", "--no-job.print_config",
    "--checkpoint.enable", "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0",
]
STEPS = 10  # of the restarted run
LAUNCH_TIMEOUT_S = 300
# The bound for a run's processes to be gone once its launcher died by SIGKILL.
ORPHAN_BOUND_S = 10
# How long rank 0 waits for the hung rank 1 before it stops: the restart's cause. Steps of 2
# ranks lag each other by well under a second, so no healthy collective comes near it.
TRAIN_TIMEOUT_S = 8


def launch(run_dir: Path, *args: str, **env: str) -> subprocess.Popen:
    """NGPU=2 run_train.sh with this module's settings (`in_process.start`)."""
    return start(run_dir, [*ARGS, *args], **env)


def finish(proc: subprocess.Popen) -> str:
    try:
        return proc.communicate(timeout=LAUNCH_TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"run_train.sh did not end within {LAUNCH_TIMEOUT_S} s: {proc.communicate()[0][-3000:]}") from None


def records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's step records in the order they were written (a restart appends)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while max((r["step"] for r in records(run_dir)), default=0) < step:
        assert proc.poll() is None, f"ended before step {step}: {proc.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, f"no step {step} within {LAUNCH_TIMEOUT_S} s"
        time.sleep(0.1)


def alive(group: dict[int, str]) -> list[int]:
    """The processes of `group` still running (a zombie has ended: only its exit status is left)."""
    table = processes()
    return [pid for pid, start in group.items() if pid in table and table[pid][2] == start and table[pid][1] != "Z"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict:
    """A 1000-step run, saving every step, killed by `kill -9 -- -PGID` once it has trained STEPS
    steps: its losses, its processes left ORPHAN_BOUND_S after the kill, and its checkpoints."""
    run = tmp_path_factory.mktemp("killed") / "run"
    proc = launch(run, "--training.steps", "1000", "--checkpoint.interval", "1")
    wait_for_step(proc, run, STEPS)
    group = descendants(proc.pid)
    saved = max(c.step for c in list_checkpoints(run / "checkpoint"))
    os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + ORPHAN_BOUND_S
    # Not communicate(): orphans would hold the output pipe open.
    proc.wait(timeout=ORPHAN_BOUND_S)
    proc.stdout.close()
    while alive(group) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = alive(group)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    after = [c.step for c in list_checkpoints(run / "checkpoint")]
    time.sleep(2)
    return {
        "losses": {r["step"]: r["loss"] for r in records(run) if r["step"] <= STEPS},
        "group": group, "left": left, "saved": saved, "after": after,
        "later": [c.step for c in list_checkpoints(run / "checkpoint")],
    }


def test_kill_9_of_the_process_group_leaves_no_process_and_no_new_checkpoint(killed):
    assert len(killed["group"]) >= 4, killed["group"]  # the stderr filter, torchrun and 2 workers
    left = killed["left"]
    assert not left, f"still running {ORPHAN_BOUND_S} s after kill -9 of the script's group: {left}"
    # A save may have been finishing as the signal came; none starts after it.
    assert max(killed["after"]) <= killed["saved"] + 1, (killed["saved"], killed["after"])
    assert killed["later"] == killed["after"]


def test_a_killed_worker_is_restarted_and_resumes_exactly(tmp_path, killed):
    args = ["--training.steps", str(STEPS), "--checkpoint.interval", "2"]
    want = killed["losses"]
    assert sorted(want) == list(range(1, STEPS + 1))

    # Rank 1 hangs (SIGSTOP) after step 5: rank 0's collective times out, it stops with its one-line
    # error (exit 2), and once it is gone rank 1 is killed. The restart cures the run, so the job
    # ends 0 and its last words are the final attempt's (issue 44); the restart says why it came.
    restarted = tmp_path / "restarted"
    restarted.mkdir()
    run = restarted / "run"
    proc = launch(run, *args, "--comm.train_timeout_seconds", str(TRAIN_TIMEOUT_S), RESTARTS="1")
    wait_for_step(proc, run, 5)
    rank0, rank1 = worker_of_rank(proc.pid, 0), worker_of_rank(proc.pid, 1)
    os.kill(rank1, signal.SIGSTOP)
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while rank0 in processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(rank1, signal.SIGKILL)
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert ("restart 1 of at most 1 (torchrun --max-restarts) after rank 0 stopped: error: a collective waited "
            f"longer than comm.train_timeout_seconds = {TRAIN_TIMEOUT_S} s") in out, out[-3000:]
    after_restart = out.rsplit("restart 1 of at most 1", 1)[1].split("\n", 1)[1]
    assert "error" not in after_restart and "Traceback" not in after_restart, out[-3000:]
    resumed = [line for line in out.splitlines() if "resumed from " in line]
    assert len(resumed) == 1, out[-3000:]
    step = int(resumed[0].rsplit("(step ", 1)[1].split(")")[0])
    assert step >= 4 and step % 2 == 0 and f"resumed from {run / 'checkpoint' / f'step-{step}'} (step {step})" in resumed[0]

    got = records(run)
    # The restart's records follow the first launch's, starting again after the resumed step.
    restart_at = next(i for i in range(1, len(got)) if got[i]["step"] <= got[i - 1]["step"])
    before, after = got[:restart_at], got[restart_at:]
    steps = [r["step"] for r in got]
    assert before[-1]["step"] >= 5 and [r["step"] for r in after] == list(range(step + 1, STEPS + 1)), steps
    for r in before + after:
        assert abs(r["loss"] - want[r["step"]]) <= 1e-6, (r["step"], r["loss"], want[r["step"]])
