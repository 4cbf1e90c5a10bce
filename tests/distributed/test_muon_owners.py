"""Each Muon matrix is orthogonalised once (issue 32): one training step of the real trainer on 4
gloo ranks under `dp_shard 4` and under `pp 2 x dp_shard 2 x ep 2`, counting every rank's
Newton-Schulz calls (tests/distributed/muon_owner_worker.py).

The calls summed over the ranks are the model's 2-D Muon matrices, each once (its owner's), plus
one batched call per local expert stack on every rank; the busiest rank's NS FLOPs (expert stacks
included) stay within 25% of the mean (printed): owners are balanced over all ranks, so the pipeline
stage with more matrices hands some to the other stage's ranks. In the same processes, two Muon
steps in each placement a 2-D parameter gets (FSDP, HSDP, FSDP x TP, FSDP over TP's dim,
replicated) give one process's weights bitwise."""

from __future__ import annotations

import muon_owner_worker
import pytest

from trainer.diagnostics import free_port, spawn_local


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    workdir = tmp_path_factory.mktemp("muon_owners")
    out = spawn_local(muon_owner_worker.run, 4, str(workdir), [free_port(), free_port()], timeout=300)
    return sorted(out, key=lambda r: r["rank"])


@pytest.mark.slow  # 4 ranks build the trainer twice
@pytest.mark.parametrize("layout", list(muon_owner_worker.LAYOUTS))
def test_each_matrix_is_orthogonalised_once(ranks, layout):
    got = [r[layout] for r in ranks]
    assert len(got) == 4 and all(g["loss"] > 0 for g in got)
    matrices = set().union(*(g["matrices"] for g in got))  # every stage's, each named once
    assert sum(g["calls"]["matrix"] for g in got) == len(matrices) > 0
    for g in got:
        # A share only (owners are balanced over all ranks, also across pipeline stages), and one
        # batched call per local expert stack.
        assert 0 < g["calls"]["matrix"] < len(matrices)
        assert g["calls"]["stack"] == g["stacks"] > 0
    flops = [g["flops"] for g in got]
    mean = sum(flops) / len(flops)
    print(f"{layout}: NS FLOPs per rank {[f'{f:.3g}' for f in flops]}, max / mean {max(flops) / mean:.3f}")
    assert max(flops) <= 1.25 * mean


@pytest.mark.slow
def test_every_placement_gives_one_process_weights_bitwise(ranks):
    for r in ranks:
        assert r["placements"] == dict.fromkeys(r["placements"], True) and len(r["placements"]) == 5, r["placements"]
