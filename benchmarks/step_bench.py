"""Whole training step of a flavor: eager vs torch.compile, bf16 vs float8 (GPU), in one process.

Every variant is the trainer's own ``Trainer`` (trainer/trainer.py: model build, parallelize
incl. the float8 converter and compile, loss, optimizer, data loader) built from the same
config and seed, so all see the same weights and the same batches; a timed step is
``Trainer.train_step`` (forward + backward of the whole objective, clipping, optimizer), with
the batches fetched before the clock starts. After ``--warmup`` steps each (compiles happen
there), the timed steps are interleaved round by round over the variants, so machine noise hits
them alike, in ``--repeats`` blocks of ``--steps`` steps: tokens/s is computed per block from
its median step, and the spread (max - min) / median over the blocks is the run-to-run
reproducibility figure. On CPU the same is also reported per process CPU-second
(``time.process_time``): wall time on a shared machine moves with whatever else takes the cores,
CPU time much less (shared caches and memory bandwidth still move it). A CPU has no known peak,
and a VM's speed drifts by minutes, so on CPU each round of steps is followed by a fixed burst of
fp32 matmuls: its GFLOP/s is the machine's speed at that moment, reported next to tokens/s with
the step's model FLOP/s as a fraction of it. Two runs whose tokens/s differ while this reference
moved the same way differ by the machine, not by the code.

Reported per variant: tokens/s, model TFLOP/s and MFU, peak memory, ratios to the first
variant. FLOPs convention (models/deepseek_v3/stats.py): 6 x *active* non-embedding parameters
per token + the attention term 6 x layers x heads x (qk_head_dim + v_head_dim) x seq_len, without
causal halving, MTP modules included. MFU needs the device peak: known GPUs are looked up
(trainer/metrics.py), elsewhere pass ``--peak-flops``.

Peak memory is the variant's own: the bytes of its parameters and optimizer states (gradients
are freed between steps) plus the peak of what its step allocates on top: on CUDA the
allocator's peak during its timed steps minus what was allocated before the step (other
variants' models share the device); on CPU, where torch keeps no allocator statistics, one extra
untimed step under ``torch.profiler`` with ``profile_memory=True``, whose memory events carry
the running total of bytes allocated since profiling started. Both count every byte torch
allocates (activations, gradients, temporaries), i.e. what trainer/planning/memory.py models;
the process RSS would add the Python and library runtime.

    python benchmarks/step_bench.py                      # CPU: debugmodel, fp32, eager vs compile
    python benchmarks/step_bench.py --flavor proxy_1b --seq-len 4096 --batch-size 1   # GPU, bf16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from models.deepseek_v3 import get_flavor
from trainer.config import load_config
from trainer.data import build_tokenizer
from trainer.diagnostics import ModelOverrideError, apply_overrides, profile_step, weight_cast_bytes
from trainer.model_args import build_model_args
from trainer.planning.memory import estimate
from trainer.runtime import resolve_path
from trainer.trainer import Trainer

FLOPS_CONVENTION = (
    "6 x active non-embedding params + attention 6*L*H*(qk+v)*seq, no causal halving, MTP included "
    "(models/deepseek_v3/stats.py)"
)
VARIANTS = {
    "eager": [],
    "compile": ["--training.compile"],
    "eager_float8": ["--quantize.float8"],
    "compile_float8": ["--training.compile", "--quantize.float8"],
    # One-process bf16 cast policy (docs/performance.md): "eager"/"compile" are FSDP2's cast.
    "eager_autocast": ["--training.one_process_cast", "autocast"],
    "compile_autocast": ["--training.compile", "--training.one_process_cast", "autocast"],
    # Optimizers (docs/optimizers.md): AdamW fp32 is "eager".
    "adamw_bf16": ["--optimizer.state_dtype", "bfloat16"],
    "muon": ["--optimizer.name", "muon"],
    "muon_bf16": ["--optimizer.name", "muon", "--optimizer.state_dtype", "bfloat16"],
    "muon_qk_clip": ["--optimizer.name", "muon", "--optimizer.qk_clip"],
}


def float8_unavailable_reason(device: torch.device) -> str | None:
    """Why a float8 speed variant cannot run here (None when it can)."""
    if device.type != "cuda":
        return (
            f"float8 matmuls need a CUDA GPU with compute capability >= 8.9; on {device.type} torchao can "
            "only emulate them, which says nothing about speed"
        )
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return f"this GPU has compute capability {cap[0]}.{cap[1]}; float8 needs >= 8.9"
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "torchao is not installed (pip install torchao)"
    return None


def build_trainer(name: str, a, folder: Path) -> Trainer:
    argv = [
        "--job.dump_folder", str(folder / name),
        "--model.flavor", a.flavor,
        "--training.seq_len", str(a.seq_len),
        "--training.local_batch_size", str(a.batch_size),
        "--training.mixed_precision_param", "bfloat16" if a.dtype == "bf16" else "float32",
        "--training.seed", str(a.seed),
        "--training.device", a.device,
        "--training.steps", str(a.warmup + a.steps * a.repeats + 2),
        "--activation_checkpoint.mode", a.ac,
        "--no-validation.enable",
        "--no-job.print_config",
        *VARIANTS[name],
    ]
    if "--quantize.float8" in argv and a.float8_experts:
        argv.append("--quantize.float8_experts")
    if a.peak_flops:
        argv += ["--metrics.peak_flops", str(a.peak_flops)]
    cfg = load_config(argv)
    tokenizer = build_tokenizer(resolve_path(cfg.model.tokenizer_path))
    # The overrides apply after the config's model args (vocabulary, seq_len, MoE options), so
    # they win over both; the trainer's FLOPs and memory use the result.
    model_args = apply_overrides(build_model_args(cfg, tokenizer.vocab_size, tokenizer.eos_id), a.model_override)
    # The trainer logs its run header to stdout; keep stdout for the JSON and the table.
    with contextlib.redirect_stdout(sys.stderr):
        return Trainer(cfg, model_args)


def state_bytes(trainer: Trainer) -> int:
    """Parameters and optimizer states of one variant (gradients are freed between steps)."""
    tensors = list(trainer.model.parameters())
    for state in trainer.optimizer.state.values():
        tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_estimate_mib(trainer: Trainer, a) -> float | None:
    """trainer/planning/memory.py (scripts/estimate_memory.py) for this single-device config (AC none/full only)."""
    if a.ac not in ("none", "full"):
        return None
    m = trainer.cfg.model
    est = estimate(
        a.flavor, 1, 1, 1, 1, a.seq_len, a.batch_size, a.ac, mixed_precision=trainer.cfg.training.mixed_precision_param,
        model_args=trainer.model_args, device_type=trainer.device.type,
        block_causal_sdpa=m.attn_mask_type == "block_causal" and m.attn_backend == "sdpa",
    )
    return est["gib"]["total"] * 1024


REFERENCE_MATMUL = (512, 20)  # square size, matmuls per burst: ~30 ms on one 2.4 GHz core


def reference_matmul_gflops(operands: tuple[torch.Tensor, torch.Tensor]) -> float:
    """The CPU's fp32 matmul speed right now, from a burst of the same matmuls every time."""
    x, y = operands
    n, count = REFERENCE_MATMUL
    start = time.perf_counter()
    for _ in range(count):
        torch.mm(x, y)
    return 2 * n**3 * count / (time.perf_counter() - start) / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Variant:
    def __init__(self, name: str, trainer: Trainer):
        self.name, self.trainer = name, trainer
        self.blocks: list[list[float]] = []
        self.cpu_blocks: list[list[float]] = []
        self.cuda_peaks: list[int] = []
        self.losses: list[float] = []
        self.warmup_s = 0.0
        self.memory_note = ""
        self.peak_bytes: int | None = None
        self.profile: list[dict] = []
        self.cast_bytes: int | None = None

    def step(self, measure_cuda_memory: bool = False) -> tuple[float, float]:
        t, device = self.trainer, self.trainer.device
        batches, _ = t.next_microbatches()  # outside the clock: data loading is not step time
        t.step += 1
        _sync(device)
        if measure_cuda_memory:
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        stats = t.train_step(batches)
        _sync(device)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if measure_cuda_memory:
            self.cuda_peaks.append(torch.cuda.max_memory_allocated(device) - before)
        self.losses.append(stats["loss"])
        return elapsed, cpu

    def measure_cpu_memory(self, folder: Path) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
            self.step()
        trace = folder / f"{self.name}_memory_trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
        os.remove(trace)
        totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
        if not totals:
            self.memory_note = "the profiler recorded no memory events"
            return
        self.peak_bytes = max(totals) + state_bytes(self.trainer)


def main(argv: list[str] | None = None) -> dict:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="proxy_1b" if cuda else "debugmodel")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16" if cuda else "fp32",
                   help="bf16 = the trainer's mixed precision (bf16 autocast, fp32 master weights)")
    p.add_argument("--seq-len", type=int, default=4096 if cuda else 256)
    p.add_argument("--batch-size", type=int, default=1 if cuda else 4)
    p.add_argument("--steps", type=int, default=30,
                   help="timed steps per variant per repeat block (30: runs within 1.07-1.09x on CPU, 10: 1.10-1.13x)")
    p.add_argument("--repeats", type=int, default=3, help="timed blocks; their spread is the reproducibility figure")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant (compiles)")
    p.add_argument("--variants", default="eager,compile,compile_float8",
                   help=f"comma-separated, first one is the ratio baseline; of {', '.join(VARIANTS)}")
    p.add_argument("--float8-experts", action="store_true", help="float8 variants also convert the routed experts")
    p.add_argument("--ac", default="none", choices=("none", "full", "selective", "op"), help="activation checkpointing")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--peak-flops", type=float, default=0.0, help="device peak FLOP/s for MFU; 0 = look it up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-override", action="append", default=[], metavar="KEY=VALUE",
                   help="change a DeepSeekV3ModelArgs field of the flavor, repeatable: n_layers=4, moe.num_experts=16")
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, profile --profile-steps more steps per variant: top ops, kernel "
                        "launches, host reads of device values, a Chrome trace per step in --trace-dir")
    p.add_argument("--profile-steps", type=int, default=1, help="profiled steps per variant with --profile")
    p.add_argument("--trace-dir", default="step_bench_traces", help="where --profile writes <variant>_step<k>.json")
    p.add_argument("--json", default=None, help="also write the JSON result to this file")
    a = p.parse_args(argv)
    if a.profile_steps < 1:
        p.error(f"--profile-steps must be >= 1, got {a.profile_steps}")
    try:
        apply_overrides(get_flavor(a.flavor), a.model_override)
    except (ModelOverrideError, ValueError) as e:
        p.error(str(e))
    device = torch.device(a.device)
    names = [n.strip() for n in a.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    skipped = {}
    reason = float8_unavailable_reason(device)
    if reason is not None:
        for n in [n for n in names if "float8" in n]:
            skipped[n] = reason
            names.remove(n)
            print(f"skipping {n}: {reason}", file=sys.stderr)
    if not names:
        p.error(f"every variant was skipped: {'; '.join(f'{n}: {why}' for n, why in skipped.items())}")

    with tempfile.TemporaryDirectory(prefix="step_bench_") as tmp:
        variants = [Variant(n, build_trainer(n, a, Path(tmp))) for n in names]
        for v in variants:
            start = time.perf_counter()
            for _ in range(a.warmup):
                v.step()
            v.warmup_s = time.perf_counter() - start
        reference_blocks: list[list[float]] = []  # reference matmul GFLOP/s after each round (CPU)
        operands = tuple(torch.randn(REFERENCE_MATMUL[0], REFERENCE_MATMUL[0]) for _ in range(2))
        for _ in range(a.repeats):
            for v in variants:
                v.blocks.append([])
                v.cpu_blocks.append([])
            reference_blocks.append([])
            for _ in range(a.steps):
                for v in variants:
                    wall, cpu = v.step(measure_cuda_memory=device.type == "cuda")
                    v.blocks[-1].append(wall)
                    v.cpu_blocks[-1].append(cpu)
                if device.type == "cpu":
                    reference_blocks[-1].append(reference_matmul_gflops(operands))
        for v in variants:
            if device.type == "cuda":
                v.peak_bytes = max(v.cuda_peaks) + state_bytes(v.trainer)
            else:
                v.measure_cpu_memory(Path(tmp))
        if a.profile:
            for v in variants:
                for k in range(a.profile_steps):
                    trace = Path(a.trace_dir) / f"{v.name}_step{k}.json"
                    # No Python read counter under compile: dynamo cannot trace through its mode.
                    v.profile.append(profile_step(v.step, device, trace, count_python_reads="compile" not in v.name))
                # Bytes of bf16/fp8 weight copies one step makes (a dispatch mode: eager variants only).
                v.cast_bytes = None if "compile" in v.name else weight_cast_bytes(v.trainer.model, v.step)
        for v in variants:
            v.trainer.close()

    first = variants[0].trainer
    tokens = a.batch_size * a.seq_len
    result = {
        "benchmark": "train_step",
        "flavor": a.flavor, "model_overrides": a.model_override,
        "dtype": a.dtype, "seq_len": a.seq_len, "batch_size": a.batch_size,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "steps": a.steps, "repeats": a.repeats, "warmup": a.warmup, "ac": a.ac,
        "params_total": first.n_params, "params_active": first.n_active,
        "flops_per_token": first.flops_per_token, "flops_convention": FLOPS_CONVENTION,
        "peak_flops": first.peak_flops,
        "memory_estimate_mib": memory_estimate_mib(first, a),
        "memory": "own params + optimizer states + peak allocated by the step ("
        + ("cuda allocator stats)" if device.type == "cuda" else "torch.profiler memory events)"),
        "variants": {}, "skipped": skipped,
    }
    if device.type == "cpu":
        per_block_ref = [statistics.median(ref) for ref in reference_blocks]
        result["reference_matmul"] = f"fp32 {REFERENCE_MATMUL[0]}^3 matmuls, {REFERENCE_MATMUL[1]} after every round"
        result["reference_matmul_gflops"] = statistics.median(per_block_ref)
        result["reference_matmul_gflops_per_repeat"] = per_block_ref
    for v in variants:
        per_block = [tokens / statistics.median(b) for b in v.blocks]
        med_tps = statistics.median(per_block)
        r = {
            "median_step_s": statistics.median([t for b in v.blocks for t in b]),
            "tokens_per_s": med_tps,
            "tokens_per_s_per_repeat": per_block,
            "repeat_spread_pct": 100.0 * (max(per_block) - min(per_block)) / med_tps,
            "tflops": med_tps * first.flops_per_token / 1e12,
            "mfu_pct": 100.0 * med_tps * first.flops_per_token / first.peak_flops if first.peak_flops else None,
            "peak_mem_mib": v.peak_bytes / 2**20 if v.peak_bytes is not None else None,
            "warmup_s": v.warmup_s,
            "final_loss": v.losses[-1],
        }
        if device.type == "cpu":
            # Process CPU seconds: the step's own compute, which other processes taking the cores
            # disturb less than wall time (caches and memory bandwidth are still shared);
            # reported next to, never instead of, wall time.
            per_block_cpu = [tokens / statistics.median(b) for b in v.cpu_blocks]
            r["tokens_per_cpu_s"] = statistics.median(per_block_cpu)
            r["tokens_per_cpu_s_per_repeat"] = per_block_cpu
            r["cpu_repeat_spread_pct"] = 100.0 * (max(per_block_cpu) - min(per_block_cpu)) / r["tokens_per_cpu_s"]
            # Model FLOP/s over the machine's matmul GFLOP/s measured between the same steps.
            fractions = [
                100.0 * tps * first.flops_per_token / (statistics.median(ref) * 1e9)
                for tps, ref in zip(per_block, reference_blocks)
            ]
            r["pct_of_reference_matmul"] = statistics.median(fractions)
            r["pct_of_reference_matmul_per_repeat"] = fractions
        if v.memory_note:
            r["memory_note"] = v.memory_note
        if v.profile:
            r["profile"] = v.profile
            for counter in ("kernel_launches", "host_syncs", "host_reads", "scalar_reads_aten"):
                r[counter] = v.profile[-1][counter]
            r["weight_cast_bytes"] = v.cast_bytes
        result["variants"][v.name] = r
    base = result["variants"][variants[0].name]
    for r in result["variants"].values():
        r["speed_vs_first"] = r["tokens_per_s"] / base["tokens_per_s"]
        if r["peak_mem_mib"] and base["peak_mem_mib"]:
            r["memory_vs_first"] = r["peak_mem_mib"] / base["peak_mem_mib"]
        if r["peak_mem_mib"] and result["memory_estimate_mib"]:
            r["estimate_vs_measured"] = result["memory_estimate_mib"] / r["peak_mem_mib"]
    # Same weights, same batches: the variants' losses stay close (compile reorders float ops).
    result["max_loss_diff_vs_first"] = max(
        (abs(x - y) for v in variants[1:] for x, y in zip(v.losses, variants[0].losses)), default=0.0
    )

    print(json.dumps(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    print()
    print(markdown(result))
    return result


def markdown(result: dict) -> str:
    mfu_known = result["peak_flops"] is not None
    lines = [
        f"{' '.join([result['flavor'], *result['model_overrides']])}, {result['dtype']}, {result['device']}, "
        f"batch {result['batch_size']} x "
        f"{result['seq_len']}, {result['repeats']} blocks of {result['steps']} steps; "
        f"FLOPs/token {result['flops_per_token']:.3g} ({result['flops_convention']})",
        "",
        "| variant | tokens/s | spread over repeats | TFLOP/s | MFU | peak memory (MiB) | speed vs first | memory vs first |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["variants"].items():
        mfu = f"{r['mfu_pct']:.1f}%" if mfu_known else "n/a (peak unknown)"
        mem = f"{r['peak_mem_mib']:.1f}" if r["peak_mem_mib"] is not None else "n/a"
        mem_ratio = f"{r['memory_vs_first']:.3f}" if "memory_vs_first" in r else "n/a"
        lines.append(
            f"| {name} | {r['tokens_per_s']:,.0f} | {r['repeat_spread_pct']:.1f}% | {r['tflops']:.3f} | {mfu} | "
            f"{mem} | {r['speed_vs_first']:.3f} | {mem_ratio} |"
        )
    for name, why in result["skipped"].items():
        lines.append(f"| {name} | skipped: {why} | | | | | | |")
    cpu = {n: r for n, r in result["variants"].items() if "tokens_per_cpu_s" in r}
    if cpu:
        lines += ["", "Per process CPU-second (less affected by other processes on the cores than wall time): " + ", ".join(
            f"{n} {r['tokens_per_cpu_s']:,.0f} tokens/CPU-s (spread {r['cpu_repeat_spread_pct']:.1f}%)"
            for n, r in cpu.items()
        )]
        ref = result["reference_matmul_gflops_per_repeat"]
        lines += ["", f"Machine speed during the run ({result['reference_matmul']}): "
                      f"{result['reference_matmul_gflops']:.1f} GFLOP/s (blocks {', '.join(f'{g:.1f}' for g in ref)}); "
                      "model FLOP/s as a share of it: " + ", ".join(
                          f"{n} {r['pct_of_reference_matmul']:.1f}%" for n, r in cpu.items())]
    if result["memory_estimate_mib"] is not None:
        ratios = ", ".join(
            f"{n} {r['estimate_vs_measured']:.3f}" for n, r in result["variants"].items() if "estimate_vs_measured" in r
        )
        lines += ["", f"trainer/planning/memory.py estimate: {result['memory_estimate_mib']:.1f} MiB; estimate / measured: "
                      f"{ratios or 'n/a'}"]
    profiled = {n: r for n, r in result["variants"].items() if "profile" in r}
    for name, r in profiled.items():
        for k, step in enumerate(r["profile"]):
            syncs = "n/a on CPU" if step["host_syncs"] is None else step["host_syncs"]
            reads = (
                "n/a under compile" if step["host_reads"] is None
                else f"{step['host_reads']} {step['host_reads_by_kind']}"
            )
            casts = "n/a under compile" if r["weight_cast_bytes"] is None else f"{r['weight_cast_bytes'] / 2**20:.1f} MiB"
            lines += ["", f"Profile {name} step {k}: weight casts {casts}, kernel launches {step['kernel_launches']} "
                          f"({step['kernel_launch_counter']}), host syncs {syncs}, host reads of device values "
                          f"{reads}, aten scalar reads "
                          f"{step['scalar_reads_aten']}; trace {step.get('trace')}",
                      "", f"| op (by {step['top_ops_by']}) | ms | calls |", "|---|---|---|"]
            lines += [f"| {op['name'][:80]} | {op['ms']:.3f} | {op['calls']} |" for op in step["top_ops"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
