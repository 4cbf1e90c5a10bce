"""Pipeline parallelism on CPU: step time and bubble fraction per schedule, and the memory
estimate of a 671B layout with and without pipelining.

    python benchmarks/pp_bench.py                      # pp 2 on 2 CPU processes, debug model
    python benchmarks/pp_bench.py --schedules 1F1B ZBVZeroBubble --steps 8
    python benchmarks/pp_bench.py --microbatches 8     # more, smaller micro-batches

Each schedule trains the debug model with the real `Trainer` (gloo, fp32, one thread per rank,
the same global batch) on ``--pp`` processes. The step time is the median over the steps after
the first two (warm-up), from the run's tokens/s. The bubble is measured on every rank as the
share of the training time it spends outside its stages' compute:

    bubble = 1 - (time inside PipelineStage forward / backward / weight-backward) / training time

so waiting for a neighbour's activations or gradients, and the transfers themselves, count as
bubble; the table shows the mean over ranks. The stage methods are timed by wrapping them in
this process (the schedules call them; nothing else in torch reports busy time). Then the
memory estimate (trainer/memory.py) of DeepSeek-V3 671B on ``--gpus`` GPUs: the best layout
without pipelining and the pipelined recipe of docs/parallelism.md. Prints markdown tables and
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from trainer.config.pipeline_layout import PP_SCHEDULES, default_microbatches, default_stages_per_rank
from trainer.diagnostics import spawn_local
from trainer.run_folder import latest_run_folder

ROOT = Path(__file__).resolve().parents[1]

STAGE_WORK = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def _timed_stage_work() -> list[float]:
    """Wraps the stage methods the schedules call with a clock; returns the running total."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    busy = [0.0]

    def timed(method):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - start

        return run

    for name in STAGE_WORK:
        setattr(_PipelineStageBase, name, timed(getattr(_PipelineStageBase, name)))
    return busy


def _worker(rank: int, world: int, port: int, argv: list[str], queue) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WANDB_MODE="disabled",
    )
    import torch

    from trainer.config import load_config
    from trainer.train import Trainer

    torch.set_num_threads(1)
    busy = _timed_stage_work()
    trainer = Trainer(load_config(argv))
    start = time.perf_counter()
    trainer.train()
    queue.put((rank, busy[0], time.perf_counter() - start))
    trainer.close()


def run(folder: Path, schedule: str, microbatches: int, args) -> dict:
    argv = [
        "--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"),
        "--job.dump_folder", str(folder), "--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len),
        "--training.global_batch_size", str(args.batch), "--training.local_batch_size", str(args.batch),
        "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1", "--no-validation.enable",
        "--no-job.print_config", "--lr_scheduler.warmup_steps", "2",
        "--parallelism.pp", str(args.pp), "--parallelism.pp_schedule", schedule,
        "--parallelism.pp_microbatches", str(microbatches),
    ]
    ranks = spawn_local(_worker, args.pp, argv, timeout=1800)
    records = [json.loads(line) for line in (latest_run_folder(folder) / "metrics.jsonl").read_text().splitlines()]
    tokens_per_device = args.batch * args.seq_len / args.pp
    times = [tokens_per_device / r["tokens_per_sec"] for r in records if r["step"] > 2 and "tokens_per_sec" in r]
    bubbles = [1 - busy / train_s for _, busy, train_s in sorted(ranks)]
    return {"step_s": statistics.median(times), "bubble": statistics.mean(bubbles), "bubble_per_rank": bubbles}


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
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seq-len", dest="seq_len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences), one data rank")
    p.add_argument("--microbatches", type=int, default=-1,
                   help="pp_microbatches (at least the schedule's fewest; -1: the fewest)")
    p.add_argument("--gpus", type=int, default=512, help="GPUs of the 671B memory comparison")
    args = p.parse_args(argv)

    results = {"pp": args.pp, "seq_len": args.seq_len, "batch": args.batch, "schedules": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.schedules:
            stages = default_stages_per_rank(name)
            micro = max(args.microbatches, default_microbatches(name, args.pp, stages))
            results["schedules"][name] = {
                "stages_per_rank": stages, "microbatches": micro, **run(Path(tmp) / name, name, micro, args),
            }
    print(f"pp {args.pp}, debug model, seq_len {args.seq_len}, global batch {args.batch}\n")
    print("| schedule | stages/rank | micro-batches | step (s) | bubble fraction (mean of ranks) |")
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
