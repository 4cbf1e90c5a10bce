"""``CollectiveRecorder``: every collective a step issues, as the dry run reports them
(trainer/dry_run.py) and as the MoE-overlap tests compare the ranks' sequences
(tests/distributed/moe_overlap_worker.py). It works the same on the fake backend and on gloo, so a
dry run's list compares with a real run's (tests/distributed/test_dry_run.py)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# The c10d operators a collective reaches the dispatcher as (torch.distributed's calls and
# ProcessGroup methods: "c10d"; DTensor and funcol: "_c10d_functional", with autograd).
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
_NOT_COLLECTIVES = {"wait_tensor", "wait", "monitored_barrier_", "_wrap_tensor_autograd"}
# The argument of FSDP2's collectives that is its communication buffer.
_FSDP_BUFFERS = {"_allgather_base_": 0, "_reduce_scatter_base_": 1}


class Collective(NamedTuple):
    """One collective call: operator, group size, the bytes of its largest tensor (the whole
    buffer: an all-gather's output, a reduce-scatter's input, an all-reduce's or a point-to-point's
    tensor, an all-to-all's input) and the shapes of its tensors, in argument order."""

    name: str
    group_size: int
    nbytes: int
    shapes: tuple[tuple[int, ...], ...]


class CollectiveRecorder(TorchDispatchMode):
    """Records every collective a step issues (``calls``, in issue order). With ``tracker`` (the
    step's memory tracker), FSDP's flat all-gather outputs and reduce-scatter inputs are counted
    as communication buffers."""

    def __init__(self, tracker: MemTracker | None = None):
        super().__init__()
        self.calls: list[Collective] = []
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor turns it into local ops and collectives, seen again here
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace in _COLLECTIVE_NAMESPACES and name not in _NOT_COLLECTIVES:
            flat = [*args, *kwargs.values()]
            tensors = [
                t for a in flat for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)
            ]
            size = next((s for s in map(_group_size, flat) if s is not None), 1)
            nbytes = max((t.numel() * t.element_size() for t in tensors), default=0)
            self.calls.append(Collective(name.rstrip("_"), size, nbytes, tuple(tuple(t.shape) for t in tensors)))
        out = func(*args, **kwargs)
        if self.tracker is not None and name in _FSDP_BUFFERS:
            # FSDP's flat all-gather output and reduce-scatter input: communication buffers.
            self.tracker._update_and_maybe_create_winfos(args[_FSDP_BUFFERS[name]], _MemRefType.OTH)
        return out

    def summary(self) -> list[dict]:
        """One row per (collective, group size): count and bytes (total and largest)."""
        rows: dict[tuple[str, int], dict] = {}
        for name, size, nbytes, _ in self.calls:
            row = rows.setdefault(
                (name, size), {"collective": name, "group_size": size, "count": 0, "bytes": 0, "largest_bytes": 0}
            )
            row["count"] += 1
            row["bytes"] += nbytes
            row["largest_bytes"] = max(row["largest_bytes"], nbytes)
        return sorted(rows.values(), key=lambda r: -r["bytes"])


def _group_size(arg) -> int | None:
    """The size of the process group ``arg`` names (a ProcessGroup, or funcol's group name)."""
    if isinstance(arg, dist.ProcessGroup):
        return arg.size()
    if isinstance(arg, torch.ScriptObject):
        try:
            return dist.ProcessGroup.unbox(arg).size()
        except (RuntimeError, AttributeError):
            return None
    if isinstance(arg, str) and arg:
        try:
            return dist.distributed_c10d._resolve_process_group(arg).size()
        except (RuntimeError, ValueError, KeyError):
            return None
    return None
