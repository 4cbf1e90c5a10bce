"""The memory estimator (trainer/planning/memory.py) against the dry run's tracked peak (trainer/dry_run.py),
per rank, for the debug model, proxy_1b and 671B in four layouts each; and, for small worlds, the
dry run against a real gloo run of the same layout tracked by the same code (its second step on
real tensors).

Each dry run is its own process (``python -m trainer.train --job.dry_run ...``), timed, with the
peak RSS of the process tree (``resource.RUSAGE_CHILDREN``). Prints a markdown table; ``--json``
also writes the rows.

    python benchmarks/dry_run_vs_estimate.py --cases debug proxy_1b      # minutes
    python benchmarks/dry_run_vs_estimate.py --cases 671B                 # the 2048-GPU layouts
    python benchmarks/dry_run_vs_estimate.py --real                       # debug: dry run vs real gloo run
    python benchmarks/dry_run_vs_estimate.py --cases 671B --layouts 1 --ac none full selective op --rank 0
    python benchmarks/dry_run_vs_estimate.py --ac modules --recompute-modules deepseek   # DeepSeek's set

``--ac`` runs every layout once per activation-checkpointing mode, on a GPU large enough that the
estimator's fit check rehearses it whatever its estimate (the dry run's verdict is not the
point here). A dry run that ends "does not fit" (exit 3) still reports.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXIT_DOES_NOT_FIT = 3  # trainer/dry_run.py's (imported there with torch; this script stays torch-free)
# --ac: a GPU no estimate exceeds, so every mode is rehearsed.
ANY_GPU = ["--dry_run.gpu_memory_gib", "100000"]
DEBUG = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "256"]
PROXY = ["--job.config_file", "train_configs/debug_model.toml", "--model.flavor", "proxy_1b",
         "--training.seq_len", "4096", "--training.mixed_precision_param", "bfloat16"]
BIG = ["--job.config_file", "train_configs/deepseek_v3_671b.toml", "--no-training.compile",
       "--training.global_batch_size", "-1"]
PP16 = ["--parallelism.pp", "16", "--parallelism.pp_microbatches", "32", "--parallelism.dp_shard", "128",
        "--parallelism.ep", "64", "--training.local_batch_size", "32"]

# case -> [(layout name, world size, flags)]
CASES = {
    "debug": [
        ("FSDP 8", 8, [*DEBUG, "--parallelism.dp_shard", "8", "--training.local_batch_size", "4"]),
        ("FSDP 4 x TP 2, EP 2", 8, [*DEBUG, "--parallelism.dp_shard", "4", "--parallelism.tp", "2",
                                     "--parallelism.ep", "2", "--training.local_batch_size", "4"]),
        ("pp 2 1F1B x FSDP 4, EP 2", 8, [*DEBUG, "--parallelism.pp", "2", "--parallelism.dp_shard", "4",
                                          "--parallelism.ep", "2", "--training.local_batch_size", "4"]),
        ("pp 2 DualPipeV x FSDP 4, EP 2", 8, [*DEBUG, "--parallelism.pp", "2", "--parallelism.pp_schedule",
                                               "DualPipeV", "--parallelism.dp_shard", "4", "--parallelism.ep", "2",
                                               "--training.local_batch_size", "4"]),
    ],
    "proxy_1b": [
        ("FSDP 64, EP 8", 64, [*PROXY, "--parallelism.dp_shard", "64", "--parallelism.ep", "8",
                               "--training.local_batch_size", "1", "--activation_checkpoint.mode", "full"]),
        ("HSDP 2 x 32, EP 8", 64, [*PROXY, "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "32",
                                   "--parallelism.ep", "8", "--training.local_batch_size", "1"]),
        ("pp 4 1F1B x FSDP 16, EP 8", 64, [*PROXY, "--parallelism.pp", "4", "--parallelism.dp_shard", "16",
                                            "--parallelism.ep", "8", "--training.local_batch_size", "4"]),
        ("pp 4 Interleaved1F1B x FSDP 16, EP 8", 64, [*PROXY, "--parallelism.pp", "4", "--parallelism.pp_schedule",
                                                       "Interleaved1F1B", "--parallelism.dp_shard", "16",
                                                       "--parallelism.ep", "8", "--training.local_batch_size", "4"]),
    ],
    "671B": [
        ("pp 16 1F1B x FSDP 128, EP 64", 2048, [*BIG, *PP16, "--parallelism.pp_schedule", "1F1B"]),
        ("pp 16 DualPipeV x FSDP 128, EP 64", 2048, [*BIG, *PP16, "--parallelism.pp_schedule", "DualPipeV"]),
        ("pp 16 Interleaved1F1B (2 per rank) x FSDP 128, EP 64", 2048,
         [*BIG, *PP16, "--parallelism.pp_schedule", "Interleaved1F1B", "--parallelism.pp_stages_per_rank", "2"]),
        ("FSDP 256, EP 64 (no pp)", 256, [*BIG, "--parallelism.dp_shard", "256", "--parallelism.ep", "64",
                                          "--training.local_batch_size", "1"]),
    ],
}


def dry_run(name: str, world: int, flags: list[str], out: Path) -> list[dict]:
    """One dry run as a user starts it; its per-rank reports with the run's wall time and RSS."""
    cmd = [sys.executable, "-m", "trainer.train", *flags, "--job.dry_run", "--dry_run.world_size", str(world),
           "--dry_run.output_json", str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - start
    if proc.returncode not in (0, EXIT_DOES_NOT_FIT):
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    reports = json.loads(out.read_text())
    for r in reports:
        r.update(name=name, command=" ".join(["python -m trainer.train", *flags, "--job.dry_run",
                                              "--dry_run.world_size", str(world)]), wall_s=wall, tree_rss_gib=rss)
    return reports


def real_run(rank: int, world: int, port: int, workdir: str, flags: list[str], queue) -> None:
    """One gloo rank of a real run: its second step tracked as the dry run tracks its one."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    import torch

    from trainer.config import load_config
    from trainer.diagnostics import track_step
    from trainer.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(load_config([*flags, "--job.dump_folder", workdir, "--no-validation.enable",
                                   "--training.device", "cpu", "--no-job.print_config"]))
    try:
        trainer.train_step(trainer.next_microbatches()[0])
        memory, _ = track_step(trainer, trainer.next_microbatches()[0])
        queue.put({"rank": rank, "total": memory["total"]})
    finally:
        trainer.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", choices=tuple(CASES), default=["debug", "proxy_1b"])
    p.add_argument("--real", action="store_true", help="debug at world 2 and 4: the dry run against a real gloo run")
    p.add_argument("--layouts", type=int, nargs="+", help="only these layouts of each case (1-based, as listed)")
    p.add_argument("--ac", nargs="+", default=[], help="activation_checkpoint.mode values, one run of each layout per mode")
    p.add_argument("--rank", type=int, help="rehearse this rank only (dry_run.rank) instead of the ranks that can peak")
    p.add_argument("--json", default="")
    p.add_argument("--recompute-modules", default="deepseek", help="activation_checkpoint.recompute_modules under --ac modules")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if a.real:
            from trainer.diagnostics import spawn_local

            small = [("FSDP 2, EP 2", 2, [*DEBUG, "--parallelism.dp_shard", "2", "--parallelism.ep", "2",
                                           "--training.local_batch_size", "4"]),
                     ("pp 2 1F1B x FSDP 2", 4, [*DEBUG, "--parallelism.pp", "2", "--parallelism.dp_shard", "2",
                                               "--training.local_batch_size", "4"])]
            print("| layout | world | rank | dry run peak GiB | real run peak GiB | dry / real |")
            print("|---|---|---|---|---|---|")
            for name, world, flags in small:
                real = {r["rank"]: r["total"] for r in spawn_local(real_run, world, tmp, flags, timeout=900)}
                for r in dry_run(name, world, flags, Path(tmp) / "dry.json"):
                    got = r["memory_gib"]["total"]
                    print(f"| {name} | {world} | {r['rank']} | {got:.4f} | {real[r['rank']]:.4f} | "
                          f"{got / real[r['rank']]:.3f} |")
            return 0
        rank = ["--dry_run.rank", str(a.rank)] if a.rank is not None else []
        for case in a.cases:
            for i, (name, world, flags) in enumerate(CASES[case], 1):
                if a.layouts and i not in a.layouts:
                    continue
                for mode in a.ac or [""]:
                    ac = ["--activation_checkpoint.mode", mode, *ANY_GPU] if mode else []
                    if mode == "modules":
                        ac += ["--activation_checkpoint.recompute_modules", a.recompute_modules]
                    label = f"{case}: {name}" + (f", AC {mode}" if mode else "")
                    rows += dry_run(label, world, [*flags, *ac, *rank], Path(tmp) / f"{case}{i}{mode}.json")
    print("| layout | rank (stages) | dry run peak GiB | estimator GiB | estimator / dry run | wall s | RSS GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        got, est = r["memory_gib"]["total"], r["estimate_gib"]["tensors"]
        print(f"| {r['name']} | {r['rank']} {r['stages'] or ''} | {got:.2f} | {est:.2f} | {est / got:.3f} | "
              f"{r['wall_s']:.0f} | {r['tree_rss_gib']:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
