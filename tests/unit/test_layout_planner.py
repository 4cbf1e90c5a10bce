"""The layout planner (trainer/layout_planner.py) and its step-time model (trainer/step_time.py)."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError
from trainer.layout_planner import RESERVE_GIB, check_flags, find, plan_layouts
from trainer.step_time import Hardware, bubble_fraction

# The 4-process layouts of tests/e2e/test_layout_parity.py (LAYOUTS), as plan fields. Not listed:
# pp_2_ep_2_as_cp (the planner does not enumerate ep_as_cp) and the Engram layouts (another model).
PARITY_LAYOUTS = {
    "hsdp_2x2_ep_2": dict(pp=1, dp_replicate=2, dp_shard=2, cp=1, tp=1, ep=2),
    "pp_2_fsdp_2": dict(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=1, schedule="1F1B"),
    "pp_2_fsdp_2_ep_2": dict(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=2, schedule="1F1B"),
    "pp_2_tp_2": dict(pp=2, dp_replicate=1, dp_shard=1, cp=1, tp=2, ep=1, schedule="1F1B"),
    "pp_2_cp_2": dict(pp=2, dp_replicate=1, dp_shard=1, cp=2, tp=1, ep=1, schedule="1F1B"),
    "pp_2_dualpipev_fsdp_2_ep_2": dict(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=2, schedule="DualPipeV"),
    "pp_2_zbv_fsdp_2": dict(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=1, schedule="ZBVZeroBubble"),
    "pp_2_interleaved_zb_dp_replicate_2": dict(
        pp=2, dp_replicate=2, dp_shard=1, cp=1, tp=1, ep=1, schedule="InterleavedZeroBubble"
    ),
    "pp_2_dualpipev_cp_2": dict(pp=2, dp_replicate=1, dp_shard=1, cp=2, tp=1, ep=1, schedule="DualPipeV"),
}


@pytest.fixture(scope="module")
def debug_plan():
    # The parity tests' shape: seq_len 32, global batch 8.
    return plan_layouts("debugmodel", 4, 80.0, 8, 32, 8, Hardware())


@pytest.mark.slow
def test_the_planner_lists_the_parity_layouts_of_the_debug_model_on_4_gpus(debug_plan):
    ranked, considered = debug_plan
    assert considered >= len(ranked) > 0
    missing = [name for name, fields in PARITY_LAYOUTS.items() if find(ranked, **fields) is None]
    assert not missing, missing
    for _, r in (find(ranked, **fields) for fields in PARITY_LAYOUTS.values()):
        check_flags("debugmodel", r)  # its run_train.sh flags pass the config's own checks
    times = [r.time["seconds"] for r in ranked]
    assert times == sorted(times)


@pytest.mark.slow
def test_no_planned_layout_exceeds_the_memory():
    every, _ = plan_layouts("debugmodel", 2, 80.0, 8, 32, 8, Hardware())
    memories = sorted(r.memory_gib for r in every)
    limit = memories[len(memories) // 2]
    ranked, _ = plan_layouts("debugmodel", 2, RESERVE_GIB + limit, 8, 32, 8, Hardware())
    assert 0 < len(ranked) < len(memories) and all(r.memory_gib <= limit for r in ranked)


def test_bubble_formulas():
    assert bubble_fraction("1F1B", 4, 1, 8, 0.6) == pytest.approx(3 / 8)
    assert bubble_fraction("Interleaved1F1B", 4, 2, 8, 0.6) == pytest.approx(3 / 16)
    assert bubble_fraction("DualPipeV", 2, 2, 4, 0.6) == 0.0  # (p/2 - 1) = 0
    assert 0 < bubble_fraction("DualPipeV", 16, 2, 32, 0.6) < bubble_fraction("1F1B", 16, 1, 32, 0.6)


def test_constants_are_overridable_by_name():
    hw = Hardware().with_overrides(["peak_flops=2.25e15", "gpus_per_node=4"])
    assert hw.peak_flops == 2.25e15 and hw.gpus_per_node == 4
    with pytest.raises(ValueError, match="unknown step-time constant"):
        Hardware().with_overrides(["flops=1"])


@pytest.mark.slow
def test_check_flags_refuses_what_the_config_refuses(debug_plan):
    ranked, _ = debug_plan
    r = ranked[0]
    bad = type(r)(plan=type(r.plan)(**{**r.plan.__dict__, "tp": 3}), memory_gib=r.memory_gib, time=r.time)
    with pytest.raises(ConfigError):
        check_flags("debugmodel", bad)
