"""The overlapped MoE step (``[parallelism] moe_overlap``) is the plain step, bit for bit, in
``dp_shard 2 x ep 2`` with 4 accumulated micro-batches, issues the same collectives in the same
order on every rank, and keeps the one host read per MoE layer and micro-batch."""

from __future__ import annotations

import moe_overlap_worker
import pytest

from trainer.diagnostics import spawn_local

# One 2-rank launch (~50 s on 2 shared cores) serves the three tests.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    workdir = tmp_path_factory.mktemp("moe_overlap")
    return sorted(spawn_local(moe_overlap_worker.run, 2, str(workdir), timeout=300), key=lambda r: r["rank"])


def test_overlap_gives_bitwise_the_plain_losses_and_gradients(ranks):
    for r in ranks:
        assert r["micro_batches"] == 4
        assert r["plain_losses"] == r["overlap_losses"], r
        assert r["plain_losses"][1] != r["plain_losses"][0]
        assert r["same_grad_names"] and any("experts.w1" in n for n in r["grads"])
        assert not r["grads_differing"], r["grads_differing"]


def test_every_rank_issues_the_same_collectives_in_the_same_order(ranks):
    sequences = [r["collectives"] for r in ranks]
    assert any("alltoall" in op for op in sequences[0]), sequences[0][:20]
    assert sequences[0] == sequences[1]


def test_overlap_keeps_one_host_read_per_moe_layer_and_micro_batch(ranks):
    for r in ranks:
        # As tests/distributed/test_step_sync_ep.py: the step's own 3 reads, then the split sizes.
        assert r["host_reads"] <= 3 + r["moe_layers"] * r["micro_batches"], r["host_reads"]
