"""Every gradient of one pipelined training step equals one process's (gloo, CPU, fp32), and the
zero-bubble schedules' FSDP guard (trainer/parallel/pipeline_step.py) holds.

- Fast tier: pp 2 with DualPipeV (stages 0 and 3 on rank 0, which shares its embedding with MTP)
  on 2 ranks, no data parallelism: the pipeline runtime in the fast tier.
- pp 2 x FSDP 2 with DualPipeV on 4 ranks: the stage modules are FSDP roots with
  ``reshard_after_forward=False`` inside, and every gradient is reduced once, after the weight pass.
- The negative control: the same pipeline with every unit resharding after forward gives wrong or
  missing gradients (torch 2.13), and the step builder refuses it. When torch fixes this the
  control fails, and the guard can go.

Bound: rel 1e-5 of each tensor's largest gradient (sharding and splitting only reorder fp32 sums).
"""

from __future__ import annotations

import pipeline_grads_worker
import pytest

from trainer.diagnostics import spawn_local

REL = 1e-5


def _run(world: int, **layout) -> list[dict]:
    return sorted(spawn_local(pipeline_grads_worker.run, world, layout, timeout=300), key=lambda r: r["rank"])


def test_dualpipev_gradients_match_one_process():
    ranks = _run(2, schedule="DualPipeV", pp=2, dp_shard=1, ep=1, negative_control=False)
    for r in ranks:
        assert r["params"] > 0 and not r["missing"], r
        assert r["max_rel"] <= REL, r


@pytest.mark.slow
def test_dualpipev_under_fsdp_gradients_match_one_process():
    ranks = _run(4, schedule="DualPipeV", pp=2, dp_shard=2, ep=1, negative_control=False)
    for r in ranks:
        assert r["params"] > 0 and not r["missing"], r
        assert r["max_rel"] <= REL, r


@pytest.mark.slow
def test_resharding_after_forward_is_wrong_and_refused():
    ranks = _run(4, schedule="DualPipeV", pp=2, dp_shard=2, ep=1, negative_control=True)
    assert any(r["missing"] or r["max_rel"] > 1e-3 for r in ranks), ranks
    for r in ranks:
        assert r["refused"] and "reshard after forward" in r["refused"], r
