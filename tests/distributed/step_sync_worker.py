"""Worker of tests/distributed/test_step_sync_ep.py: the host reads of one expert-parallel training
step on one of 2 gloo ranks (--parallelism.ep 2).

Each rank runs the profiled step of tests/helpers.py (as tests/unit/test_step_sync.py) (debug model, fp32, grouped mm) and
puts its counts on the queue.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def run(rank: int, world: int, port: int, workdir: str, queue) -> None:
    # The Trainer joins its process group from the environment, as under torchrun.
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    from models.moe import moe_modules
    from tests.helpers import ATOMIC_OPS, profiled_step, step_trainer

    trainer = step_trainer(Path(workdir), "--parallelism.ep", "2", "--training.device", "cpu")
    try:
        stats, reads, ops = profiled_step(trainer)
        queue.put({
            "rank": rank,
            "loss": stats["loss"],
            "reads": dict(reads),
            "moe_layers": len(moe_modules(trainer.model)),
            "micro_batches": trainer.grad_accum_steps,
            "atomic_ops": {op: n for op, n in ops.items() if op in ATOMIC_OPS},
        })
    finally:
        trainer.close()
