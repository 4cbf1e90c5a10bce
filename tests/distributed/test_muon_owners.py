"""Each Muon matrix is orthogonalised once (issue 32): one training step of the real trainer on 4
gloo ranks under `dp_shard 4`, `pp 2 x dp_shard 2 x ep 2`, HSDP 2x2 (replicas of sharded expert
stacks), `dp_shard 4 x ep 2` with two routed experts (efsdp 2 over one expert per EP rank, so
one efsdp rank of each pair holds none) and `dp_shard 2 x tp 2` (TP leaves the routed experts
whole on both tp ranks: replicas, whose expert gradients and weights are checked bitwise equal),
counting every rank's Newton-Schulz calls (tests/distributed/muon_owner_worker.py).

What counts: a matrix is one 2-D matrix or one expert of a stack `[E, A, B]`. A call is one
`newton_schulz` (a 2-D matrix on its owner) or one `batched_newton_schulz`: a stack a rank holds
alone (pp 2 x dp_shard 2 x ep 2: efsdp 1, no replica), or the expert matrices one owner
orthogonalises in one bucket, one call per shape (the debug model's experts are all 128 x 128
and fit one bucket: one call per owning rank). Over the world, every matrix, expert matrices
included, is orthogonalised by exactly one rank (named from the owner plans and the stacks held
alone; the kernels' batch sizes add up to each rank's share); the busiest rank's NS FLOPs stay
within 25% of the mean (printed): owners are balanced over all ranks, experts within their
expert-parallel slice. In the fast tier, two Muon steps in each placement a 2-D parameter or an
expert stack gets give one process's weights bitwise. Both in the 4 ranks the distributed tests
share (tests/distributed/conftest.py `four_ranks`)."""

from __future__ import annotations

import collections

import muon_owner_worker
import pytest

pytestmark = pytest.mark.numerics  # docs/numerics.md


@pytest.fixture(scope="module")
def ranks(four_ranks) -> list[dict]:
    # In the 4 ranks the distributed tests share (tests/distributed/conftest.py).
    return sorted(four_ranks["muon_layouts"], key=lambda r: r["rank"])


@pytest.mark.slow  # 4 ranks build the trainer four times
@pytest.mark.parametrize("layout", list(muon_owner_worker.LAYOUTS))
def test_each_matrix_is_orthogonalised_once(ranks, layout):
    got = [r[layout] for r in ranks]
    assert len(got) == 4 and all(g["loss"] > 0 for g in got)
    matrices = set().union(*(g["matrices"] for g in got))  # every stage's, each named once
    stacks = {name: n for g in got for name, n in g["stacks"].items()}
    experts = {(name, e) for name, n in stacks.items() for e in range(n)}
    named = {key: name for g in got for key, name in g["named_keys"].items()}
    done = collections.Counter(m for g in got for m in [named[k] for k in g["owned_keys"]] + g["local_experts"])
    assert set(done) == matrices | experts and set(done.values()) == {1}, done.most_common(3)
    assert sum(g["calls"]["matrix"] for g in got) == len(matrices) > 0
    for g in got:
        # A share only (owners are balanced over all ranks, also across pipeline stages)
        assert 0 < g["calls"]["matrix"] < len(matrices)
        assert g["ns_matrices"] == len(g["owned_keys"]) + len(g["local_experts"])
        owns_experts = any(k[0] == 1 for k in g["owned_keys"])
        assert g["calls"]["stack"] == g["stacks_alone"] + owns_experts
    if layout != "pp_2_dp_shard_2_ep_2":  # there every rank holds its stacks alone
        assert all(g["stacks_alone"] == 0 for g in got) and sum(any(k[0] == 1 for k in g["owned_keys"]) for g in got) > 1
        # Owners within the expert-parallel slice: the ranks with one ep coordinate (ep fastest).
        ep = 2 if "ep_2" in layout else 1
        assert [g["expert_groups"] for g in got] == [[tuple(range(r % ep, 4, ep))] for r in range(4)]
    if "tp_2" in layout:
        # TP's replicas of the routed experts (tp fastest: ranks 2k and 2k + 1) see bitwise the same
        # gradients, so pooling them is exact, and their weights stay the same after the step.
        for kind in ("grads", "weights"):
            assert [g["digests"][kind] for g in got[::2]] == [g["digests"][kind] for g in got[1::2]], kind
        assert got[0]["digests"]["grads"] != got[2]["digests"]["grads"]  # FSDP shards: other experts
        # Experts spread evenly stay with a holder: only results move (to the other tp rank).
        assert all(k in g["named_keys"] for g in got for k in g["owned_keys"] if k[0] == 1)
    flops = [g["flops"] for g in got]
    mean = sum(flops) / len(flops)
    print(f"{layout}: NS FLOPs per rank {[f'{f:.3g}' for f in flops]}, max / mean {max(flops) / mean:.3f}")
    assert max(flops) <= 1.25 * mean


def test_every_placement_gives_one_process_weights_bitwise(four_ranks):
    # The owners' exchange without a trainer: plain parameters on 4 ranks, in the fast tier.
    ranks = four_ranks["muon_placements"]
    assert len(ranks) == 4
    for r in ranks:
        assert r["placements"] == dict.fromkeys(r["placements"], True) and len(r["placements"]) == 10, r["placements"]
