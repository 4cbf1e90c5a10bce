"""Stopping a run cleanly: SIGTERM/SIGINT and a wall-clock limit ask the loop to save and exit at
the next step boundary, a guard skips optimizer steps whose loss or gradient norm is not finite,
and a state holding NaN or inf is never saved over the good checkpoints.

Both decisions must be the same on every rank (a rank that stops or skips alone deadlocks the
others in their next collective). A stop request is local (a signal, a clock), so `StopRequest`
agrees through a MAX all-reduce over all ranks; the guard is given the step's global loss and
gradient norm (already reduced over every rank), so every rank decides alike by itself.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from typing import Any, Callable, Iterator

import torch

from trainer.distributed import all_ranks_any, local_tensor

logger = logging.getLogger("trainer")

Agree = Callable[[bool], bool]


class StopRequest:
    """Turns SIGTERM/SIGINT and a time limit into a flag the training loop polls between steps.

    The handlers only set a flag: saving from inside a signal handler could interrupt a
    collective or a half-written tensor. A second SIGINT (an impatient Ctrl-C) restores the
    default handler's behaviour and raises KeyboardInterrupt at once.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, time_limit_minutes: float = 0.0, agree: Agree = all_ranks_any):
        self.deadline = time.monotonic() + 60.0 * time_limit_minutes if time_limit_minutes > 0 else None
        self.time_limit_minutes = time_limit_minutes
        self.agree = agree
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequest:
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:
                # Not the main thread (e.g. a test runner thread): rely on the time limit only.
                logger.warning("cannot install a %s handler outside the main thread", signal.Signals(sig).name)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_name == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = name

    def reason(self) -> str | None:
        """Why the run should stop now (same answer on every rank), or None to go on."""
        local = None
        if self.signal_name is not None:
            local = f"received {self.signal_name}"
        elif self.deadline is not None and time.monotonic() >= self.deadline:
            local = f"time limit of {self.time_limit_minutes:g} minutes reached"
        if not self.agree(local is not None):
            return None
        return local or "another rank asked to stop"


class TrainingDiverged(RuntimeError):
    """Too many consecutive non-finite steps, or non-finite weights or optimizer state; the run
    stops without saving (exit code 3). The message says what happened; where a rerun resumes is
    the checkpoint manager's to say (`CheckpointManager.newest_good`)."""


def _tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(state, dict):
        for key, value in state.items():
            yield from _tensors(value, f"{prefix}{key}.")
    elif isinstance(state, torch.Tensor):
        yield prefix.rstrip("."), state


def nonfinite_entries(state: dict) -> list[str]:
    """The keys (dotted paths) of the floating-point tensors in the nested `state` that hold a NaN
    or inf in this rank's part. One host read for the whole state."""
    names, extrema = [], []
    for name, t in _tensors(state):
        t = local_tensor(t)
        if t.is_floating_point() and t.numel():
            names.append(name)
            # min and max, not isfinite(t).all(): no temporary the size of the tensor, and a NaN
            # anywhere makes both NaN, an inf makes one of them infinite.
            extrema.append(torch.stack(torch.aminmax(t)).float())
    if not names:
        return []
    finite = torch.isfinite(torch.stack(extrema)).all(dim=1).tolist()
    return [name for name, ok in zip(names, finite) if not ok]


class NonFiniteGuard:
    """Decides, before `optimizer.step()`, whether a step's loss and gradient norm are finite.

    A non-finite step is skipped by the caller (gradients dropped, no optimizer step, so no MoE
    bias update either). `max_consecutive` skipped steps in a row raise `TrainingDiverged`: a
    single bad batch is survivable, a run that keeps producing NaN is broken. `total` counts every
    skip of the run and is saved with the checkpoint.
    """

    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.total = 0

    def should_skip(self, step: int, loss: float, grad_norm: float) -> bool:
        """``loss`` and ``grad_norm`` must be the global values (the same on every rank)."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.total += 1
        logger.warning(
            "step %d: non-finite loss %s / grad norm %s; optimizer step skipped (%d in a row, %d in total, "
            "limit %d in a row)",
            step, loss, grad_norm, self.consecutive, self.total, self.max_consecutive,
        )
        if self.consecutive >= self.max_consecutive:
            raise TrainingDiverged(
                f"step {step}: {self.consecutive} consecutive steps with a non-finite loss or gradient norm "
                f"(training.max_skipped_steps = {self.max_consecutive}); stopping without saving"
            )
        return True

    def state_dict(self) -> dict:
        return {"skipped_total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.total = int(state.get("skipped_total", 0))
