"""Optimizer step time and state bytes per parameter: AdamW (fp32 / bf16 states) vs Muon, one process.

Each setting builds the flavor's model (seeded init, `--model-override` applied) and its
`trainer.optim.build_optimizer`, gives every parameter the same random gradient, and times
`optimizer.step()` alone: `--warmup` untimed steps (they create the state), then the median of
`--steps` timed ones. State bytes per parameter count every optimizer-state tensor (Muon's
momentum, AdamW's moments and step counters) over the model's parameter count. The step's
transient peak is what one more step allocates on top (temporaries: Muon's gathered matrices and
Newton-Schulz buffers, fp32 copies of bf16 states), from `torch.profiler`'s memory events. Settings run one
after another in one process; on a shared machine compare ratios taken in the same run.

    python benchmarks/optim_bench.py                                   # debugmodel
    python benchmarks/optim_bench.py --model-override dim=512 --model-override moe_inter_dim=512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from models.deepseek_v3 import DeepSeekV3Model, get_flavor
from trainer.config import JobConfig
from trainer.diagnostics import apply_overrides
from trainer.optim import build_optimizer

SETTINGS = (("AdamW", "float32"), ("AdamW", "bfloat16"), ("muon", "float32"), ("muon", "bfloat16"))


def transient_peak_bytes(optimizer: torch.optim.Optimizer) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        optimizer.step()
    fd, trace = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    os.remove(trace)
    return max((e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"), default=0)


def measure(args, name: str, state_dtype: str, a) -> dict:
    torch.manual_seed(a.seed)
    model = DeepSeekV3Model(args)
    model.init_weights()
    cfg = JobConfig().optimizer
    cfg.name, cfg.state_dtype, cfg.muon_ns_dtype = name, state_dtype, a.ns_dtype
    optimizer = build_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(a.seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    times = []
    for i in range(a.warmup + a.steps):
        start = time.perf_counter()
        optimizer.step()
        if i >= a.warmup:
            times.append(time.perf_counter() - start)
    n_params = sum(p.numel() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    return {"optimizer": name, "state_dtype": state_dtype, "step_ms": 1e3 * statistics.median(times),
            "state_bytes_per_param": state / n_params, "params": n_params,
            "step_peak_mib": transient_peak_bytes(optimizer) / 2**20, "state_mib": state / 2**20}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--model-override", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ns-dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="optimizer.muon_ns_dtype (auto: float32 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    a = p.parse_args(argv)
    args = apply_overrides(get_flavor(a.flavor), a.model_override)
    rows = [measure(args, name, dtype, a) for name, dtype in SETTINGS]
    base = rows[0]["step_ms"]
    print(f"| optimizer | state dtype | step ms (median of {a.steps}) | vs AdamW fp32 | state bytes / param "
          "| state MiB | step transient peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['optimizer']} | {r['state_dtype']} | {r['step_ms']:.1f} | {r['step_ms'] / base:.2f}x "
              f"| {r['state_bytes_per_param']:.2f} | {r['state_mib']:.1f} | {r['step_peak_mib']:.1f} |")
    print(f"({rows[0]['params'] / 1e6:.2f}M parameters, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
