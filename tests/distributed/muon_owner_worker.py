"""Worker of tests/distributed/test_muon_owners.py: one Muon training step of the real trainer on one
of 4 gloo ranks, counting this rank's Newton-Schulz calls (`trainer.muon.newton_schulz` per
matrix, `batched_newton_schulz` per expert stack) and their FLOPs.

Both layouts, and a bitwise check of the owned NS in each placement a 2-D parameter gets
(`_placements`), run in the same 4 processes one after the other (each joins a fresh process
group on its own port): each process imports torch once.
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


def _placements(rank: int, world: int, port: int) -> dict[str, bool]:
    """Two Muon steps on matrices of odd shapes in each placement the trainer's layouts give a
    2-D parameter (FSDP, HSDP, FSDP x TP by rows and columns, FSDP over TP's dim, replicated),
    small buckets: whether each layout's weights equal one process's bitwise."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from trainer.diagnostics import init_local_gloo
    from trainer.muon import MuonAdamW

    init_local_gloo(rank, world, port)
    shapes = [(24, 40), (7, 9), (33, 16), (5, 64), (64, 8)]
    gen = torch.Generator().manual_seed(0)
    w0 = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    flat, grid = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
    layouts = {
        "fsdp": (flat, [Shard(0)]), "hsdp": (grid, [Replicate(), Shard(0)]), "fsdp_tp_rows": (grid, [Shard(0), Shard(1)]),
        "fsdp_over_tp": (grid, [_StridedShard(0, split_factor=2), Shard(0)]), "replicated": (flat, [Replicate()]),
    }
    kw = dict(lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, ns_dtype=torch.float32)

    def trained(place) -> list[torch.Tensor]:
        params = [nn.Parameter(place(w.clone())) for w in w0]
        opt = MuonAdamW([{"params": params, "muon": True}], bucket_bytes=4000, **kw)  # several buckets
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = place(g.clone())
            opt.step()
        return [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in params]

    want = trained(lambda t: t)
    out = {}
    for name, (mesh, placements) in layouts.items():
        got = trained(lambda t: distribute_tensor(t, mesh, placements, src_data_rank=None))
        out[name] = all(torch.equal(a, b) for a, b in zip(got, want))
    dist.destroy_process_group()
    return out


def run(rank: int, world: int, port: int, workdir: str, ports: list[int], queue) -> None:
    torch.set_num_threads(1)
    out = {"rank": rank}
    for (name, flags), layout_port in zip(LAYOUTS.items(), (port, *ports)):
        out[name] = _one_layout(rank, world, layout_port, Path(workdir) / name, flags)
    out["placements"] = _placements(rank, world, ports[-1])
    queue.put(out)
