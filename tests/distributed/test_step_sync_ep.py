"""Under expert parallelism a training step may read the device once more per MoE layer and
micro-batch: the all-to-all split sizes, the one documented sync of the EP dispatcher."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.numerics  # docs/numerics.md


@pytest.fixture(scope="module")
def ranks(two_ranks) -> list[dict]:
    # tests/distributed/step_sync_worker.py in the fast tier's shared 2-rank launch
    # (tests/distributed/conftest.py): a launch of its own would only add an import of torch.
    return sorted(two_ranks["step_sync_ep"], key=lambda r: r["rank"])


def test_ep_step_reads_the_device_once_per_moe_layer_beyond_three(ranks):
    assert len(ranks) == 2
    for r in ranks:
        assert r["moe_layers"] > 0 and r["loss"] > 0
        allowed = 3 + r["moe_layers"] * r["micro_batches"]
        assert sum(r["reads"].values()) <= allowed, r


def test_ep_step_has_no_atomic_scatter(ranks):
    assert not any(r["atomic_ops"] for r in ranks), ranks
