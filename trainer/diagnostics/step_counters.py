"""Counters of one call: torch.profiler's top ops, kernel launches and host syncs, and the
Python-level reads of device values (``HostReadCounter``). benchmarks/step_bench.py --profile
reports them per step; the step-sync tests assert the reads.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

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
