"""Fault-tolerant replica groups (``[fault_tolerance]``, trainer/parallel/replica_groups.py) through
run_train.sh, with torchft's own lighthouse binary started here: two groups of 2 ranks each (FSDP
2 x EP 2 inside), Muon as the optimizer (its momentum and owner exchange inside each group).

One scenario, launched once for the module (launches are the suite's cost): both groups train;
at step ``KILL_AT`` every process of group 1 (the script, torchrun, the workers) gets SIGKILL;
group 0 trains on alone; group 1, started again with the same command, heals from group 0 and
both run to ``STEPS``. It shows:

- before the kill, the per-step losses are the one-process run's within rel 1e-5 (the bound of
  tests/e2e/test_layout_parity.py, where HSDP 2x2 x EP 2 meets the same one-process run: the
  groups' sums are HSDP's, only summed in another order);
- group 0's step counter never goes back and it steps with one live group; group 1 heals; at the
  end both groups' checkpoints (model and optimizer state) are bitwise equal, as the healed group
  took the live group's state and then ran the same calls on the same data;
- the checkpoint of the run resumes (one process, another layout) and trains on.
"""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from in_process import COMMON, REPO, assert_close, descendants, run_main
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from trainer.diagnostics import free_port, start_lighthouse

KILL_AT = 3
STEPS = 18
# Constant LR after the warmup: steps 1..KILL_AT have the same LR in a KILL_AT-step run.
SCHEDULE = ["--lr_scheduler.warmup_steps", str(KILL_AT), "--lr_scheduler.decay_ratio", "0"]
ARGS = [
    *COMMON,
    *SCHEDULE,
    "--optimizer.name",
    "muon",
    "--no-validation.enable",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "1000",
]
GROUP = [
    "--training.steps",
    str(STEPS),
    "--parallelism.dp_replicate",
    "2",
    "--parallelism.ep",
    "2",
    "--training.local_batch_size",
    "2",
    "--fault_tolerance.enable",
    "--fault_tolerance.timeout_seconds",
    "20",
    # Group 0 is paused while group 1 starts again (see `scenario`): its collectives wait that long.
    "--comm.train_timeout_seconds",
    "900",
]
TIMEOUT = 600


def _metrics(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _start(run: Path, args: list[str], log: Path) -> subprocess.Popen:
    """NGPU=2 run_train.sh in a session of its own, its output into ``log`` (torchft logs every
    quorum: a pipe nobody reads while the group trains would fill and stop it)."""
    env = {**os.environ, "NGPU": "2", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "MASTER_PORT": ""}
    with log.open("w") as out:
        return subprocess.Popen(
            ["bash", str(REPO / "run_train.sh"), "--job.dump_folder", str(run), *args],
            cwd=run.parent,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait_for(what: str, condition, procs: list[subprocess.Popen], deadline: float) -> None:
    while not condition():
        for proc in procs:
            if proc.poll() is not None:
                pytest.fail(f"waiting for {what}: a group ended with {proc.returncode} (logs: {proc.args})")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def _meet(procs: list[subprocess.Popen], logs: list[Path], line: str, deadline: float) -> None:
    """Each launch that has printed ``line`` is paused (SIGSTOP) until every launch has; then all go on."""
    paused = set()
    try:
        while len(paused) < len(procs):
            for g, (proc, log) in enumerate(zip(procs, logs)):
                if g not in paused and line in log.read_text():
                    _signal(proc, signal.SIGSTOP)
                    paused.add(g)
                if proc.poll() is not None:
                    pytest.fail(f"waiting for {line!r}: group {g} ended with {proc.returncode} (log: {log})")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {line!r} from every group")
            time.sleep(0.05)
    finally:
        for g in paused:
            _signal(procs[g], signal.SIGCONT)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to every process of one launch: the script, torchrun and the workers."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _kill(proc: subprocess.Popen) -> None:
    _signal(proc, signal.SIGKILL)
    proc.wait(timeout=60)


def _state(folder: Path, tmp: Path) -> dict:
    """A group's last checkpoint as one dict of whole tensors (DCP's own converter)."""
    step = folder / "checkpoint" / f"step-{STEPS}"
    target = tmp / f"{folder.name}.pt"
    dcp_to_torch_save(step, target)
    return torch.load(target, weights_only=False)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    root = tmp_path_factory.mktemp("replica_groups")
    single = root / "single"
    assert (
        run_main(
            root,
            "--job.dump_folder",
            str(single),
            *ARGS,
            "--training.steps",
            str(KILL_AT),
            "--training.local_batch_size",
            "8",
        )
        == 0
    )
    port = free_port()
    # A group silent for 3 s drops out of the next quorum; a live group that has not asked for it yet
    # (one in the middle of a step, or still building its model) is waited for up to 60 s.
    lighthouse = start_lighthouse(port, "--join_timeout_ms", "60000", "--heartbeat_timeout_ms", "3000")
    group_args = [*ARGS, *GROUP, "--fault_tolerance.lighthouse", f"http://127.0.0.1:{port}"]
    run = root / "run"
    run.mkdir()
    folders = [run / f"replica_group_{g}" for g in (0, 1)]
    logs = [root / "group0.log", root / "group1.log", root / "group1_again.log"]
    procs = [_start(run, [*group_args, "--fault_tolerance.replica_id", str(g)], logs[g]) for g in (0, 1)]
    try:
        deadline = time.monotonic() + TIMEOUT
        # The lighthouse waits for a group only once that group's manager beats, and a launch asks for its
        # first quorum about a second after its manager starts: were one launch a few seconds behind the
        # other (a loaded CPU), the first would train its first steps alone. So each group pauses once its
        # manager is up until the other's is; from there each waits for the other (`--join_timeout_ms`).
        _meet(procs, logs[:2], "Manager listening", deadline)
        _wait_for(f"group 1 at step {KILL_AT}", lambda: len(_metrics(folders[1])) >= KILL_AT, procs, deadline)
        _kill(procs[1])
        _wait_for(
            "group 0 stepping alone",
            lambda: any(r.get("replica_groups") == 1 for r in _metrics(folders[0])),
            procs[:1],
            deadline,
        )
        # Group 0 pauses while group 1 starts again (a minute of imports and building on a loaded CPU, in
        # which group 0 alone could finish the run) and goes on once group 1's processes have met, seconds
        # before it asks for its first quorum. Were group 0 silent then, group 1 would train a step alone
        # from step 0 and heal at the next quorum all the same: torchft heals whichever group is behind.
        _signal(procs[0], signal.SIGSTOP)
        procs[1] = _start(run, [*group_args, "--fault_tolerance.replica_id", "1"], logs[2])
        try:
            _wait_for("group 1 started again", lambda: "run folder" in logs[2].read_text(), procs[1:], deadline)
        finally:
            _signal(procs[0], signal.SIGCONT)
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                _kill(proc)
        os.killpg(lighthouse.pid, signal.SIGKILL)
        lighthouse.wait()
    outputs = [logs[0].read_text(), logs[2].read_text()]
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]
    return {
        "root": root,
        "single": single,
        "folders": folders,
        "outputs": outputs,
        "metrics": [_metrics(f) for f in folders],
    }


def test_two_groups_match_one_process(scenario):
    single = {r["step"]: r for r in _metrics(scenario["single"]) if "loss" in r}
    for group in scenario["metrics"]:
        # The first record of a step: group 1's folder also holds its life after the restart.
        by_step = {}
        for record in group:
            if "loss" in record:
                by_step.setdefault(record["step"], record)
        for step in range(1, KILL_AT + 1):
            assert by_step[step]["replica_groups"] == 2
            assert_close(f"step {step} loss", by_step[step]["loss"], single[step]["loss"])


def test_killed_group_heals_and_the_live_one_never_steps_back(scenario, tmp_path):
    steps = [r["step"] for r in scenario["metrics"][0] if "loss" in r]
    assert steps == list(range(1, STEPS + 1)), steps  # one record per step: no step went back
    alone = [r["step"] for r in scenario["metrics"][0] if r.get("replica_groups") == 1]
    assert alone and min(alone) > KILL_AT, alone
    assert "healed: step" in scenario["outputs"][1], scenario["outputs"][1][-3000:]
    states = [_state(folder, tmp_path) for folder in scenario["folders"]]
    assert states[0].keys() == states[1].keys()
    for key in ("model", "optimizer"):
        left, right = states[0][key], states[1][key]
        assert left.keys() == right.keys()
        for name, value in left.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, right[name]), f"{key}.{name} differs after healing"
            else:
                assert value == right[name], f"{key}.{name}: {value} vs {right[name]}"
    assert states[0]["train_state"]["step"] == states[1]["train_state"]["step"] == STEPS


def test_checkpoint_of_the_run_resumes(scenario):
    """Group 0's last checkpoint resumes without fault tolerance, in one process, and trains on."""
    resumed = scenario["root"] / "resumed"
    shutil.copytree(scenario["folders"][0] / "checkpoint", resumed / "checkpoint")
    assert (
        run_main(
            scenario["root"],
            "--job.dump_folder",
            str(resumed),
            *ARGS,
            "--training.steps",
            str(STEPS + 1),
            "--training.local_batch_size",
            "8",
        )
        == 0
    )
    records = _metrics(resumed)
    assert [r["step"] for r in records if "loss" in r] == [STEPS + 1]
