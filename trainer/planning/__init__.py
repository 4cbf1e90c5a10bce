"""Planning a run before it starts (docs/planning.md): does a layout fit, how fast will it step,
which layout to pick. Torch-free arithmetic on the model's shapes, but for the fit check.

* activation_memory.py  what a block keeps for its backward under each checkpointing mode
* memory.py             the peak memory estimate per device and pipeline rank (``estimate``)
* fit_check.py          the estimate of a config against its device, before the build
* step_time.py          the step-time model (compute, communication, bubble, recompute)
* layout_planner.py     every layout of a cluster, ranked by step time among those that fit

Nothing is re-exported here: each module is imported by its full name.
"""
