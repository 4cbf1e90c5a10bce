"""Parallelism applied to the single-device model, and the step's layout work.

The trainer uses only these entry points; the ``apply_*`` modules behind them are details.
"""

from trainer.distributed import (
    destroy_distributed,
    exit_process,
    from_rank0,
    init_distributed,
    is_collective_timeout,
    is_rank0,
    local_rank_from_env,
    set_collective_timeout,
)
from trainer.parallel.parallel_dims import ParallelDims, ParallelDimsError
from trainer.parallel.parallelize import build_loss_function, materialize, parallelize_model
from trainer.parallel.step import MicroBatch, ParallelStep

__all__ = [
    "MicroBatch",
    "ParallelDims",
    "ParallelDimsError",
    "ParallelStep",
    "build_loss_function",
    "destroy_distributed",
    "exit_process",
    "from_rank0",
    "init_distributed",
    "is_collective_timeout",
    "is_rank0",
    "local_rank_from_env",
    "materialize",
    "parallelize_model",
    "set_collective_timeout",
]
