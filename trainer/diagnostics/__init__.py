"""Measuring tools and the local test launcher: used by tests/, benchmarks/ and the dry run, never by
a training run.

* step_counters.py   ``profile_step`` (top ops, kernel launches, host syncs of one call) and
                     ``HostReadCounter`` (Python-level reads of device values)
* weight_casts.py    ``weight_cast_bytes``: the bytes of low-precision weight copies of one step
* model_overrides.py ``--model-override key=value`` of the benchmarks (a flavor's fields)
* memory_tracker.py  ``track_step``: a step's peak tensor memory by category (``StepMemTracker``,
                     torch's ``MemTracker``) and its collectives
* collectives.py     ``CollectiveRecorder``: every collective of a step (name, group size, bytes)
* launch.py          ``spawn_local`` / ``init_local_gloo`` / ``free_port``: N local gloo ranks;
                     ``set_torchrun_env``: a spawned rank's torchrun environment (for a Trainer);
                     ``spawn_local_jobs``: several targets, one after another, in one spawn;
                     ``start_lighthouse``: torchft's lighthouse for replica-group runs
"""

from trainer.diagnostics.collectives import Collective, CollectiveRecorder
from trainer.diagnostics.launch import (
    free_port,
    init_local_gloo,
    set_torchrun_env,
    spawn_local,
    spawn_local_jobs,
    start_lighthouse,
)
from trainer.diagnostics.memory_tracker import StepMemTracker, own_shape_propagation, track_step
from trainer.diagnostics.model_overrides import ModelOverrideError, apply_overrides
from trainer.diagnostics.step_counters import HostReadCounter, profile_step
from trainer.diagnostics.weight_casts import weight_cast_bytes

__all__ = [
    "Collective",
    "CollectiveRecorder",
    "HostReadCounter",
    "ModelOverrideError",
    "StepMemTracker",
    "apply_overrides",
    "free_port",
    "init_local_gloo",
    "own_shape_propagation",
    "profile_step",
    "set_torchrun_env",
    "spawn_local",
    "spawn_local_jobs",
    "start_lighthouse",
    "track_step",
    "weight_cast_bytes",
]
