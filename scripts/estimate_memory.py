"""Per-GPU memory estimate of a DeepSeek-V3 training layout (the model: trainer/planning/memory.py).

    python scripts/estimate_memory.py --flavor 671B --dp_shard 512 --ep 64 --tp 1 \
        --seq_len 4096 --local_batch_size 1 --ac full
    python scripts/estimate_memory.py --flavor 671B --pp 8 --pp_schedule Interleaved1F1B --dp_shard 64 \
        --ep 32 --seq_len 4096 --local_batch_size 8 --ac full
    # DeepSeek-V3's layout on 2048 GPUs: DualPipeV, pp 16 x ep 64 x ZeRO data parallelism 128
    python scripts/estimate_memory.py --flavor 671B --pp 16 --pp_schedule DualPipeV --pp_microbatches 32 \
        --dp_shard 128 --ep 64 --seq_len 4096 --local_batch_size 32 --ac full

What is counted and what is not is in trainer/planning/memory.py's docstring; the trainer itself refuses a
run whose estimate exceeds the device's free memory before building the model.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing

from models.deepseek_v3 import flavor_names
from trainer.config import ConfigError
from trainer.config.activation_checkpoint import RECOMPUTE_MODULES, RECOMPUTE_SETS, ACMode
from trainer.config.pipeline_layout import PipelinePlan
from trainer.config.schedules import PP_SCHEDULES
from trainer.planning.memory import ACT_BYTES, estimate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Per-GPU memory estimate of a DeepSeek-V3 training layout.")
    p.add_argument("--flavor", required=True, choices=flavor_names())
    p.add_argument("--dp_shard", type=int, required=True, help="FSDP degree (without cp)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (divides dp_shard x cp)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree")
    p.add_argument("--ep_as_cp", action="store_true", help="the ep ranks split each sequence (parallelism.ep_as_cp; cp 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (GPUs = pp x dp_shard x cp x tp)")
    p.add_argument("--pp_schedule", choices=PP_SCHEDULES, default="1F1B")
    p.add_argument("--pp_stages_per_rank", type=int, default=-1, help="-1: the schedule's default")
    p.add_argument("--pp_microbatches", type=int, default=-1, help="-1: the schedule's default")
    p.add_argument("--pp_layout", default="", help="explicit stage split, as parallelism.pp_layout (empty: by cost)")
    p.add_argument("--pp_max_deferred_weight_passes", type=int, default=-1,
                   help="as parallelism.pp_max_deferred_weight_passes (-1: the schedule's own)")
    p.add_argument("--seq_len", type=int, required=True)
    p.add_argument("--local_batch_size", type=int, default=1,
                   help="sequences per data rank per accumulation micro-batch (with --pp: split into --pp_microbatches)")
    p.add_argument("--ac", choices=typing.get_args(ACMode), default="full", help="activation_checkpoint.mode")
    p.add_argument("--recompute_modules", nargs="+", default=["deepseek"],
                   help="activation_checkpoint.recompute_modules under --ac modules (names or sets: "
                   + ", ".join((*RECOMPUTE_SETS, *RECOMPUTE_MODULES)) + ")")
    p.add_argument("--selective_every", type=int, default=2, help="activation_checkpoint.selective_every")
    p.add_argument("--mixed_precision", choices=tuple(ACT_BYTES), default="bfloat16",
                   help="activation dtype: training.mixed_precision_param")
    p.add_argument("--optimizer", choices=("AdamW", "muon"), default="AdamW", help="optimizer.name")
    p.add_argument("--state_dtype", choices=("float32", "bfloat16"), default="float32", help="optimizer.state_dtype")
    p.add_argument("--gpu_gib", type=float, default=80.0, help="device memory to compare against")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda adds the bf16 weight copies, allocator rounding and cuBLAS workspace")
    p.add_argument("--json", action="store_true", help="print JSON only")
    args = p.parse_args(argv)
    try:
        r = estimate(args.flavor, args.dp_shard, args.ep, args.tp, args.cp, args.seq_len, args.local_batch_size,
                     args.ac, args.mixed_precision, device_type=args.device, optimizer=args.optimizer,
                     state_dtype=args.state_dtype, pipeline=PipelinePlan.from_config(args),
                     ep_as_cp=args.ep_as_cp, recompute_modules=tuple(args.recompute_modules),
                     selective_every=args.selective_every)
    except (ValueError, ConfigError) as e:
        p.error(str(e))
    if args.json:
        print(json.dumps(r))
        return 0
    lay = r["layout"]
    pipeline = f"pp {lay['pp']} x " if lay["pp"] > 1 else ""
    print(f"{args.flavor}: {r['params_total_B']:.2f}B params; {lay['gpus']} GPUs = {pipeline}dp_shard {lay['dp_shard']} x "
          f"cp {lay['cp']} x tp {lay['tp']}, ep {lay['ep']}{' as cp' if lay['ep_as_cp'] else ''} (efsdp {lay['efsdp']}); seq_len {lay['seq_len']}, "
          f"local batch {lay['local_batch_size']}, AC {lay['ac']}")
    if lay["pp"] > 1:
        print(f"  pipeline {lay['pp_schedule']}, {lay['pp_stages_per_rank']} stage(s) per rank, "
              f"{lay['pp_microbatches']} micro-batches; the fullest pp rank below, every rank's total: "
              + ", ".join(f"{g:.1f}" for g in r["gib_per_pp_rank"]) + " GiB")
    print(f"  parameters per GPU        {r['params_per_gpu_B']:8.3f} B")
    for key, label in (("params", "fp32 parameters"), ("grads", "fp32 gradients"),
                       ("backward_temporaries", "embed/head grad temps"), ("optimizer", "optimizer states"),
                       ("fsdp_unsharded_block", "FSDP unsharded blocks"),
                       ("stage_unsharded_params", "stages unsharded"),
                       ("stage_grad_accumulators", "stage fp32 grad accum."),
                       ("pipeline_buffers", "pipeline recv buffers"),
                       ("bf16_weight_copies", "bf16 weight copies"),
                       ("allocator_rounding", "allocator rounding"), ("cublas_workspace", "cuBLAS workspace"),
                       ("layers", "activations (blocks)"),
                       ("logits_and_loss", "logits + loss"),
                       ("late_backward", "late backward (w/o grads)"), ("total", "total (peak)")):
        print(f"  {label:<25} {r['gib'][key]:8.2f} GiB")
    verdict = "fits" if r["gib"]["total"] + 6 <= args.gpu_gib else "does NOT fit"
    print(f"  -> {verdict} in {args.gpu_gib:.0f} GiB with ~6 GiB for CUDA context, NCCL and fragmentation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
