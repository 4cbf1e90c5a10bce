"""Under expert parallelism a training step may read the device once more per MoE layer and
micro-batch: the all-to-all split sizes, the one documented sync of the EP dispatcher."""

from __future__ import annotations

import pytest
import step_sync_worker

from trainer.diagnostics import spawn_local

pytestmark = pytest.mark.numerics  # docs/numerics.md


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    # Spawned from this process: a launcher process of its own would only add an import of torch.
    workdir = tmp_path_factory.mktemp("step_sync_ep")
    return sorted(spawn_local(step_sync_worker.run, 2, str(workdir)), key=lambda r: r["rank"])


def test_ep_step_reads_the_device_once_per_moe_layer_beyond_three(ranks):
    assert len(ranks) == 2
    for r in ranks:
        assert r["moe_layers"] > 0 and r["loss"] > 0
        allowed = 3 + r["moe_layers"] * r["micro_batches"]
        assert sum(r["reads"].values()) <= allowed, r


def test_ep_step_has_no_atomic_scatter(ranks):
    assert not any(r["atomic_ops"] for r in ranks), ranks
