"""Optimizer step time, Newton-Schulz work per rank and host reads: AdamW (fp32 / bf16 states) vs
Muon, on 1, 2 and 4 local gloo ranks; and the 671B flavor's NS FLOPs per rank in three layouts.

**Measured** (default): for each world size of `--worlds`, that many spawned processes (one
thread each; world 1 in this process) build the flavor's model (seeded init, `--model-override` applied), shard it with
FSDP2 over all ranks (`fully_shard` of the whole model on a 1-D mesh: every parameter dim-0
sharded, so routed experts stay whole on their rank, as with efsdp), build
`trainer.optim.build_optimizer`, give every parameter the same random gradient, and time
`optimizer.step()` alone: `--warmup` untimed steps (they create the state and Muon's owner
plan), then the median of `--steps` timed ones; a row's time is the slowest rank's. During one
more step each rank counts its Newton-Schulz calls and their FLOPs (by wrapping
`trainer.optim.muon.newton_schulz` / `batched_newton_schulz`) and its host reads
(`trainer.diagnostics.HostReadCounter`: `.item()`, `.tolist()`, ... of tensors). State bytes per
parameter count every optimizer-state tensor over the parameter count (world 1). Settings run one
after another in the same processes; on a shared machine compare ratios taken in the same run.

**671B** (`--flops-671b`): NS FLOPs per rank of the 671B flavor at 2048 ranks, before (every rank
orthogonalises every 2-D Muon matrix of its pipeline stage) and after (each once, owners from
`trainer.optim.muon_owners.assign_owners`, the optimizer's own code, balanced over all ranks against
the expert stacks each rank orthogonalises anyway). No process group: shapes come from the model
built on the meta device.

    python benchmarks/optim_bench.py                                   # debugmodel, worlds 1,2,4
    python benchmarks/optim_bench.py --model-override dim=512 --model-override moe_inter_dim=512
    python benchmarks/optim_bench.py --flops-671b
    python benchmarks/optim_bench.py --worlds 1 --ns-compare ns.json   # batched vs per-matrix expert NS
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from models.deepseek_v3 import DeepSeekV3Model, get_flavor
from trainer.config import JobConfig
from trainer.diagnostics import HostReadCounter, apply_overrides, init_local_gloo, spawn_local
from trainer.optim.build import build_optimizer
from trainer.optim.muon import muon_params

SETTINGS = (("AdamW", "float32"), ("AdamW", "bfloat16"), ("muon", "float32"), ("muon", "bfloat16"))
KERNELS = ("newton_schulz", "batched_newton_schulz")


def _ns_flops(shape, steps: int) -> float:
    try:
        from trainer.optim.muon_owners import ns_flops
    except ImportError:  # a tree from before owned Newton-Schulz (`--before` figures): the same count
        s, l = sorted(shape[-2:])
        return 2.0 * (shape[0] if len(shape) == 3 else 1) * steps * s * s * (2 * l + s)
    return ns_flops(shape, steps)


def _count_ns(calls: list) -> dict:
    """Wraps the NS kernels of trainer.optim.muon (those this tree has) to append (shape, FLOPs) to
    `calls`; returns the originals."""
    import trainer.optim.muon as muon

    originals = {k: getattr(muon, k) for k in KERNELS if hasattr(muon, k)}

    def wrap(kernel):
        def counted(x, steps, dtype):
            calls.append(_ns_flops(tuple(x.shape), steps))
            return kernel(x, steps, dtype)
        return counted

    for k, kernel in originals.items():
        setattr(muon, k, wrap(kernel))
    return originals


def _model(args, world: int, seed: int, device: torch.device):
    torch.manual_seed(seed)
    with device:
        model = DeepSeekV3Model(args)
    model.init_weights()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model


def _set_grads(model, seed: int) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        g = (torch.randn(p.shape, generator=gen) * 1e-3).to(p.device)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else g


def _timed_step(optimizer, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def measure(args, name: str, state_dtype: str, a, world: int) -> dict:
    device = torch.device(a.device)
    model = _model(args, world, a.seed, device)
    cfg = JobConfig().optimizer
    cfg.name, cfg.state_dtype, cfg.muon_ns_dtype = name, state_dtype, a.ns_dtype
    optimizer, _ = build_optimizer(model, cfg)
    _set_grads(model, a.seed)
    times = [_timed_step(optimizer, device) for _ in range(a.warmup + a.steps)][a.warmup:]
    calls: list[float] = []
    originals = _count_ns(calls)
    reads = HostReadCounter(device.type)
    try:
        with reads:
            optimizer.step()
    finally:
        import trainer.optim.muon as muon

        for k, kernel in originals.items():
            setattr(muon, k, kernel)
    n_params = sum(p.numel() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    return {"optimizer": name, "state_dtype": state_dtype, "step_ms": 1e3 * statistics.median(times),
            "state_bytes_per_param": state / n_params, "params": n_params, "ns_calls": len(calls),
            "ns_flops": sum(calls), "host_reads": sum(reads.counts.values())}


def _worker(rank: int, world: int, port: int, argv: list[str], queue) -> None:
    a = _parse(argv)
    torch.set_num_threads(1)
    init_local_gloo(rank, world, port)
    args = apply_overrides(get_flavor(a.flavor), a.model_override)
    queue.put((rank, [measure(args, name, dtype, a, world) for name, dtype in a.settings]))


def measured(a, argv: list[str]) -> list[dict]:
    rows = []
    for world in a.worlds:
        if world == 1:  # in this process: nothing to spawn
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            args = apply_overrides(get_flavor(a.flavor), a.model_override)
            ranks = [[measure(args, name, dtype, a, 1) for name, dtype in a.settings]]
            torch.set_num_threads(threads)
        else:
            ranks = [r for _, r in sorted(spawn_local(_worker, world, argv, timeout=3600))]
        for i, (name, dtype) in enumerate(a.settings):
            per_rank = [r[i] for r in ranks]
            flops = [r["ns_flops"] for r in per_rank]
            rows.append({
                "world": world, "optimizer": name, "state_dtype": dtype,
                "step_ms": max(r["step_ms"] for r in per_rank),
                "ns_calls_max": max(r["ns_calls"] for r in per_rank),
                "ns_gflop_max": max(flops) / 1e9, "ns_gflop_mean": sum(flops) / len(flops) / 1e9,
                "host_reads": max(r["host_reads"] for r in per_rank),
                "state_bytes_per_param": per_rank[0]["state_bytes_per_param"] * world, "params": per_rank[0]["params"],
            })
    print(f"| world | optimizer | state dtype | step ms (median of {a.steps}, slowest rank) | vs AdamW fp32 "
          "| NS calls / rank (max) | NS GFLOP / rank, max (mean) | host reads / step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = next(b for b in rows if b["world"] == r["world"])["step_ms"]
        print(f"| {r['world']} | {r['optimizer']} | {r['state_dtype']} | {r['step_ms']:.1f} | "
              f"{r['step_ms'] / base:.2f}x | {r['ns_calls_max']} | {r['ns_gflop_max']:.2f} ({r['ns_gflop_mean']:.2f}) "
              f"| {r['host_reads']} |")
    print(f"({rows[0]['params'] / 1e6:.2f}M parameters, torch {torch.__version__}, 1 thread per rank, {a.device})")
    return rows


def ns_compare(args, device: torch.device, dtype: torch.dtype, seed: int) -> dict:
    """Batched NS of one routed-expert stack of the flavor vs the same matrices one at a time, in
    `dtype` on `device`: whether they are bitwise equal, and the largest difference (the results'
    entries are O(0.1))."""
    from trainer.optim.muon import batched_newton_schulz, newton_schulz

    gen = torch.Generator().manual_seed(seed)
    stack = torch.randn(args.moe.num_experts, args.moe_inter_dim, args.dim, generator=gen).to(device)
    batched = batched_newton_schulz(stack, 5, dtype)
    single = torch.stack([newton_schulz(m, 5, dtype) for m in stack])
    return {"shape": list(stack.shape), "dtype": str(dtype).removeprefix("torch."),
            "bitwise_equal": bool(torch.equal(batched, single)),
            "max_abs_diff": (batched.float() - single.float()).abs().max().item(),
            "max_abs": single.float().abs().max().item()}


def _stage_of(name: str, n_layers: int, pp: int) -> int:
    """The pipeline stage of a parameter when `n_layers` blocks are split evenly over `pp` stages,
    MTP on the last (an estimate of the trainer's cost-based split)."""
    if name.startswith("layers."):
        return int(name.split(".")[1]) * pp // n_layers
    return pp - 1


def layout_flops(args, world: int, pp: int, ep: int, replicate: int, ns_steps: int = 5) -> dict:
    """NS FLOPs per rank for `world` ranks in `pp` stages whose `world / pp` ranks are `replicate`
    replicas x FSDP (EP `ep` inside: the expert grid [replicate, efsdp, ep], ep fastest), from the
    shapes of the flavor's Muon parameters, three ways: `before` (every rank orthogonalises every
    2-D matrix of its stage, and the experts it holds), `local` (2-D matrices owned, experts where
    they are held) and `pooled` (every matrix owned, each expert within its expert-parallel slice:
    what `trainer.optim.muon_owners.OwnedExchange` does, by the same `assign_owners`)."""
    from trainer.optim.muon_owners import assign_owners, ns_flops

    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    names = {id(p): n for n, p in model.named_parameters()}
    per_stage = world // pp
    efsdp = per_stage // replicate // ep
    matrices = [(names[id(p)], tuple(p.shape)) for p in muon_params(model) if p.ndim == 2]
    stacks = [(names[id(p)], tuple(p.shape)) for p in muon_params(model) if p.ndim == 3]
    experts = [0.0] * world  # held: dim-0 shards of the EP rank's n / ep experts over efsdp (torch.chunk)
    costs, candidates, holders = [], [], []  # pooled expert matrices, the ranks of their slice, their holders
    alone = [0.0] * world  # stacks whose slice is one rank: they stay there
    for name, (n, a_, b_) in stacks:
        stage = _stage_of(name, args.n_layers, pp)
        per_ep, cost = n // ep, ns_flops((a_, b_), ns_steps)
        part = -(-per_ep // efsdp)
        groups = [[stage * per_stage + (rep * efsdp + f) * ep + e for rep in range(replicate) for f in range(efsdp)]
                  for e in range(ep)]
        for e, group in enumerate(groups):
            for rank in group:
                f = (rank - stage * per_stage) // ep % efsdp
                experts[rank] += max(0, min(part, per_ep - f * part)) * cost
            if len(group) == 1:
                alone[group[0]] += per_ep * cost
        if len(groups[0]) == 1:
            continue
        # The owner plan's order (`trainer.optim.muon_owners._plan_order`): in turn over the slice's
        # holders (efsdp rank i // part), the groups interleaved.
        for i in sorted(range(per_ep), key=lambda i: (i % part, i // part)):
            for e, group in enumerate(groups):
                costs.append(cost)
                candidates.append(group)
                holders.append([stage * per_stage + (rep * efsdp + i // part) * ep + e for rep in range(replicate)])
    stage_flops = [0.0] * pp
    for name, shape in matrices:
        stage_flops[_stage_of(name, args.n_layers, pp)] += ns_flops(shape, ns_steps)
    before = [experts[r] + stage_flops[r // per_stage] for r in range(world)]
    dense = [ns_flops(shape, ns_steps) for _, shape in matrices]
    local = list(experts)
    for cost, owner in zip(dense, assign_owners(dense, world, experts)):
        local[owner] += cost
    pooled = list(alone)
    none = [None] * len(dense)
    owners = assign_owners(dense + costs, world, alone, none + candidates, none + holders)
    for cost, owner in zip(dense + costs, owners):
        pooled[owner] += cost
    moved = sum(owner not in held for owner, held in zip(owners[len(dense):], holders))
    once = sum(dense) + sum(ns_flops(shape, ns_steps) for _, shape in stacks)  # every matrix once
    return {"before": before, "local": local, "pooled": pooled, "experts": experts, "matrices": len(matrices),
            "expert_matrices": len(costs), "moved": moved, "once": once}


def flops_671b() -> list[dict]:
    args = get_flavor("671B")
    layouts = {
        "FSDP 2048 x EP 64": dict(pp=1, ep=64, replicate=1),
        "PP 16 x FSDP 128 (EP 64)": dict(pp=16, ep=64, replicate=1),
        "HSDP 16 x 128 (EP 64)": dict(pp=1, ep=64, replicate=16),
    }
    rows = []
    print("| 671B layout, 2048 ranks | every rank its stage's 2-D matrices: TFLOP / rank, max (mean) "
          "| 2-D owned, experts where held: max (mean) | all owned, experts pooled: max (mean) "
          "| max / mean, pooled | experts held, max | expert matrices moved / pooled |")
    print("|---|---|---|---|---|---|---|")
    for name, kw in layouts.items():
        r = layout_flops(args, 2048, **kw)
        row = {"layout": name, "expert_matrices_pooled": r["expert_matrices"], "experts_max": max(r["experts"]),
               "expert_matrices_moved": r["moved"], "once": r["once"]}
        for k in ("before", "local", "pooled"):
            row[f"{k}_max"], row[f"{k}_mean"] = max(r[k]), sum(r[k]) / len(r[k])
        row["matrices_before_max"] = max(x - y for x, y in zip(r["before"], r["experts"]))
        row["matrices_local_max"] = max(x - y for x, y in zip(r["local"], r["experts"]))
        rows.append(row)
        cells = " | ".join(f"{row[f'{k}_max'] / 1e12:.1f} ({row[f'{k}_mean'] / 1e12:.1f})"
                           for k in ("before", "local", "pooled"))
        print(f"| {name} | {cells} | {row['pooled_max'] / row['pooled_mean']:.2f} | {row['experts_max'] / 1e12:.1f} "
              f"| {r['moved']} / {r['expert_matrices']} |")
    return rows


def _parse(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--model-override", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--worlds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4],
                   help="comma-separated numbers of gloo ranks")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ns-dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="optimizer.muon_ns_dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (one rank per GPU: --worlds 1 on one GPU)")
    p.add_argument("--settings", type=lambda s: [tuple(x.split(":")) for x in s.split(",")], default=list(SETTINGS),
                   help="comma-separated optimizer:state_dtype pairs (default: all four)")
    p.add_argument("--flops-671b", action="store_true", help="the 671B flavor's NS FLOPs per rank instead")
    p.add_argument("--ns-compare", default=None, metavar="PATH",
                   help="also write there the batched vs one-matrix-at-a-time NS of one expert stack (NS dtype of --device)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    a = _parse(argv)
    rows = flops_671b() if a.flops_671b else measured(a, argv)
    if a.ns_compare:
        device = torch.device(a.device)
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(
            a.ns_dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
        result = ns_compare(apply_overrides(get_flavor(a.flavor), a.model_override), device, dtype, a.seed)
        print(f"batched vs per-matrix NS {result}")
        Path(a.ns_compare).write_text(json.dumps(result))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
