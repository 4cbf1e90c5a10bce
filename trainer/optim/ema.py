"""An exponential moving average (EMA) of the parameters, kept in CPU memory (``[ema]``).

DeepSeek-V3 (report, section 3.3.1, "Exponential Moving Average in CPU") keeps an EMA of the
weights in host memory, updated asynchronously after each training step, to judge the model
early without extra device memory. Here every rank averages its own parameter shards (the
local tensor of an FSDP2 / TP / EP DTensor, the rows of a sharded Engram table, its own pipeline
stages): ``avg <- decay * avg + (1 - decay) * param``, written as ``avg.lerp_(param, 1 - decay)``,
in fp32, every ``update_every`` steps whose optimizer step was applied (a skipped non-finite step
changes no weight, so it adds nothing to the average). Host memory: 4 bytes per local parameter,
plus as much again for the pinned staging copy on a GPU.

When the update runs. A step's hooks run in list order, and other hooks change the weights both
before the optimizer (the Engram tables' CPU Adam writes them) and after it (QK-clip rescales
them). So this hook goes first in the list and the update of step N is made at the start of step
N + 1 (``before_forward``), when the weights are final; ``pending`` says one is owed, and every
read of the average (checkpoint, validation swap, export) first brings it up to date (``flush``).

- On a GPU the weights are copied to pinned host buffers with ``non_blocking`` copies on a side
  stream, which overlap the next forward and backward (they only read the weights); the main stream
  waits for that copy (a device-side wait, no host stall) in ``before_optimizer``, before anything
  writes the weights again. A worker thread then waits for the copy and makes the lerp on the CPU;
  the next update waits for it before reusing the buffers (a whole step later, normally long done).
- On the CPU the weights are already in host memory: there is nothing to copy, and the update is
  one in-place lerp per tensor (read the weight, read and write the average: 12 bytes of memory
  traffic per fp32 parameter). It runs in the step's own thread: a worker thread would compete for
  the same cores with the step's intra-op threads and would need a lock against the optimizer,
  for a memory-bound pass (benchmarks/ema_bench.py measures it).

Either way the average is the same sequence of CPU ``lerp_`` calls on the same fp32 tensors, so
a run and its resumed continuation hold bit-identical averages (tests/unit/test_ema.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.distributed import local_tensor
from trainer.parallel.weight_init import global_name
from trainer.step_hooks import StepHook


class ParameterEMA(StepHook):
    """The CPU-resident EMA of ``model``'s parameters (this rank's shards); see the module docstring.

    Args:
        model: the run's model as laid out (this rank's part of it).
        decay: the weight of the old average, in (0, 1).
        update_every: update after every N-th step (the average then spans about
            ``update_every / (1 - decay)`` steps).
    """

    def __init__(self, model: nn.Module, decay: float, update_every: int):
        self.decay, self.update_every = decay, update_every
        named = list(model.named_parameters())
        self.names = [global_name(name) for name, _ in named]
        self.params = [p for _, p in named]
        device = self.params[0].device
        # Only a GPU run copies, and pinned pages make its device-to-host copies asynchronous.
        self.cuda = pin = device.type == "cuda" and torch.cuda.is_available()
        self.averages = [self._host_buffer(p, pin) for p in self.params]
        self.staging = [self._host_buffer(p, pin) for p in self.params] if self.cuda else []
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ema") if self.cuda else None
        self.copied: torch.cuda.Event | None = None  # the staging copy the weights' next writer waits for
        self.lerp: Future | None = None  # the worker's lerp of the staged copy
        self.step = 0
        self.pending = False  # the last step's update is owed
        self.restart()

    @staticmethod
    def _host_buffer(p: torch.Tensor, pin: bool) -> torch.Tensor:
        return torch.empty(local_tensor(p).shape, dtype=torch.float32, device="cpu", pin_memory=pin)

    def _locals(self) -> list[torch.Tensor]:
        # Looked up at each use, not kept: the local tensor is a view that layouts may rebuild.
        return [local_tensor(p.detach()) for p in self.params]

    @torch.no_grad()
    def restart(self) -> None:
        """Start the average afresh from the current parameters (a fresh run, or one whose
        checkpoint holds no average)."""
        self._wait()
        for avg, local in zip(self.averages, self._locals()):
            avg.copy_(local)
        self.pending = False

    # ---- the step ------------------------------------------------------------------------------

    def before_forward(self, step: int) -> None:
        if self.pending:  # the previous step's weights are final now
            self._update(asynchronous=True)
        self.step = step

    def before_optimizer(self, skip: bool) -> None:
        if self.copied is not None:
            # The weights' next writers (this step's optimizer, hooks after this one) run after the
            # copy has read them; the host goes on.
            torch.cuda.current_stream(self.params[0].device).wait_event(self.copied)
            self.copied = None

    def after_optimizer(self, stepped: bool) -> None:
        if stepped and self.step % self.update_every == 0:
            self.pending = True

    @torch.no_grad()
    def _update(self, asynchronous: bool) -> None:
        self.pending = False
        weight = 1.0 - self.decay
        if not self.cuda:
            for avg, local in zip(self.averages, self._locals()):
                avg.lerp_(local if local.dtype == torch.float32 else local.float(), weight)
            return
        self._wait()  # the staging buffers are free again
        device = self.params[0].device
        self.stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.stream):
            for buffer, local in zip(self.staging, self._locals()):
                buffer.copy_(local, non_blocking=True)
            self.copied = self.stream.record_event()
        self.lerp = self.worker.submit(self._lerp_staged, self.copied, weight)
        if not asynchronous:
            self._wait()

    def _lerp_staged(self, copied: torch.cuda.Event, weight: float) -> None:
        copied.synchronize()
        with torch.no_grad():
            for avg, buffer in zip(self.averages, self.staging):
                avg.lerp_(buffer, weight)

    def _wait(self) -> None:
        lerp, self.lerp = self.lerp, None
        if lerp is not None:
            lerp.result()

    def flush(self) -> None:
        """Bring the average up to date (an owed update made now, the worker's lerp finished)."""
        if self.pending:
            self._update(asynchronous=False)
        self._wait()
        self.copied = None  # the lerp waited for the copy: the weights' writers need not

    # ---- reading the average ---------------------------------------------------------------------

    def state_dict(self, model_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The average keyed and laid out as ``model_state_dict`` (``get_model_state_dict`` of the
        model) holds the parameters: a DTensor over the same mesh and placements where the model's
        entry is one, so DCP writes every rank's shard and reshards on load as it does the model.
        The tensors are views of the live average: a DCP load into them loads it in place."""
        self.flush()
        out = {}
        for name, avg in zip(self.names, self.averages):
            like = model_state_dict.get(name)
            if like is None:
                raise KeyError(f"ema: parameter {name} is not in the model's state dict")
            if isinstance(like, DTensor):
                if like.to_local().shape != avg.shape:
                    raise ValueError(
                        f"ema: {name} is saved as a shard of {tuple(like.to_local().shape)}, "
                        f"its average holds {tuple(avg.shape)}"
                    )
                avg = DTensor.from_local(
                    avg, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
                )
            out[name] = avg
        return out

    def loaded(self) -> None:
        """The average was just loaded in place (through ``state_dict``'s views): nothing is owed."""
        self.pending = False

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model computes with the averaged weights inside the block (cast to each parameter's
        dtype) and gets its own back, bit for bit, when it leaves."""
        self.flush()
        locals_ = self._locals()
        # A GPU run's staging buffers are free after the flush; on the CPU a temporary copy.
        saved = self.staging if self.cuda else [local.clone() for local in locals_]
        for keep, local, avg in zip(saved, locals_, self.averages):
            keep.copy_(local)
            local.copy_(avg)
        try:
            yield
        finally:
            for keep, local in zip(saved, locals_):
                local.copy_(keep)

    def close(self) -> None:
        self.flush()
        if self.worker is not None:
            self.worker.shutdown()
