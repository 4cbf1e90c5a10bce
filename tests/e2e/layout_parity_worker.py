"""Worker of tests/e2e/test_layout_parity.py: one rank of a multi-process run, made as a torchrun
worker of run_train.sh makes it, in ranks that `spawn_local_jobs` started once for many runs.

A torchrun worker is `python -m trainer.train ARGS` with RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set; its `__main__` guard calls `trainer.train.main`. Here each run
sets the same variables (a port of its own) and calls `main` through tests/e2e/in_process.py's
`run_main` (the default config first, one intra-op thread, the process's settings put back after
the run), so a rank that already imported torch runs one layout after another: the run's
Trainer joins a fresh process group and destroys it when it closes.
"""

from __future__ import annotations

from pathlib import Path

from trainer.diagnostics import set_torchrun_env


def run(rank: int, world: int, port: int, cwd: str, args: list[str], queue) -> None:
    set_torchrun_env(rank, world, port)
    from in_process import run_main

    queue.put(run_main(Path(cwd), *args))
