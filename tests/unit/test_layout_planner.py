"""The layout planner (trainer/planning/layout_planner.py) and its step-time model (trainer/planning/step_time.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from models.deepseek_v3 import get_flavor
from trainer.config import ConfigError, load_config
from trainer.config.pipeline_layout import PipelinePlan
from trainer.planning.layout_planner import RESERVE_GIB, check_flags, find, plan_layouts
from trainer.planning.step_time import (
    Hardware,
    ModelFigures,
    Plan,
    bubble_fraction,
    overlapped_pairs,
    part_flops,
    recompute_flops,
    recomputes,
    step_time,
)

# The 4-process layouts of tests/e2e/test_layout_parity.py (LAYOUTS), as plan fields by their config
# names. Not listed: the Engram layouts (another model) and moe_overlap at pp 1 (not enumerated).
PARITY_LAYOUTS = {
    "hsdp_2x2_ep_2": dict(pp=1, dp_replicate=2, dp_shard=2, cp=1, tp=1, ep=2),
    "pp_2_fsdp_2": dict(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=1, pp_schedule="1F1B"),
    "pp_2_fsdp_2_ep_2": dict(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=2, pp_schedule="1F1B"),
    "pp_2_tp_2": dict(pp=2, dp_replicate=1, dp_shard=1, cp=1, tp=2, ep=1, pp_schedule="1F1B"),
    "pp_2_cp_2": dict(pp=2, dp_replicate=1, dp_shard=1, cp=2, tp=1, ep=1, pp_schedule="1F1B"),
    "pp_2_dualpipev_fsdp_2_ep_2": dict(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=2, pp_schedule="DualPipeV"),
    "pp_2_zbv_fsdp_2": dict(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=1, pp_schedule="ZBVZeroBubble"),
    "pp_2_interleaved_zb_dp_replicate_2": dict(
        pp=2, dp_replicate=2, dp_shard=1, cp=1, tp=1, ep=1, pp_schedule="InterleavedZeroBubble"
    ),
    "pp_2_dualpipev_cp_2": dict(pp=2, dp_replicate=1, dp_shard=1, cp=2, tp=1, ep=1, pp_schedule="DualPipeV"),
    "pp_2_ep_2_as_cp": dict(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=2, ep_as_cp=True, pp_schedule="1F1B"),
}


@pytest.fixture(scope="module")
def figures_671b():
    # Counted on a meta model, seconds each: shared by the tests that time 671B layouts.
    return ModelFigures.of(get_flavor("671B"), 4096)


@pytest.fixture(scope="module")
def debug_plan():
    # The parity tests' shape: seq_len 32, global batch 8.
    return plan_layouts("debugmodel", 4, 80.0, 8, 32, 8, Hardware())


def test_the_planner_lists_the_parity_layouts_of_the_debug_model_on_4_gpus(debug_plan):
    ranked, considered = debug_plan
    assert considered >= len(ranked) > 0
    missing = [name for name, fields in PARITY_LAYOUTS.items() if find(ranked, **fields) is None]
    assert not missing, missing
    for _, r in (find(ranked, **fields) for fields in PARITY_LAYOUTS.values()):
        check_flags("debugmodel", r)  # its run_train.sh flags pass the config's own checks
    times = [r.time["seconds"] for r in ranked]
    assert times == sorted(times)


def test_no_planned_layout_exceeds_the_memory():
    every, _ = plan_layouts("debugmodel", 2, 80.0, 8, 32, 8, Hardware())
    memories = sorted(r.memory_gib for r in every)
    limit = memories[len(memories) // 2]
    ranked, _ = plan_layouts("debugmodel", 2, RESERVE_GIB + limit, 8, 32, 8, Hardware())
    assert 0 < len(ranked) < len(memories) and all(r.memory_gib <= limit for r in ranked)


def test_bubble_formulas():
    def bubble(pp, schedule, per_rank, micro):
        return bubble_fraction(PipelinePlan(pp, schedule, per_rank, micro), 0.6)

    assert bubble(4, "1F1B", 1, 8) == pytest.approx(3 / 8)
    assert bubble(4, "Interleaved1F1B", 2, 8) == pytest.approx(3 / 16)
    assert bubble(2, "DualPipeV", 2, 4) == 0.0  # (p/2 - 1) = 0
    assert 0 < bubble(16, "DualPipeV", 2, 32) < bubble(16, "1F1B", 1, 32)
    assert bubble_fraction(PipelinePlan(), 0.6) == 0.0


def test_constants_are_overridable_by_name():
    hw = Hardware().with_overrides(["peak_flops=2.25e15", "gpus_per_node=4"])
    assert hw.peak_flops == 2.25e15 and hw.gpus_per_node == 4
    with pytest.raises(ValueError, match="unknown step-time constant"):
        Hardware().with_overrides(["flops=1"])


def test_check_flags_refuses_what_the_config_refuses(debug_plan):
    ranked, _ = debug_plan
    r = ranked[0]
    bad = type(r)(plan=type(r.plan)(**{**r.plan.__dict__, "tp": 3}), memory_gib=r.memory_gib, time=r.time)
    with pytest.raises(ConfigError):
        check_flags("debugmodel", bad)


def test_a_plan_holds_its_pipeline_plan_and_its_flags_give_it_back():
    """The planner's layouts carry a `PipelinePlan` (the one reader of the pp* options): the printed
    flags, read back by the config loader, are the same plan."""
    from trainer.planning.layout_planner import Ranked

    pipeline = PipelinePlan(pp=2, pp_schedule="Interleaved1F1B", pp_stages_per_rank=2, pp_microbatches=4)
    plan = Plan(4, 1, 2, 1, 1, 2, pipeline, 4, 1, 32, "full")
    assert plan.pp == 2 and plan.field("pp_schedule") == "Interleaved1F1B" and plan.field("ep") == 2
    ranked = Ranked(plan, 0.0, step_time(get_flavor("debugmodel"), plan, Hardware()))
    cfg = load_config(["--model.flavor", "debugmodel", *ranked.flags()])
    assert PipelinePlan.from_config(cfg.parallelism) == pipeline
    assert find([ranked], pp=2, pp_stages_per_rank=2) == (1, ranked)
    assert find([ranked], pp_schedule="1F1B") is None


def test_ep_as_cp_is_enumerated_and_its_latent_exchange_timed():
    """ep_as_cp layouts are candidates where the layout checks allow them (cp 1, ep > 1), with the
    data ranks the layout gives (dp_shard / ep), and the step-time model times the context
    exchange over the ep group, which plain ep does not have."""
    from trainer.planning.layout_planner import candidates

    plans = list(candidates("debugmodel", 4, 8, 32, 8))
    as_cp = [p for p in plans if p.ep_as_cp]
    assert as_cp and all(p.cp == 1 and p.ep > 1 for p in as_cp)
    assert all(p.dp * p.local_batch_size * p.accumulation == 8 for p in plans)
    args, hw = get_flavor("debugmodel"), Hardware()
    flat = Plan(4, 1, 4, 1, 1, 4, PipelinePlan(), 2, 1, 32, "none")
    spread = Plan(4, 1, 4, 1, 1, 4, PipelinePlan(), 8, 1, 32, "none", ep_as_cp=True)
    assert flat.dp == 4 and spread.dp == 1 and spread.context == 4
    assert step_time(args, flat, hw)["exposed"]["cp"] == 0 < step_time(args, spread, hw)["exposed"]["cp"]


def test_pruning_ranks_exactly_as_estimating_every_layout(monkeypatch):
    """The planner skips the estimate of layouts whose states alone cannot fit (``prune``) and shares
    each group's repeated figures (``memo``, trainer/planning/memory.py ``EstimateCache``): the same layouts,
    memory figures, step times and order as the straightforward enumeration (every layout
    estimated on its own), with fewer estimates. 16B on 16 GPUs with 40 GiB, where the HSDP-heavy
    layouts' states exceed the GPU."""
    import trainer.planning.layout_planner as planner

    calls = {"estimate": 0}
    real = planner.estimate

    def counted(*args, **kwargs):
        calls["estimate"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "estimate", counted)
    every = plan_layouts("16B", 16, 40.0, 8, 4096, 32, Hardware(), prune=False, memo=False)
    estimated = calls["estimate"]
    pruned = plan_layouts("16B", 16, 40.0, 8, 4096, 32, Hardware())
    overlapped = sum(p.moe_overlap for p in planner.candidates("16B", 16, 8, 4096, 32))  # the plain one's estimate
    assert estimated == every[1] - overlapped and calls["estimate"] - estimated < estimated
    assert 0 < len(pruned[0]) < pruned[1]
    assert pruned == every


def test_each_named_recompute_set_is_enumerated_and_its_flags_load():
    """The planner lists no checkpointing, full, and ``modules`` with each named set (DeepSeek's and
    Megatron's), and moe_overlap exactly where the config takes it (DualPipeV, no AC, ep > 1, tp
    and cp 1): the printed flags of each load and pass the pre-launch check."""
    from trainer.planning.layout_planner import Ranked, candidates

    plans = list(candidates("debugmodel", 4, 8, 32, 8))
    modes = {(p.ac, p.recompute_modules) for p in plans}
    assert {("modules", ("deepseek",)), ("modules", ("megatron_dsv3",))} <= modes
    assert {ac for ac, _ in modes} == {"none", "modules", "full"}
    overlapped = [p for p in plans if p.moe_overlap]
    assert overlapped and all(
        p.pipeline.pp_schedule == "DualPipeV" and p.ac == "none" and p.ep > 1 and p.tp == p.cp == 1 and not p.ep_as_cp
        for p in overlapped
    )
    megatron = next(p for p in plans if p.recompute_modules == ("megatron_dsv3",) and p.pp > 1)
    for plan in (megatron, overlapped[0]):
        ranked = Ranked(plan, 0.0, step_time(get_flavor("debugmodel"), plan, Hardware()))
        check_flags("debugmodel", ranked)
    cfg = load_config(["--model.flavor", "debugmodel", *Ranked(megatron, 0.0, {}).flags()])
    assert cfg.activation_checkpoint.recompute_modules == ["megatron_dsv3"]
    assert load_config(["--model.flavor", "debugmodel", *Ranked(overlapped[0], 0.0, {}).flags()]).parallelism.moe_overlap


def test_recompute_flops_per_mode_are_the_recomputed_parts(figures_671b):
    """One recomputation costs nothing without AC, a forward of every block (MTP's too) under full,
    and under modules the chosen parts' forward FLOPs: DeepSeek's set the up-projections (its norms
    and activation are elementwise), Megatron's those and the dense blocks' FFN. The parts and the
    projections no part holds (wq_a, wkv_a, wo, the router) add up to the whole forward, counted
    from the model's parameters (models/deepseek_v3/stats.py): no part counted twice or left out."""
    args, figures = get_flavor("671B"), figures_671b
    plan = Plan(2048, 1, 128, 1, 1, 64, PipelinePlan(pp=16, pp_microbatches=32), 32, 1, 4096, "none")

    def flops(ac, parts=("deepseek",)):
        return recompute_flops(args, replace(plan, ac=ac, recompute_modules=parts), figures)

    part = part_flops(args, 4096)
    blocks = args.n_layers + args.mtp_depth
    assert flops("none") == 0 and flops("full") == figures.block_forward_flops
    assert flops("modules") == part["mla_up_proj"] > 0 and part["layernorm"] == part["moe_act"] == 0
    assert flops("modules", ("megatron_dsv3",)) == part["mla_up_proj"] + part["mlp"] > flops("modules")
    assert flops("modules", ("moe", "shared_experts")) == part["moe"]
    kept = 2 * blocks * (args.dim * (args.q_lora_rank + args.kv_lora_rank + args.qk_rope_head_dim)
                         + args.n_heads * args.v_head_dim * args.dim)
    every = flops("modules", ("layernorm", "mla_up_proj", "core_attn", "moe_act", "mlp", "moe"))
    assert every + kept == pytest.approx(figures.block_forward_flops, rel=1e-4)  # the norms' weights aside
    # op recomputes elementwise ops only; selective the checkpointed blocks, every N-th of a stage,
    # MTP's never: every main block at N = 1, blocks 0, 2, ... 60 of one stage at N = 2.
    assert flops("op") == 0
    flat = replace(plan, pipeline=PipelinePlan())
    selective = [recompute_flops(args, replace(flat, ac="selective", selective_every=n), figures) for n in (1, 2)]
    assert selective[0] == sum(figures.block_forward[: args.n_layers])
    assert selective[1] == sum(figures.block_forward[0 : args.n_layers : 2])
    # Under pp the count restarts on each rank (one stage each here): 16 stages of 3-5 blocks at
    # N = 3 checkpoint each stage's first and fourth, more blocks than every third of the model (21).
    from trainer.planning.step_time import _selective_blocks

    stages = plan.pipeline.split(args.n_layers, args.mtp_depth, figures.costs)
    staged = _selective_blocks(args, replace(plan, ac="selective", selective_every=3), figures)
    assert len(staged) == sum(-(-len([i for i in s.layers if i < args.n_layers]) // 3) for s in stages) > 21
    assert {s.layers[0] for s in stages} <= set(staged)


def test_step_time_charges_each_recomputation_pass(figures_671b):
    """Compute grows with the recomputed FLOPs: none < DeepSeek's set < Megatron's < full; a
    zero-bubble schedule recomputes a checkpointed block for its input and again for its weight
    pass (2 per micro-batch), 1F1B once, DualPipeV in between (its overlapped pairs run whole)."""
    args, hw, figures = get_flavor("671B"), Hardware(), figures_671b
    plan = Plan(2048, 1, 128, 1, 1, 64, PipelinePlan(pp=16, pp_microbatches=32), 32, 1, 4096, "none")
    modes = [("none", ("deepseek",)), ("modules", ("deepseek",)), ("modules", ("megatron_dsv3",)), ("full", ())]
    compute = [step_time(args, replace(plan, ac=ac, recompute_modules=parts or plan.recompute_modules), hw,
                         figures)["compute_s"] for ac, parts in modes]
    assert compute == sorted(compute) and len(set(compute)) == 4
    full = compute[-1] / compute[0] - 1
    assert full == pytest.approx(figures.block_forward_flops / figures.flops_per_token)  # 1F1B: once
    dualpipev = PipelinePlan(pp=16, pp_schedule="DualPipeV", pp_stages_per_rank=2, pp_microbatches=32)
    zbv = replace(dualpipev, pp_schedule="ZBVZeroBubble")
    assert recomputes(plan.pipeline) == 1 and recomputes(zbv) == 2 and 1 < recomputes(dualpipev) < 2
    zbv_full = step_time(args, replace(plan, pipeline=zbv, ac="full"), hw, figures)["compute_s"]
    assert zbv_full / compute[0] - 1 == pytest.approx(2 * full)


@pytest.mark.parametrize("pp, microbatches", [(2, 4), (2, 8), (4, 8), (4, 12), (16, 32), (16, 64)])
def test_dualpipev_pairs_and_split_backwards_are_torchs(pp, microbatches):
    """The step-time model's count of DualPipeV's overlapped pairs and split backwards per rank is
    what torch's schedule generates (private API, as of torch 2.13: this fails if torch changes it)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, _ComputationType

    from trainer.planning.step_time import _dualpipev_counts

    schedule = SimpleNamespace(pp_group_size=pp, _n_microbatches=microbatches)
    for rank, counted in enumerate(_dualpipev_counts(pp, microbatches)):
        kinds = [a.computation_type for a in ScheduleDualPipeV._calculate_single_rank_operations(schedule, rank) if a]
        assert counted == (kinds.count(_ComputationType.OVERLAP_F_B), kinds.count(_ComputationType.BACKWARD_INPUT))


def test_moe_overlap_credit_only_under_dualpipev(figures_671b):
    """moe_overlap takes from the exposed all-to-all ``moe_overlap_hiding`` of the lesser of the
    paired exchanges and the pairs' compute, under DualPipeV only; the flag elsewhere, or DualPipeV
    without it, is credited nothing."""
    args, figures = get_flavor("671B"), figures_671b
    hw = Hardware()
    dualpipev = PipelinePlan(pp=16, pp_schedule="DualPipeV", pp_stages_per_rank=2, pp_microbatches=64)
    plan = Plan(2048, 1, 128, 1, 1, 64, dualpipev, 64, 1, 4096, "none")

    def times(p, h=hw):
        return step_time(args, p, h, figures)

    plain, overlapped = times(plan), times(replace(plan, moe_overlap=True))
    paired = overlapped_pairs(dualpipev)
    assert 0 < paired < 1
    credit = hw.moe_overlap_hiding * paired * min(plain["exposed"]["ep_all_to_all"], plain["compute_s"])
    assert plain["exposed"]["ep_all_to_all"] - overlapped["exposed"]["ep_all_to_all"] == pytest.approx(credit)
    assert overlapped["seconds"] < plain["seconds"]
    assert times(replace(plan, moe_overlap=True), replace(hw, moe_overlap_hiding=0.0)) == plain
    zbv = replace(plan, pipeline=replace(dualpipev, pp_schedule="ZBVZeroBubble"))
    assert times(replace(zbv, moe_overlap=True)) == times(zbv)
    flat = replace(plan, pipeline=PipelinePlan())
    assert overlapped_pairs(flat.pipeline) == 0 and times(replace(flat, moe_overlap=True)) == times(flat)


def test_two_worker_processes_rank_exactly_as_one(debug_plan):
    """``workers`` splits the groups over processes: the same ranking, ties in the same order."""
    one = debug_plan  # the same arguments in one process
    two = plan_layouts("debugmodel", 4, 80.0, 8, 32, 8, Hardware(), workers=2)
    assert one == two and one[0]
