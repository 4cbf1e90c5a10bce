"""What happens to an NGPU=2 run_train.sh job when a process of it dies by SIGKILL.

- A worker: with RESTARTS=1, torchrun restarts both workers, which resume from the newest complete
  checkpoint (saved every 2 steps) on their own and name it in the log; the job exits 0 and the
  steps trained after the restart have the losses of the same run uninterrupted.
- The script's whole process group (`kill -9 -- -PGID`, `timeout -s KILL`): torchrun and the
  workers, in process groups of their own, die with it (trainer/parent_death.py) within 10 s, and
  no checkpoint appears after that.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from in_process import descendants, processes, start, worker_of_rank

from trainer.checkpoint import list_checkpoints

REPO = Path(__file__).resolve().parents[2]
ARGS = [
    "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32",
    "--training.deterministic", "--no-validation.enable", "--metrics.log_freq", "1", "--no-job.print_config",
    "--checkpoint.enable",
]
LAUNCH_TIMEOUT_S = 300
# The bound for a run's processes to be gone once its launcher died by SIGKILL.
ORPHAN_BOUND_S = 10


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


def test_a_killed_worker_is_restarted_and_resumes_exactly(tmp_path):
    args = ["--training.steps", "10", "--checkpoint.interval", "2"]
    straight = tmp_path / "straight"
    straight.mkdir()
    proc = launch(straight / "run", *args)
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    want = {r["step"]: r["loss"] for r in records(straight / "run")}
    assert sorted(want) == list(range(1, 11))

    # Rank 1 hangs (SIGSTOP) after step 5: rank 0's collective times out, it stops with its one-line
    # error (exit 2), and once it is gone rank 1 is killed. The restart cures the run, so the job
    # ends 0 and its last words are the final attempt's (issue 44); the restart says why it came.
    restarted = tmp_path / "restarted"
    restarted.mkdir()
    run = restarted / "run"
    proc = launch(run, *args, "--comm.train_timeout_seconds", "15", RESTARTS="1")
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
            "longer than comm.train_timeout_seconds = 15 s") in out, out[-3000:]
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
    assert before[-1]["step"] >= 5 and [r["step"] for r in after] == list(range(step + 1, 11)), [r["step"] for r in got]
    for r in before + after:
        assert abs(r["loss"] - want[r["step"]]) <= 1e-6, (r["step"], r["loss"], want[r["step"]])


def test_kill_9_of_the_process_group_leaves_no_process_and_no_new_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = launch(run, "--training.steps", "1000", "--checkpoint.interval", "1")
    wait_for_step(proc, run, 2)
    group = descendants(proc.pid)
    assert len(group) >= 4, group  # the stderr filter, torchrun and 2 workers
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
    assert not left, f"still running {ORPHAN_BOUND_S} s after kill -9 of the script's group: {left}"
    # A save may have been finishing as the signal came; none starts after it.
    after = [c.step for c in list_checkpoints(run / "checkpoint")]
    assert max(after) <= saved + 1, (saved, after)
    time.sleep(2)
    assert [c.step for c in list_checkpoints(run / "checkpoint")] == after
