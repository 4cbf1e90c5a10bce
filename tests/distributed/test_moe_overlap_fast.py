"""The overlapped MoE steps give bitwise the plain steps' losses, gradients and MoE token counts,
in the fast tier's shared 2-rank launch (tests/distributed/conftest.py), 2 micro-batches each:
``MoEOverlapStep`` (trainer/parallel/moe_overlap.py) in ``dp_shard 2 x ep 2`` on a 3-block debug
model, and DualPipeV's interleaved OVERLAP_F_B (trainer/parallel/pipeline_overlap.py) in ``pp 2``
with the all-to-all dispatcher over a group of one (2 ranks leave none for ep beside pp: ep
borrows from dp_shard inside a pipeline rank). tests/distributed/test_moe_overlap.py (slow) runs
them through the Trainer with 4 micro-batches, real ep exchanges under pp (``pp 2 x dp_shard 2 x
ep 2``, 4 ranks), FSDP under pp, the collective order and the host reads."""

import pytest

pytestmark = pytest.mark.numerics  # docs/numerics.md


def _assert_bitwise(ranks: list[dict]) -> None:
    assert sorted(r["rank"] for r in ranks) == [0, 1], ranks
    for r in ranks:
        assert r["plain_losses"] == r["overlap_losses"], r
        assert r["same_grad_names"] and any("experts.w1" in n for n in r["grads"]), r["grads"]
        assert not r["grads_differing"], r["grads_differing"]
        assert any("tokens_per_expert" in n for n in r["buffers"]), r["buffers"]
        assert not r["buffers_differing"], r["buffers_differing"]


def test_overlap_step_is_the_plain_step_bit_for_bit(two_ranks):
    ranks = two_ranks["moe_overlap"]
    _assert_bitwise(ranks)
    assert [r["moe_layers"] for r in ranks] == [3, 3]  # two MoE blocks and MTP's


def test_dualpipev_overlap_is_plain_dualpipev_bit_for_bit(two_ranks):
    ranks = two_ranks["moe_overlap_dualpipev"]
    _assert_bitwise(ranks)
    # Both ranks ran OVERLAP_F_B interleaved, one MoE block beside one (each stage holds one).
    assert [r["pairs"] for r in sorted(ranks, key=lambda r: r["rank"])] == [[(1, 1)], [(1, 1)]], ranks
    # Rank 0 holds the last stage: its loss sums are the pipeline's.
    assert all(loss > 0 for r in ranks if r["rank"] == 0 for loss in r["plain_losses"]), ranks
