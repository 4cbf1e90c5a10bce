"""Worker of tests/distributed/test_muon_owners.py: one Muon training step of the real trainer on one
of 4 gloo ranks, counting this rank's Newton-Schulz calls (`trainer.muon.newton_schulz` per
matrix, `batched_newton_schulz` per expert stack) and their FLOPs.

Both layouts run in the same 4 processes, one after the other (the second trainer joins a fresh
process group on its own port): each process imports torch once.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

LAYOUTS = {
    "dp_shard_4": ["--parallelism.dp_shard", "4"],
    "pp_2_dp_shard_2_ep_2": ["--parallelism.pp", "2", "--parallelism.dp_shard", "2", "--parallelism.ep", "2"],
}


def _one_layout(rank: int, world: int, port: int, workdir: Path, flags: list[str]) -> dict:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    import trainer.muon as muon
    from tests.helpers import step_trainer
    from trainer.muon_owners import ns_flops

    calls: dict[str, list] = {"matrix": [], "stack": []}
    kernels = {"matrix": muon.newton_schulz, "stack": muon.batched_newton_schulz}

    def counted(kind):
        def run(x, steps, dtype):
            calls[kind].append((tuple(x.shape), ns_flops(x.shape, steps)))
            return kernels[kind](x, steps, dtype)
        return run

    muon.newton_schulz, muon.batched_newton_schulz = counted("matrix"), counted("stack")
    trainer = step_trainer(workdir, "--optimizer.name", "muon", "--optimizer.muon_ns_dtype", "float32",
                           "--training.device", "cpu", "--training.local_batch_size", "4", *flags)
    try:
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        held = [p for g in trainer.optimizer.param_groups if g["muon"] for p in g["params"]]
        trainer.step = 1
        stats = trainer.train_step(trainer.next_microbatches()[0])
        return {
            "loss": stats["loss"],
            "matrices": sorted(names[id(p)] for p in held if p.ndim == 2),
            "stacks": sum(p.ndim == 3 for p in held),
            "calls": {k: len(v) for k, v in calls.items()},
            "flops": sum(f for v in calls.values() for _, f in v),
        }
    finally:
        muon.newton_schulz, muon.batched_newton_schulz = kernels["matrix"], kernels["stack"]
        trainer.close()


def run(rank: int, world: int, port: int, workdir: str, second_port: int, queue) -> None:
    torch.set_num_threads(1)
    out = {"rank": rank}
    for (name, flags), layout_port in zip(LAYOUTS.items(), (port, second_port)):
        out[name] = _one_layout(rank, world, layout_port, Path(workdir) / name, flags)
    queue.put(out)
