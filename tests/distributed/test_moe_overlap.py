"""The overlapped MoE step (``[parallelism] moe_overlap``) is the plain step, bit for bit, in
``dp_shard 2 x ep 2`` with 4 accumulated micro-batches, issues the same collectives in the same
order on every rank, and keeps the one host read per MoE layer and micro-batch. DualPipeV with its
OVERLAP_F_B actions interleaved (trainer/parallel/pipeline_overlap.py) is plain DualPipeV, bit
for bit, in ``pp 2 x dp_shard 2 x ep 2``, and the ranks of a pipeline stage agree on the order."""

from __future__ import annotations

import moe_overlap_worker
import pytest

from trainer.diagnostics import spawn_local_jobs

# One spawn of 4 ranks: the DualPipeV job on all four serves the two tests with DualPipeV, then
# the job on ranks 0 and 1 the three without PP.
pytestmark = [pytest.mark.slow, pytest.mark.numerics]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, list[dict]]:
    """Each job's results, sorted by rank."""
    jobs = {
        "dualpipev": (moe_overlap_worker.run_dualpipev, (str(tmp_path_factory.mktemp("moe_overlap_dualpipev")),), 4),
        "ep": (moe_overlap_worker.run, (str(tmp_path_factory.mktemp("moe_overlap")),), 2),
    }
    return {name: sorted(got, key=lambda r: r["rank"]) for name, got in spawn_local_jobs(jobs, 4, timeout=600).items()}


@pytest.fixture(scope="module")
def ranks(jobs) -> list[dict]:
    return jobs["ep"]


def _assert_bitwise(ranks: list[dict], micro_batches: int) -> None:
    for r in ranks:
        assert r["micro_batches"] == micro_batches
        assert r["plain_losses"] == r["overlap_losses"], r
        assert r["plain_losses"][1] != r["plain_losses"][0]
        assert r["same_grad_names"] and any("experts.w1" in n for n in r["grads"])
        assert not r["grads_differing"], r["grads_differing"]


def test_overlap_gives_bitwise_the_plain_losses_and_gradients(ranks):
    _assert_bitwise(ranks, 4)


def test_every_rank_issues_the_same_collectives_in_the_same_order(ranks):
    sequences = [r["collectives"] for r in ranks]
    assert any("alltoall" in op for op in sequences[0]), sequences[0][:20]
    assert sequences[0] == sequences[1]


def test_overlap_keeps_one_host_read_per_moe_layer_and_micro_batch(ranks):
    for r in ranks:
        # As tests/distributed/test_step_sync_ep.py: the step's own 3 reads, then the split sizes.
        assert r["host_reads"] <= 3 + r["moe_layers"] * r["micro_batches"], r["host_reads"]


@pytest.fixture(scope="module")
def dualpipev_ranks(jobs) -> list[dict]:
    return jobs["dualpipev"]


def test_dualpipev_overlap_gives_bitwise_the_plain_losses_and_gradients(dualpipev_ranks):
    _assert_bitwise(dualpipev_ranks, 1)  # one schedule run per step
    # Every rank ran OVERLAP_F_B interleaved: rank 0 stages 0 and 3 with one MoE block each, rank
    # 1 stages 1 (two MoE blocks) and 2 (one) in both orders (common layer, then the rest alone).
    pairs = {r["pp_rank"]: r["pairs"] for r in dualpipev_ranks}
    assert pairs == {0: [(1, 1)], 1: [(1, 2), (2, 1)]}, pairs


def test_dualpipev_overlap_ranks_of_a_stage_issue_the_same_collectives_in_order(dualpipev_ranks):
    by_stage = {}
    for r in dualpipev_ranks:
        by_stage.setdefault(r["pp_rank"], []).append(r["collectives"])
    for sequences in by_stage.values():
        assert any("alltoall" in op for op in sequences[0]), sequences[0][:20]
        assert sequences[0] == sequences[1]
