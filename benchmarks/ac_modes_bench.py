"""Activation checkpointing per block: memory held for backward and step time of each mode.

One transformer block of a flavor (an MoE block unless ``--dense``), as the trainer wraps it
(trainer/parallel/activation_checkpoint.py), runs forward and backward on one batch for every
mode: none, full, selective (every block: the same as full for one block, so left out), op, and
``modules`` with each ``--sets`` entry (default: DeepSeek's set, NVIDIA's Megatron set, and each
part alone; ``+`` joins names into one entry: ``layernorm+moe_act``). Memory is torch's ``MemTracker`` (the dry run's tracker, trainer/dry_run.py) on the
CPU: the tensors alive after the forward that were not before it (what the block holds for its
backward, its output included) and the peak over forward and backward. The estimator's figure
for the same block and mode (trainer/planning/activation_memory.py ``block_activation_bytes``) is printed beside it.
Times are the median of ``--repeats`` forward + backward runs, interleaved round by round so
machine noise hits every mode alike.

    python benchmarks/ac_modes_bench.py                                   # proxy_1b MoE block, fp32, 2 x 1024
    python benchmarks/ac_modes_bench.py --flavor debugmodel --seq-len 256 --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from models.common.rope import precompute_freqs_cis
from models.deepseek_v3 import get_flavor
from models.deepseek_v3.model import TransformerBlock
from trainer.config.activation_checkpoint import CHEAP_PARTS, recompute_module_set
from trainer.parallel.activation_checkpoint import apply_activation_checkpointing
from trainer.planning.activation_memory import block_activation_bytes

MiB = 1024**2
DEFAULT_SETS = ["deepseek", "megatron_dsv3", "layernorm", "mla_up_proj", "moe_act", "core_attn", "shared_experts"]


class _Holder(torch.nn.Module):
    """The one block in a ``layers`` dict, as ``apply_activation_checkpointing`` wraps a model's."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.layers = torch.nn.ModuleDict({"0": block})


def _bytes(tracker: MemTracker, kind: str) -> int:
    snap = next(iter(tracker.get_tracker_snapshot(kind).values()), {})
    return snap.get("Total", next((v for k, v in snap.items() if getattr(k, "value", k) == "Total"), 0))


def run(args) -> list[dict]:
    margs = get_flavor(args.flavor)
    margs = dataclasses.replace(margs, max_seq_len=args.seq_len)
    layer_id = 0 if args.dense else max(margs.n_dense_layers, 0)
    if not args.dense and margs.n_dense_layers >= margs.n_layers:
        raise SystemExit(f"{args.flavor} has no MoE block")
    torch.manual_seed(0)
    block = TransformerBlock(layer_id, margs)
    block.init_weights()
    state = block.state_dict()
    freqs = precompute_freqs_cis(margs.qk_rope_head_dim, args.seq_len, margs.rope_theta, device="cpu")
    x = torch.randn(args.batch, args.seq_len, margs.dim, generator=torch.Generator().manual_seed(1))
    modes = [("none", ()), ("full", ()), ("op", ())] + [("modules", (s,)) for s in args.sets]
    rows = []
    for mode, parts in modes:
        torch.manual_seed(0)
        holder = _Holder(TransformerBlock(layer_id, margs))
        holder.layers["0"].load_state_dict(state)
        apply_activation_checkpointing(holder, mode, recompute_modules=parts[0].split("+") if parts else ())
        wrapped = holder.layers["0"]

        def step(wrapped=wrapped):
            inp = x.clone().requires_grad_()
            out, aux = wrapped(inp, freqs, None)
            (out.float().square().mean() + aux).backward()

        step()  # warm-up (first-call allocations)
        tracker = MemTracker()
        tracker.track_external(wrapped)
        with tracker:
            before = _bytes(tracker, "current")
            inp = x.clone().requires_grad_()
            out, aux = wrapped(inp, freqs, None)
            held = _bytes(tracker, "current") - before
            (out.float().square().mean() + aux).backward()
            peak = _bytes(tracker, "peak") - before
        tokens = args.batch * args.seq_len
        # op: the estimator's modules with the cheap parts (trainer/planning/activation_memory.py `recomputed_parts`).
        chosen = recompute_module_set(parts[0].split("+")) if mode == "modules" else CHEAP_PARTS if mode == "op" else ()
        estimate = block_activation_bytes(margs, not args.dense, "modules" if chosen else mode, chosen) * tokens
        rows.append(
            {
                "mode": mode if not parts else f"modules {parts[0]}",
                "held_mib": held / MiB,
                "peak_mib": peak / MiB,
                "estimate_mib": estimate / MiB,
                "step": step,
                "times": [],
            }
        )
    for _ in range(args.repeats):
        for row in rows:
            start = time.perf_counter()
            row["step"]()
            row["times"].append(time.perf_counter() - start)
    for row in rows:
        row["step_s"] = statistics.median(row.pop("times"))
        del row["step"]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="proxy_1b")
    p.add_argument("--dense", action="store_true", help="a dense block (the flavor's first) instead of an MoE one")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sets", default=",".join(DEFAULT_SETS), help="recompute_modules entries, one modules run each")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    args.sets = [s for s in args.sets.split(",") if s]
    torch.set_num_threads(torch.get_num_threads())
    rows = run(args)
    base = next(r for r in rows if r["mode"] == "none")
    print(
        f"{args.flavor} {'dense' if args.dense else 'MoE'} block, fp32, batch {args.batch} x seq {args.seq_len}, "
        f"{args.repeats} repeats, {torch.get_num_threads()} threads"
    )
    print("| mode | held for backward MiB | estimate MiB | peak MiB | step s | step / none |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['held_mib']:.1f} | {r['estimate_mib']:.1f} | {r['peak_mib']:.1f} | "
            f"{r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
