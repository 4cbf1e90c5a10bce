"""One-process runs in the pytest process, as an NGPU=1 run_train.sh runs them.

NGPU=1 run_train.sh runs its pre-launch check (trainer/config/check.py), then execs `python -m
trainer.train --job.config_file <CONFIG_FILE> ARGS`, whose `__main__` guard only calls
`trainer.train.main`. Calling it here proves the same run, minus the pre-launch check (tested
through run_train.sh elsewhere: tests/e2e/test_bad_inputs.py, test_reruns.py), without a new
process's ~4 s import of torch, which is most of a short test run's cost on 2 cores.
"""

import logging
import os
from pathlib import Path

import torch

from trainer.train import main

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "train_configs" / "debug_model.toml"  # run_train.sh's CONFIG_FILE default


def run_main(cwd: Path, *args: str) -> int:
    """`trainer.train.main` from `cwd` (relative paths are the user's), with the default config
    first as run_train.sh passes it (a later --job.config_file wins) and the one intra-op thread
    of the launches (OMP_NUM_THREADS=1): the same reduction order as a launched run. What a run
    sets for its process and a launch would drop with it (the thread count, the working directory,
    deterministic algorithms, the trainer logger's handlers) is put back afterwards."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    before = os.getcwd()
    torch.set_num_threads(1)
    try:
        os.chdir(cwd)
        return main(["--job.config_file", str(DEFAULT_CONFIG), *args])
    finally:
        os.chdir(before)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        trainer_log = logging.getLogger("trainer")
        for handler in list(trainer_log.handlers):
            trainer_log.removeHandler(handler)
            handler.close()
