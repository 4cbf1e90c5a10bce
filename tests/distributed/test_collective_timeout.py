"""Collective timeouts ([comm], trainer/distributed.py `set_collective_timeout`): a rank that stops
calling collectives after the first step ends the others with one line naming
`comm.train_timeout_seconds`, within that timeout rather than torch's default (30 minutes for gloo).

Two ranks run the real Trainer and `run` (FSDP over both, the debug model) under `spawn_local`, as
torchrun's workers would (env:// variables, `TRAINER_LAUNCH_DIR`, so the line goes where
run_train.sh prints it from: `rank<R>.err`). Rank 1 stops at the start of step 2, before its data
(the tokenisation exchange) and its first collective, and waits there until rank 0 has reported."""

import os
import time
from pathlib import Path

from trainer.diagnostics import spawn_local

TRAIN_TIMEOUT = 5.0
# Liveness only: the line must come from the 5 s timeout, not torch's 30-minute gloo default.
REPORT_BOUND = 120.0


# Every mesh this layout (FSDP 2, no Engram) builds: trainer/parallel/parallel_dims.py.
MESHES = ("world", "fsdp", "loss", "hsdp", "dp", "sparse", "efsdp", "ehsdp")


def _groups_of(trainer) -> list:
    """The run's process groups, found without the registry `set_collective_timeout` walks: the
    default group, every mesh dim's group and the tokenisation group."""
    import torch.distributed as dist

    meshes = [trainer.parallel_dims.mesh(name) for name in MESHES]
    return [dist.group.WORLD, trainer.token_group, *(g for mesh in meshes for g in mesh.get_all_groups())]


def _timeouts(groups: list) -> set[float]:
    import torch

    # A group's timeout has no public getter: read it off its gloo backend's options (tests only).
    return {g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups}


def _one_rank_stops(rank: int, world: int, port: int, launch_dir: str, dump: str, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world), TRAINER_LAUNCH_DIR=launch_dir,
    )
    from trainer.config import load_config
    from trainer.outcome import run
    from trainer.trainer import Trainer

    report = Path(launch_dir, "attempt0", "rank0.err")  # torchrun's first attempt (trainer/launch_files.py)

    class OneRankStops(Trainer):
        def next_microbatches(self):
            if self.step == 1:
                self.timeouts_in_first_step = _timeouts(_groups_of(self))
            if self.step == 2:
                self.stopped_at = time.monotonic()
                self.timeouts_after_first_step = _timeouts(_groups_of(self))
                if rank == 1:
                    while not report.exists() and time.monotonic() - self.stopped_at < 2 * REPORT_BOUND:
                        time.sleep(0.2)
                    queue.put((rank, self.timeouts_after_first_step))
                    raise SystemExit(0)
            return super().next_microbatches()

    cfg = load_config([
        "--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", dump,
        "--training.steps", "4", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.device", "cpu", "--no-validation.enable", "--no-job.print_config",
        "--comm.train_timeout_seconds", str(TRAIN_TIMEOUT),
    ])
    trainer = OneRankStops(cfg)
    code = run(trainer)
    queue.put((rank, {
        "code": code, "in_first_step": trainer.timeouts_in_first_step,
        "after_first_step": trainer.timeouts_after_first_step,
        "seconds": time.monotonic() - trainer.stopped_at, "report": report.read_text(),
    }))


def test_a_rank_that_stops_calling_collectives_ends_the_others_with_one_line(tmp_path):
    launch_dir = tmp_path / "launch"
    launch_dir.mkdir()
    results = dict(spawn_local(_one_rank_stops, 2, str(launch_dir), str(tmp_path / "run"), timeout=480))
    rank0 = results[0]
    assert rank0["code"] == 2, rank0
    # The first step (it compiles, when compiling) waits up to comm.init_timeout_seconds (default
    # 300) in every group, not torch's backend default.
    assert rank0["in_first_step"] == {300.0}, rank0
    # Every group switched after the first step, on both ranks.
    assert rank0["after_first_step"] == results[1] == {TRAIN_TIMEOUT}, results
    lines = rank0["report"].splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("error: a collective waited longer than comm.train_timeout_seconds = 5 s at step 2"), line
    assert "another rank stopped calling collectives" in line and "--comm.train_timeout_seconds" in line, line
    assert "Traceback" not in line
    assert rank0["seconds"] < REPORT_BOUND, rank0
    # Only the failing rank reports; the stopped one never reached a collective to fail in.
    assert sorted(p.name for p in launch_dir.glob("attempt0/*.err")) == ["rank0.err"]
