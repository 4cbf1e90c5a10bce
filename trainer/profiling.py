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
* Step counters (``profile_step``, used by benchmarks/step_bench.py --profile): one call under
  torch.profiler and ``HostReadCounter`` gives the top ops by time, the kernel launches and the
  host reads of device values, and writes its Chrome trace.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from trainer.parallel.distributed import global_rank

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


# CUDA runtime / driver calls that start device work, and those that block the host on the device.
_LAUNCH_EVENTS = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
    "cudaLaunchCooperativeKernel", "cudaGraphLaunch",
})
_SYNC_EVENTS = frozenset({
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize", "cudaMemcpy",
})
# Tensor methods whose result is a Python value, so the host waits for (and copies) device data.
_HOST_READS = frozenset({"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "nonzero", "numpy"})


class HostReadCounter(TorchFunctionMode):
    """Counts Python-level reads of device values while active: ``.item()``, ``.tolist()``,
    ``int()/float()/bool()`` of a tensor, ``nonzero`` and boolean-mask indexing (its output size
    depends on the data). Only tensors on ``device_type`` count, so on CUDA a CPU tensor's
    ``.item()`` is not a device read. Compiled regions hide their reads from it: the profiler's
    ``aten::_local_scalar_dense`` count covers those."""

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type
        self.reads: list[str] = []  # in call order

    @property
    def counts(self) -> Counter[str]:
        return Counter(self.reads)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        on_device = isinstance(first, torch.Tensor) and first.device.type == self.device_type
        if on_device and name in _HOST_READS:
            self.reads.append(name)
        elif on_device and name in ("__getitem__", "__setitem__") and _has_bool_tensor(args[1]):
            self.reads.append("bool_index")
        return func(*args, **(kwargs or {}))


def _has_bool_tensor(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def profile_step(
    fn: Callable[[], object], device: torch.device, trace_path: Path | None = None, top: int = 10,
    count_python_reads: bool = True,
) -> dict:
    """Runs ``fn`` once under torch.profiler and ``HostReadCounter``; returns its counters.

    ``kernel_launches``: on CUDA the runtime's launch calls; a CPU has no kernels, so there it
    is the number of leaf aten ops (aten ops calling no other aten op), the closest proxy.
    ``host_syncs``: on CUDA the runtime calls that block the host on the device
    (cudaStreamSynchronize, cudaMemcpy, ...); None on CPU, where reading a value never waits.
    ``host_reads``: Python-level reads of device values (``HostReadCounter``), and
    ``scalar_reads_aten`` the aten ``_local_scalar_dense`` calls (``.item()`` and friends,
    compiled regions included). ``top_ops``: by self device time on CUDA, self CPU time on CPU.
    ``count_python_reads=False`` leaves ``host_reads`` None: torch.compile cannot trace through a
    TorchFunctionMode (dynamo fails inside e.g. ``Tensor.unflatten``), so compiled runs skip it.
    """
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    counter = HostReadCounter(device.type)
    with torch.profiler.profile(activities=activities) as prof:
        with counter if count_python_reads else contextlib.nullcontext():
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    events = prof.events()
    names = Counter(e.name for e in events)
    if cuda:
        launches = sum(names[n] for n in _LAUNCH_EVENTS)
        syncs = sum(names[n] for n in _SYNC_EVENTS)
    else:
        launches = sum(
            1 for e in events
            if e.name.startswith("aten::") and not any(c.name.startswith("aten::") for c in e.cpu_children)
        )
        syncs = None
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    # On CUDA the device's own events (kernels, copies, memsets), not the aten ops that launched them.
    averages = [
        a for a in prof.key_averages()
        if getattr(a, key) > 0 and (not cuda or a.device_type == torch.autograd.DeviceType.CUDA)
    ]
    averages.sort(key=lambda a: getattr(a, key), reverse=True)
    record = {
        "kernel_launches": launches,
        "kernel_launch_counter": "CUDA launch runtime calls" if cuda else "leaf aten ops (CPU proxy: no kernels)",
        "host_syncs": syncs,
        "host_reads": sum(counter.counts.values()) if count_python_reads else None,
        "host_reads_by_kind": dict(counter.counts) if count_python_reads else None,
        "scalar_reads_aten": names["aten::_local_scalar_dense"],
        "top_ops_by": "self device time" if cuda else "self CPU time",
        "top_ops": [
            {"name": a.key, "ms": getattr(a, key) / 1000.0, "calls": a.count} for a in averages[:top]
        ],
    }
    if trace_path is not None:
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
        record["trace"] = str(trace_path)
    return record
