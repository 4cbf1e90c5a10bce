"""Engram cost: training step time with vs without Engram on the same backbone, and table bytes
per rank under embedding parallelism (degree 1/2/4, as ratios of the unsharded table).

    python benchmarks/engram_bench.py                       # debugmodel, CPU or the visible GPU
    python benchmarks/engram_bench.py --flavor proxy_1b --seq-len 2048 --batch 4 --steps 20

The byte ratios are computed from the shard layout (`shard_rows`), so the Engram-27B sizes
(K=8, D_h=80, 2,262,400 rows per head) can be reported without allocating them.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from models.deepseek_v3 import DeepSeekV3Model, get_flavor
from models.engram import EngramArgs, NgramHasher, TokenCompression, engram_table_params, find_primes
from trainer.parallel.engram_parallel import shard_rows


def step_time(args, engram: EngramArgs | None, batch: int, seq_len: int, steps: int, device) -> float:
    margs = dataclasses.replace(args, engram=engram, max_seq_len=seq_len)
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepSeekV3Model(margs)
        model.init_weights()
    tables = {id(p) for p in engram_table_params(model)}
    groups = [{"params": [p for p in model.parameters() if id(p) not in tables]}]
    if tables:
        groups.append({"params": engram_table_params(model), "lr": 5e-4, "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups, lr=1e-4)
    hasher = None
    if engram is not None:
        comp = TokenCompression(torch.arange(margs.vocab_size), margs.vocab_size, 0)
        hasher = NgramHasher(engram, comp).to(device)
    tokens = torch.randint(0, margs.vocab_size, (batch, seq_len), device=device)
    labels = tokens.roll(-1, 1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else None
    times = []
    for i in range(steps + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        ids = hasher(tokens) if hasher is not None else None
        with autocast if autocast is not None else torch.autocast("cpu", enabled=False):
            out = model(tokens, labels=labels, engram_ids=ids)
            loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:  # warm-up steps excluded
            times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


def bytes_per_rank(engram: EngramArgs, degree: int, bytes_per_elem: int = 4) -> int:
    """Largest per-rank table bytes (rank 0 holds the full rows_per_rank of every table)."""
    total = 0
    for layer_primes in find_primes(engram).values():
        _, _, rows = shard_rows(sum(layer_primes), degree, 0)
        total += rows * engram.head_dim * bytes_per_elem
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layer-ids", default="1,3")
    p.add_argument("--heads-per-order", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--base-size", type=int, default=4099)
    opts = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = dataclasses.replace(get_flavor(opts.flavor), mtp_depth=0)
    engram = EngramArgs(
        layer_ids=tuple(int(i) for i in opts.layer_ids.split(",")), heads_per_order=opts.heads_per_order,
        head_dim=opts.head_dim, base_size=opts.base_size,
    )
    base = step_time(args, None, opts.batch, opts.seq_len, opts.steps, device)
    with_engram = step_time(args, engram, opts.batch, opts.seq_len, opts.steps, device)
    print(f"device {device} | flavor {opts.flavor} | batch {opts.batch} x seq {opts.seq_len} | median of {opts.steps} steps")
    print(f"step time without Engram {base:.1f} ms | with Engram at layers {list(engram.layer_ids)} "
          f"(K={engram.heads_per_order}, D_h={engram.head_dim}) {with_engram:.1f} ms | ratio {with_engram / base:.3f}")
    for name, e in (("this config", engram),
                    ("Engram-27B shape (K=8, D_h=80, base 2,262,400, 2 layers)",
                     EngramArgs(layer_ids=(1, 14), heads_per_order=8, head_dim=80, base_size=2_262_400))):
        full = bytes_per_rank(e, 1)
        ratios = " ".join(f"degree {d}: {bytes_per_rank(e, d) / full:.4f}" for d in (1, 2, 4))
        print(f"table bytes per rank, {name}: {full / 2**20:,.1f} MiB unsharded (fp32) | {ratios}")


if __name__ == "__main__":
    main()
