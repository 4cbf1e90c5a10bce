"""The layouts of a model on a cluster, ranked by the step-time model (docs/planning.md).

    python scripts/plan_layout.py --flavor 671B --gpus 2048 --gpu-memory 80 --gpus-per-node 8 \
        --seq-len 4096 --global-batch 4096

Enumerates every layout the pre-launch check accepts (dp_replicate, dp_shard, tp, cp, ep, pp,
schedule, micro-batches, activation checkpointing; trainer/planning/layout_planner.py), drops those whose
memory estimate (trainer/planning/memory.py, plus 6 GiB for the CUDA context, NCCL and fragmentation) does
not fit, and ranks the rest by the step-time model (trainer/planning/step_time.py, docs/performance.md).
Prints the top ``--top`` with their memory, step time, shares of exposed communication and of
the pipeline bubble, and the run_train.sh flags. ``--set name=value`` overrides a constant of
the model (``--set peak_flops=2.25e15 --set network_bytes_per_s=1e11`` for another GPU and
network); ``--recipe`` also reports where one given layout ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from models.deepseek_v3 import flavor_names
from trainer.config import ConfigError
from trainer.planning.layout_planner import check_flags, find, plan_layouts
from trainer.planning.step_time import Hardware

RECIPE_KEYS = ("pp", "pp_schedule", "pp_stages_per_rank", "pp_microbatches", "dp_replicate", "dp_shard", "cp", "tp",
               "ep", "ep_as_cp", "local_batch_size", "ac", "recompute_modules", "moe_overlap")


def _recipe(text: str) -> dict:
    """``pp=16,ep=64,pp_schedule=DualPipeV`` -> the plan fields to look for, by their config names
    (``Plan.field``; ``ep_as_cp`` and ``moe_overlap`` 1 or 0; ``recompute_modules`` names joined
    by ``+``, as the planner lists them: a set's name, ``megatron_dsv3``)."""
    out = {}
    for pair in text.split(","):
        key, _, value = (part.strip() for part in pair.partition("="))
        if key not in RECIPE_KEYS:
            raise ValueError(f"unknown --recipe field {key!r}; the fields: {', '.join(RECIPE_KEYS)}")
        if key in ("pp_schedule", "ac"):
            out[key] = value
        elif key == "recompute_modules":
            out[key] = tuple(value.split("+"))
        else:
            out[key] = bool(int(value)) if key in ("ep_as_cp", "moe_overlap") else int(value)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Rank the parallel layouts of a model on a cluster by a step-time model.")
    p.add_argument("--flavor", required=True)
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the run (NNODES x NGPU)")
    p.add_argument("--gpu-memory", type=float, required=True, help="GiB of one GPU")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=0, help="sequences per optimizer step; 0 = 2 x gpus")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override a step-time constant (trainer/planning/step_time.py Hardware)")
    p.add_argument("--recipe", action="append", default=[], metavar="FIELD=VALUE,...",
                   help="also report the rank of the best layout with these fields, by their config names "
                        "(e.g. pp=16,ep=64,pp_schedule=DualPipeV)")
    p.add_argument("--json", default="", help="also write the ranked layouts to this JSON file")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                   help="processes that estimate the layouts (default: this machine's cores); the table is the same")
    a = p.parse_args(argv)
    if a.flavor not in flavor_names():
        print(f"error: unknown flavor {a.flavor!r}; available: {', '.join(flavor_names())}", file=sys.stderr)
        return 2
    if a.gpus < 1 or a.gpu_memory <= 0 or a.gpus_per_node < 1 or a.seq_len < 1 or a.global_batch < 0 or a.workers < 1:
        print("error: --gpus, --gpu-memory, --gpus-per-node, --seq-len and --workers must be positive, "
              "--global-batch >= 0", file=sys.stderr)
        return 2
    try:
        hardware = Hardware(gpus_per_node=a.gpus_per_node).with_overrides(a.set)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        recipes = [(text, _recipe(text)) for text in a.recipe]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    batch = a.global_batch or 2 * a.gpus
    ranked, considered = plan_layouts(
        a.flavor, a.gpus, a.gpu_memory, a.gpus_per_node, a.seq_len, batch, hardware, workers=a.workers
    )
    print(f"{a.flavor} on {a.gpus} GPUs ({a.gpus_per_node} per node, {a.gpu_memory:g} GiB), seq_len {a.seq_len}, "
          f"global batch {batch}: {considered} valid layouts, {len(ranked)} fit")
    if not ranked:
        print("error: no layout fits; use more GPUs, a shorter sequence or a smaller batch", file=sys.stderr)
        return 2
    print(f"{'#':>3} {'GiB':>6} {'s/step':>8} {'tok/s/GPU':>9} {'MFU':>5} {'comm':>5} {'bubble':>6}  run_train.sh flags")
    for i, r in enumerate(ranked[: a.top], 1):
        try:
            check_flags(a.flavor, r)
        except ConfigError as e:  # the enumeration and the config loader disagree: a bug here
            raise AssertionError(f"planner layout refused by the config check: {e}") from e
        t = r.time
        print(f"{i:>3} {r.memory_gib:6.1f} {t['seconds']:8.2f} {t['tokens_per_s_per_gpu']:9.0f} {t['mfu']:5.1%} "
              f"{t['comm_share']:5.0%} {t['bubble_share']:6.0%}  {' '.join(r.flags())}")
    for text, fields in recipes:
        hit = find(ranked, **fields)
        if hit is None:
            print(f"recipe {text}: not among the layouts that fit")
        else:
            rank, r = hit
            print(f"recipe {text}: rank {rank} of {len(ranked)}, {r.memory_gib:.1f} GiB, {r.time['seconds']:.2f} s/step, "
                  f"{r.time['tokens_per_s_per_gpu']:.0f} tok/s/GPU, {' '.join(r.flags())}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{"flags": r.flags(), "memory_gib": r.memory_gib, **r.time} for r in ranked], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
