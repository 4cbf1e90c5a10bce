"""The pipeline schedules' facts, one record per schedule of `torch.distributed.pipelining`: the one
place that says what a schedule is. The pre-launch check (pipeline_layout.py, combinations.py),
the memory estimator (trainer/planning/memory.py), the step-time model (trainer/planning/step_time.py), the layout
planner (trainer/planning/layout_planner.py) and the pipeline runtime (trainer/parallel/pipeline_step.py)
read a schedule's record through `schedule_facts`; none of them tests a schedule by name.

Families: "single" schedules run one stage per rank; "looped" ones several stages per rank, stage
s on rank s % pp, micro-batches in rounds of pp; "V" ones exactly two, rank r holding stages r and
2 pp - 1 - r (the first and the last stage share a rank). Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from trainer.config.fields import ConfigError, choice_message

Family = Literal["single", "looped", "V"]


# Micro-batches in flight: how many micro-batches' activations pp rank ``rank`` holds at once, in
# units of all its stages' (a looped schedule's stage chunk is 1/v of them), from torch's warm-up of
# each schedule, as (pp, micro-batches, stages per rank v, rank) -> count. Measured by the dry run
# (docs/performance.md, "The estimator against the dry run").
def _in_flight_1f1b(pp: int, micro: int, v: int, rank: int) -> float:
    """Rank r runs pp - r forwards before its first backward (the last rank holds one)."""
    return min(pp - rank, micro)


def _in_flight_all(pp: int, micro: int, v: int, rank: int) -> float:
    """Every forward runs before the first backward."""
    return micro


def _in_flight_interleaved_1f1b(pp: int, micro: int, v: int, rank: int) -> float:
    """The warm-up's (v - 1) x pp + 2 (pp - 1 - r) stage chunks (torch's ``_get_warmup_ops``), at
    most all m x v chunks."""
    per_round = micro // max(1, micro // pp)
    return min(micro * v, (v - 1) * per_round + 2 * (pp - 1 - rank)) / v


def _in_flight_zero_bubble(pp: int, micro: int, v: int, rank: int) -> float:
    """Zero-bubble and V schedules: up to pp."""
    return min(pp, micro)


# Forwards before the first backward: how many micro-batches (units of all the rank's stages) pp rank
# ``rank`` runs forward before its first backward, as (pp, micro-batches, v, rank) -> count; where
# it is the step's every micro-batch, no gradient exists while the rank's activations are most.
def _warmup_1f1b(pp: int, micro: int, v: int, rank: int) -> float:
    """torch's ``warmup_chunks``: pp - r forwards (at most all), then backward first (1B1F)."""
    return min(pp - rank, micro)


def _warmup_interleaved_1f1b(pp: int, micro: int, v: int, rank: int) -> float:
    """The warm-up's stage chunks (``_in_flight_interleaved_1f1b``); its steady state runs a
    forward before each backward, one more chunk, at most all m x v."""
    chunks = _in_flight_interleaved_1f1b(pp, micro, v, rank) * v
    return min(micro * v, chunks + 1) / v


# Bubble: idle time over useful time of one schedule run, as (pp, v, m, F, B, W) -> fraction, with F,
# B, W one micro-batch's forward, input gradient and weight gradient on one stage, in units of F
# (B + W = 2: trainer/planning/step_time.py chooses B).
def _bubble_1f1b(pp: int, v: int, m: int, f: float, b: float, w: float) -> float:
    """(p - 1) (F + B + W) per run of m micro-batches of (F + B + W): (p - 1) / m."""
    return (pp - 1) / m


def _bubble_interleaved_1f1b(pp: int, v: int, m: int, f: float, b: float, w: float) -> float:
    """(p - 1) / (v m) (Narayanan et al. 2021)."""
    return (pp - 1) / (v * m)


def _bubble_interleaved_zero_bubble(pp: int, v: int, m: int, f: float, b: float, w: float) -> float:
    """One stage per rank's worth of W filling the gaps: (p - 1) (F + B - 2W) / (m (F + B + W))
    (ZB-H1, Qi et al. 2023), floored at 0, divided by v."""
    return max(0.0, (pp - 1) * (f + b - 2 * w)) / (v * m * (f + b + w))


def _bubble_v(pp: int, v: int, m: int, f: float, b: float, w: float) -> float:
    """The DualPipe table's (PP/2 - 1)(F&B + B - 3W) (DeepSeek-V3 report, table 2) with F&B = F + B
    (this trainer does not overlap the pair), over m (F + B + W), floored at 0."""
    return max(0.0, (pp / 2 - 1) * ((f + b) + b - 3 * w)) / (m * (f + b + w))


def _per_rank(pp: int, stages_per_rank: int) -> int:
    return pp


def _per_stage(pp: int, stages_per_rank: int) -> int:
    return pp * stages_per_rank


@dataclass(frozen=True)
class ScheduleFacts:
    """What the trainer knows of one schedule."""

    name: str
    """The ``parallelism.pp_schedule`` value (torch's ``get_schedule_class`` name)."""
    torch_class: str
    """Its class in ``torch.distributed.pipelining.schedules``."""
    family: Family
    """"single", "looped" or "V" (module docstring)."""
    stages_per_rank: int
    """Stages per rank for ``pp_stages_per_rank = -1``; the single and V families take no other."""
    split_backward: bool
    """Each backward split into an input and a weight pass (a zero-bubble schedule): FSDP keeps the
    stages unsharded through the step, and torch refuses compiled stages (`compile`)."""
    min_microbatches: Callable[[int, int], int]
    """(pp, stages per rank) -> the fewest micro-batches the schedule accepts (and that fill the pipeline)."""
    in_flight: Callable[[int, int, int, int], float]
    """(pp, micro-batches, stages per rank, rank) -> micro-batches whose activations the rank holds
    at once, in units of all its stages'."""
    warmup: Callable[[int, int, int, int], float] | None
    """(pp, micro-batches, stages per rank, rank) -> micro-batches the rank runs forward before its
    first backward, in units of all its stages'; None for a split-backward schedule (not modelled:
    its stages are unsharded from the first forward, its accumulators estimated through the step)."""
    bubble: Callable[[int, int, int, float, float, float], float]
    """(pp, stages per rank, micro-batches, F, B, W) -> idle over useful time of one run."""
    moe_overlap: bool
    """``parallelism.moe_overlap`` can interleave its overlapped actions (``OVERLAP_F_B``)."""
    planned_stages_per_rank: tuple[int, ...]
    """The stages per rank the layout planner tries; none for a schedule another one dominates."""

    @property
    def v_shaped(self) -> bool:
        """Rank r holds stages r and 2 pp - 1 - r (the first and the last stage share a rank)."""
        return self.family == "V"

    @property
    def compile(self) -> bool:
        """Compiled stages run: a compiled block is one autograd node whose whole backward a weight
        pass would run again, which inductor refuses (docs/compile.md, "Zero-bubble schedules")."""
        return not self.split_backward


SCHEDULES: tuple[ScheduleFacts, ...] = (
    # Dominated by 1F1B's memory: the planner skips it.
    ScheduleFacts(
        name="GPipe",
        torch_class="ScheduleGPipe",
        family="single",
        stages_per_rank=1,
        split_backward=False,
        min_microbatches=_per_rank,
        in_flight=_in_flight_all,
        warmup=_in_flight_all,
        bubble=_bubble_1f1b,
        moe_overlap=False,
        planned_stages_per_rank=(),
    ),
    ScheduleFacts(
        name="1F1B",
        torch_class="Schedule1F1B",
        family="single",
        stages_per_rank=1,
        split_backward=False,
        min_microbatches=_per_rank,
        in_flight=_in_flight_1f1b,
        warmup=_warmup_1f1b,
        bubble=_bubble_1f1b,
        moe_overlap=False,
        planned_stages_per_rank=(1,),
    ),
    ScheduleFacts(
        name="Interleaved1F1B",
        torch_class="ScheduleInterleaved1F1B",
        family="looped",
        stages_per_rank=2,
        split_backward=False,
        min_microbatches=_per_rank,
        in_flight=_in_flight_interleaved_1f1b,
        warmup=_warmup_interleaved_1f1b,
        bubble=_bubble_interleaved_1f1b,
        moe_overlap=False,
        planned_stages_per_rank=(2, 4),
    ),
    # Dominated by Interleaved1F1B's bubble: the planner skips it.
    ScheduleFacts(
        name="LoopedBFS",
        torch_class="ScheduleLoopedBFS",
        family="looped",
        stages_per_rank=2,
        split_backward=False,
        min_microbatches=_per_rank,
        in_flight=_in_flight_all,
        warmup=_in_flight_all,
        bubble=_bubble_1f1b,
        moe_overlap=False,
        planned_stages_per_rank=(),
    ),
    ScheduleFacts(
        name="InterleavedZeroBubble",
        torch_class="ScheduleInterleavedZeroBubble",
        family="looped",
        stages_per_rank=2,
        split_backward=True,
        min_microbatches=_per_rank,
        in_flight=_in_flight_zero_bubble,
        warmup=None,
        bubble=_bubble_interleaved_zero_bubble,
        moe_overlap=False,
        planned_stages_per_rank=(2,),
    ),
    # torch asks the V schedules for one micro-batch per stage.
    ScheduleFacts(
        name="ZBVZeroBubble",
        torch_class="ScheduleZBVZeroBubble",
        family="V",
        stages_per_rank=2,
        split_backward=True,
        min_microbatches=_per_stage,
        in_flight=_in_flight_zero_bubble,
        warmup=None,
        bubble=_bubble_v,
        moe_overlap=False,
        planned_stages_per_rank=(2,),
    ),
    ScheduleFacts(
        name="DualPipeV",
        torch_class="ScheduleDualPipeV",
        family="V",
        stages_per_rank=2,
        split_backward=True,
        min_microbatches=_per_stage,
        in_flight=_in_flight_zero_bubble,
        warmup=None,
        bubble=_bubble_v,
        moe_overlap=True,
        planned_stages_per_rank=(2,),
    ),
)
PP_SCHEDULES: tuple[str, ...] = tuple(s.name for s in SCHEDULES)
# The config field's type: its choices are the table's names (trainer/config/fields.py reads them).
PPSchedule = Literal[PP_SCHEDULES]  # type: ignore[valid-type]
ZERO_BUBBLE_SCHEDULES: tuple[str, ...] = tuple(s.name for s in SCHEDULES if s.split_backward)
_BY_NAME = MappingProxyType({s.name: s for s in SCHEDULES})


def schedule_facts(name: str) -> ScheduleFacts:
    """The record of schedule ``name``; ConfigError naming the known schedules for any other."""
    facts = _BY_NAME.get(name)
    if facts is None:
        raise ConfigError(choice_message("parallelism.pp_schedule", name, PP_SCHEDULES))
    return facts


def family_names(family: Family) -> tuple[str, ...]:
    """The schedules of one family, in the table's order."""
    return tuple(s.name for s in SCHEDULES if s.family == family)
