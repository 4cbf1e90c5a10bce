"""Where the layout planner ranks three published DeepSeek-V3 671B recipes
(../shared/design/REFERENCES.md), and its predicted throughput next to the published one.

For each recipe the planner runs with the recipe's GPUs and GPU memory (80 GiB: H800 and H100),
seq_len 4096 and a global batch of 4096 sequences (the recipes' batch is not all published; every
recipe's data-parallel degree divides it), and the best-ranked layout with the recipe's degrees
and schedule is looked up. Published throughput, converted to tokens/s per GPU:

* DeepSeek-V3 report: 180K H800 GPU-hours per trillion tokens -> 1e12 / (180e3 x 3600) tok/s/GPU;
* torchtitan (PR 2107), 512 H100: 9.8% MFU with all-to-all (16.5% with DeepEP), converted with
  this trainer's FLOPs per token at seq_len 4096 (models/deepseek_v3/stats.py) and 989 TFLOP/s;
* Megatron-Core's 1024-H100 recipe: no throughput in the references.

    python benchmarks/published_recipes.py            # three planner runs on 2048, 1024, 512 GPUs (6 CPU-minutes)
    python benchmarks/published_recipes.py --gpus 512
"""

from __future__ import annotations

import argparse
import sys
import time

from models.deepseek_v3 import flops_per_token, get_flavor
from trainer.planning.layout_planner import find, plan_layouts
from trainer.planning.step_time import Hardware

SEQ, BATCH = 4096, 4096
RECIPES = [
    ("DeepSeek-V3 (report)", 2048, dict(pp=16, ep=64, tp=1, cp=1, dp_replicate=1, ep_as_cp=False, pp_schedule="DualPipeV"),
     1e12 / (180e3 * 3600), "180K H800 GPU-hours / 1T tokens"),
    ("Megatron-Core recipe", 1024, dict(pp=8, ep=64, tp=2, cp=1, dp_replicate=1, ep_as_cp=False, pp_schedule="Interleaved1F1B",
                                        pp_stages_per_rank=4), None, "none published"),
    ("torchtitan (PR 2107)", 512, dict(pp=8, ep=32, tp=1, cp=1, dp_replicate=1, ep_as_cp=False, pp_schedule="Interleaved1F1B",
                                       pp_stages_per_rank=2),
     0.098 * 989e12 / flops_per_token(get_flavor("671B"), SEQ), "9.8% MFU (all-to-all)"),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a step-time constant")
    p.add_argument("--gpus", type=int, nargs="+", default=[r[1] for r in RECIPES], help="only these recipes")
    a = p.parse_args()
    hw = Hardware().with_overrides(a.set)
    print("| recipe | GPUs | rank in the planner's list | layouts that fit | predicted s/step | predicted tok/s/GPU "
          "| published tok/s/GPU | planner's first | first's tok/s/GPU | planner time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, gpus, degrees, published, source in RECIPES:
        if gpus not in a.gpus:
            continue
        start = time.perf_counter()
        ranked, _ = plan_layouts("671B", gpus, 80.0, 8, SEQ, BATCH, hw)
        took = time.perf_counter() - start
        hit = find(ranked, **degrees)
        best = ranked[0]
        first = " ".join(best.flags()[:12])
        pub = f"{published:.0f} ({source})" if published else source
        if hit is None:
            row = f"not among the {len(ranked)} that fit | - | - "
        else:
            rank, r = hit
            row = f"{rank} | {len(ranked)} | {r.time['seconds']:.1f} | {r.time['tokens_per_s_per_gpu']:.0f} "
        print(f"| {name} | {gpus} | {row}| {pub} | `{first}` | {best.time['tokens_per_s_per_gpu']:.0f} | {took:.0f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
