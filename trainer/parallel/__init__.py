"""Parallelism applied to the single-device model, and the step's layout work.

The trainer uses only these entry points; the ``apply_*`` modules behind them are details. The
process-group helpers are the ground floor's, trainer/distributed.py.
"""

from trainer.parallel.parallel_dims import ParallelDims, ParallelDimsError
from trainer.parallel.parallelize import build_loss_function, materialize, parallelize_model
from trainer.parallel.step import MicroBatch, ParallelStep

__all__ = [
    "MicroBatch",
    "ParallelDims",
    "ParallelDimsError",
    "ParallelStep",
    "build_loss_function",
    "materialize",
    "parallelize_model",
]
