"""scripts/slurm/train.sbatch under a real Slurm: two emulated nodes on this machine
(scripts/slurm/local_cluster.sh, started here when no cluster of it is up and stopped again).

One resumable job, `--nodes=2`, one task per node and NGPU=1 each, is submitted three times. The
first is cancelled with `scancel` once it has trained a step: it ends CANCELLED with exit code 0
(srun's: both nodes' run_train.sh exited 0 after every worker had saved), and the checkpoint of the
step it stopped at is complete. The second resumes from it and is stopped by `scancel
--signal=TERM`, the SIGTERM to the tasks alone that `#SBATCH --signal` sends before the time limit:
it saves too and ends COMPLETED. The third resumes and finishes. The losses of every step, across
the three jobs, equal bit for bit those of the same run launched as one NGPU=2 run_train.sh.

A mistake in the submission (two tasks per node, an unknown option) ends the job FAILED with exit
code 2 and one line in the job's log.

Slurm must run here for real (the test does not skip): without it, and without root and apt-get to
install it, the test fails saying so.
"""

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from in_process import COMMON, REPO, run_layout

from trainer.checkpoint import list_checkpoints
from trainer.diagnostics import free_port

CLUSTER = REPO / "scripts" / "slurm" / "local_cluster.sh"
SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
STEPS = 16
ARGS = [*COMMON, "--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", "1000"]
JOB_TIMEOUT_S = 600
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE"}


@pytest.fixture(scope="module")
def slurm():
    """The environment for Slurm's client commands; starts the local cluster unless it is up."""
    status = subprocess.run([str(CLUSTER), "status"], capture_output=True, text=True, timeout=60)
    started = status.returncode != 0
    if started:
        # Installs Slurm first where it is missing (apt-get, about 10 s: the README's Tests).
        status = subprocess.run([str(CLUSTER), "start"], capture_output=True, text=True, timeout=600)
        assert status.returncode == 0, (
            "tests/e2e/test_slurm.py needs a local Slurm cluster and could not start one with "
            f"scripts/slurm/local_cluster.sh start (exit {status.returncode}):\n{status.stdout}{status.stderr}"
        )
    conf = re.search(r"SLURM_CONF=(\S+)", status.stdout).group(1)
    try:
        yield {**os.environ, "SLURM_CONF": conf}
    finally:
        if started:
            stop = subprocess.run([str(CLUSTER), "stop"], capture_output=True, text=True, timeout=120)
            assert stop.returncode == 0, stop.stdout + stop.stderr


def submit(env: dict, workdir: Path, run_dir: Path, options: tuple[str, ...] = (), args: list[str] = ARGS) -> int:
    """train.sbatch with sbatch `options` and run_train.sh `args` on both nodes, from `workdir` (its
    logs go there); returns the job id."""
    env = {**env, "NGPU": "1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", *options, str(SBATCH),
         "--job.dump_folder", str(run_dir), *args],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return int(proc.stdout.split(";")[0])


def job_state(env: dict, job: int) -> tuple[str, str]:
    """(JobState, ExitCode) as `scontrol show job` gives them."""
    out = subprocess.run(["scontrol", "-o", "show", "job", str(job)], env=env, capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return re.search(r"JobState=(\S+)", out).group(1), re.search(r"ExitCode=(\S+)", out).group(1)


def node_logs(workdir: Path, job: int) -> list[str]:
    """What each node's run_train.sh printed, by node id."""
    return [(workdir / f"slurm-{job}" / f"node{n}.log").read_text() for n in (0, 1)]


def logs(workdir: Path, job: int) -> str:
    """The batch log, then each node's log, with headers: for assertion messages."""
    parts = [workdir / f"slurm-{job}.out", *sorted((workdir / f"slurm-{job}").glob("node*.log"))]
    return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in parts if p.exists())


def wait_for(env: dict, workdir: Path, job: int, what: str, condition) -> None:
    """Polls `condition` until it holds; fails (cancelling the job) if the job ends or time runs out first."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not condition():
        state, _ = job_state(env, job)
        if state in ENDED and not condition():
            raise AssertionError(f"job {job} ended {state} before {what}:\n{logs(workdir, job)}")
        if time.monotonic() > deadline:
            subprocess.run(["scancel", str(job)], env=env, timeout=30)
            raise AssertionError(f"no {what} within {JOB_TIMEOUT_S} s:\n{logs(workdir, job)}")
        time.sleep(0.2)


def wait_for_end(env: dict, workdir: Path, job: int) -> tuple[str, str]:
    wait_for(env, workdir, job, "its end", lambda: job_state(env, job)[0] in ENDED)
    return job_state(env, job)


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss of a resumable run's metrics.jsonl; a resumed run appends, the last record of a
    step wins. A line still being written is left for the next look."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return {}
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def stop_midway(env: dict, workdir: Path, run_dir: Path, scancel: list[str]) -> tuple[int, str, int]:
    """Submits the resumable run, lets it train a step more than its checkpoint holds, stops it with
    `scancel`; checks that it saved and every node exited 0. Returns the job, its state and the step
    it stopped at."""
    before = max(losses(run_dir), default=0)
    job = submit(env, workdir, run_dir)
    wait_for(env, workdir, job, "a newly trained step", lambda: max(losses(run_dir), default=0) > before)
    subprocess.run(["scancel", *scancel, str(job)], env=env, timeout=30, check=True)
    state, exit_code = wait_for_end(env, workdir, job)
    out = logs(workdir, job)
    # srun's exit 0 is both nodes' run_train.sh exiting 0: each does only when all its workers
    # finished or saved on request, and exited 0. The job's exit code is the batch script's, srun's.
    assert exit_code == "0:0", (state, exit_code, out)
    assert (workdir / f"slurm-{job}.out").read_text().splitlines()[-1] == "train.sbatch: srun exited 0", out
    assert "Traceback" not in out, out
    stopped = max(losses(run_dir))
    assert before < stopped < STEPS, f"stopped at {stopped}, resumed at {before}:\n{out}"
    assert all("run_train.sh: SIGTERM" in log for log in node_logs(workdir, job)), out
    # Rank 0 logs the run; the rendezvous may put it on either node.
    assert any(f"stopped at step {stopped} (received SIGTERM" in log for log in node_logs(workdir, job)), out
    # list_checkpoints lists complete checkpoints only, newest first.
    assert list_checkpoints(run_dir / "checkpoint")[0].step == stopped, out
    return job, state, stopped


def resumed_from(workdir: Path, job: int, run_dir: Path, step: int) -> bool:
    line = f"resumed from {run_dir / 'checkpoint' / f'step-{step}'} (step {step})"
    return any(line in log for log in node_logs(workdir, job))


def test_slurm_job_trains_like_ngpu2_saves_on_scancel_and_resumes_exactly(slurm, tmp_path):
    reference = run_layout(tmp_path / "reference", 2, ARGS)
    want = {step: record["loss"] for step, record in reference.items() if "loss" in record}
    assert sorted(want) == list(range(1, STEPS + 1))

    run_dir = tmp_path / "run"
    # A plain scancel: SIGTERM to every task (and the batch shell), SIGKILL after KillWait.
    _, state, first = stop_midway(slurm, tmp_path, run_dir, [])
    assert state == "CANCELLED"
    # SIGTERM to the tasks alone (what --signal does before the time limit): the job ends itself.
    job, state, second = stop_midway(slurm, tmp_path, run_dir, ["--signal=TERM"])
    assert state == "COMPLETED" and resumed_from(tmp_path, job, run_dir, first), logs(tmp_path, job)

    job = submit(slurm, tmp_path, run_dir)
    assert wait_for_end(slurm, tmp_path, job) == ("COMPLETED", "0:0"), logs(tmp_path, job)
    assert resumed_from(tmp_path, job, run_dir, second), logs(tmp_path, job)
    assert losses(run_dir) == want, logs(tmp_path, job)


def test_bad_submissions_fail_with_one_line(slurm, tmp_path):
    tasks = submit(slurm, tmp_path, tmp_path / "run", options=("--ntasks-per-node=2",))
    assert wait_for_end(slurm, tmp_path, tasks) == ("FAILED", "2:0"), logs(tmp_path, tasks)
    assert (tmp_path / f"slurm-{tasks}.out").read_text() == (
        "train.sbatch: 4 tasks on 2 nodes: run one task per node (--ntasks-per-node=1); NGPU sets the workers per node\n"
    )

    # A time limit the stop signal's lead swallows (issue 44): refused, not COMPLETED with nothing trained.
    short = submit(slurm, tmp_path, tmp_path / "run", options=("--time=2",))
    assert wait_for_end(slurm, tmp_path, short) == ("FAILED", "2:0"), logs(tmp_path, short)
    assert (tmp_path / f"slurm-{short}.out").read_text().startswith(
        "train.sbatch: the time limit 00:02:00 is not longer than the 300 s before it at which the stop signal comes"
    ), logs(tmp_path, short)

    # Both nodes' run_train.sh refuse it before starting anything, and the job's log repeats their line.
    typo = submit(slurm, tmp_path, tmp_path / "run", args=["--training.stepz", "3"])
    assert wait_for_end(slurm, tmp_path, typo) == ("FAILED", "2:0"), logs(tmp_path, typo)
    lines = (tmp_path / f"slurm-{typo}.out").read_text().splitlines()
    assert lines[-3] == "train.sbatch: srun exited 2", lines
    assert all(line.startswith(f"node{n}: config error: unknown option --training.stepz; did you mean --training.steps?")
               for n, line in enumerate(lines[-2:])), lines
    assert not (tmp_path / "run").exists()
