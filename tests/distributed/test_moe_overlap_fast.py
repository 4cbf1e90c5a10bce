"""The overlapped MoE step (``MoEOverlapStep``, trainer/parallel/moe_overlap.py) gives bitwise the
plain step's losses, gradients and MoE token counts in ``dp_shard 2 x ep 2``: one (B_0, F_1) pair
of 2 micro-batches on a 3-block debug model, in the fast tier's shared 2-rank launch
(tests/distributed/conftest.py). tests/distributed/test_moe_overlap.py (slow) runs 4 micro-batches
through the Trainer, the collective order, the host reads and DualPipeV's overlap, which needs
``pp 2 x ep 2``: 4 ranks (``ep`` borrows from ``dp_shard`` inside one pipeline rank)."""

import pytest

pytestmark = pytest.mark.numerics  # docs/numerics.md


def test_overlap_step_is_the_plain_step_bit_for_bit(two_ranks):
    ranks = two_ranks["moe_overlap"]
    assert sorted(r["rank"] for r in ranks) == [0, 1], ranks
    for r in ranks:
        assert r["moe_layers"] == 3, r  # two MoE blocks and MTP's
        assert r["plain_losses"] == r["overlap_losses"], r
        assert r["same_grad_names"] and any("experts.w1" in n for n in r["grads"]), r["grads"]
        assert not r["grads_differing"], r["grads_differing"]
        assert any("tokens_per_expert" in n for n in r["buffers"]), r["buffers"]
        assert not r["buffers_differing"], r["buffers_differing"]
