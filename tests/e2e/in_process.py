"""How the e2e tests run the trainer as a user does, and read what a run logged.

`run_layout` launches run_train.sh with NGPU processes, or, for one process, runs it in the
pytest process (`run_main`); both return metrics.jsonl's records by step. `worker_of_rank` finds
a launched run's worker process (to stop or kill it). `COMMON` are the parity settings (fp32,
deterministic, global batch 8, the debug model at seq_len 32) and `assert_close` their bound.

One-process runs in the pytest process, as an NGPU=1 run_train.sh runs them:

NGPU=1 run_train.sh runs its pre-launch check (trainer/config/check.py), then execs `python -m
trainer.train --job.config_file <CONFIG_FILE> ARGS`, whose `__main__` guard only calls
`trainer.train.main`. Calling it here proves the same run, minus the pre-launch check (tested
through run_train.sh elsewhere: tests/e2e/test_bad_inputs.py, test_reruns.py), without a new
process's ~4 s import of torch, which is most of a short test run's cost on 2 cores.
"""

import json
import logging
import os
import subprocess
from pathlib import Path

import torch

from trainer.diagnostics import free_port
from trainer.run_folder import latest_run_folder
from trainer.train import main

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "train_configs" / "debug_model.toml"  # run_train.sh's CONFIG_FILE default
COMMON = [
    "--training.seq_len", "32", "--training.global_batch_size", "8",
    "--training.mixed_precision_param", "float32", "--training.deterministic",
    "--metrics.log_freq", "1", "--validation.steps", "2", "--job.print_config=false",
]
# Sharding only reorders fp32 sums: layouts agree to ~1e-7.
REL = 1e-5


def assert_close(what: str, got: float, want: float, rel: float = REL) -> None:
    assert abs(got - want) <= rel * abs(want), f"{what}: {got} vs {want}"


def launch(run_dir: Path, nproc: int, args: list[str]) -> str:
    """run_train.sh with NGPU=nproc processes from ``run_dir``'s parent; returns what it printed."""
    env = {**os.environ, "NGPU": str(nproc), "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", str(REPO / "run_train.sh"), "--job.dump_folder", str(run_dir), *args],
        cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def start(run_dir: Path, args: list[str], **env: str) -> subprocess.Popen:
    """NGPU=2 run_train.sh from ``run_dir``'s parent in a process group of its own, as a shell runs
    a foreground job, without waiting: its output (stdout and stderr) is ``.stdout``. ``env``
    adds to or overrides the environment (MASTER_PORT unset: one node picks a free port)."""
    env = {**os.environ, "NGPU": "2", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "MASTER_PORT": "", **env}
    return subprocess.Popen(
        ["bash", str(REPO / "run_train.sh"), "--job.dump_folder", str(run_dir), *args],
        cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """The newest run folder's metrics.jsonl, its records merged by step."""
    records: dict[int, dict] = {}
    for line in (latest_run_folder(run_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["step"], {}).update(record)
    return records


def run_layout(run_dir: Path, nproc: int, args: list[str]) -> dict[int, dict]:
    """`launch`, or for one process `run_main` here (a launch would add the ~4 s import of torch
    and prove nothing more); returns the run's records by step."""
    if nproc == 1:
        assert run_main(run_dir.parent, "--job.dump_folder", str(run_dir), *args) == 0
    else:
        launch(run_dir, nproc, args)
    return metrics_by_step(run_dir)


def run_main(cwd: Path, *args: str) -> int:
    """`trainer.train.main` from `cwd` (relative paths are the user's), with the default config
    first as run_train.sh passes it (a later --job.config_file wins) and the one intra-op thread
    of the launches (OMP_NUM_THREADS=1): the same reduction order as a launched run. What a run
    sets for its process and a launch would drop with it (the thread count, the working directory,
    deterministic algorithms, the trainer logger's handlers) is put back afterwards."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    before = os.getcwd()
    torch.set_num_threads(1)
    try:
        os.chdir(cwd)
        return main(["--job.config_file", str(DEFAULT_CONFIG), *args])
    finally:
        os.chdir(before)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        trainer_log = logging.getLogger("trainer")
        for handler in list(trainer_log.handlers):
            trainer_log.removeHandler(handler)
            handler.close()


def processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, start time) of every process (one /proc read each)."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(stat.parent.name)] = (int(fields[1]), fields[0], fields[19])
    return table


def descendants(root: int) -> dict[int, str]:
    """pid -> start time of every process below `root` (pid and start time name a process even if
    its pid is reused)."""
    table = processes()
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _, started) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = started
                frontier.append(pid)
    return found


def worker_of_rank(script_pid: int, rank: int) -> int:
    """The worker process of global rank `rank`, not one of its own children (data loader or
    checkpoint processes, forked with the same command and environment)."""
    table, found = processes(), set()
    for pid in descendants(script_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"trainer.train" in cmdline and f"RANK={rank}".encode() in environ:
            found.add(pid)
    workers = [pid for pid in found if pid in table and table[pid][0] not in found]
    assert len(workers) == 1, f"no single worker of rank {rank} below {script_pid}: {found}"
    return workers[0]
