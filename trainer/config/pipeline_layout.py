"""Pipeline parallelism's arithmetic, torch-free: schedule families, the micro-batch count and the
split of the model into stages.

The schedules themselves are `torch.distributed.pipelining`'s (trainer/parallel/pipeline.py); this
module knows only what each one accepts, so the pre-launch check (`python -m trainer.config.check`)
refuses a layout torch would refuse, in one line, before any process starts.

Stage split. A stage is a run of "layer equivalents": `E` (the embedding), `t` (one transformer
block), `L` (final norm, head, loss and the MTP modules, which need the head). The automatic split
counts each MTP module as one more equivalent of `L` (as torchtitan and Megatron count the
embedding and the head) and deals the equivalents out evenly, earlier stages taking the remainder.
`pp_layout` overrides it Megatron-style: stages separated by `|`, `x*N` repeats a token, e.g.
`Et*2|t*4L` for 6 blocks on 2 stages.
"""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass
from typing import Literal

from trainer.config.fields import ConfigError

PPSchedule = Literal[
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
]
PP_SCHEDULES: tuple[str, ...] = typing.get_args(PPSchedule)
# Its families: schedules that run one stage per rank, several stages per rank in a loop (stage s
# on rank s % pp), and the "V" schedules (rank r holds stages r and 2 pp - 1 - r, so the first and
# the last stage share a rank).
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
LOOPED_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# Split backward into input and weight passes: torch refuses compiled (OptimizedModule) stages.
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def default_stages_per_rank(schedule: str) -> int:
    return 1 if schedule in SINGLE_STAGE_SCHEDULES else 2


def default_microbatches(schedule: str, pp: int, stages_per_rank: int) -> int:
    """The fewest micro-batches that fill the pipeline and that the schedule accepts: one per
    rank, or one per stage for the V schedules (torch asks DualPipeV for that many)."""
    return pp * stages_per_rank if schedule in V_SCHEDULES else pp


def schedule_problems(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> list[str]:
    """What torch's schedule would refuse (or run with an idle rank), one message each."""
    problems = []
    n_stages = pp * stages_per_rank
    if schedule in SINGLE_STAGE_SCHEDULES and stages_per_rank != 1:
        problems.append(
            f"parallelism.pp_schedule = {schedule!r} runs one stage per rank, got pp_stages_per_rank = "
            f"{stages_per_rank}; use 1, or a multi-stage schedule ({', '.join(LOOPED_SCHEDULES)})"
        )
    if schedule in V_SCHEDULES and stages_per_rank != 2:
        problems.append(
            f"parallelism.pp_schedule = {schedule!r} is a V schedule: it needs exactly 2 stages per rank, got "
            f"pp_stages_per_rank = {stages_per_rank}; set --parallelism.pp_stages_per_rank 2 (or -1)"
        )
    if stages_per_rank < 1:
        problems.append(f"parallelism.pp_stages_per_rank must be >= 1 (or -1 for the schedule's), got {stages_per_rank}")
    need = n_stages if schedule in V_SCHEDULES else pp
    if microbatches < need:
        what = "stages (pp x pp_stages_per_rank)" if schedule in V_SCHEDULES else "pipeline ranks (pp)"
        problems.append(
            f"parallelism.pp_microbatches = {microbatches} is fewer than the {need} {what} that "
            f"{schedule!r} needs to fill the pipeline; use at least {need} (or -1)"
        )
    elif schedule in LOOPED_SCHEDULES and microbatches % pp:
        problems.append(
            f"parallelism.pp_microbatches = {microbatches} must be a multiple of pp = {pp} for {schedule!r} "
            f"(it runs the micro-batches in rounds of pp); use {microbatches + pp - microbatches % pp}"
        )
    return problems


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: the blocks it runs and whether it holds the embedding / the head."""

    index: int
    layers: tuple[int, ...]
    first: bool
    last: bool


def rank_stages(specs: list[StageSpec], schedule: str, pp: int, rank: int) -> list[StageSpec]:
    """The stages pp rank ``rank`` runs: stage s on rank s % pp (looped schedules), or rank r
    holding stages r and 2 pp - 1 - r (V schedules, so the first and last stage share a rank)."""
    if schedule in V_SCHEDULES:
        return [specs[rank], specs[2 * pp - 1 - rank]]
    return specs[rank::pp]


_TOKEN = re.compile(r"([EtL])(?:\*(\d+))?")


def parse_pp_layout(text: str) -> list[list[str]]:
    """`Et*2|t*4L` -> [["E", "t", "t"], ["t", "t", "t", "t", "L"]]; ConfigError naming the key."""
    stages = []
    for part in text.replace(" ", "").split("|"):
        tokens, pos = [], 0
        while pos < len(part):
            m = _TOKEN.match(part, pos)
            if m is None:
                raise ConfigError(
                    f"parallelism.pp_layout = {text!r}: cannot read {part[pos:]!r}; write stages separated by '|' "
                    "with E (embedding), t (block), L (norm + head + MTP) and x*N to repeat, e.g. 'Et*2|t*4L'"
                )
            tokens += [m.group(1)] * int(m.group(2) or 1)
            pos = m.end()
        stages.append(tokens)
    return stages


def pp_layout_problems(text: str, n_stages: int) -> list[str]:
    """What is wrong with an explicit `pp_layout` whatever the model (the block count is checked
    against the model by `split_stages`)."""
    if not text:
        return []
    try:
        stages = parse_pp_layout(text)
    except ConfigError as e:
        return [str(e)]
    problems = []
    if len(stages) != n_stages:
        problems.append(
            f"parallelism.pp_layout = {text!r} has {len(stages)} stages, the layout runs pp x pp_stages_per_rank = "
            f"{n_stages}; write {n_stages} stages separated by '|'"
        )
    flat = [(i, tok) for i, stage in enumerate(stages) for tok in stage]
    if [tok for _, tok in flat if tok == "E"] != ["E"] or flat[0] != (0, "E"):
        problems.append(f"parallelism.pp_layout = {text!r}: exactly one E, at the start of the first stage")
    if [tok for _, tok in flat if tok == "L"] != ["L"] or flat[-1] != (len(stages) - 1, "L"):
        problems.append(f"parallelism.pp_layout = {text!r}: exactly one L, at the end of the last stage")
    return problems


def split_stages(n_layers: int, mtp_depth: int, n_stages: int, pp_layout: str = "") -> list[StageSpec]:
    """The stages' blocks, from `pp_layout` or the even split; ConfigError when they do not fit."""
    if n_stages > n_layers:
        raise ConfigError(
            f"the pipeline has {n_stages} stages (parallelism.pp x pp_stages_per_rank) but the model has only "
            f"{n_layers} blocks; use fewer stages (each stage needs at least one block)"
        )
    if pp_layout:
        stages = parse_pp_layout(pp_layout)
        blocks = sum(stage.count("t") for stage in stages)
        if blocks != n_layers:
            raise ConfigError(
                f"parallelism.pp_layout = {pp_layout!r} places {blocks} blocks, the model has {n_layers}; "
                f"its t tokens must add up to {n_layers}"
            )
        counts = [stage.count("t") for stage in stages]
    else:
        counts = _even_counts(n_layers, mtp_depth, n_stages)
    specs, start = [], 0
    for i, count in enumerate(counts):
        specs.append(StageSpec(i, tuple(range(start, start + count)), first=i == 0, last=i == n_stages - 1))
        start += count
    return specs


def _even_counts(n_layers: int, mtp_depth: int, n_stages: int) -> list[int]:
    """Blocks per stage when E, every block, L and every MTP module weigh one each, keeping at
    least one block per stage."""
    units = n_layers + 2 + mtp_depth
    per_stage = [units // n_stages + (1 if i < units % n_stages else 0) for i in range(n_stages)]
    per_stage[0] -= 1
    per_stage[-1] -= 1 + mtp_depth
    counts = [max(1, c) for c in per_stage]
    # Stages clamped up to one block take theirs from the fullest stages.
    while sum(counts) > n_layers:
        counts[counts.index(max(counts))] -= 1
    return counts
