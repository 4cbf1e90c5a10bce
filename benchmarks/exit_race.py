"""How often a finished gloo job aborts while its processes exit, with and without `exit_process`.

    python benchmarks/exit_race.py [--runs 75] [--parallel 3] [--plain-exit]

Launches `--runs` 4-rank torchrun jobs (`--parallel` at a time, so that the ranks compete for
the cores as in CI) of a worker that sums tensors with functional collectives over a DeviceMesh
sub-group, as DTensor and FSDP2 do, then destroys the process group. The worker leaves through
`trainer.distributed.exit_process`, or with `--plain-exit` by the end of its script and
the interpreter's teardown. Prints the jobs that failed and why ("terminate called without an active
exception" is the abort `exit_process` exists for).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ABORT = "terminate called without an active exception"


# Module-level, as the reproducer was found: the mesh and its group stay referenced by globals
# until the interpreter's teardown clears the module (a trainer's reference cycles keep its
# meshes and groups into the teardown too). A worker whose mesh was freed before the teardown
# did not abort in 300 jobs (benchmarks/RESULTS.md).
WORKER = """
import sys
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
group = mesh["b"].get_group()
for _ in range(20):
    total = funcol.wait_tensor(funcol.all_reduce(torch.ones(100_000), "sum", group))
    assert float(total[0]) == 2.0
    del total
dist.destroy_process_group()
if sys.argv[1] == "exit_process":
    from trainer.distributed import exit_process

    exit_process(0)
"""


def launch(plain_exit: bool) -> str | None:
    """One torchrun job; None when it succeeded, else the reason it failed."""
    from trainer.diagnostics import free_port

    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}",
        "worker.py", "teardown" if plain_exit else "exit_process",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "worker.py").write_text(WORKER)
        log = Path(tmp, "log")
        with log.open("w") as f:
            proc = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, timeout=300, cwd=tmp,
                # The fault handler names the thread of an abort in the output.
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "PYTHONPATH": str(REPO)},
            )
        out = log.read_text()
    if proc.returncode == 0:
        return None
    if ABORT in out:
        return ABORT
    worker_codes = sorted(set(re.findall(r"exitcode\s*:\s*(-?\d+)", out)))
    first_error = next((line.strip()[:160] for line in out.splitlines() if "rror" in line), "")
    return f"torchrun exit code {proc.returncode}, worker exit codes {worker_codes}: {first_error}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=75)
    ap.add_argument("--parallel", type=int, default=3, help="jobs at a time")
    ap.add_argument("--plain-exit", action="store_true", help="leave through the interpreter's teardown, not exit_process")
    args = ap.parse_args()
    with ThreadPoolExecutor(args.parallel) as pool:
        failures = [f for f in pool.map(lambda _: launch(args.plain_exit), range(args.runs)) if f]
    exit_path = "interpreter teardown" if args.plain_exit else "exit_process"
    aborts = sum(f == ABORT for f in failures)
    print(f"{exit_path}: {len(failures)} of {args.runs} jobs failed, {aborts} of them with '{ABORT}'")
    for other in sorted({f for f in failures if f != ABORT}):
        print(f"  other failure: {other}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
