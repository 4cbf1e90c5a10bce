"""MoE layer forward+backward: grouped-mm vs per-expert loop vs the dense ideal.

The ideal is a dense SwiGLU whose hidden width equals the MoE's *active* width
((top_k + num_shared_experts) x moe_inter_dim), so it does the same expert FLOPs per token
with none of the routing, sorting or scattering. ``ratio_to_ideal`` = MoE step time /
dense step time (1.0 = routing is free).

All variants run in one process on the same input and seed, interleaved round by round so
machine noise hits them alike; the reported time is the median over rounds.

    python benchmarks/moe_bench.py                       # debugmodel sizes, CPU, fp32
    python benchmarks/moe_bench.py --flavor proxy_1b --dtype bf16 --tokens 16384   # GPU
    python benchmarks/moe_bench.py --flavor 16B --model-override moe.top_k=4 --dtype bf16

`--compile` runs every variant through `torch.compile` (the trainer's dynamo settings); on one
device the MoE block is then one graph. `--model-override key=value` (repeatable) changes a
field of the flavor's `DeepSeekV3ModelArgs` (`moe.*` for `MoEArgs`; trainer/diagnostics/model_overrides.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time

import torch

from models.common.ffn import FeedForward
from models.deepseek_v3 import get_flavor
from models.moe import MoE
from trainer.diagnostics import apply_overrides
from trainer.parallel.compile import compile_dynamo_config


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_variants(
    flavor: str, device: torch.device, dtype: torch.dtype, overrides: list[str] | None = None
):
    """The two MoE expert paths and the dense same-active-FLOPs FFN, on one seed; returns (variants, model args)."""
    args = apply_overrides(get_flavor(flavor), overrides or [])
    variants = {}
    for name, grouped in (("moe_grouped_mm", True), ("moe_loop", False)):
        torch.manual_seed(0)
        moe = MoE(args.dim, args.moe_inter_dim, dataclasses.replace(args.moe, use_grouped_mm=grouped))
        moe.init_weights(0.02)
        variants[name] = moe
    active_hidden = (args.moe.top_k + args.moe.num_shared_experts) * args.moe_inter_dim
    torch.manual_seed(0)
    dense = FeedForward(args.dim, active_hidden)
    dense.init_weights(0.02)
    variants["dense_same_active_flops"] = dense
    return {k: v.to(device=device, dtype=dtype).train() for k, v in variants.items()}, args


def step_fn(module: torch.nn.Module, x: torch.Tensor):
    out = module(x)
    if isinstance(out, tuple):  # MoE returns (out, aux_loss)
        out = out[0]
    out.float().square().mean().backward()
    module.zero_grad(set_to_none=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per step (batch x seq)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--model-override", action="append", default=[], metavar="KEY=VALUE",
        help="change a field of the flavor, e.g. dim=2048 or moe.top_k=6 (repeatable; see trainer/diagnostics/model_overrides.py)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile every variant's forward")
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    try:
        variants, args = build_variants(a.flavor, device, dtype, a.model_override)
    except ValueError as exc:
        p.error(str(exc))
    x = torch.randn(1, a.tokens, args.dim, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    x.requires_grad_(True)
    dynamo = contextlib.nullcontext()
    if a.compile:
        for m in variants.values():
            m.forward = torch.compile(m.forward)
        dynamo = torch._dynamo.config.patch(**compile_dynamo_config())

    with dynamo:
        for _ in range(a.warmup):
            for m in variants.values():
                step_fn(m, x)
        times = {k: [] for k in variants}
        for _ in range(a.rounds):
            for name, m in variants.items():
                _sync(device)
                t0 = time.perf_counter()
                step_fn(m, x)
                _sync(device)
                times[name].append(time.perf_counter() - t0)

    ideal = statistics.median(times["dense_same_active_flops"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append(
            {
                "variant": name,
                "median_s": round(med, 5),
                "tokens_per_s": round(a.tokens / med, 1),
                "ratio_to_ideal": round(med / ideal, 3),
            }
        )
    result = {
        "benchmark": "moe_layer_fwd_bwd",
        "flavor": a.flavor,
        "model_overrides": a.model_override,
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "dtype": a.dtype,
        "compile": a.compile,
        "tokens": a.tokens,
        "dim": args.dim,
        "experts": args.moe.num_experts,
        "top_k": args.moe.top_k,
        "shared": args.moe.num_shared_experts,
        "moe_inter_dim": args.moe_inter_dim,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "results": rows,
    }
    print(json.dumps(result, indent=2))
    print()
    print("| variant | median step (s) | tokens/s | time / dense ideal |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['median_s']:.4f} | {r['tokens_per_s']:,.0f} | {r['ratio_to_ideal']:.2f}x |")


if __name__ == "__main__":
    main()
