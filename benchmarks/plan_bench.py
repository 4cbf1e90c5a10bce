"""The layout planner's time (issue 48): wall time and the CPU time of the planner's process.

    python benchmarks/plan_bench.py                      # 671B on 2048 GPUs, docs/planning.md's command
    python benchmarks/plan_bench.py --repo /path/to/old  # the same command in another checkout (before / after)
    python benchmarks/plan_bench.py -- --flavor 16B --gpus 16 --gpu-memory 40 --global-batch 32

Runs scripts/plan_layout.py as a child process and reports its wall time and its user + system CPU
time (``resource.getrusage(RUSAGE_CHILDREN)``). The planner is one process, so on an idle machine
its wall time is its CPU time; on a machine shared with other work the wall time grows with the load
(printed: the 1-minute load average before and after) while the CPU time stays close to the idle
figure. stdout's first line (layouts considered and fitting) is printed to check runs against each
other; the progress lines (stderr) are discarded.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

DEFAULT = [
    "--flavor",
    "671B",
    "--gpus",
    "2048",
    "--gpu-memory",
    "80",
    "--gpus-per-node",
    "8",
    "--seq-len",
    "4096",
    "--global-batch",
    "4096",
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]), help="checkout whose planner to time")
    p.add_argument("planner_args", nargs="*", help="scripts/plan_layout.py's arguments (after --)")
    a = p.parse_args()
    argv = a.planner_args or DEFAULT
    env = {**os.environ, "PYTHONPATH": a.repo}
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(Path(a.repo) / "scripts" / "plan_layout.py"), *argv],
        env=env,
        cwd=a.repo,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    wall = time.monotonic() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        print(f"error: the planner exited with {done.returncode}", file=sys.stderr)
        return done.returncode
    print(done.stdout.splitlines()[0])
    print(
        f"wall {wall:.1f} s, CPU user {usage.ru_utime:.1f} s + system {usage.ru_stime:.1f} s, "
        f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
