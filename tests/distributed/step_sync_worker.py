"""Host reads of one expert-parallel training step, per rank (2 gloo processes, --parallelism.ep 2).

    python -m tests.distributed.step_sync_worker --out out.json --port PORT

Each rank runs `tests/unit/test_step_sync.py`'s profiled step (debug model, fp32, grouped mm) and
writes its counts to ``out.json`` (a list, one entry per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

WORLD = 2


def _worker(rank: int, port: int, out: str, workdir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD)
    )
    torch.set_num_threads(1)
    from models.moe import moe_modules
    from tests.unit.test_step_sync import ATOMIC_OPS, _profiled_step, _trainer

    trainer = _trainer(Path(workdir), "--parallelism.ep", "2", "--training.device", "cpu")
    try:
        stats, reads, ops = _profiled_step(trainer)
        result = {
            "rank": rank,
            "loss": stats["loss"],
            "reads": dict(reads),
            "moe_layers": len(moe_modules(trainer.model)),
            "micro_batches": trainer.grad_accum_steps,
            "atomic_ops": {op: n for op, n in ops.items() if op in ATOMIC_OPS},
        }
        Path(f"{out}.rank{rank}").write_text(json.dumps(result))
    finally:
        trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        torch.multiprocessing.spawn(_worker, args=(args.port, args.out, workdir), nprocs=WORLD)
    results = [json.loads(Path(f"{args.out}.rank{r}").read_text()) for r in range(WORLD)]
    Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
