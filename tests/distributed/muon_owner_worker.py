"""Worker of tests/distributed/test_muon_owners.py: one Muon training step of the real trainer on one
of 4 gloo ranks, counting this rank's Newton-Schulz calls (`trainer.optim.muon.newton_schulz` per
matrix, `batched_newton_schulz` per expert stack) and their FLOPs.

Both layouts, and a bitwise check of the owned NS in each placement a 2-D parameter gets
(`_placements`), run in the same 4 processes one after the other (each joins a fresh process
group on its own port): each process imports torch once.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# name: (parallelism flags, routed experts of the debug model: None = its own 8)
LAYOUTS = {
    "dp_shard_4": (["--parallelism.dp_shard", "4"], None),
    "pp_2_dp_shard_2_ep_2": (["--parallelism.pp", "2", "--parallelism.dp_shard", "2", "--parallelism.ep", "2"], None),
    # Replicas of sharded stacks: each expert matrix is held by two ranks, owned by one of four.
    # (HSDP x EP builds here alone, but not after or before another layout in the same processes:
    # the expert stacks' weight init then resolves a process group of another world. Its
    # placements are in `_placements`.)
    "hsdp_2x2": (["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"], None),
    # efsdp 2 over one expert per EP rank: one of the two efsdp ranks holds it, both orthogonalise.
    "dp_shard_4_ep_2_two_experts": (["--parallelism.dp_shard", "4", "--parallelism.ep", "2"], 2),
    # TP leaves the routed experts whole on both tp ranks (FSDP shards them over dp_shard only):
    # the tp peers are replicas, pooled with the FSDP shards.
    "dp_shard_2_tp_2": (["--parallelism.dp_shard", "2", "--parallelism.tp", "2"], None),
}


def _one_layout(rank: int, world: int, port: int, workdir: Path, flags: list[str], experts: int | None) -> dict:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    import dataclasses

    import trainer.model_args as model_args
    import trainer.optim.muon as muon
    from models.deepseek_v3 import get_flavor
    from tests.helpers import step_trainer
    from trainer.distributed import local_part, local_tensor
    from trainer.optim.muon_owners import ns_flops

    calls: dict[str, list] = {"matrix": [], "stack": []}
    kernels = {"matrix": muon.newton_schulz, "stack": muon.batched_newton_schulz}

    def counted(kind):
        def run(x, steps, dtype):
            calls[kind].append((tuple(x.shape), ns_flops(x.shape, steps)))
            return kernels[kind](x, steps, dtype)
        return run

    def flavor(name):
        args = get_flavor(name)
        moe = dataclasses.replace(args.moe, num_experts=experts, num_expert_groups=1, num_limited_groups=1)
        return dataclasses.replace(args, moe=moe)

    muon.newton_schulz, muon.batched_newton_schulz = counted("matrix"), counted("stack")
    if experts is not None:
        model_args.get_flavor = flavor
    trainer = step_trainer(workdir, "--optimizer.name", "muon", "--optimizer.muon_ns_dtype", "float32",
                           "--training.device", "cpu", "--training.local_batch_size", "4", *flags)
    try:
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        held = [p for g in trainer.optimizer.param_groups if g["muon"] for p in g["params"]]
        stacks = [p for p in held if p.ndim == 3]
        # Bitwise digests of this rank's expert gradients (before the step) and weights (after):
        # replicas (tp peers) must agree on both.
        digests = {}
        trainer.optimizer.register_step_pre_hook(
            lambda *_: digests.update(grads=_digest(local_tensor(p.grad) for p in stacks)))
        trainer.step = 1
        stats = trainer.train_step(trainer.next_microbatches()[0])
        digests["weights"] = _digest(local_tensor(p).detach() for p in stacks)
        (exchange,) = trainer.optimizer._exchanges.values()
        # What this rank orthogonalised, by name: its owned matrices (named by their holders, in
        # the test) and the stacks it holds alone (each expert).
        alone = [p for p in stacks if not muon._pooled(p, trainer.optimizer.expert_replicas)]
        local_experts = [(names[id(p)], e) for p in alone
                         for e in (local_part(torch.arange(p.shape[0]), p).tolist() if hasattr(p, "device_mesh")
                                   else range(p.shape[0]))]
        return {
            "loss": stats["loss"],
            "matrices": sorted(names[id(p)] for p in held if p.ndim == 2),
            "stacks": {names[id(p)]: p.shape[0] for p in held if p.ndim == 3},
            "stacks_alone": len(alone),
            "expert_groups": sorted({key[1] for key in exchange.keys if key[0] == 1 and rank in key[1]}),
            "digests": digests,
            "calls": {k: len(v) for k, v in calls.items()},
            "ns_matrices": sum(1 if len(s) == 2 else s[0] for v in calls.values() for s, _ in v),
            "flops": sum(f for v in calls.values() for _, f in v),
            "named_keys": {key: names[id(exchange.params[i])] if j is None else (names[id(exchange.params[i])], key[3])
                           for key, (i, j) in exchange.local.items()},
            "owned_keys": exchange.owned_keys(),
            "local_experts": local_experts,
        }
    finally:
        muon.newton_schulz, muon.batched_newton_schulz = kernels["matrix"], kernels["stack"]
        model_args.get_flavor = get_flavor
        trainer.close()


def _digest(tensors) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def _placements(rank: int, world: int, port: int) -> dict[str, bool]:
    """Two Muon steps on matrices of odd shapes in each placement the trainer's layouts give a
    2-D parameter (FSDP, HSDP, FSDP x TP by rows and columns, FSDP over TP's dim, replicated) and
    an expert stack (FSDP over all ranks with an empty shard; efsdp 2 x EP 2 with one expert per EP
    rank, so one efsdp rank holds none; HSDP 2 x EP 2, replicas holding whole experts; TP's
    replicas: plain stacks on 4 tp ranks, and FSDP 2 x TP 2 with an empty shard), small
    buckets: whether each layout's weights equal one process's bitwise, every expert matrix of a
    stack having gone through the owner plan (pooled expert matrices are orthogonalised on owners,
    several to a batched call, where one process runs each whole stack in one call)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from trainer.diagnostics import HostReadCounter, init_local_gloo
    from trainer.optim.muon import MuonAdamW

    init_local_gloo(rank, world, port)
    gen = torch.Generator().manual_seed(0)
    flat, grid = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
    expert_grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    expert_hsdp = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "efsdp", "ep"))
    fsdp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    efsdp_ep = [_StridedShard(0, split_factor=2), Shard(0)]
    matrices = [(24, 40), (7, 9), (33, 16), (5, 64), (64, 8)]
    # name: (mesh (None: plain tensors), placements, shapes, replicas outside the mesh)
    layouts = {
        "fsdp": (flat, [Shard(0)], matrices, None),
        "hsdp": (grid, [Replicate(), Shard(0)], matrices, None),
        "fsdp_tp_rows": (grid, [Shard(0), Shard(1)], matrices, None),
        "fsdp_over_tp": (grid, [_StridedShard(0, split_factor=2), Shard(0)], matrices, None),
        "replicated": (flat, [Replicate()], matrices, None),
        "experts_fsdp": (flat, [Shard(0)], [(6, 24, 40), (6, 7, 9), (6, 33, 16)], None),
        "experts_efsdp_2_ep_2": (expert_grid, efsdp_ep, [(2, 24, 40), (2, 33, 16)], None),
        "experts_hsdp_2_ep_2": (expert_hsdp, [Replicate(), *efsdp_ep], [(6, 7, 9), (6, 40, 24)], None),
        # TP's replicas of the routed experts: plain stacks on 4 tp ranks, FSDP 2 x TP 2.
        "experts_tp_4": (None, [], [(6, 7, 9), (3, 40, 24)], flat),
        "experts_fsdp_2_tp_2": (fsdp_tp["fsdp"], [Shard(0)], [(6, 24, 40), (1, 33, 16)], fsdp_tp["tp"]),
    }
    kw = dict(lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, ns_dtype=torch.float32)

    def trained(place, w0, grads, replicas=None) -> tuple[list[torch.Tensor], int]:
        """The weights after two steps, and the expert matrices the owner plan moves (-1 where the
        second step read a tensor's value on the host)."""
        params = [nn.Parameter(place(w.clone())) for w in w0]
        opt = MuonAdamW([{"params": params, "muon": True}], bucket_bytes=4000, expert_replicas=replicas, **kw)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = place(g.clone())
            with HostReadCounter("cpu") as reads:  # the second step (the plan exists) reads nothing
                opt.step()
        pooled = sum(key[0] == 1 for plan in opt._exchanges.values() for key in plan.keys)
        weights = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in params]
        return weights, pooled if not reads.reads else -1

    out = {}
    for name, (mesh, placements, shapes, replicas) in layouts.items():
        w0 = [torch.randn(s, generator=gen) for s in shapes]
        grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
        want, _ = trained(lambda t: t, w0, grads)
        got, pooled = trained(
            (lambda t: t) if mesh is None else lambda t: distribute_tensor(t, mesh, placements, src_data_rank=None),
            w0, grads, replicas)
        stacked = sum(s[0] for s in shapes if len(s) == 3)
        out[name] = all(torch.equal(a, b) for a, b in zip(got, want)) and pooled == stacked
    dist.destroy_process_group()
    return out


def run(rank: int, world: int, port: int, workdir: str, ports: list[int], queue) -> None:
    torch.set_num_threads(1)
    out = {"rank": rank}
    for (name, (flags, experts)), layout_port in zip(LAYOUTS.items(), (port, *ports)):
        out[name] = _one_layout(rank, world, layout_port, Path(workdir) / name, flags, experts)
    queue.put(out)


def run_placements(rank: int, world: int, port: int, queue) -> None:
    """The owners' exchange alone (no trainer is built): the fast tier's launch."""
    torch.set_num_threads(1)
    queue.put({"rank": rank, "placements": _placements(rank, world, port)})
