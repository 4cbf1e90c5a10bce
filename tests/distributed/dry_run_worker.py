"""Worker of tests/distributed/test_dry_run.py: one real gloo rank of the layout the dry run
rehearses at world 2, its second step (the first makes the optimizer state) under the dry run's
own memory tracker and collective recorder, on real tensors."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def run(rank: int, world: int, port: int, workdir: str, extra: list[str], queue) -> None:
    # The Trainer joins its process group from the environment, as under torchrun.
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    from tests.helpers import step_trainer
    from trainer.diagnostics import track_step

    trainer = step_trainer(Path(workdir), "--training.device", "cpu", *extra)
    try:
        trainer.step = 1
        trainer.train_step(trainer.next_microbatches()[0])
        batches, _ = trainer.next_microbatches()
        memory, collectives = track_step(trainer, batches)
        queue.put({"rank": rank, "collectives": collectives, "memory_gib": memory})
    finally:
        trainer.close()
