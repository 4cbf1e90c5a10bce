"""``[profiling]``: torch.profiler traces, CUDA memory snapshots and the per-step time breakdown.

* Traces: steps ``profile_start_step .. + profile_steps - 1`` are recorded by torch.profiler on
  the ranks in ``ranks`` and written as Chrome traces (open in https://ui.perfetto.dev or
  chrome://tracing) to ``<run folder>/<traces_folder>/rank<R>_steps<A>-<B>.json``.
* Memory snapshots (CUDA only): the caching allocator records allocation history
  (``torch.cuda.memory._record_memory_history``) from the first step; a snapshot is dumped after
  ``memory_snapshot_step`` and/or when a step raises OutOfMemoryError, as
  ``<traces_folder>/rank<R>_memory_step<N>.pickle`` / ``..._oom_step<N>.pickle`` (drag it onto
  https://pytorch.org/memory_viz).
* Step breakdown: ``StepBreakdown`` splits each step into data wait, forward+backward,
  reductions+clipping and optimizer; the trainer logs the per-step mean in milliseconds.
  Each boundary synchronises CUDA (otherwise the host times only the kernel launches), so it
  is off by default. FSDP / EP communication overlaps forward+backward and is not separable
  by host timers: read it from a trace.

The per-call counters of the benchmarks and tests (``profile_step``, ``HostReadCounter``) live in
trainer/diagnostics/.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from trainer.distributed import global_rank

logger = logging.getLogger("trainer")

# Allocation events kept by the CUDA allocator history (each costs ~1 KB of host memory).
_MEMORY_HISTORY_ENTRIES = 100_000

PHASES = ("data_wait", "forward_backward", "reduce_clip", "optimizer")


class Profiler:
    """Drives torch.profiler and the CUDA memory snapshots around the training steps.

    The trainer calls ``step_begin(step)`` before fetching the step's data, ``step_end(step)``
    after it finished (device synchronised), ``on_oom(step)`` when a step ran out of memory and
    ``close()`` at the end.
    """

    def __init__(self, pcfg, run_dir: Path, device: torch.device):
        self.cfg = pcfg
        self.device = device
        self.rank = global_rank()
        self.active = self.rank in pcfg.ranks
        self.folder = run_dir / pcfg.traces_folder
        self._prof = None
        self._first = pcfg.profile_start_step
        self._last = pcfg.profile_start_step + pcfg.profile_steps - 1
        wants_snapshot = pcfg.memory_snapshot_step > 0 or pcfg.memory_snapshot_on_oom
        self._memory_history = False
        if self.active and wants_snapshot:
            if device.type == "cuda":
                torch.cuda.memory._record_memory_history(max_entries=_MEMORY_HISTORY_ENTRIES)
                self._memory_history = True
            else:
                logger.warning(
                    "profiling: memory snapshots (memory_snapshot_step / memory_snapshot_on_oom) record the "
                    "CUDA caching allocator and are skipped on %s; use profile_memory = true for a trace "
                    "with CPU allocations",
                    device.type,
                )
        if self.active and (pcfg.enable_profiling or self._memory_history):
            self.folder.mkdir(parents=True, exist_ok=True)

    def step_begin(self, step: int) -> None:
        if not (self.active and self.cfg.enable_profiling and step == self._first):
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(
            activities=activities,
            record_shapes=True,
            profile_memory=self.cfg.profile_memory,
            with_stack=False,
        )
        self._prof.__enter__()

    def step_end(self, step: int) -> None:
        if not self.active:
            return
        if self._prof is not None and step == self._last:
            self._finish_trace()
        if self._memory_history and step == self.cfg.memory_snapshot_step:
            self._dump_snapshot(f"rank{self.rank}_memory_step{step}.pickle")

    def on_oom(self, step: int) -> None:
        """Called with the OutOfMemoryError still in flight (the caller re-raises it)."""
        if self.active and self._memory_history and self.cfg.memory_snapshot_on_oom:
            self._dump_snapshot(f"rank{self.rank}_oom_step{step}.pickle")

    def close(self) -> None:
        if self._prof is not None:  # the run stopped inside the profiled window
            self._finish_trace()
        if self._memory_history:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._memory_history = False

    def _finish_trace(self) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        path = self.folder / f"rank{self.rank}_steps{self._first}-{self._last}.json"
        prof.export_chrome_trace(str(path))
        logger.info("profiling: trace of steps %d-%d written to %s", self._first, self._last, path)

    def _dump_snapshot(self, name: str) -> None:
        path = self.folder / name
        torch.cuda.memory._dump_snapshot(str(path))
        logger.info("profiling: CUDA memory snapshot written to %s (view at https://pytorch.org/memory_viz)", path)


class StepBreakdown:
    """Wall time per phase of a step, accumulated over a logging window.

    ``begin()`` starts the clock, ``mark(phase)`` charges the time since the previous boundary
    to ``phase``. When disabled every call is a no-op, so the step pays nothing (no CUDA sync).
    """

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled = enabled
        self.device = device
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._steps = 0
        self._last = 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def begin(self, data_wait: float) -> None:
        if not self.enabled:
            return
        self._totals["data_wait"] += data_wait
        self._steps += 1
        self._last = self._now()

    def mark(self, phase: str) -> None:
        if not self.enabled:
            return
        now = self._now()
        self._totals[phase] += now - self._last
        self._last = now

    def window_record(self) -> dict[str, float]:
        """``time/<phase>_ms``: mean per step since the last call (empty when disabled); resets."""
        if not self.enabled or self._steps == 0:
            return {}
        record = {f"time/{k}_ms": 1000.0 * v / self._steps for k, v in self._totals.items()}
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._steps = 0
        return record
