"""Per-GPU memory estimate of a DeepSeek-V3 training layout (the model: trainer/memory.py).

    python scripts/estimate_memory.py --flavor 671B --dp_shard 512 --ep 64 --tp 1 \
        --seq_len 4096 --local_batch_size 1 --ac full

What is counted and what is not is in trainer/memory.py's docstring; the trainer itself refuses a
run whose estimate exceeds the device's free memory before building the model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.deepseek_v3 import flavor_names  # noqa: E402
from trainer.memory import ACT_BYTES, estimate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Per-GPU memory estimate of a DeepSeek-V3 training layout.")
    p.add_argument("--flavor", required=True, choices=flavor_names())
    p.add_argument("--dp_shard", type=int, required=True, help="FSDP degree (without cp)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (divides dp_shard x cp)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1, help="context degree (cp, or ep with ep_as_cp)")
    p.add_argument("--seq_len", type=int, required=True)
    p.add_argument("--local_batch_size", type=int, default=1, help="sequences per data rank per micro-batch")
    p.add_argument("--ac", choices=("full", "none"), default="full")
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
                     state_dtype=args.state_dtype)
    except ValueError as e:
        p.error(str(e))
    if args.json:
        print(json.dumps(r))
        return 0
    lay = r["layout"]
    print(f"{args.flavor}: {r['params_total_B']:.2f}B params; {lay['gpus']} GPUs = dp_shard {lay['dp_shard']} x cp "
          f"{lay['cp']} x tp {lay['tp']}, ep {lay['ep']} (efsdp {lay['efsdp']}); seq_len {lay['seq_len']}, "
          f"local batch {lay['local_batch_size']}, AC {lay['ac']}")
    print(f"  parameters per GPU        {r['params_per_gpu_B']:8.3f} B")
    for key, label in (("params", "fp32 parameters"), ("grads", "fp32 gradients"),
                       ("backward_temporaries", "embed/head grad temps"), ("optimizer", "optimizer states"),
                       ("fsdp_unsharded_block", "FSDP unsharded blocks"), ("bf16_weight_copies", "bf16 weight copies"),
                       ("allocator_rounding", "allocator rounding"), ("cublas_workspace", "cuBLAS workspace"),
                       ("layers", "activations (blocks)"),
                       ("logits_and_loss", "logits + loss"), ("total", "total (peak)")):
        print(f"  {label:<25} {r['gib'][key]:8.2f} GiB")
    verdict = "fits" if r["gib"]["total"] + 6 <= args.gpu_gib else "does NOT fit"
    print(f"  -> {verdict} in {args.gpu_gib:.0f} GiB with ~6 GiB for CUDA context, NCCL and fragmentation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
