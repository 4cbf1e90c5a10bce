"""FSDP 2 + EP 2 checkpoints (2 gloo processes; fp32, deterministic, CPU): exact resume at the same
layout, and DCP resharding between one process and two, both ways.

Routed experts are DTensors of the global ``[E, ...]`` stack (``Shard(0)`` on "ep", FSDP on top),
so DCP writes and reshards global expert tensors and their AdamW moments like any other weight.

- exact resume: FSDP 2 + EP 2 (data-parallel 2) for 10 steps straight vs a new Trainer resuming
  from the step-5 checkpoint for 5 more steps: bit-identical losses. Process start-up dominates
  on a 2-core CI machine, so all two-process runs share one launch of two gloo ranks
  (`spawn_local`, with the env:// variables torchrun would set, and no torchrun process to start);
  each resumed Trainer is built from scratch and gets model, optimizer, schedule, data position
  and RNG from the checkpoint alone. A real process kill is tested single-process in
  test_resume.py. Every run keeps the parameter EMA (``[ema]``, trainer/optim/ema.py): each
  rank averages its own FSDP / EP shards, and the resumed run's average at step 10 is
  bit-identical to the straight run's (both read from their step-10 checkpoints, resharded to
  whole tensors by DCP).
- reshard: the layouts must read the same tokens per step to compare losses, so the two-process
  side is FSDP 2 + EP 2 as context parallel (``ep_as_cp``: data-parallel degree 1, the sequence
  split over the ep ranks; the same expert placements as FSDP 2 + EP 2). A single-process
  checkpoint at step 5 resumed by it, and its own checkpoint at step 8 resumed by one process,
  continue the single-process run's losses (rel 1e-5, the layout parity bound of
  tests/distributed/test_parity.py). The first step after a load checks the weights, the next
  ones the optimizer state too.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import list_checkpoints, read_model_state_dict
from trainer.diagnostics import set_torchrun_env, spawn_local
from trainer.train import main

pytestmark = pytest.mark.numerics  # docs/numerics.md

REPO = Path(__file__).resolve().parents[2]
STEPS = 10
ARGS = [
    "--config", str(REPO / "train_configs/debug_model.toml"),
    "--training.steps", str(STEPS), "--training.seq_len", "64", "--training.local_batch_size", "2",
    "--training.mixed_precision_param", "float32", "--training.deterministic", "--no-validation.enable",
    "--metrics.log_freq", "1", "--job.print_config=false",
    "--checkpoint.enable", "--checkpoint.interval", str(STEPS // 2), "--checkpoint.keep_latest_k", "0",
    # Warmup, then a constant LR (WSD without decay): the schedule does not depend on
    # training.steps, so a run may stop early (--training.steps 8) on the same LRs.
    "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0",
    "--ema.enable", "--ema.decay", "0.7",
]
FSDP_EP = ["--parallelism.dp_shard", "2", "--parallelism.ep", "2"]
FSDP_EP_AS_CP = ["--parallelism.dp_shard", "2", "--parallelism.ep", "2", "--parallelism.ep_as_cp"]
REL = 1e-5


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def start_from(run_dir: Path, source: Path) -> Path:
    """A fresh run folder whose only checkpoint is a copy of ``source``."""
    shutil.copytree(source, run_dir / "checkpoint" / source.name)
    return run_dir


def assert_close(got: dict[int, float], want: dict[int, float], steps: range) -> None:
    assert sorted(got) == list(steps)
    for step in steps:
        assert abs(got[step] - want[step]) <= REL * abs(want[step]), (step, got[step], want[step])


def _two_process_runs(rank: int, world: int, port: int, tmp: Path, queue) -> None:
    """Rank body (`spawn_local`): the three two-process runs, one Trainer after the other."""
    import torch.distributed as dist

    from trainer.config import load_config
    from trainer.distributed import destroy_distributed
    from trainer.trainer import Trainer

    set_torchrun_env(rank, world, port)
    os.environ["WANDB_MODE"] = "disabled"
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 in a launch

    def train(run_dir: Path, *extra: str) -> None:
        trainer = Trainer(load_config([*ARGS, "--job.dump_folder", str(run_dir), *extra]))
        try:
            trainer.train()
        finally:  # the process group stays for the next Trainer
            trainer.checkpointer.close()
            trainer.metrics.close()

    def copy_then_train(run_dir: Path, source: Path, *extra: str) -> None:
        if dist.get_rank() == 0:
            start_from(run_dir, source)
        dist.barrier()
        train(run_dir, *extra)

    train(tmp / "straight", *FSDP_EP)
    copy_then_train(tmp / "resumed", tmp / "straight" / "checkpoint" / f"step-{STEPS // 2}", *FSDP_EP)
    copy_then_train(tmp / "two", tmp / "single" / "checkpoint" / "step-5", *FSDP_EP_AS_CP, "--training.steps", "8")
    destroy_distributed()
    queue.put(rank)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Single-process 10 steps (in this process), then the one two-process launch."""
    tmp = tmp_path_factory.mktemp("resume_fsdp")
    assert main([*ARGS, "--job.dump_folder", str(tmp / "single")]) == 0
    assert sorted(spawn_local(_two_process_runs, 2, tmp, timeout=900)) == [0, 1]
    return tmp


@pytest.mark.slow
def test_fsdp2_ep2_exact_resume(runs):
    straight = losses(runs / "straight")
    assert sorted(straight) == list(range(1, STEPS + 1))
    assert straight[STEPS] < straight[1] - 0.1  # it trains: not two constant sequences
    log = (runs / "resumed" / "train.log").read_text()
    assert f"step-{STEPS // 2} (step {STEPS // 2})" in log and "restart from the seed" not in log
    assert losses(runs / "resumed") == {s: straight[s] for s in range(STEPS // 2 + 1, STEPS + 1)}  # bit-identical
    want, got = (read_model_state_dict(runs / run / "checkpoint" / f"step-{STEPS}", ema=True)
                 for run in ("straight", "resumed"))
    weights = read_model_state_dict(runs / "straight" / "checkpoint" / f"step-{STEPS}")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert not torch.equal(want["layers.0.attn.wq.weight"], weights["layers.0.attn.wq.weight"])  # an average


@pytest.mark.slow
def test_reshard_between_one_process_and_fsdp2_ep2(runs, tmp_path):
    single = losses(runs / "single")
    # 1 process -> FSDP 2 + EP 2: resumed at step 5, steps 6-8, saved at step 8. Only rank 0
    # logs: rank 1 has no saved state of its own and takes rank 0's (the data position is
    # global); otherwise its half of each sequence, and so the losses, would differ.
    log = (runs / "two" / "train.log").read_text()
    assert "resumed from" in log and "restart from the seed" not in log and "not restored" not in log
    assert "holds no parameter EMA" not in log  # resharded from one process like the weights
    assert_close(losses(runs / "two"), single, range(6, 9))
    assert [c.step for c in list_checkpoints(runs / "two" / "checkpoint")] == [8, 5]

    # FSDP 2 + EP 2 -> 1 process: its step 8, then steps 9-10.
    back = start_from(tmp_path / "back", runs / "two" / "checkpoint" / "step-8")
    assert main([*ARGS, "--job.dump_folder", str(back)]) == 0
    log = (back / "train.log").read_text()
    assert "resumed from" in log and "restart from the seed" not in log and "not restored" not in log
    assert_close(losses(back), single, range(9, STEPS + 1))
