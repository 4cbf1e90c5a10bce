"""The per-step cost of fault-tolerant replica groups (``[fault_tolerance]``, torchft) beside the same
layout without them, on CPU with gloo.

    python benchmarks/replica_groups_bench.py [--steps 12] [--warmup 2]

Runs through run_train.sh, as a user does: the HSDP layout dp_replicate 2 x dp_shard 2 x EP 2 in
one 4-process launch, then the same layout as two replica groups of 2 processes (one launch each,
torchft's lighthouse binary started here). Prints, over the steps after ``warmup``, the median step
time of each and the median seconds a group spends per step in the quorum and the commit vote
(the ``quorum_s`` metric), i.e. torchft's own per-step cost; the rest of the difference is the
cross-group sums going through torchft's process group instead of FSDP's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.diagnostics import free_port, start_lighthouse  # noqa: E402

COMMON = [
    "--training.seq_len",
    "32",
    "--training.global_batch_size",
    "8",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.log_freq",
    "1",
    "--no-validation.enable",
    "--job.print_config=false",
    "--parallelism.dp_replicate",
    "2",
    "--parallelism.ep",
    "2",
    "--training.local_batch_size",
    "2",
]


def launch(folder: Path, nproc: int, args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "NGPU": str(nproc), "OMP_NUM_THREADS": "1", "MASTER_PORT": ""}
    return subprocess.Popen(
        ["bash", str(REPO / "run_train.sh"), "--job.dump_folder", str(folder), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def records(folder: Path, warmup: int) -> list[dict]:
    (metrics,) = folder.rglob("metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in rows if "step_time_s" in r and r["step"] > warmup]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    a = parser.parse_args()
    args = [*COMMON, "--training.steps", str(a.steps)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        assert launch(root / "hsdp", 4, args).wait() == 0, "the HSDP run failed"
        hsdp = records(root / "hsdp", a.warmup)
        port = free_port()
        server = start_lighthouse(port, "--join_timeout_ms", "10000")
        try:
            ft = [*args, "--fault_tolerance.enable", "--fault_tolerance.lighthouse", f"http://127.0.0.1:{port}"]
            groups = [launch(root / "ft", 2, [*ft, "--fault_tolerance.replica_id", str(g)]) for g in (0, 1)]
            assert all(p.wait() == 0 for p in groups), "a replica group failed"
        finally:
            server.kill()
        ft_rows = records(root / "ft" / "replica_group_0", a.warmup)
    hsdp_step = statistics.median(r["step_time_s"] for r in hsdp)
    ft_step = statistics.median(r["step_time_s"] for r in ft_rows)
    quorum = statistics.median(r["quorum_s"] for r in ft_rows)
    print(
        f"median over steps {a.warmup + 1}-{a.steps}, debugmodel seq 32, global batch 8, dp_replicate 2 x dp_shard 2 x ep 2"
    )
    print("| layout | step | quorum + commit per step |")
    print("|---|---|---|")
    print(f"| HSDP, one launch of 4 | {hsdp_step:.3f} s | - |")
    print(f"| 2 replica groups of 2 (torchft) | {ft_step:.3f} s | {quorum * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
