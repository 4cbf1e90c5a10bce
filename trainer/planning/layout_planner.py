"""The layout planner: every layout of a model on N GPUs that the pre-launch check accepts, those
the memory estimator fits on the GPUs, ranked by the step-time model (trainer/planning/step_time.py).

Candidates: pp over the divisors of N that leave every stage a block, with each schedule and its
planned stages per rank (trainer/config/schedules.py: 1F1B, Interleaved1F1B with 2 or 4 stages per
rank, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) and 1, 2 or 4
micro-batches per stage of the run; tp up to a node (it divides the heads), cp 1, 2 or 4;
dp_replicate among the divisors of what is left; ep over the divisors of dp_shard x cp that divide
the experts, and with cp 1 and ep > 1 also ep_as_cp (the ep ranks split each sequence, and the
data ranks drop to dp_replicate x dp_shard / ep); activation checkpointing none, full, or modules
with each named set of parts (``RECOMPUTE_SETS``: DeepSeek's and Megatron's); DualPipeV without
checkpointing also with ``moe_overlap`` where the config allows it (ep > 1, tp and cp 1, not
ep_as_cp; its memory estimated as without, which the dry run put 3.4% low at 16B,
benchmarks/RESULTS.md); without pp, the micro-batch rows among 1, 2, 4 and 8. The batch is the global batch over the data ranks (`Layout.dp_degree`). A candidate is valid when `Layout`
accepts its degrees and the model's blocks, heads, experts and sequence (`check_model_fit`, the
pre-launch check's own), and its batch divides (`Layout.check_batch`); the printed flags of the
ranked ones go once more through `load_config` and the same checks, as run_train.sh reads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import multiprocessing
from collections.abc import Iterator
from dataclasses import dataclass

from models.deepseek_v3 import get_flavor
from models.deepseek_v3.stats import stage_unit_costs
from trainer.config import ConfigError, load_config
from trainer.config.activation_checkpoint import RECOMPUTE_SETS
from trainer.config.check import check_model_fit
from trainer.config.layout import Layout, divisors
from trainer.config.pipeline_layout import PipelineCosts, PipelinePlan
from trainer.config.schedules import SCHEDULES
from trainer.planning.memory import EstimateCache, estimate
from trainer.planning.step_time import Hardware, ModelFigures, Plan, step_time
from trainer.progress import Progress, phase

# GiB a GPU keeps outside torch's tensors: CUDA context, NCCL buffers, fragmentation
# (scripts/estimate_memory.py's allowance).
RESERVE_GIB = 6.0


@dataclass(frozen=True)
class Ranked:
    plan: Plan
    memory_gib: float
    time: dict

    def flags(self) -> list[str]:
        """The ``run_train.sh`` options of this layout (with the config file's)."""
        p, pipe = self.plan, self.plan.pipeline
        out = [
            "--parallelism.pp", str(p.pp), "--parallelism.dp_replicate", str(p.dp_replicate),
            "--parallelism.dp_shard", str(p.dp_shard), "--parallelism.cp", str(p.cp), "--parallelism.tp", str(p.tp),
            "--parallelism.ep", str(p.ep),
        ]
        if p.ep_as_cp:
            out += ["--parallelism.ep_as_cp"]
        if pipe.enabled:
            out += ["--parallelism.pp_schedule", pipe.pp_schedule, "--parallelism.pp_stages_per_rank",
                    str(pipe.pp_stages_per_rank), "--parallelism.pp_microbatches", str(pipe.pp_microbatches)]
        out += ["--training.seq_len", str(p.seq_len), "--training.local_batch_size", str(p.local_batch_size),
                "--training.global_batch_size", str(p.dp * p.local_batch_size * p.accumulation),
                "--activation_checkpoint.mode", p.ac]
        if p.ac == "modules":
            out += ["--activation_checkpoint.recompute_modules", ",".join(p.recompute_modules)]
        if p.moe_overlap:
            out += ["--parallelism.moe_overlap"]
        return out


def candidates(flavor: str, gpus: int, gpus_per_node: int, seq_len: int, global_batch: int) -> Iterator[Plan]:
    """Every layout the pre-launch check's rules accept (module docstring)."""
    shape = get_flavor(flavor)
    for pp, tp, cp in itertools.product(divisors(gpus), (1, 2, 4, 8), (1, 2, 4)):
        if tp > gpus_per_node or gpus % (pp * tp * cp) or pp > shape.n_layers:
            continue
        rest = gpus // (pp * tp * cp)
        for dp_replicate in divisors(rest):
            dp_shard = rest // dp_replicate
            for ep in divisors(dp_shard * cp):
                if shape.moe.num_experts % ep:
                    continue
                for ep_as_cp in (False, True) if cp == 1 and ep > 1 else (False,):
                    try:
                        layout = Layout(dp_replicate, dp_shard, cp, tp, ep, ep_as_cp, gpus,
                                        pipeline=PipelinePlan(pp=pp))
                        layout.check_shapes(seq_len, n_heads=shape.n_heads, num_experts=shape.moe.num_experts)
                    except ConfigError:
                        continue
                    if global_batch % layout.dp_degree:
                        continue
                    local = global_batch // layout.dp_degree
                    base = Plan(gpus, dp_replicate, dp_shard, cp, tp, ep, PipelinePlan(), local, 1, seq_len, "none",
                                ep_as_cp)
                    yield from _batch_shapes(base, layout, shape)


def _batch_shapes(base: Plan, layout: Layout, shape) -> Iterator[Plan]:
    """The schedules, micro-batches and activation checkpointing of one set of degrees (``base``:
    the degrees, and the sequences per data rank as ``local_batch_size``)."""
    local = base.local_batch_size
    pp = layout.pipeline.pp
    # recompute_modules stays the config's default where the mode reads none.
    checkpointing = [dataclasses.replace(base, ac="none"),
                     *(dataclasses.replace(base, ac="modules", recompute_modules=(name,)) for name in RECOMPUTE_SETS),
                     dataclasses.replace(base, ac="full")]
    # moe_overlap's refusals (trainer/config/combinations.py) but for the schedule and AC, below.
    overlap = base.ep > 1 and base.tp == 1 and base.cp == 1 and not base.ep_as_cp
    pipelines = list(_pipelines(layout, local, shape)) if pp > 1 else []
    for checkpointed in checkpointing:
        if pp == 1:
            for rows in (1, 2, 4, 8):
                if local % rows == 0:
                    yield dataclasses.replace(checkpointed, local_batch_size=rows, accumulation=local // rows)
            continue
        for pipeline in pipelines:
            yield dataclasses.replace(checkpointed, pipeline=pipeline)
            if overlap and checkpointed.ac == "none" and pipeline.facts.moe_overlap:
                yield dataclasses.replace(checkpointed, pipeline=pipeline, moe_overlap=True)


def _pipelines(layout: Layout, local: int, shape) -> Iterator[PipelinePlan]:
    """The pipelines of one set of degrees (``layout``'s pp) that the checks accept for ``local``
    sequences per data rank: each schedule's planned stages per rank (trainer/config/schedules.py;
    none for GPipe and LoopedBFS, dominated by 1F1B's memory and Interleaved1F1B's bubble) with 1, 2
    or 4 micro-batches per stage."""
    pp = layout.pipeline.pp
    for schedule, per_rank in [(s.name, v) for s in SCHEDULES for v in s.planned_stages_per_rank]:
        for fill in (1, 2, 4):
            pipeline = PipelinePlan(pp=pp, pp_schedule=schedule, pp_stages_per_rank=per_rank,
                                    pp_microbatches=pp * per_rank * fill)
            if local % pipeline.pp_microbatches or pipeline.problems():
                continue
            try:
                dataclasses.replace(layout, pipeline=pipeline).check_stages(shape.n_layers, shape.mtp_depth)
            except ConfigError:
                continue
            yield pipeline


def _split_string(args, pipeline: PipelinePlan, costs: PipelineCosts) -> str:
    """The trainer's cost-balanced split as a ``pp_layout`` string, so that the estimator need not
    search it again for every layout of the same pipeline shape."""
    parts = [f"t*{len(s.layers)}" for s in pipeline.split(args.n_layers, args.mtp_depth, costs)]
    return "|".join(["E" + parts[0], *parts[1:-1], parts[-1] + "L"] if len(parts) > 1 else ["E" + parts[0] + "L"])


def _states_gib(est: dict) -> float:
    """A lower bound of ``est``'s total: what its fullest rank holds whatever the batch (parameters,
    optimizer states and gradients; trainer/planning/memory.py adds only terms >= 0 to them)."""
    g = est["gib"]
    return g["params"] + g["optimizer"] + g["grads"]


def plan_layouts(
    flavor: str, gpus: int, gpu_memory_gib: float, gpus_per_node: int, seq_len: int, global_batch: int,
    hardware: Hardware, prune: bool = True, workers: int = 1, memo: bool = True,
) -> tuple[list[Ranked], int]:
    """The layouts that fit, fastest first, and how many valid layouts were considered.

    ``prune``: skip the estimate of a layout whose states alone cannot fit. The layouts of one set of
    degrees and one pipeline split (differing in the batch rows, the micro-batches and activation
    checkpointing) hold the same parameters, optimizer states and gradients on every rank, so the
    fullest rank's of one of them (``_states_gib``) bounds them all from below. Exact: the ranking
    is the unpruned one (tests/unit/test_layout_planner.py).

    ``memo``: the estimates of a group share one ``EstimateCache`` (its ranks' states, block
    figures and pipeline ranks computed once); the same figures as without (the tests compare).

    ``workers``: processes that estimate the groups (a group's layouts stay in one process, in
    order, so the pruning is the same); the result, ties included, does not depend on it."""
    args = get_flavor(flavor)
    costs = PipelineCosts(**stage_unit_costs(args, seq_len))
    phase(f"plan: listing the layouts of {flavor} on {gpus} GPUs ...")
    plans = list(candidates(flavor, gpus, gpus_per_node, seq_len, global_batch))
    groups: dict[tuple, list[tuple[int, Plan]]] = {}
    splits: dict[tuple, str] = {}
    split_pipelines: dict[PipelinePlan, PipelinePlan] = {}  # each pipeline with its split, made once
    for index, plan in enumerate(plans):
        pipe = plan.pipeline
        if pipe.enabled:
            if pipe not in split_pipelines:
                key = (pipe.pp, pipe.pp_schedule, pipe.pp_stages_per_rank)
                if key not in splits:
                    splits[key] = _split_string(args, pipe, costs)
                split_pipelines[pipe] = dataclasses.replace(pipe, pp_layout=splits[key])
            plan = dataclasses.replace(plan, pipeline=split_pipelines[pipe])
        group = (plan.dp_shard, plan.ep, plan.tp, plan.cp, plan.ep_as_cp, pipe.pp, pipe.pp_schedule,
                 pipe.pp_stages_per_rank)
        groups.setdefault(group, []).append((index, plan))
    job = functools.partial(
        _fitting, flavor, seq_len, gpu_memory_gib, hardware, prune, memo, args, costs, ModelFigures.of(args, seq_len)
    )
    progress = Progress("plan: layouts estimated", len(plans))
    found: list[tuple[int, Ranked]] = []
    with _pool(workers) as pool:
        for done, fitting in pool(job, list(groups.values())):
            found += fitting
            progress.update(done, fit=len(found))
    progress.close(fit=len(found))
    # Fastest first; equal times in the order of enumeration, as one process finds them.
    found.sort(key=lambda item: (item[1].time["seconds"], item[0]))
    return [ranked for _, ranked in found], len(plans)


def _fitting(flavor: str, seq_len: int, gpu_memory_gib: float, hardware: Hardware, prune: bool, memo: bool, args,
             costs: PipelineCosts, figures: ModelFigures,
             group: list[tuple[int, Plan]]) -> tuple[int, list[tuple[int, Ranked]]]:
    """The layouts of one group (``plan_layouts``) that fit, with their places in the enumeration;
    and how many layouts the group had."""
    states = None  # the group's lower bound, from its first estimate
    fitting = []
    est = None
    # The group's layouts repeat their ranks' states and block figures (trainer/planning/memory.py).
    cache = EstimateCache(args) if memo else None
    for index, plan in group:
        if prune and states is not None and states + RESERVE_GIB > gpu_memory_gib:
            break  # every later layout of the group is bounded alike
        if plan.moe_overlap:  # not in the estimator: the plain layout's, enumerated just before
            memory = est["gib"]["total"]
            if memory + RESERVE_GIB <= gpu_memory_gib:
                fitting.append((index, Ranked(plan, memory, step_time(args, plan, hardware, figures))))
            continue
        est = estimate(flavor, plan.dp_shard, plan.ep, plan.tp, plan.cp, seq_len, plan.local_batch_size, plan.ac,
                       model_args=args, stage_costs=costs, pipeline=plan.pipeline, ep_as_cp=plan.ep_as_cp,
                       recompute_modules=plan.recompute_modules, cache=cache)
        states = _states_gib(est) if states is None else states
        memory = est["gib"]["total"]
        if memory + RESERVE_GIB <= gpu_memory_gib:
            fitting.append((index, Ranked(plan, memory, step_time(args, plan, hardware, figures))))
    return len(group), fitting


@contextlib.contextmanager
def _pool(workers: int):
    """``map(job, items)`` yielding results as they come: in this process for one worker, else in
    ``workers`` processes (the estimates are pure functions of their arguments)."""
    if workers <= 1:
        yield lambda job, items: map(job, items)
        return
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        yield lambda job, items: pool.imap_unordered(job, items, chunksize=8)


def check_flags(flavor: str, ranked: Ranked, config_file: str | None = None) -> None:
    """The printed flags through the config loader and the pre-launch check (ConfigError if not)."""
    argv = (["--job.config_file", config_file] if config_file else []) + ["--model.flavor", flavor, *ranked.flags()]
    cfg = load_config(argv)
    layout = Layout.from_job(cfg, ranked.plan.gpus)
    check_model_fit(cfg, layout)
    layout.check_batch(cfg.training.local_batch_size, cfg.training.global_batch_size)


def find(ranked: list[Ranked], **fields) -> tuple[int, Ranked] | None:
    """The best-ranked layout (1-based rank) whose plan has these values, by their config names
    (``pp_schedule``, ``pp_stages_per_rank``, ``pp_microbatches`` are the pipeline's)."""
    for i, r in enumerate(ranked, 1):
        if all(r.plan.field(k) == v for k, v in fields.items()):
            return i, r
    return None
