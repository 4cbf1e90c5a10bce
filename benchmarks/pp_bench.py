"""Pipeline parallelism on CPU: step time, per-rank bubble and stage balance per schedule, and
the memory estimate of a 671B layout with and without pipelining.

    python benchmarks/pp_bench.py                      # pp 2 on 2 CPU processes, debug model
    python benchmarks/pp_bench.py --schedules 1F1B DualPipeV --steps 8
    python benchmarks/pp_bench.py --microbatches 8     # more, smaller micro-batches
    python benchmarks/pp_bench.py --split even         # the old even split of layer equivalents
    python benchmarks/pp_bench.py --dp-shard 2         # pp 2 x FSDP 2 on 4 processes
    python benchmarks/pp_bench.py --ac full            # every run with full activation checkpointing
    python benchmarks/pp_bench.py --ac none full op    # each schedule once per activation checkpointing mode

Each schedule trains the debug model with the real `Trainer` (gloo, fp32, one thread per rank,
the same global batch) on ``--pp x --dp-shard`` processes. The step time is the median over the
steps after the first two (warm-up), from the run's tokens/s; the peak memory per pipeline rank is
what the trainer logs at the last step (``memory_gib_pp<r>``: on CPU the process's peak resident
set, torch and the data included). Inside each schedule run (torch's
``step``: the pipeline's forwards, backwards, transfers and gradient reduction, not the optimizer)
every rank times its stages' compute (PipelineStage forward / backward / weight-backward):

    bubble of a rank = 1 - (its stages' compute) / (its schedule run's time)

so waiting for a neighbour's activations or gradients, the transfers and FSDP's reductions count
as bubble. Both are summed over the runs after the warm-up steps. The stage balance is each pipeline
rank's share of the stage compute (of data rank 0's pipeline); a perfect split gives 1 / pp each.
A schedule that fails is reported in its row and the others still run. Then the memory estimate
(trainer/planning/memory.py) of DeepSeek-V3 671B on ``--gpus`` GPUs: DeepSeek's pp 16 x ep 64 layout under
DualPipeV, 1F1B and Interleaved1F1B, and the best layout without pipelining. Prints markdown tables
and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import typing
from pathlib import Path

from trainer.config.activation_checkpoint import ACMode
from trainer.config.pipeline_layout import PipelinePlan
from trainer.config.schedules import PP_SCHEDULES
from trainer.diagnostics import spawn_local
from trainer.run_folder import latest_run_folder

ROOT = Path(__file__).resolve().parents[1]

STAGE_WORK = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def _timed_schedule_runs() -> list[list[float]]:
    """Clocks the schedules' ``step`` and the stage methods they call; returns a list that gets
    one ``[run seconds, stage compute seconds]`` per schedule run (timing only: nothing else in
    torch reports a rank's busy time)."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import _PipelineStageBase

    runs: list[list[float]] = []

    def timed_work(method):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                if runs:
                    runs[-1][1] += time.perf_counter() - start

        return run

    def timed_step(method):
        def run(*args, **kwargs):
            runs.append([0.0, 0.0])
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                runs[-1][0] = time.perf_counter() - start

        return run

    for name in STAGE_WORK:
        setattr(_PipelineStageBase, name, timed_work(getattr(_PipelineStageBase, name)))
    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        cls.step = timed_step(cls.step)
    return runs


def _worker(rank: int, world: int, port: int, argv: list[str], warmup: int, queue) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WANDB_MODE="disabled",
    )
    import torch

    from trainer.config import load_config
    from trainer.trainer import Trainer

    torch.set_num_threads(1)
    runs = _timed_schedule_runs()
    trainer = Trainer(load_config(argv))
    trainer.train()
    kept = runs[warmup:]
    pp_rank = trainer.parallel_dims.mesh("pp").get_local_rank()
    data_rank = trainer.parallel_dims.dp_rank_and_degree()[0] if trainer.parallel_dims.has_mesh("dp") else 0
    queue.put({"rank": rank, "pp_rank": pp_rank, "data_rank": data_rank,
               "run_s": sum(r[0] for r in kept), "busy_s": sum(r[1] for r in kept)})
    trainer.close()


def even_layout(n_layers: int, mtp_depth: int, n_stages: int) -> str:
    """The even split of layer equivalents (each block, E, L and each MTP module weigh one) as a
    ``pp_layout`` string: the split before stages were balanced by cost."""
    from trainer.config.pipeline_layout import split_stages

    specs = split_stages(n_layers, mtp_depth, n_stages)
    return "|".join(("E" if s.first else "") + "t" * len(s.layers) + ("L" if s.last else "") for s in specs)


def run(folder: Path, schedule: str, microbatches: int, ac: str, args) -> dict:
    stages = PipelinePlan(pp=args.pp, pp_schedule=schedule).pp_stages_per_rank
    argv = [
        "--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"),
        "--job.dump_folder", str(folder), "--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len),
        "--training.global_batch_size", str(args.batch),
        "--training.local_batch_size", str(args.batch // args.dp_shard),
        "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1", "--no-validation.enable",
        "--no-job.print_config", "--lr_scheduler.warmup_steps", "2",
        "--parallelism.pp", str(args.pp), "--parallelism.dp_shard", str(args.dp_shard),
        "--parallelism.pp_schedule", schedule, "--parallelism.pp_microbatches", str(microbatches),
        "--activation_checkpoint.mode", ac,
    ]
    if args.split == "even":
        from models.deepseek_v3 import get_flavor

        flavor = get_flavor("debugmodel")
        argv += ["--parallelism.pp_layout", even_layout(flavor.n_layers, flavor.mtp_depth, args.pp * stages)]
    ranks = spawn_local(_worker, args.pp * args.dp_shard, argv, 2, timeout=1800)
    records = [json.loads(line) for line in (latest_run_folder(folder) / "metrics.jsonl").read_text().splitlines()]
    tokens_per_device = args.batch * args.seq_len / args.pp / args.dp_shard
    times = [tokens_per_device / r["tokens_per_sec"] for r in records if r["step"] > 2 and "tokens_per_sec" in r]
    pipeline = sorted((r for r in ranks if r["data_rank"] == 0), key=lambda r: r["pp_rank"])
    busy = [r["busy_s"] for r in pipeline]
    last = records[-1]
    return {
        "ac": ac, "stages_per_rank": stages, "microbatches": microbatches, "step_s": statistics.median(times),
        "peak_gib_per_pp_rank": [last.get(f"memory_gib_pp{r}", last.get("memory_gib")) for r in range(args.pp)],
        "bubble_per_rank": [1 - r["busy_s"] / r["run_s"] for r in pipeline],
        "work_share_per_rank": [b / sum(busy) for b in busy],
    }


def memory_rows(gpus: int) -> list[dict]:
    """DeepSeek's layout (pp 16 x ep 64, data parallel over the rest) under DualPipeV, 1F1B and
    Interleaved1F1B, and the best layout without pipelining, on ``gpus`` GPUs: 32 one-sequence
    micro-batches per pipeline run (what DualPipeV's 32 stages need)."""
    from trainer.planning.memory import estimate

    common = dict(flavor="671B", tp=1, cp=1, seq_len=4096, ac="full")
    pipelined = dict(dp_shard=gpus // 16, ep=64, local_batch_size=32)

    def plan(schedule: str) -> PipelinePlan:
        return PipelinePlan(pp=16, pp_schedule=schedule, pp_microbatches=32)

    layouts = [
        ("no PP: FSDP over all GPUs, EP 64", dict(dp_shard=gpus, ep=64, local_batch_size=1)),
        ("PP 16 (1F1B) x FSDP, EP 64", dict(**pipelined, pipeline=plan("1F1B"))),
        ("PP 16 (Interleaved1F1B, 2 stages/rank) x FSDP, EP 64", dict(**pipelined, pipeline=plan("Interleaved1F1B"))),
        ("PP 16 (DualPipeV, 2 stages/rank) x FSDP, EP 64", dict(**pipelined, pipeline=plan("DualPipeV"))),
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
    p.add_argument("--dp-shard", dest="dp_shard", type=int, default=1, help="FSDP degree beside pp")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seq-len", dest="seq_len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--microbatches", type=int, default=-1,
                   help="pp_microbatches (at least the schedule's fewest; -1: the fewest)")
    p.add_argument("--split", choices=("cost", "even"), default="cost",
                   help="stage split: by estimated cost (the trainer's) or the even split of layer equivalents")
    p.add_argument("--ac", nargs="+", default=["none"], choices=typing.get_args(ACMode),
                   help="activation_checkpoint.mode: each schedule runs once per mode given")
    p.add_argument("--gpus", type=int, default=2048, help="GPUs of the 671B memory comparison (a multiple of 16)")
    args = p.parse_args(argv)

    results = {"pp": args.pp, "dp_shard": args.dp_shard, "seq_len": args.seq_len, "batch": args.batch,
               "split": args.split, "ac": args.ac, "schedules": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.schedules:
            micro = max(args.microbatches, PipelinePlan(pp=args.pp, pp_schedule=name).pp_microbatches)
            for ac in args.ac:
                key = name if len(args.ac) == 1 else f"{name} / AC {ac}"
                try:
                    results["schedules"][key] = run(Path(tmp) / name / ac, name, micro, ac, args)
                except Exception as e:  # one run's failure must not hide the others' figures
                    results["schedules"][key] = {"microbatches": micro,
                                                 "error": f"{type(e).__name__}: {e}".splitlines()[0]}
    print(f"pp {args.pp} x dp_shard {args.dp_shard}, debug model, seq_len {args.seq_len}, global batch {args.batch}, "
          f"{args.split} split, AC {', '.join(args.ac)}\n")
    print("| schedule | stages/rank | micro-batches | step (s) | peak GiB per pp rank | bubble per pp rank | "
          "stage work per pp rank |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results["schedules"].items():
        if "error" in r:
            print(f"| {name} | | {r['microbatches']} | failed: {r['error']} | | | |")
            continue
        peak = " / ".join(f"{m:.3f}" for m in r["peak_gib_per_pp_rank"])
        bubble = " / ".join(f"{b:.2f}" for b in r["bubble_per_rank"])
        share = " / ".join(f"{w:.0%}" for w in r["work_share_per_rank"])
        print(f"| {name} | {r['stages_per_rank']} | {r['microbatches']} | {r['step_s']:.3f} | {peak} | {bubble} | "
              f"{share} |")
    rows = memory_rows(args.gpus)
    results["memory_671b"] = rows
    print(f"\n671B on {args.gpus} GPUs, seq_len 4096, AC full (estimate, GiB/GPU, the fullest pp rank):\n")
    print("| layout | params/GPU (B) | params+grads+Adam | stage grad accum. + unsharded | activations (blocks) | "
          "logits+loss | peak |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        states = r["params"] + r["grads"] + r["optimizer"]
        stages = r["stage_grad_accumulators"] + r["stage_unsharded_params"]
        print(f"| {r['layout']} | {r['params_per_gpu_B']:.3f} | {states:.1f} | {stages:.1f} | {r['layers']:.1f} | "
              f"{r['logits_and_loss']:.1f} | {r['total']:.1f} |")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
