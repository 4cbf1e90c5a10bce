"""Per-GPU memory estimate of a DeepSeek-V3 training layout (first-order; see docs/parallelism.md).

    python scripts/estimate_memory.py --flavor 671B --dp_shard 512 --ep 64 --tp 1 \
        --seq_len 4096 --local_batch_size 1 --ac full

Model states follow this trainer's layout: FSDP2 shards non-expert weights over dp_shard x cp;
tensor parallelism splits attention heads, dense / shared-expert FFNs, embedding and head, while
`wq_a`, `wkv_a`, norms and the router stay replicated over tp; routed experts are split over ep
and FSDP-sharded over (dp_shard x cp) / ep, and replicated over tp (docs/parallelism.md). fp32
master weights, fp32 gradients (FSDP reduces in fp32), AdamW's two fp32 moments: 16 bytes per
local parameter. Activations are estimates of the tensors autograd saves per token and layer
(listed in `_layer_activation_bytes`), in bf16 (`--mixed_precision bfloat16`, autocast) or fp32;
`--ac full` keeps each block's input plus one block's activations during recompute.
The peak: gradients are freed at every step's end (`zero_grad(set_to_none=True)`) and allocated
during backward while the saved activations are released, so the total holds parameters,
optimizer states and the larger of (gradients + the embedding / head gradient temporaries) and
(activations + logits + FSDP buffers).
Not modelled: allocator fragmentation, CUDA context and NCCL buffers (budget ~4-6 GiB),
temporary buffers of kernels. Checked against the debug flavor's measured peak on CPU
(tests/unit/test_memory_estimate.py, within 15%); expect more spread on large GPU layouts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.deepseek_v3 import DeepSeekV3ModelArgs, flavor_names, get_flavor  # noqa: E402

GiB = 1024**3
ACT_BYTES = {"bfloat16": 2, "float32": 4}  # activations follow training.mixed_precision_param
STATE_BYTES = {"params": 4, "grads": 4, "optimizer": 8}  # fp32 master, fp32 grads, AdamW m and v


def _block_params(a: DeepSeekV3ModelArgs, moe: bool) -> dict[str, int]:
    """Parameters of one block split by how they are laid out: tp-split, tp-replicated, routed experts."""
    d, h = a.dim, a.n_heads
    split = h * a.v_head_dim * d + a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim)  # wo, wkv_b
    repl = d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank + 2 * d  # wkv_a, kv_norm, 2 norms
    if a.q_lora_rank == 0:
        split += d * h * a.qk_head_dim
    else:
        split += a.q_lora_rank * h * a.qk_head_dim
        repl += d * a.q_lora_rank + a.q_lora_rank
    experts = 0
    if moe:
        m = a.moe
        repl += m.num_experts * d  # router
        split += 3 * d * m.num_shared_experts * a.moe_inter_dim
        experts = m.num_experts * 3 * d * a.moe_inter_dim
    else:
        split += 3 * d * a.inter_dim
    return {"tp_split": split, "tp_replicated": repl, "experts": experts}


def _layer_activation_bytes(a: DeepSeekV3ModelArgs, moe: bool, tp: int, cp: int, act_bytes: int) -> float:
    """Bytes saved for backward per *local* token of one block (no checkpointing)."""
    d, h = a.dim, a.n_heads
    heads = h / tp
    attn = (
        d / tp + d  # attn_norm input (sequence-sharded) and its all-gathered output
        + (2 * a.q_lora_rank if a.q_lora_rank else 0)  # wq_a out, q_norm out
        + 2 * heads * a.qk_head_dim  # q before / after the rope concat
        + 2 * (a.kv_lora_rank + a.qk_rope_head_dim)  # wkv_a out, kv_norm out (+ the gathered copy)
        + cp * heads * (a.qk_nope_head_dim + a.v_head_dim)  # wkv_b out for all cp ranks' keys
        + cp * heads * 2 * a.qk_head_dim  # k and zero-padded v for all keys
        + 2 * heads * a.v_head_dim  # attention output, wo input
    )
    if moe:
        m = a.moe
        routed = m.top_k * (2 * d + 4 * a.moe_inter_dim)  # dispatched rows, w1/w3 outs, silu, product, expert out
        shared = d + 4 * m.num_shared_experts * a.moe_inter_dim / tp
        ffn = d / tp + d + routed + shared + 2 * m.num_experts  # norm in/out, fp32 router scores
    else:
        ffn = d / tp + d + 4 * a.inter_dim / tp
    return (attn + ffn) * act_bytes


def estimate(
    flavor: str, dp_shard: int, ep: int, tp: int, cp: int, seq_len: int, local_batch_size: int, ac: str,
    mixed_precision: str = "bfloat16", model_args: DeepSeekV3ModelArgs | None = None,
) -> dict:
    """``model_args`` replaces the flavor's preset (e.g. the trainer's, with the tokenizer's vocabulary)."""
    a = model_args or get_flavor(flavor)
    act_bytes = ACT_BYTES[mixed_precision]
    if seq_len % (2 * cp) and cp > 1:
        raise ValueError(f"seq_len must be a multiple of 2 x cp = {2 * cp}")
    fsdp = dp_shard * cp
    if fsdp % ep:
        raise ValueError(f"ep={ep} must divide dp_shard x cp = {fsdp}")
    efsdp = fsdp // ep
    n_moe = a.n_layers - a.n_dense_layers
    blocks = [_block_params(a, moe=False)] * a.n_dense_layers + [_block_params(a, moe=True)] * n_moe
    blocks += [_block_params(a, moe=True)] * a.mtp_depth
    embed_head = 2 * a.vocab_size * a.dim
    mtp_extra = a.mtp_depth * (2 * a.dim * a.dim + 3 * a.dim)  # eh_proj (tp-split) + 3 norms

    split = sum(b["tp_split"] for b in blocks) + embed_head + a.mtp_depth * 2 * a.dim * a.dim
    repl = sum(b["tp_replicated"] for b in blocks) + a.dim + a.mtp_depth * 3 * a.dim
    experts = sum(b["experts"] for b in blocks)
    total = split + repl + experts
    local = split / (tp * fsdp) + repl / fsdp + experts / (ep * efsdp)
    states = {k: local * v / GiB for k, v in STATE_BYTES.items()}

    # FSDP all-gathers one block ahead: the current and the prefetched block unsharded in the
    # param dtype, and the block being reduced holds its fp32 unsharded gradient. Without
    # sharding (one data rank) there is no FSDP wrap and no such buffer.
    biggest = max(blocks, key=lambda b: b["tp_split"] + b["experts"])
    unsharded = biggest["tp_split"] / tp + biggest["tp_replicated"] + biggest["experts"] / ep
    transient = unsharded * (2 * act_bytes + 4) / GiB if fsdp > 1 else 0.0

    tokens = local_batch_size * seq_len / cp  # local tokens per GPU
    per_layer = [
        _layer_activation_bytes(a, moe=i >= a.n_dense_layers, tp=tp, cp=cp, act_bytes=act_bytes) * tokens
        for i in range(a.n_layers + a.mtp_depth)
    ]
    if ac == "full":
        act = len(per_layer) * tokens * a.dim / tp * act_bytes + max(per_layer)
    else:
        act = sum(per_layer)
    # Logits, their fp32 log-softmax in the loss and its fp32 gradient, per head use (main + MTP).
    logits = (1 + a.mtp_depth) * tokens * a.vocab_size / tp * (act_bytes + 4 + 4)
    activations = {"layers": act / GiB, "logits_and_loss": logits / GiB}
    # At the end of backward, while (nearly) all gradients are live: the embedding's dense
    # vocab x dim gradient and the head's weight gradient pass through fp32 temporaries
    # (measured on CPU with MemTracker for the debug flavor: 2-3 such buffers).
    backward_tmp = 2 * a.vocab_size * a.dim / tp * 4 / GiB
    result = {
        "flavor": flavor,
        "layout": {"dp_shard": dp_shard, "cp": cp, "tp": tp, "ep": ep, "efsdp": efsdp,
                   "gpus": dp_shard * cp * tp, "seq_len": seq_len, "local_batch_size": local_batch_size, "ac": ac,
                   "mixed_precision": mixed_precision},
        "params_total_B": total / 1e9,
        "params_per_gpu_B": local / 1e9,
        "gib": {**states, "backward_temporaries": backward_tmp, "fsdp_unsharded_block": transient, **activations},
    }
    g = result["gib"]
    g["total"] = g["params"] + g["optimizer"] + max(
        g["grads"] + g["backward_temporaries"], g["fsdp_unsharded_block"] + g["layers"] + g["logits_and_loss"]
    )
    return result


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
    p.add_argument("--gpu_gib", type=float, default=80.0, help="device memory to compare against")
    p.add_argument("--json", action="store_true", help="print JSON only")
    args = p.parse_args(argv)
    try:
        r = estimate(args.flavor, args.dp_shard, args.ep, args.tp, args.cp, args.seq_len, args.local_batch_size, args.ac,
                     args.mixed_precision)
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
                       ("backward_temporaries", "embed/head grad temps"), ("optimizer", "AdamW states"),
                       ("fsdp_unsharded_block", "FSDP unsharded blocks"), ("layers", "activations (blocks)"),
                       ("logits_and_loss", "logits + loss"), ("total", "total (peak)")):
        print(f"  {label:<25} {r['gib'][key]:8.2f} GiB")
    verdict = "fits" if r["gib"]["total"] + 6 <= args.gpu_gib else "does NOT fit"
    print(f"  -> {verdict} in {args.gpu_gib:.0f} GiB with ~6 GiB for CUDA context, NCCL and fragmentation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
