"""The peak tensor memory of one training step by category, as the dry run reports it
(trainer/dry_run.py): ``track_step`` runs a built Trainer's step under torch's ``MemTracker``
(``StepMemTracker``) and the collective recorder. The same code measures a dry run on fake tensors
and a real run on real ones (tests/distributed/test_dry_run.py)."""

from __future__ import annotations

import contextlib
import weakref

from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.tensor import _sharding_prop

from trainer.diagnostics.collectives import CollectiveRecorder
from trainer.planning.memory import GiB


class _ForwardOnlyModTracker(ModTracker):
    """torch's ``ModTracker`` without its gradient hooks. Its backward bookkeeping hangs a
    multi-gradient hook on every module's inputs and outputs; under a zero-bubble schedule the
    weight pass runs one ``autograd.grad`` per parameter group, each reaching only some of a
    module's inputs, and the hook buffers those partial gradients per graph task forever: the
    dry run of a zero-bubble schedule then grew with the micro-batches (671B DualPipeV: 945 GiB,
    debug ZBVZeroBubble + full AC: 0.08 GiB per micro-batch), a run without the tracker does not
    (benchmarks/RESULTS.md). The memory tracker needs only ``is_bw`` (torch's: a graph task is
    running) and the forward hooks; its per-module backward statistics are not reported."""

    def _fw_pre_hook(self, mod, input):
        self._get_append_fn(weakref.ref(mod), self._get_mod_name(mod), False)()
        if self._user_pre_fw_hook is not None:
            self._user_pre_fw_hook(mod, input)

    def _fw_post_hook(self, mod, input, output):
        if self._user_post_fw_hook is not None:
            self._user_post_fw_hook(mod, input, output)
        self._get_pop_fn(weakref.ref(mod), self._get_mod_name(mod), False)()


class StepMemTracker(MemTracker):
    """torch's ``MemTracker`` over a step that runs the model (or a pipeline stage) once per
    micro-batch: its module statistics, which this report does not use, refuse a second forward of
    a root module. Tensors are tracked as before: the module's parameters were at its first call."""

    def __init__(self):
        super().__init__()
        self._mod_tracker = _ForwardOnlyModTracker()

    def _pre_fw_hook(self, module, inputs) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            return
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state) -> None:
        """The device's peak only: torch's also walks every module's statistics at every operator,
        most of a dry run's time."""
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[dev] = snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)


def _no_fake_mode(*args) -> None:
    return None


@contextlib.contextmanager
def own_shape_propagation():
    """DTensor derives an operator's global output shape by running it on whole-size fake tensors,
    in the fake mode it finds active (``detect_fake_mode``, which its sharding propagation imports
    by name, torch 2.11 and 2.13 alike): a dry run's, where the tracker would count them (a
    256-expert weight of 671B is 14 GiB). Found none, it makes one of its own, which the tracker
    does not count: for the step's length it finds none. A seam of torch's own module attribute,
    set and put back here (torch 2.13's ``ShardingPropagator._fake_mode_lock`` hook is not in 2.11)."""
    previous = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = _no_fake_mode
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = previous


def track_step(trainer, batches, *contexts) -> tuple[dict[str, float], list[dict]]:
    """``trainer.train_step(batches)`` of a built Trainer under the memory tracker and the
    collective recorder, inside ``contexts`` (the dry run's fake mode; none for a real run): the
    peak GiB by category and the collectives."""
    tracker = StepMemTracker()
    recorder = CollectiveRecorder(tracker)
    tracker.track_external(trainer.model, trainer.optimizer)
    own = _snapshot(tracker, "current")  # this rank's parameter shards and buffers
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        stack.enter_context(tracker)
        stack.enter_context(recorder)
        trainer.train_step(batches)
    peak = _snapshot(tracker, "peak")
    held = own.get("Parameter", 0) + own.get("Buffer", 0)
    gib = {
        "params": held,
        "grads": peak.get("Gradient", 0),
        "optimizer_states": peak.get("Optstate", 0),
        "activations": peak.get("Activation", 0),
        "temporaries": peak.get("Temp", 0),
        # Parameters gathered from other ranks (FSDP's unsharded blocks) and FSDP's flat buffers.
        "comm_buffers": peak.get("Parameter", 0) + peak.get("Buffer", 0) - held + peak.get("Other", 0),
        "total": peak.get("Total", 0),
    }
    return {k: v / GiB for k, v in gib.items()}, recorder.summary()


def _snapshot(tracker: MemTracker, kind: str) -> dict[str, int]:
    """The tracker's snapshot of this process's one device, bytes by category name."""
    snap = next(iter(tracker.get_tracker_snapshot(kind).values()), {})
    return {getattr(k, "value", k): v for k, v in snap.items()}
