"""Expert parallelism over 2 gloo ranks: the all-to-all dispatcher gives the single-process
MoE's outputs and gradients, and reads the host once per MoE layer (the split sizes)."""

import moe_ep_worker
import pytest

pytestmark = pytest.mark.numerics  # docs/numerics.md


def test_ep2_matches_single_process_with_one_host_read_per_layer(two_ranks):
    # In the fast tier's shared 2-rank launch (tests/distributed/conftest.py).
    results = dict(two_ranks["moe_ep"])
    assert sorted(results) == [0, 1], results
    for rank, r in results.items():
        assert isinstance(r, dict), f"rank {rank}: {r}"
        assert r["reads"] == ["tolist"] * moe_ep_worker.N_LAYERS, r
