"""Every gradient of one pipelined training step equals one process's (gloo, CPU, fp32), and the
zero-bubble schedules' FSDP guard (trainer/parallel/pipeline_step.py) holds.

- Fast tier, 2 ranks: pp 2 with every schedule torch ships (the pipeline runtime of
  each, including the V schedules, whose rank 0 shares its embedding with MTP on the last stage,
  and the looped ones with four stages). The zero-bubble schedules again with full activation
  checkpointing: one weight pass (trainer/parallel/weight_pass.py `weight_pass`) recomputes each
  checkpointed block at most once per micro-batch for its input gradients and once for its weight
  gradients, where torch's own weight pass recomputes it once per parameter group, and the
  gradients equal torch's path bit for bit (the same calls on the same recomputed values).
  DualPipeV once more with at most one weight pass waiting: bitwise the same gradients.
- pp 2 x FSDP 2 on 4 ranks with DualPipeV, ZBVZeroBubble and InterleavedZeroBubble, and the V
  schedules with EP 2 too: the stage modules are FSDP roots with ``reshard_after_forward=False``
  inside, and every gradient (the routed experts' second parameter group on "efsdp" included) is
  reduced once, after the weight pass.
- The negative control, in the same 4-rank job: the same pipeline with the blocks' units resharding
  after forward gives wrong or missing gradients (torch 2.13), and the step builder refuses it.
  When torch fixes this the control fails, and the guard can go.

Bound: rel 1e-5 of each tensor's largest gradient (sharding and splitting only reorder fp32 sums).
"""

from __future__ import annotations

import pipeline_grads_worker
import pytest

from trainer.config.schedules import PP_SCHEDULES, ZERO_BUBBLE_SCHEDULES
from trainer.diagnostics import spawn_local_jobs

pytestmark = pytest.mark.numerics  # docs/numerics.md

REL = 1e-5
# (schedule, ep) under pp 2 x FSDP 2.
FSDP_CASES = [(s, 1) for s in ZERO_BUBBLE_SCHEDULES] + [("DualPipeV", 2), ("ZBVZeroBubble", 2)]


def _by_case(results: list[dict]) -> dict[tuple, list[dict]]:
    """Results by (schedule, ep, negative_control), each a list over the ranks."""
    by_case: dict[tuple, list[dict]] = {}
    for r in sorted(results, key=lambda r: r["rank"]):
        case = r["case"]
        by_case.setdefault((case["schedule"], case["ep"], case["negative_control"]), []).append(r)
    return by_case


def _assert_matches(ranks: list[dict]) -> None:
    assert ranks
    for r in ranks:
        assert r["params"] > 0 and not r["missing"], r
        assert r["max_rel"] <= REL, r


def _by_ac(results: list[dict]) -> dict[tuple, list[dict]]:
    """Results by (schedule, activation checkpointing mode), each a list over the ranks."""
    by_case: dict[tuple, list[dict]] = {}
    for r in sorted(results, key=lambda r: r["rank"]):
        by_case.setdefault((r["case"]["schedule"], r["case"]["ac"]), []).append(r)
    return by_case


def _recomputes(calls: dict) -> list[int]:
    """Each checkpointed block's recomputations per micro-batch (its calls less the forward)."""
    return [n - 1 for n in calls.values()]


@pytest.fixture(scope="module")
def jobs(selected) -> dict[str, list[dict]]:
    """The selected tests' jobs in one spawn (4 ranks with the FSDP cases, else 2): each job's
    results, one per case and rank. The 4-rank job first: ranks 2 and 3 then leave."""
    jobs = {}
    fsdp_tests = ("test_zero_bubble_under_fsdp_matches_one_process", "test_resharding_after_forward_is_wrong_and_refused")
    if any(selected(f"test_pipeline_grads.py::{test}") for test in fsdp_tests):
        cases = [dict(schedule=s, pp=2, dp_shard=2, ep=ep, negative_control=False) for s, ep in FSDP_CASES]
        cases.append(dict(schedule="DualPipeV", pp=2, dp_shard=2, ep=1, negative_control=True))
        jobs["fsdp"] = (pipeline_grads_worker.run_job, (cases,), 4)
    if selected("test_pipeline_grads.py::test_every_schedule_matches_one_process"):
        cases = [dict(schedule=s, pp=2, dp_shard=1, ep=1, negative_control=False, ac="none") for s in PP_SCHEDULES]
        cases += [dict(schedule=s, pp=2, dp_shard=1, ep=1, negative_control=False, ac="full")
                  for s in ZERO_BUBBLE_SCHEDULES]
        jobs["schedules"] = (pipeline_grads_worker.run_job, (cases,), 2)
    out = spawn_local_jobs(jobs, max(job[2] for job in jobs.values()), timeout=900)
    return {name: [r for rank in got for r in rank] for name, got in out.items()}


def test_every_schedule_matches_one_process(jobs):
    results = _by_ac(jobs["schedules"])
    for schedule in PP_SCHEDULES:
        _assert_matches(results[schedule, "none"])
    for schedule in ZERO_BUBBLE_SCHEDULES:
        ranks = results[schedule, "full"]
        _assert_matches(ranks)
        for r in ranks:
            # Each block of the rank's stages, per micro-batch: recomputed once for a full backward
            # (DualPipeV's overlapped pairs; the first stage, whose input pass torch skips and whose
            # weight pass is its whole backward), else once for the input pass and once for the
            # weight pass.
            ours, theirs = _recomputes(r["calls"]), _recomputes(r["torch_path"]["calls"])
            assert ours and len(ours) == len(theirs), r
            assert max(ours) <= 2 and min(ours) >= 1, (schedule, r["rank"], r["calls"])
            # The count sees torch's repeats: its weight pass recomputes a block per parameter group.
            assert max(theirs) > 2, (schedule, r["rank"], r["torch_path"]["calls"])
            assert r["torch_path"]["bitwise"], (schedule, r["rank"])
    # DualPipeV with at most one weight pass waiting (``pp_max_deferred_weight_passes = 1``): rank 1
    # ends the schedule's own order with two waiting; the oldest is taken in its input pass
    # instead, and every gradient is bitwise the schedule's own order's.
    capped = [r["torch_path"] for r in results["DualPipeV", "full"]]
    assert [c["waiting"] for c in capped] == [(1, 1), (2, 1)], capped
    assert all(c["capped_bitwise"] for c in capped), capped


@pytest.fixture(scope="module")
def fsdp_results(jobs):
    return _by_case(jobs["fsdp"])


@pytest.mark.slow
@pytest.mark.parametrize("schedule, ep", FSDP_CASES)
def test_zero_bubble_under_fsdp_matches_one_process(fsdp_results, schedule, ep):
    _assert_matches(fsdp_results[schedule, ep, False])


@pytest.mark.slow
def test_resharding_after_forward_is_wrong_and_refused(fsdp_results):
    ranks = fsdp_results["DualPipeV", 1, True]
    assert len(ranks) == 4
    assert any(r["missing"] or r["max_rel"] > 1e-3 for r in ranks), ranks
    for r in ranks:
        assert r["refused"] and "reshard after forward" in r["refused"], r
