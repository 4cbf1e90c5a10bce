"""One training step, eager vs `torch.compile` (trainer/parallel/compile.py), in one process.

Both variants start from the same weights (one seed), see the same batches and run the
trainer's objective (cross-entropy + MoE aux loss + MTP loss) with AdamW. After `--warmup`
steps each (the compiled variant compiles there), the timed steps are interleaved round by
round, eager then compiled, so machine noise hits both alike; the reported time is the median.

Peak memory of a step is measured as the growth over the memory in use just before it:
* CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats` minus
  `memory_allocated` before the step;
* CPU: the resident set size (from /proc/self/statm), sampled every ~1 ms by a thread during
  the step, minus the RSS just before it; freed heap is returned to the OS first
  (`malloc_trim`) so the baseline is live memory. Short spikes between samples can be missed,
  so treat CPU figures as approximate.
The reported peak is the largest over the timed steps.

    python benchmarks/compile_bench.py                          # CPU: debugmodel, fp32
    python benchmarks/compile_bench.py --dtype bf16             # CPU, bf16 autocast
    python benchmarks/compile_bench.py --flavor proxy_1b --dtype bf16 --batch-size 4 --seq-len 2048  # GPU
    python benchmarks/compile_bench.py --ep 2 --steps 30       # CPU: expert parallelism, 2 gloo ranks

`--ep N` runs the step the trainer runs under expert parallelism: N gloo processes, FSDP over
them and EP N (`dp_shard = ep = N`, so efsdp 1), each rank with its own batches. It reports per
rank the median step time and the recompiles (dynamo's guard failures): after warm-up, during
the timed steps, where routing keeps changing the rows each rank's experts receive, they must
stay at 0. No memory figure under EP.

Prints one JSON object, then a markdown table.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import statistics
import threading
import time

import torch

from models.deepseek_v3 import DeepSeekV3Model, get_flavor, mtp_loss
from trainer.diagnostics import init_local_gloo, spawn_local
from trainer.loss import cross_entropy_sum
from trainer.parallel.compile import apply_compile, compiled_cross_entropy_sum

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the baseline then includes cached heap
        pass


class _RssPeak:
    """Samples the RSS in a thread while active; `delta` = peak - RSS at entry."""

    def __enter__(self):
        gc.collect()
        _malloc_trim()
        self.base = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())
        self.delta = self.peak - self.base


class _Variant:
    def __init__(self, name, model, loss_fn, lr):
        self.name, self.model, self.loss_fn = name, model, loss_fn
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.times, self.peaks, self.losses = [], [], []
        self.warmup_s = 0.0


def build_model(args, device: torch.device, seed: int) -> DeepSeekV3Model:
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    model.init_weights()
    return model.train()


def train_step(v: _Variant, inputs, labels, autocast_dtype) -> float:
    enabled = autocast_dtype is not None
    with torch.autocast(inputs.device.type, dtype=autocast_dtype or torch.bfloat16, enabled=enabled):
        out = v.model(inputs, labels=labels)
        loss = v.loss_fn(out.logits, labels) / labels.numel()
        objective = loss + out.aux_loss
        if out.mtp_logits:
            mtp_sum, n_mtp = mtp_loss(out.mtp_logits, labels)
            objective = objective + mtp_sum / n_mtp.clamp_min(1)
    objective.backward()
    v.optimizer.step()
    v.optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def measured_step(v: _Variant, batch, device, autocast_dtype) -> None:
    inputs, labels = batch
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        loss = train_step(v, inputs, labels, autocast_dtype)
        torch.cuda.synchronize(device)
        v.times.append(time.perf_counter() - start)
        v.peaks.append(torch.cuda.max_memory_allocated(device) - before)
    else:
        with _RssPeak() as rss:
            start = time.perf_counter()
            loss = train_step(v, inputs, labels, autocast_dtype)
            v.times.append(time.perf_counter() - start)
        v.peaks.append(rss.delta)
    v.losses.append(float(loss))


def _batches(args, a, device, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(a.warmup + a.steps):
        data = torch.randint(0, args.vocab_size, (a.batch_size, a.seq_len + 1), generator=g)
        batches.append((data[:, :-1].to(device), data[:, 1:].to(device)))
    return batches


def _recompiles() -> int:
    # Dynamo records the failed guards of every recompilation, per code object.
    return sum(len(reasons) for reasons in torch._dynamo.utils.guard_failures.values())


def _run_variants(eager: _Variant, compiled: _Variant, batches, a, device, autocast_dtype) -> dict:
    """Warm-up per variant, then the timed steps interleaved; returns the recompile counts."""
    for v in (eager, compiled):
        start = time.perf_counter()
        for inputs, labels in batches[: a.warmup]:
            v.losses.append(float(train_step(v, inputs, labels, autocast_dtype)))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        v.warmup_s = time.perf_counter() - start
    after_warmup = _recompiles()
    for batch in batches[a.warmup :]:
        for v in (eager, compiled):
            measured_step(v, batch, device, autocast_dtype)
    return {"recompiles_warmup": after_warmup, "recompiles_timed": _recompiles() - after_warmup}


def _variant_result(v: _Variant, memory: bool) -> dict:
    out = {"median_step_s": statistics.median(v.times), "warmup_s": v.warmup_s, "final_loss": v.losses[-1]}
    if memory:
        out["peak_mem_mib"] = max(v.peaks) / 2**20
    return out


def _ep_rank(rank: int, world: int, port: int, a, queue) -> None:
    """One rank of `--ep`: eager and compiled EP + FSDP models, as parallelize_model builds them."""
    from trainer.parallel.expert_parallel import apply_expert_parallel
    from trainer.parallel.fsdp import apply_fsdp
    from trainer.parallel.parallel_dims import ParallelDims

    torch.set_num_threads(a.threads)
    init_local_gloo(rank, world, port)
    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, ep=world, ep_as_cp=False, world_size=world)
    dims.build_meshes("cpu")
    device = torch.device("cpu")
    args = dataclasses.replace(get_flavor(a.flavor), max_seq_len=a.seq_len)
    variants = {}
    for name, loss_fn in (("eager", cross_entropy_sum), ("compiled", compiled_cross_entropy_sum())):
        model = build_model(args, device, a.seed)
        apply_expert_parallel(model, dims.mesh("ep"))
        if name == "compiled":
            apply_compile(model)
        apply_fsdp(model, dims.mesh("fsdp"), dims.mesh("efsdp"))
        variants[name] = _Variant(name, model, loss_fn, a.lr)
    autocast_dtype = torch.bfloat16 if a.dtype == "bf16" else None
    counts = _run_variants(
        variants["eager"], variants["compiled"], _batches(args, a, device, a.seed + rank), a, device, autocast_dtype
    )
    result = {name: _variant_result(v, memory=False) for name, v in variants.items()}
    result.update(counts, unique_graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"])
    queue.put((rank, result))
    torch.distributed.destroy_process_group()


def main_ep(a) -> None:
    ranks = dict(spawn_local(_ep_rank, a.ep, a, timeout=3600))
    result = {
        "flavor": a.flavor, "dtype": a.dtype, "device": "cpu", "torch": torch.__version__, "threads": a.threads,
        "batch_size": a.batch_size, "seq_len": a.seq_len, "steps": a.steps, "warmup": a.warmup,
        "layout": f"dp_shard {a.ep}, ep {a.ep} (gloo)", "ranks": [ranks[r] for r in sorted(ranks)],
    }
    print(json.dumps(result))
    print()
    print(f"{a.flavor}, {a.dtype}, cpu, EP {a.ep} + FSDP {a.ep}, batch {a.batch_size} x {a.seq_len} per rank, "
          f"median of {a.steps} steps")
    print()
    print("| rank | eager step (s) | compiled step (s) | compiled / eager | recompiles in warm-up | recompiles in timed steps |")
    print("|---|---|---|---|---|---|")
    for rank, r in enumerate(result["ranks"]):
        e, c = r["eager"]["median_step_s"], r["compiled"]["median_step_s"]
        print(f"| {rank} | {e:.4f} | {c:.4f} | {c / e:.3f} | {r['recompiles_warmup']} | {r['recompiles_timed']} |")


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="proxy_1b" if cuda else "debugmodel")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16" if cuda else "fp32",
                   help="bf16 = bf16 autocast with fp32 weights (the trainer's mixed precision)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant (compiles)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (> 1: that many gloo processes, CPU)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process under --ep")
    a = p.parse_args()
    if a.ep > 1:
        if a.device != "cpu":
            p.error("--ep runs gloo processes on CPU; pass --device cpu")
        main_ep(a)
        return
    device = torch.device(a.device)
    autocast_dtype = torch.bfloat16 if a.dtype == "bf16" else None

    args = dataclasses.replace(get_flavor(a.flavor), max_seq_len=a.seq_len)
    eager = _Variant("eager", build_model(args, device, a.seed), cross_entropy_sum, a.lr)
    compiled_model = build_model(args, device, a.seed)
    apply_compile(compiled_model)
    compiled = _Variant("compiled", compiled_model, compiled_cross_entropy_sum(), a.lr)
    counts = _run_variants(eager, compiled, _batches(args, a, device, a.seed), a, device, autocast_dtype)

    result = {
        "flavor": a.flavor, "dtype": a.dtype, "device": str(device), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "batch_size": a.batch_size, "seq_len": a.seq_len,
        "steps": a.steps, "warmup": a.warmup,
        "memory": "cuda max_memory_allocated growth" if device.type == "cuda" else "sampled RSS growth",
        **counts,
    }
    for v in (eager, compiled):
        result[v.name] = _variant_result(v, memory=True)
    result["speedup"] = result["eager"]["median_step_s"] / result["compiled"]["median_step_s"]
    result["memory_ratio"] = result["compiled"]["peak_mem_mib"] / max(result["eager"]["peak_mem_mib"], 1e-9)
    result["max_loss_diff"] = max(abs(x - y) for x, y in zip(eager.losses, compiled.losses))
    print(json.dumps(result))
    print()
    print(f"{a.flavor}, {a.dtype}, {device}, batch {a.batch_size} x {a.seq_len}, median of {a.steps} steps")
    print()
    print("| variant | median step (s) | peak step memory (MiB) | warmup incl. compile (s) |")
    print("|---|---|---|---|")
    for name in ("eager", "compiled"):
        r = result[name]
        print(f"| {name} | {r['median_step_s']:.4f} | {r['peak_mem_mib']:.1f} | {r['warmup_s']:.1f} |")
    print(f"| compiled / eager | {1 / result['speedup']:.3f} | {result['memory_ratio']:.3f} | |")


if __name__ == "__main__":
    main()
