"""Sharded Engram tables (gloo, 1/2/4 ranks) equal the unsharded single-process model.

Each rank sees different tokens (with n-grams repeated within and across ranks). Checked per
rank (see engram_worker.py): logits, table gradients, the shard-once gradient norm, the
parameters after an Adam step (also with CPU-held optimizer state), identical hash constants on
every rank, and the number of all-to-alls per step with precompute on (one exchange for all
layers) and off (one per layer). With precompute on, each world size also checks context
parallelism over the same ranks (ids hashed before the split, the short conv's left context from
the other ranks): logits and every gradient against the unsplit model.
"""

import engram_worker
import pytest

pytestmark = pytest.mark.numerics  # docs/numerics.md

N_ENGRAM_LAYERS = len(engram_worker.ENGRAM.layer_ids)


@pytest.fixture(scope="module")
def launch(request):
    """`launch(world)`: the all-to-all counts by rank, {precompute: counts}; one launch per world
    size, precompute off checked at world size 2 only (it changes the exchanges, not the sharding
    that the world sizes vary). World sizes 1 and 2 run in the fast tier's shared 2-rank launch,
    4 in the shared 4-rank one (tests/distributed/conftest.py)."""
    cache: dict[int, dict] = {}

    def get(world: int) -> dict:
        if world not in cache:
            if world in (1, 2):
                results = dict(request.getfixturevalue("two_ranks")["engram" if world == 2 else "engram_world_1"])
            else:
                results = dict(request.getfixturevalue("four_ranks")["engram_world_4"])
            assert sorted(results) == list(range(world)), results
            for rank, r in results.items():
                assert isinstance(r, dict), f"rank {rank}: {r}"
            cache[world] = results
        return cache[world]

    return get


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sharded_matches_unsharded(launch, world):
    results = launch(world)
    # One exchange for all layers: counts + ids + rows in forward, rows' grads in backward.
    assert all(r[True] == {"forward_a2a": 3, "backward_a2a": 1} for r in results.values()), results


def test_precompute_off_exchanges_per_layer(launch):
    results = launch(2)
    expected = {"forward_a2a": 3 * N_ENGRAM_LAYERS, "backward_a2a": N_ENGRAM_LAYERS}
    assert all(r[False] == expected for r in results.values()), results
