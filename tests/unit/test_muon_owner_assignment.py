"""The owner assignment of owned Newton-Schulz (trainer/optim/muon_owners.py): a pure function of the
shapes and the rank count, shared by the optimizer and benchmarks/optim_bench.py."""

import pytest

from trainer.optim.muon_owners import assign_owners, ns_flops, owned_ns_flops


def test_ns_flops_counts_the_three_products_per_iteration():
    # 128 x 384: X X^T 2*128*384*128, G G 2*128^3, (.) X 2*128*128*384, five times.
    assert ns_flops((128, 384), 5) == 5 * (2 * 128 * 384 * 128 * 2 + 2 * 128**3)
    assert ns_flops((384, 128), 5) == ns_flops((128, 384), 5)
    assert ns_flops((8, 128, 384), 5) == 8 * ns_flops((128, 384), 5)


def test_lpt_owners_are_deterministic_and_balanced():
    costs = [ns_flops(s, 5) for s in [(512, 1536)] * 3 + [(256, 512)] * 7 + [(64, 64)] * 11]
    owners = assign_owners(costs, 4)
    assert owners == assign_owners(list(costs), 4)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(4)]
    # LPT's bound: the busiest rank carries at most the mean plus the largest single matrix.
    assert max(loads) <= sum(costs) / 4 + max(costs)
    assert sorted(set(owners)) == [0, 1, 2, 3]


def test_owners_balance_against_work_a_rank_already_has():
    costs = [1.0] * 6
    owners = assign_owners(costs, 3, base=[4.0, 0.0, 0.0])
    assert 0 not in owners and owners.count(1) == owners.count(2) == 3


@pytest.mark.parametrize("ranks", [1, 2, 4, 64])
def test_owned_flops_sum_to_the_whole_and_fall_with_the_group(ranks):
    shapes = [(7168, 16384)] * 4 + [(1536, 7168)] * 8 + [(576, 7168)] * 8
    per_rank = owned_ns_flops(shapes, ranks, 5)
    assert len(per_rank) == ranks
    assert sum(per_rank) == pytest.approx(sum(ns_flops(s, 5) for s in shapes))
    assert max(per_rank) <= sum(per_rank) / ranks + max(ns_flops(s, 5) for s in shapes)


def test_candidates_confine_owners_in_one_pass():
    # Two groups of two ranks for the small matrices, any rank for the large one: the rank that
    # takes the large matrix takes fewer small ones of its group.
    costs = [4.0] + [1.0] * 8
    candidates = [None] + [(0, 1)] * 4 + [(2, 3)] * 4
    owners = assign_owners(costs, 4, candidates=candidates)
    assert owners == assign_owners(list(costs), 4, candidates=list(candidates))
    assert all(o in c for o, c in zip(owners[1:], candidates[1:]))
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(4)]
    assert owners[0] == 0 and loads == [4.0, 4.0, 2.0, 2.0]


def test_held_matrices_stay_with_their_holders_unless_that_unbalances():
    # Eight equal matrices, four held by rank 0 and four by rank 1, in turn over their holders (the
    # owner plan's order): balanced already, none moves. Eight held by rank 0 alone, any of four
    # ranks may own them: they spread evenly, rank 0 keeping its share.
    costs = [1.0] * 8
    assert assign_owners(costs, 2, holders=[[0], [1]] * 4) == [0, 1] * 4
    owners = assign_owners(costs, 4, holders=[[0]] * 8)
    assert [owners.count(r) for r in range(4)] == [2, 2, 2, 2] and owners[0] == 0


def test_tp_replicas_join_expert_groups_within_their_ep_slice():
    from trainer.optim.muon_owners import _joined_groups

    # dp_shard 2 x tp 2 (tp fastest): each fsdp group's tp peers hold the same experts.
    joined = _joined_groups([(0, 2), (1, 3), (0, 1), (2, 3)])
    assert set(joined.values()) == {(0, 1, 2, 3)}
    # efsdp 2 x ep 2 x tp 2: the tp peers join their ep slice's group; ep slices stay apart.
    joined = _joined_groups([(0, 4), (2, 6), (1, 5), (3, 7), (0, 1), (2, 3), (4, 5), (6, 7)])
    assert joined[(0, 4)] == joined[(1, 5)] == (0, 1, 4, 5) and joined[(2, 6)] == joined[(3, 7)] == (2, 3, 6, 7)
    # Plain stacks under tp 2: each rank's own group joins its peer's; without replicas nothing joins.
    assert _joined_groups([(0,), (1,), (0, 1)])[(1,)] == (0, 1)
    assert _joined_groups([(0, 2), (1, 3)]) == {(0, 2): (0, 2), (1, 3): (1, 3)}
