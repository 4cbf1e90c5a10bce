"""The optional parts of a training step, behind one interface.

An option that adds work at fixed points of every step (the MoE expert-bias update, QK-clip, the
Engram tables' optimizer on the CPU) is a `StepHook`. The Trainer builds its list once and calls
every hook at the same points, so the step has no ``if feature:`` of its own:

    before_forward(step)      the step begins (before the first micro-batch's forward)
    before_optimizer(skip)    gradients are final; ``skip``: a non-finite step, no optimizer step
    after_optimizer(stepped)  after the optimizer step (``stepped`` False when it was skipped)
    metrics()                 figures for a logging step (may read the device)
"""

from __future__ import annotations


class StepHook:
    """A part of the step that an option switches on; every method does nothing unless overridden."""

    def before_forward(self, step: int) -> None:
        pass

    def before_optimizer(self, skip: bool) -> None:
        pass

    def after_optimizer(self, stepped: bool) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}
