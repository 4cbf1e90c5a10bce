"""Pipeline parallelism's arithmetic, torch-free: what each schedule accepts, the micro-batch count
and the split of the model into stages.

The schedules themselves are `torch.distributed.pipelining`'s (trainer/parallel/pipeline.py), their
facts one record each in trainer/config/schedules.py; this module knows only what each one
accepts, so the pre-launch check (`python -m trainer.config.check`) refuses a layout torch would
refuse, in one line, before any process starts.

Stage split. A stage is a run of "layer equivalents": `E` (the embedding), `t` (one transformer
block), `L` (final norm, head, loss and the MTP modules, which need the head). Given each piece's
cost (`PipelineCosts`: the trainer passes training FLOPs per token from
`models.deepseek_v3.stats.stage_unit_costs`), the split balances cost: the head with its
vocabulary and the MTP modules outweigh several blocks of a small model, so counting them as one
block each gave the first rank of the debug model at pp 2 about a quarter of the work. Without
costs (the torch-free pre-launch check, which only asks whether a split exists) it counts each
MTP module as one more equivalent of `L` (as torchtitan and Megatron count the embedding and the
head) and deals the equivalents out evenly, earlier stages taking the remainder. `pp_layout`
overrides both Megatron-style: stages separated by `|`, `x*N` repeats a token, e.g. `Et*2|t*4L`
for 6 blocks on 2 stages.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, fields

from trainer.config.fields import ConfigError
from trainer.config.schedules import ScheduleFacts, family_names, schedule_facts


def schedule_problems(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> list[str]:
    """What torch's schedule would refuse (or run with an idle rank), one message each."""
    problems = []
    facts = schedule_facts(schedule)
    if facts.family == "single" and stages_per_rank != facts.stages_per_rank:
        problems.append(
            f"parallelism.pp_schedule = {schedule!r} runs one stage per rank, got pp_stages_per_rank = "
            f"{stages_per_rank}; use 1, or a multi-stage schedule ({', '.join(family_names('looped'))})"
        )
    if facts.v_shaped and stages_per_rank != facts.stages_per_rank:
        problems.append(
            f"parallelism.pp_schedule = {schedule!r} is a V schedule: it needs exactly 2 stages per rank, got "
            f"pp_stages_per_rank = {stages_per_rank}; set --parallelism.pp_stages_per_rank 2 (or -1)"
        )
    if stages_per_rank < 1:
        problems.append(f"parallelism.pp_stages_per_rank must be >= 1 (or -1 for the schedule's), got {stages_per_rank}")
    need = facts.min_microbatches(pp, stages_per_rank)
    if microbatches < need:
        what = "stages (pp x pp_stages_per_rank)" if facts.v_shaped else "pipeline ranks (pp)"
        problems.append(
            f"parallelism.pp_microbatches = {microbatches} is fewer than the {need} {what} that "
            f"{schedule!r} needs to fill the pipeline; use at least {need} (or -1)"
        )
    elif facts.family == "looped" and microbatches % pp:
        problems.append(
            f"parallelism.pp_microbatches = {microbatches} must be a multiple of pp = {pp} for {schedule!r} "
            f"(it runs the micro-batches in rounds of pp); use {microbatches + pp - microbatches % pp}"
        )
    return problems


@dataclass(frozen=True)
class PipelinePlan:
    """The pipeline options of ``[parallelism]``, read in this one place: every other module (the
    layout checks, the trainer's split and schedule, the memory estimator, the scripts) takes a
    plan, so a new ``pp*`` option touches the schema and this class. The fields carry the
    schema's names; -1 (the schema's "the schedule's default") is resolved on construction."""

    pp: int = 1
    pp_schedule: str = "1F1B"
    pp_stages_per_rank: int = -1
    pp_microbatches: int = -1
    pp_layout: str = ""
    pp_max_deferred_weight_passes: int = -1

    def __post_init__(self) -> None:
        facts = self.facts  # ConfigError naming the known schedules for any other
        if self.pp_stages_per_rank == -1:
            object.__setattr__(self, "pp_stages_per_rank", facts.stages_per_rank)
        if self.pp_microbatches == -1:
            object.__setattr__(self, "pp_microbatches", facts.min_microbatches(self.pp, self.pp_stages_per_rank))

    @classmethod
    def from_config(cls, parallelism) -> PipelinePlan:
        """From a ``[parallelism]`` section (or anything with its ``pp*`` attributes)."""
        return cls(**{f.name: getattr(parallelism, f.name) for f in fields(cls)})

    @property
    def enabled(self) -> bool:
        return self.pp > 1

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all: pp x pp_stages_per_rank."""
        return self.pp * self.pp_stages_per_rank

    @property
    def facts(self) -> ScheduleFacts:
        """The schedule's record (trainer/config/schedules.py)."""
        return schedule_facts(self.pp_schedule)

    @property
    def zero_bubble(self) -> bool:
        """The schedule splits each backward into input and weight passes."""
        return self.facts.split_backward

    @property
    def v_shaped(self) -> bool:
        """Rank r holds stages r and 2 pp - 1 - r (the first and the last stage share a rank)."""
        return self.facts.v_shaped

    def problems(self) -> list[str]:
        """What torch's schedule or the explicit ``pp_layout`` would refuse, one message each
        (nothing without pipelining)."""
        if not self.enabled:
            return []
        problems = schedule_problems(self.pp_schedule, self.pp, self.pp_stages_per_rank, self.pp_microbatches)
        if self.pp_max_deferred_weight_passes < -1:
            problems.append(
                f"parallelism.pp_max_deferred_weight_passes = {self.pp_max_deferred_weight_passes} must be >= 0, "
                "or -1 for the schedule's own; use e.g. 8"
            )
        return problems + pp_layout_problems(self.pp_layout, self.n_stages)

    def stage_ranks(self) -> tuple[int, ...]:
        """The pp rank of every stage (`stage_ranks`)."""
        return stage_ranks(self.pp_schedule, self.pp, self.n_stages)

    def split(self, n_layers: int, mtp_depth: int, costs: PipelineCosts | None = None) -> list[StageSpec]:
        """The stages' blocks (`split_stages`: ``pp_layout``, else by ``costs``, else even)."""
        return split_stages(n_layers, mtp_depth, self.n_stages, self.pp_layout, costs, self.stage_ranks())

    def rank_stages(self, specs: list[StageSpec], rank: int) -> list[StageSpec]:
        """The stages pp rank ``rank`` runs, in stage order."""
        return rank_stages(specs, self.pp_schedule, self.pp, rank)

    def describe(self) -> str:
        return f"pipeline {self.pp_schedule}, {self.n_stages} stages, {self.pp_microbatches} micro-batches"


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: the blocks it runs and whether it holds the embedding / the head."""

    index: int
    layers: tuple[int, ...]
    first: bool
    last: bool


@dataclass(frozen=True)
class PipelineCosts:
    """What each piece of the model costs per token, in any one unit (the trainer's: training FLOPs,
    `models.deepseek_v3.stats.stage_unit_costs`): the embedding, every block, the final norm + head
    + loss, and every MTP module with its use of the head."""

    embed: float
    blocks: tuple[float, ...]
    head: float
    mtp: tuple[float, ...]

    def stage(self, spec: StageSpec) -> float:
        """The cost of one stage: its blocks, the embedding on the first, head and MTP on the last."""
        ends = (self.embed if spec.first else 0.0) + (self.head + sum(self.mtp) if spec.last else 0.0)
        return sum(self.blocks[i] for i in spec.layers) + ends


def stage_ranks(schedule: str, pp: int, n_stages: int) -> tuple[int, ...]:
    """The pp rank of every stage: stage s on rank s % pp (one stage per rank, or looped
    schedules), or rank r holding stages r and 2 pp - 1 - r (V schedules, so the first and the
    last stage share a rank)."""
    if schedule_facts(schedule).v_shaped:
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(n_stages))
    return tuple(s % pp for s in range(n_stages))


def rank_stages(specs: list[StageSpec], schedule: str, pp: int, rank: int) -> list[StageSpec]:
    """The stages pp rank ``rank`` runs, in stage order (`stage_ranks`)."""
    ranks = stage_ranks(schedule, pp, len(specs))
    return [spec for spec in specs if ranks[spec.index] == rank]


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


def split_stages(
    n_layers: int, mtp_depth: int, n_stages: int, pp_layout: str = "", costs: PipelineCosts | None = None,
    ranks: tuple[int, ...] | None = None,
) -> list[StageSpec]:
    """The stages' blocks, from `pp_layout`, else balanced by ``costs``, else the even split;
    ConfigError when they do not fit. ``ranks`` (`stage_ranks`) is the pp rank of every stage:
    where a rank runs several stages, balancing the ranks comes before balancing the stages."""
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
    elif costs is not None:
        if (len(costs.blocks), len(costs.mtp)) != (n_layers, mtp_depth):
            raise ValueError(
                f"costs of {len(costs.blocks)} blocks and {len(costs.mtp)} MTP modules for a model of "
                f"{n_layers} blocks and MTP depth {mtp_depth}"
            )
        counts = _cost_counts(costs, n_stages, ranks or tuple(range(n_stages)))
    else:
        counts = _even_counts(n_layers, mtp_depth, n_stages)
    return _specs(counts)


def _specs(counts: list[int]) -> list[StageSpec]:
    starts = [0, *itertools.accumulate(counts)]
    last = len(counts) - 1
    return [
        StageSpec(i, tuple(range(starts[i], starts[i + 1])), first=i == 0, last=i == last)
        for i in range(len(counts))
    ]


def describe_split(specs: list[StageSpec], costs: PipelineCosts, ranks: tuple[int, ...] | None = None) -> str:
    """Each stage's share of the total cost, and each rank's where a rank runs several stages, for
    the log: "stage costs: 0: embed + blocks 0-3 27%, 1: blocks 4-5 + head + MTP 73%"."""
    stage_costs = [costs.stage(spec) for spec in specs]
    total = sum(stage_costs)
    parts = []
    for spec, cost in zip(specs, stage_costs):
        first, last = spec.layers[0], spec.layers[-1]
        pieces = (["embed"] if spec.first else []) + [f"blocks {first}-{last}" if last > first else f"block {first}"]
        pieces += (["head"] + (["MTP"] if costs.mtp else [])) if spec.last else []
        parts.append(f"{spec.index}: {' + '.join(pieces)} {cost / total:.0%}")
    text = "stage costs: " + ", ".join(parts)
    if ranks is not None and len(set(ranks)) < len(ranks):
        loads = _rank_loads(stage_costs, ranks)
        text += "; per rank: " + ", ".join(f"{r}: {load / total:.0%}" for r, load in enumerate(loads))
    return text


def _rank_loads(stage_costs: list[float], ranks: tuple[int, ...]) -> list[float]:
    loads = [0.0] * (max(ranks) + 1)
    for cost, rank in zip(stage_costs, ranks):
        loads[rank] += cost
    return loads


def _cost_counts(costs: PipelineCosts, n_stages: int, ranks: tuple[int, ...]) -> list[int]:
    """Blocks per stage, at least one each: the busiest rank as light as possible, then the busiest
    stage, then ranks and stages as even as possible (least sums of squares).

    One stage per rank: exact, by dynamic programming over contiguous splits (`_bottleneck_split`).
    A rank running several stages (looped and V schedules) adds up stages far apart, which that
    recursion cannot see: a steepest descent from its split and from the even split moves blocks
    from one stage to another while the order above improves, and the better end wins (deterministic, but a
    local optimum: checked against every split of small models in the tests)."""
    n = len(costs.blocks)
    total = costs.embed + sum(costs.blocks) + costs.head + sum(costs.mtp)
    prefix = [c / total for c in itertools.accumulate(costs.blocks, initial=0.0)]
    ends = [0.0] * n_stages
    ends[0] += costs.embed / total
    ends[-1] += (costs.head + sum(costs.mtp)) / total

    def stage_cost(s: int, i: int, j: int) -> float:
        """Stage s holding blocks i..j-1, as a share of the total."""
        return prefix[j] - prefix[i] + ends[s]

    def key(counts: list[int]) -> tuple[float, ...]:
        bounds = [0, *itertools.accumulate(counts)]
        stages = [stage_cost(s, bounds[s], bounds[s + 1]) for s in range(n_stages)]
        loads = _rank_loads(stages, ranks)
        # Rounded so that sums in another order do not count as an improvement.
        return tuple(round(x, 12) for x in (
            max(loads), max(stages), sum(x * x for x in loads), sum(x * x for x in stages)
        ))

    def descend(counts: list[int]) -> tuple[tuple[float, ...], list[int]]:
        # m blocks from any stage to any other: the stages between them shift by m blocks, so a
        # chain of boundary moves that no single one improves is one move (e.g. a cheap dense
        # block reaching the stage that shares a rank with the head).
        best = key(counts)
        while True:
            moves = [
                (key(trial), trial)
                for a in range(n_stages)
                for m in range(1, counts[a])
                for b in range(n_stages) if b != a
                for trial in [[c - m * (i == a) + m * (i == b) for i, c in enumerate(counts)]]
            ]
            step, trial = min(moves, default=(best, counts))
            if step >= best:
                return best, counts
            best, counts = step, trial

    starts = (_bottleneck_split(stage_cost, n, n_stages), _even_counts(n, len(costs.mtp), n_stages))
    return min(descend(start) for start in starts)[1]


def _bottleneck_split(stage_cost, n: int, n_stages: int) -> list[int]:
    """Blocks per stage of the contiguous split of ``n`` blocks whose largest stage is smallest,
    and of those the one with the least sum of squared stage costs; ``stage_cost(s, i, j)`` is
    stage s holding blocks i..j-1."""
    inf = float("inf")
    # Stage s-1 ending before block j starts at block i >= s-1 (the stages before it hold one
    # block each at least) and leaves one block for each later stage.
    def starts(s: int, j: int) -> range:
        return range(s - 1, j)

    def ends(s: int) -> range:
        return range(s, n - (n_stages - s) + 1)

    # bottleneck[s][j]: the smallest largest stage when stages 0..s-1 hold blocks 0..j-1.
    bottleneck = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    bottleneck[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for j in ends(s):
            bottleneck[s][j] = min(max(bottleneck[s - 1][i], stage_cost(s - 1, i, j)) for i in starts(s, j))
    bound = bottleneck[n_stages][n] * (1 + 1e-9)  # ties within rounding
    # squares[s][j]: the least sum of squared stage costs under the bound, and where stage s-1 starts.
    squares = [[(inf, -1)] * (n + 1) for _ in range(n_stages + 1)]
    squares[0][0] = (0.0, -1)
    for s in range(1, n_stages + 1):
        for j in ends(s):
            options = [
                (squares[s - 1][i][0] + cost**2, i)
                for i in starts(s, j)
                if (cost := stage_cost(s - 1, i, j)) <= bound
            ]
            squares[s][j] = min(options, default=(inf, -1))
    counts, j = [], n
    for s in range(n_stages, 0, -1):
        i = squares[s][j][1]
        counts.append(j - i)
        j = i
    return counts[::-1]


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
