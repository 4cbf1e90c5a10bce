"""Cost of the parameter EMA (`[ema]`, trainer/optim/ema.py) per update, beside the optimizer step it follows.

Builds the flavor's model (seeded init, `--model-override` applied, fp32, one process), gives
every parameter the same random gradient and times, alternating within each repetition so a busy
machine's load hits both alike: `optimizer.step()` of `torch.optim.AdamW` (fused, the trainer's
default on CPU), and one EMA update as the trainer makes it (the owed update of the previous
step, in `before_forward`). On the CPU that is the update itself, one in-place `lerp_` per tensor;
on a GPU it is what the step's thread spends (enqueueing the device-to-host copies and handing
the lerp to the worker thread), and `flush` (the copy and the lerp waited for) is timed too.
Reports the medians of `--steps` repetitions after `--warmup`, and the host bytes of the average.

    python benchmarks/ema_bench.py                                              # debugmodel
    python benchmarks/ema_bench.py --model-override dim=512 --model-override moe_inter_dim=512 \
        --model-override inter_dim=1536
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from models.deepseek_v3 import DeepSeekV3Model, get_flavor
from trainer.diagnostics import apply_overrides
from trainer.optim.ema import ParameterEMA


def _timed(fn, sync) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--model-override", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--decay", type=float, default=0.999)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    a = parser.parse_args(argv)
    device = torch.device(a.device)
    args = apply_overrides(get_flavor(a.flavor), a.model_override)
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepSeekV3Model(args)
    model.init_weights()
    params = list(model.parameters())
    gen = torch.Generator(device).manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    ema = ParameterEMA(model, a.decay, 1)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def update() -> None:
        ema.after_optimizer(stepped=True)  # owes the update ...
        ema.before_forward(0)  # ... which the next step's start makes

    times = {"optimizer_step_ms": [], "ema_update_ms": [], "ema_flush_ms": []}
    for i in range(a.warmup + a.steps):
        step_ms = _timed(optimizer.step, sync)
        update_ms = _timed(update, lambda: None)  # the step's thread only: what it spends
        flush_ms = _timed(ema.flush, sync)
        ema.before_optimizer(False)
        if i >= a.warmup:
            for key, value in zip(times, (step_ms, update_ms, flush_ms)):
                times[key].append(value)
    n = sum(p.numel() for p in params)
    result = {
        "flavor": a.flavor,
        "overrides": a.model_override,
        "device": str(device),
        "params": n,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        **{key: round(statistics.median(v), 3) for key, v in times.items()},
        "ema_host_mib": round(sum(t.numel() * t.element_size() for t in ema.averages) / 2**20, 1),
        "staging_host_mib": round(sum(t.numel() * t.element_size() for t in ema.staging) / 2**20, 1),
    }
    result["ema_vs_optimizer_step"] = round(result["ema_update_ms"] / result["optimizer_step_ms"], 3)
    ema.close()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
