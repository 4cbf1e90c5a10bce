"""Pipeline parallelism on CPU: step time and bubble fraction per schedule, and the memory
estimate of a 671B layout with and without pipelining.

    python benchmarks/pp_bench.py                      # pp 2 on 2 CPU processes, debug model
    python benchmarks/pp_bench.py --schedules 1F1B ZBVZeroBubble --steps 8

Each schedule trains the debug model through ``run_train.sh`` (gloo, fp32, the same global batch)
on ``--pp`` processes, and once on one process. The step time is the median over the steps after
the first two (warm-up), from the run's tokens/s. The bubble fraction is measured as the share of
the pipeline's device time not spent on the one-process run's work:

    bubble = 1 - T_one_process / (pp x T_pipelined)

so it also holds the point-to-point transfers and each stage's own overheads; on an idle
pipeline it is the schedule's fill-and-drain time. Then the memory estimate
(trainer/memory.py) of DeepSeek-V3 671B on ``--gpus`` GPUs: the best layout without pipelining
and the pipelined recipe of docs/parallelism.md. Prints markdown tables and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.config.pipeline_layout import PP_SCHEDULES, default_microbatches, default_stages_per_rank  # noqa: E402
from trainer.parallel.distributed import free_port  # noqa: E402


def run(folder: Path, nproc: int, flags: list[str], args) -> float:
    """Median step time (s) of one run_train.sh run."""
    env = {**os.environ, "NGPU": str(nproc), "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "disabled"}
    common = [
        "--job.dump_folder", str(folder), "--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len),
        "--training.global_batch_size", str(args.batch), "--training.local_batch_size", str(args.batch),
        "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1", "--no-validation.enable",
        "--no-job.print_config", "--lr_scheduler.warmup_steps", "2",
    ]
    proc = subprocess.run(["bash", str(ROOT / "run_train.sh"), *common, *flags], cwd=folder.parent, env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"run failed ({' '.join(flags)}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    tokens_per_device = args.batch * args.seq_len / nproc
    times = [tokens_per_device / r["tokens_per_sec"] for r in records if r["step"] > 2 and "tokens_per_sec" in r]
    return statistics.median(times)


def memory_rows(gpus: int) -> list[dict]:
    from trainer.memory import estimate

    common = dict(flavor="671B", tp=1, cp=1, seq_len=4096, ac="full")
    layouts = [
        ("no PP: FSDP over all GPUs, EP 64", dict(dp_shard=gpus, ep=64, local_batch_size=1)),
        (
            "PP 8 (Interleaved1F1B, 2 stages/rank) x FSDP, EP 32",
            dict(dp_shard=gpus // 8, ep=32, local_batch_size=8, pp=8, pp_schedule="Interleaved1F1B",
                 pp_stages_per_rank=2, pp_microbatches=8),
        ),
    ]
    rows = []
    for name, kw in layouts:
        r = estimate(**common, **kw)
        rows.append({"layout": name, "params_per_gpu_B": r["params_per_gpu_B"], **r["gib"],
                     "gib_per_pp_rank": r.get("gib_per_pp_rank")})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedules", nargs="+", default=list(PP_SCHEDULES), choices=PP_SCHEDULES)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--seq-len", dest="seq_len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences), one data rank")
    p.add_argument("--gpus", type=int, default=512, help="GPUs of the 671B memory comparison")
    args = p.parse_args(argv)

    results = {"pp": args.pp, "seq_len": args.seq_len, "batch": args.batch, "schedules": {}}
    with tempfile.TemporaryDirectory() as tmp:
        one = run(Path(tmp) / "one", 1, [], args)
        results["one_process_s"] = one
        for name in args.schedules:
            stages = default_stages_per_rank(name)
            micro = default_microbatches(name, args.pp, stages)
            t = run(Path(tmp) / name, args.pp, ["--parallelism.pp", str(args.pp), "--parallelism.pp_schedule", name], args)
            results["schedules"][name] = {
                "stages_per_rank": stages, "microbatches": micro, "step_s": t, "bubble": 1 - one / (args.pp * t),
            }
    print(f"pp {args.pp}, debug model, seq_len {args.seq_len}, global batch {args.batch}; one process: {one:.3f} s/step\n")
    print("| schedule | stages/rank | micro-batches | step (s) | bubble fraction |")
    print("|---|---|---|---|---|")
    for name, r in results["schedules"].items():
        print(f"| {name} | {r['stages_per_rank']} | {r['microbatches']} | {r['step_s']:.3f} | {r['bubble']:.2f} |")
    rows = memory_rows(args.gpus)
    results["memory_671b"] = rows
    print(f"\n671B on {args.gpus} GPUs, seq_len 4096, AC full, global batch {args.gpus} sequences (estimate, GiB/GPU):\n")
    print("| layout | params/GPU (B) | params+grads+Adam | activations (blocks) | logits+loss | peak |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        states = r["params"] + r["grads"] + r["optimizer"]
        print(f"| {r['layout']} | {r['params_per_gpu_B']:.3f} | {states:.1f} | {r['layers']:.1f} | "
              f"{r['logits_and_loss']:.1f} | {r['total']:.1f} |")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
