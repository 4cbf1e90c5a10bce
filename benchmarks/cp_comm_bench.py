"""Communication volume of the context-parallel K/V exchange of MLA: compressed latent vs full K/V.

With context parallelism each rank needs the keys and values of the whole sequence. This trainer
all-gathers MLA's compressed latent, `kv_lora_rank + qk_rope_head_dim` values per token, and
up-projects it locally with `wkv_b`; the alternative (ring attention / plain all-gather of K and V)
moves `n_heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)` values per token.

The script spawns `--cp` gloo ranks on CPU and, per flavor:
1. measures both exchanges on tensors of the flavor's shapes: bytes received per rank (counted
   from the gathered tensors) and the collectives seen by `CommDebugMode`;
2. for the debug model, also runs a real `MLA` forward + backward with the trainer's
   `LatentAllGather` hook and checks it moves exactly the latent volume.
Prints a table and one JSON object (`--json` writes it to a file too).

    python benchmarks/cp_comm_bench.py [--cp 2] [--seq_len 256] [--batch 1] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from models.deepseek_v3 import get_flavor
from trainer.diagnostics import init_local_gloo, spawn_local

FLAVORS = ("debugmodel", "16B", "671B")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def widths(flavor: str) -> dict:
    a = get_flavor(flavor)
    latent = a.kv_lora_rank + a.qk_rope_head_dim
    full = a.n_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim)
    return {
        "latent_per_token": latent,
        "full_kv_per_token": full,
        "latent_formula": f"{a.kv_lora_rank} + {a.qk_rope_head_dim}",
        "full_formula": f"{a.n_heads} x ({a.qk_nope_head_dim} + {a.qk_rope_head_dim} + {a.v_head_dim})",
        "n_layers": a.n_layers,
    }


def _count_collectives(mode) -> int:
    return sum(mode.get_comm_counts().values())


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from models.common.attention import MLA
    from models.common.rope import precompute_freqs_cis
    from trainer.parallel.context_parallel import ContextParallel, LatentAllGather

    torch.set_num_threads(1)
    init_local_gloo(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        group = mesh.get_group()
        dtype = DTYPES[args.dtype]
        s_local = args.seq_len // world
        results = {}
        for flavor in FLAVORS:
            w = widths(flavor)
            a = get_flavor(flavor)
            measured = {}
            for kind in ("latent", "full_kv"):
                if kind == "latent":
                    sends = [torch.randn(args.batch, s_local, w["latent_per_token"]).to(dtype)]
                else:  # K (nope | rope per head) and V, as a ring / all-gather CP would move them
                    sends = [
                        torch.randn(args.batch, s_local, a.n_heads, a.qk_nope_head_dim + a.qk_rope_head_dim).to(dtype),
                        torch.randn(args.batch, s_local, a.n_heads, a.v_head_dim).to(dtype),
                    ]
                with CommDebugMode() as mode:
                    gathered = [funcol.wait_tensor(funcol.all_gather_tensor(t, 1, group)) for t in sends]
                received = sum(g.nbytes - t.nbytes for g, t in zip(gathered, sends))
                measured[kind] = {"bytes_received_per_rank": received, "collectives": _count_collectives(mode)}
            ratio = measured["full_kv"]["bytes_received_per_rank"] / measured["latent"]["bytes_received_per_rank"]
            results[flavor] = {**w, **measured, "ratio_full_over_latent": ratio}

        # Cross-check: the trainer's hook inside a real (debug-size) MLA, forward and backward.
        a = get_flavor("debugmodel")
        torch.manual_seed(0)
        mla = MLA(a.dim, a.n_heads, a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim,
                  a.v_head_dim, a.softmax_scale).to(dtype)
        hook = LatentAllGather(group)
        mla.latent_exchange = hook
        cp = ContextParallel(mesh, "causal", a.eos_id, "sdpa")
        tokens = torch.zeros(args.batch, args.seq_len, dtype=torch.long)
        b = cp.shard_batch(tokens, tokens)
        freqs = precompute_freqs_cis(a.qk_rope_head_dim, args.seq_len, a.rope_theta)[b.positions]
        x = torch.randn(args.batch, s_local, a.dim).to(dtype).requires_grad_()
        with CommDebugMode() as mode:
            out = mla(x, freqs, b.attn_mask)
            out.float().sum().backward()
        counts = {str(k): v for k, v in mode.get_comm_counts().items()}
        model_bytes = (world - 1) * args.batch * s_local * (a.kv_lora_rank + a.qk_rope_head_dim) * x.element_size()
        results["debugmodel"]["model_hook_check"] = {
            "collectives_fwd_bwd": counts,
            "bytes_received_per_rank_fwd": model_bytes,
            "matches_latent_measurement": model_bytes == results["debugmodel"]["latent"]["bytes_received_per_rank"],
        }
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, default=2, help="context-parallel ranks (gloo processes)")
    parser.add_argument("--seq_len", type=int, default=256, help="global sequence length")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES))
    parser.add_argument("--json", default=None, help="also write the JSON result to this file")
    args = parser.parse_args()
    if args.seq_len % (2 * args.cp):
        parser.error(f"--seq_len must be a multiple of 2 x cp = {2 * args.cp}")

    (results,) = spawn_local(_worker, args.cp, args, results=1)

    print(f"CP K/V exchange per attention layer and forward, cp={args.cp}, seq_len={args.seq_len}, "
          f"batch={args.batch}, {args.dtype} (backward reduce-scatters the same volume)")
    print(f"{'flavor':<11} {'latent/token':>18} {'full K/V/token':>26} {'latent MB/rank':>15} "
          f"{'full MB/rank':>13} {'ratio':>7}")
    for flavor, r in results.items():
        print(
            f"{flavor:<11} {r['latent_per_token']:>6} ({r['latent_formula']:>9}) "
            f"{r['full_kv_per_token']:>6} ({r['full_formula']:>17}) "
            f"{r['latent']['bytes_received_per_rank'] / 1e6:>15.3f} "
            f"{r['full_kv']['bytes_received_per_rank'] / 1e6:>13.3f} {r['ratio_full_over_latent']:>7.1f}"
        )
    check = results["debugmodel"]["model_hook_check"]
    print(f"model hook (debugmodel MLA fwd+bwd): collectives {check['collectives_fwd_bwd']}, "
          f"bytes match measurement: {check['matches_latent_measurement']}")
    payload = {"cp": args.cp, "seq_len": args.seq_len, "batch": args.batch, "dtype": args.dtype, "flavors": results}
    print(json.dumps(payload))
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
