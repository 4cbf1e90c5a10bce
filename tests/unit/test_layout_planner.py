"""The layout planner (trainer/layout_planner.py) and its step-time model (trainer/step_time.py)."""

from __future__ import annotations

import pytest

from models.deepseek_v3 import get_flavor
from trainer.config import ConfigError
from trainer.config.pipeline_layout import PipelinePlan
from trainer.layout_planner import RESERVE_GIB, check_flags, find, plan_layouts
from trainer.step_time import Hardware, Plan, bubble_fraction, step_time

# The 4-process layouts of tests/e2e/test_layout_parity.py (LAYOUTS), as plan fields by their config
# names. Not listed: the Engram layouts (another model) and moe_overlap (not enumerated).
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
    from trainer.config import load_config
    from trainer.layout_planner import Ranked

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
    from trainer.layout_planner import candidates

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
    """The planner skips the estimate of layouts whose states alone cannot fit (``prune``): the same
    layouts, memory figures, step times and order as estimating every one, with fewer estimates.
    16B on 16 GPUs with 40 GiB, where the HSDP-heavy layouts' states exceed the GPU."""
    import trainer.layout_planner as planner

    calls = {"estimate": 0}
    real = planner.estimate

    def counted(*args, **kwargs):
        calls["estimate"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "estimate", counted)
    every = plan_layouts("16B", 16, 40.0, 8, 4096, 32, Hardware(), prune=False)
    estimated = calls["estimate"]
    pruned = plan_layouts("16B", 16, 40.0, 8, 4096, 32, Hardware())
    assert estimated == every[1] and calls["estimate"] - estimated < estimated
    assert 0 < len(pruned[0]) < pruned[1]
    assert pruned == every


def test_modules_recompute_is_enumerated_and_charged_its_up_projections():
    """The planner lists DeepSeek's selective recompute (``modules``) beside none and full; its
    printed flags load, and the step-time model charges it the MLA up-projections' FLOPs once more:
    above no checkpointing, below full's extra forward."""
    from trainer.config import load_config
    from trainer.layout_planner import Ranked, candidates

    assert {p.ac for p in candidates("debugmodel", 4, 8, 32, 8)} == {"none", "modules", "full"}
    args, hw = get_flavor("671B"), Hardware()
    plans = {ac: Plan(2048, 1, 128, 1, 1, 64, PipelinePlan(pp=16, pp_microbatches=32), 32, 1, 4096, ac)
             for ac in ("none", "modules", "full")}
    compute = {ac: step_time(args, plan, hw)["compute_s"] for ac, plan in plans.items()}
    assert compute["none"] < compute["modules"] < compute["full"]
    ranked = Ranked(plans["modules"], 0.0, step_time(args, plans["modules"], hw))
    cfg = load_config(["--model.flavor", "671B", *ranked.flags()])
    assert cfg.activation_checkpoint.mode == "modules"


def test_two_worker_processes_rank_exactly_as_one():
    """``workers`` splits the groups over processes: the same ranking, ties in the same order."""
    one = plan_layouts("debugmodel", 4, 80.0, 8, 32, 8, Hardware())
    two = plan_layouts("debugmodel", 4, 80.0, 8, 32, 8, Hardware(), workers=2)
    assert one == two and one[0]
