"""The pipeline's stage split and micro-batch defaults (trainer/config/pipeline_layout.py, torch-free),
and the costs the trainer splits by (models/deepseek_v3/stats.py, imported in its tests only)."""

import itertools

import pytest

from trainer.config import ConfigError
from trainer.config.layout import Layout
from trainer.config.pipeline_layout import (
    PipelineCosts,
    PipelinePlan,
    describe_split,
    parse_pp_layout,
    rank_stages,
    split_stages,
    stage_ranks,
)


def _blocks(specs):
    return [list(s.layers) for s in specs]


def test_even_split_counts_embedding_head_and_mtp_as_layers():
    # 6 blocks + E + L + 1 MTP = 9 equivalents over 2 stages: 5 | 4, i.e. E+4 blocks | 2 blocks+L+MTP.
    assert _blocks(split_stages(6, 1, 2)) == [[0, 1, 2, 3], [4, 5]]
    # Without MTP: 8 equivalents, 4 | 4.
    assert _blocks(split_stages(6, 0, 2)) == [[0, 1, 2], [3, 4, 5]]
    specs = split_stages(6, 1, 4)
    assert [len(b) for b in _blocks(specs)] == [1, 2, 2, 1] and sum(_blocks(specs), []) == list(range(6))
    assert [(s.first, s.last) for s in specs] == [(True, False), (False, False), (False, False), (False, True)]
    # 61 blocks (671B) on 16 stages: every stage gets 3 or 4 blocks, the ends fewer.
    counts = [len(b) for b in _blocks(split_stages(61, 1, 16))]
    assert sum(counts) == 61 and max(counts) - min(counts) <= 2 and counts[0] < max(counts) and counts[-1] < max(counts)


def test_explicit_layout_and_its_mistakes():
    assert parse_pp_layout("Et*2|t*4L") == [["E", "t", "t"], ["t", "t", "t", "t", "L"]]
    assert _blocks(split_stages(6, 1, 2, "Et*2|t*4L")) == [[0, 1], [2, 3, 4, 5]]
    with pytest.raises(ConfigError, match=r"places 5 blocks, the model has 6"):
        split_stages(6, 1, 2, "Et*2|t*3L")
    with pytest.raises(ConfigError, match=r"8 stages .* only 6 blocks"):
        split_stages(6, 1, 8)


def test_layout_resolves_schedule_defaults():
    layout = Layout(1, -1, 1, 1, 1, False, 2, pipeline=PipelinePlan(pp=2, pp_schedule="DualPipeV"))
    plan = layout.pipeline
    assert (layout.dp_shard, layout.pp, plan.pp_stages_per_rank, plan.pp_microbatches, plan.n_stages) == (1, 2, 2, 4, 4)
    assert PipelinePlan(pp=4).pp_microbatches == 4 and PipelinePlan(pp=4, pp_schedule="Interleaved1F1B").pp_microbatches == 4
    with pytest.raises(ConfigError, match=r"8 stages .* only 6 blocks"):
        Layout(1, -1, 1, 1, 1, False, 4, pipeline=PipelinePlan(pp=4, pp_schedule="Interleaved1F1B")).check_stages(6, 1)


# ---------------------------------------------------------------- the split by cost


def _splits(n_layers, n_stages):
    """Every split of n_layers blocks into n_stages contiguous non-empty stages, as block counts."""
    for cuts in itertools.combinations(range(1, n_layers), n_stages - 1):
        bounds = [0, *cuts, n_layers]
        yield [bounds[i + 1] - bounds[i] for i in range(n_stages)]


def _rank_costs(costs, counts, ranks):
    """Each rank's cost when its stages hold ``counts`` blocks."""
    layout = "|".join(f"t*{c}" for c in counts)
    specs = split_stages(sum(counts), len(costs.mtp), len(counts), f"E{layout}L")
    loads = [0.0] * (max(ranks) + 1)
    for spec in specs:
        loads[ranks[spec.index]] += costs.stage(spec)
    return loads


def test_cost_split_balances_hand_made_costs():
    # Six equal blocks; head 3 and one MTP module 2 weigh five blocks: 5 blocks | 1 block + head + MTP
    # (5 against 6), where the even split gives 4 | 2 (4 against 7).
    costs = PipelineCosts(embed=0.0, blocks=(1.0,) * 6, head=3.0, mtp=(2.0,))
    assert _blocks(split_stages(6, 1, 2, costs=costs)) == [[0, 1, 2, 3, 4], [5]]
    assert _blocks(split_stages(6, 1, 2)) == [[0, 1, 2, 3], [4, 5]]
    # A heavy first block, no head cost: it stands alone against the other five.
    heavy = PipelineCosts(embed=0.0, blocks=(5.0, 1.0, 1.0, 1.0, 1.0, 1.0), head=0.0, mtp=())
    assert _blocks(split_stages(6, 0, 2, costs=heavy)) == [[0], [1, 2, 3, 4, 5]]
    # The embedding counts on the first stage.
    first_heavy = PipelineCosts(embed=4.0, blocks=(1.0,) * 6, head=0.0, mtp=())
    assert _blocks(split_stages(6, 0, 2, costs=first_heavy)) == [[0], [1, 2, 3, 4, 5]]


def test_cost_split_keeps_a_block_on_every_stage():
    # The head alone outweighs the whole model: the last stage still gets one block, and so does
    # every other stage however many there are.
    costs = PipelineCosts(embed=0.0, blocks=(1.0,) * 6, head=100.0, mtp=(50.0,))
    assert _blocks(split_stages(6, 1, 1, costs=costs)) == [list(range(6))]
    for n_stages in range(2, 7):
        counts = [len(b) for b in _blocks(split_stages(6, 1, n_stages, costs=costs))]
        assert sum(counts) == 6 and min(counts) >= 1 and counts[-1] == 1, (n_stages, counts)
    assert _blocks(split_stages(6, 1, 6, costs=costs)) == [[i] for i in range(6)]
    with pytest.raises(ConfigError, match=r"8 stages .* only 6 blocks"):
        split_stages(6, 1, 8, costs=costs)
    with pytest.raises(ValueError, match=r"costs of 6 blocks and 1 MTP modules for a model of 7 blocks"):
        split_stages(7, 1, 2, costs=costs)


def test_an_explicit_layout_wins_over_costs():
    costs = PipelineCosts(embed=0.0, blocks=(1.0,) * 6, head=3.0, mtp=(2.0,))
    assert _blocks(split_stages(6, 1, 2, "Et*2|t*4L", costs)) == [[0, 1], [2, 3, 4, 5]]


def test_one_stage_per_rank_is_the_best_of_every_split():
    """Against all splits of small models: the busiest stage is the smallest possible."""
    for n_layers, n_stages in ((5, 2), (7, 3), (8, 4)):
        for shift in range(5):
            blocks = tuple(1.0 + ((i + shift) % 3) * 0.4 for i in range(n_layers))
            costs = PipelineCosts(embed=0.1 * shift, blocks=blocks, head=0.7 * shift, mtp=(0.5,))
            ranks = tuple(range(n_stages))
            best = min(max(_rank_costs(costs, c, ranks)) for c in _splits(n_layers, n_stages))
            got = [len(b) for b in _blocks(split_stages(n_layers, 1, n_stages, costs=costs))]
            assert max(_rank_costs(costs, got, ranks)) == pytest.approx(best), (n_layers, n_stages, shift, got)


@pytest.mark.parametrize("schedule", ["DualPipeV", "Interleaved1F1B"])
def test_several_stages_per_rank_balance_the_ranks(schedule):
    """The shapes of the debug model and of V3 (one or three cheaper dense blocks, equal MoE
    blocks, a head and MTP worth several blocks) on pp 2 with two stages per rank: the busiest rank
    is as light as any split makes it, though the busiest stage alone would allow other splits."""
    ranks = stage_ranks(schedule, 2, 4)
    for n_dense, dense in ((1, 0.8), (3, 0.85)):
        for n_layers in (6, 8, 11):
            for head in (0.5, 2.0, 4.0, 8.0):
                blocks = (dense,) * n_dense + (1.0,) * (n_layers - n_dense)
                costs = PipelineCosts(embed=0.0, blocks=blocks, head=head, mtp=(head / 2 + 1,))
                best = min(max(_rank_costs(costs, c, ranks)) for c in _splits(n_layers, 4))
                got = [len(b) for b in _blocks(split_stages(n_layers, 1, 4, costs=costs, ranks=ranks))]
                assert max(_rank_costs(costs, got, ranks)) == pytest.approx(best), (n_dense, n_layers, head, got)
    # DualPipeV puts the first and the last stage on rank 0: it takes the fewest blocks there.
    costs = PipelineCosts(embed=0.0, blocks=(1.0,) * 6, head=3.0, mtp=(2.0,))
    v = split_stages(6, 1, 4, costs=costs, ranks=stage_ranks("DualPipeV", 2, 4))
    assert _blocks(v) == [[0], [1, 2], [3, 4], [5]]


def test_stage_ranks_and_rank_stages():
    assert stage_ranks("1F1B", 4, 4) == (0, 1, 2, 3)
    assert stage_ranks("Interleaved1F1B", 2, 6) == (0, 1, 0, 1, 0, 1)
    assert stage_ranks("DualPipeV", 3, 6) == (0, 1, 2, 2, 1, 0)
    specs = split_stages(8, 1, 6)
    assert [s.index for s in rank_stages(specs, "DualPipeV", 3, 0)] == [0, 5]
    assert [s.index for s in rank_stages(specs, "ZBVZeroBubble", 3, 2)] == [2, 3]
    assert [s.index for s in rank_stages(specs, "Interleaved1F1B", 3, 1)] == [1, 4]


def test_describe_split_gives_each_stage_and_rank_its_share():
    costs = PipelineCosts(embed=0.0, blocks=(1.0,) * 6, head=2.0, mtp=(2.0,))
    specs = split_stages(6, 1, 2, "Et*4|t*2L")
    assert describe_split(specs, costs) == "stage costs: 0: embed + blocks 0-3 40%, 1: blocks 4-5 + head + MTP 60%"
    ranks = stage_ranks("DualPipeV", 2, 4)
    specs = split_stages(6, 1, 4, "Et|t*2|t*2|tL")
    assert describe_split(specs, costs, ranks) == (
        "stage costs: 0: embed + block 0 10%, 1: blocks 1-2 20%, 2: blocks 3-4 20%, 3: block 5 + head + MTP 50%; "
        "per rank: 0: 60%, 1: 40%"
    )


# ------------------------------------------------------- the costs (models/deepseek_v3/stats.py)


def test_stage_unit_costs_add_up_to_the_flops_per_token():
    import dataclasses

    from models.deepseek_v3 import flops_per_token, get_flavor
    from models.deepseek_v3.stats import CROSS_ENTROPY_FLOPS_PER_LOGIT, stage_unit_costs

    args = get_flavor("debugmodel")
    costs = PipelineCosts(**stage_unit_costs(args, 128))
    assert costs.embed == 0 and len(costs.blocks) == 6 and len(costs.mtp) == 1
    loss = CROSS_ENTROPY_FLOPS_PER_LOGIT * args.vocab_size
    total = sum(costs.blocks) + costs.head + sum(costs.mtp)
    assert total - 2 * loss == pytest.approx(flops_per_token(args, 128))
    # Block 0 is dense (3 x dim x inter_dim), the others MoE: top_k of the routed experts and
    # the shared ones; an MoE block differs from the dense one by exactly those weights.
    m = args.moe
    moe_ffn = 3 * args.dim * args.moe_inter_dim * (m.top_k + m.num_shared_experts) + m.num_experts * args.dim
    assert costs.blocks[1] - costs.blocks[0] == pytest.approx(6 * (moe_ffn - 3 * args.dim * args.inter_dim))
    assert len(set(costs.blocks[1:])) == 1
    # The head: final norm, vocab x dim, the loss; an MTP module: eh_proj (2 dim -> dim), its
    # three norms, a block and the head again.
    assert costs.head == pytest.approx(6 * (args.dim + args.vocab_size * args.dim) + loss)
    mtp_own = 2 * args.dim * args.dim + 3 * args.dim
    assert costs.mtp[0] == pytest.approx(costs.blocks[1] + 6 * (mtp_own + args.vocab_size * args.dim) + loss)

    # Twice the vocabulary: the head and MTP grow by the head's matmul and loss, the blocks not.
    big = PipelineCosts(**stage_unit_costs(dataclasses.replace(args, vocab_size=2 * args.vocab_size), 128))
    assert big.blocks == costs.blocks
    assert big.head - costs.head == pytest.approx(6 * args.vocab_size * args.dim + loss)
    assert big.mtp[0] - costs.mtp[0] == pytest.approx(big.head - costs.head)
    # Longer sequences: the attention-score term of every block (and the MTP block) grows.
    long = PipelineCosts(**stage_unit_costs(args, 256))
    score = 6 * args.n_heads * (args.qk_head_dim + args.v_head_dim) * 128
    assert [b - a for a, b in zip(costs.blocks, long.blocks)] == pytest.approx([score] * 6)
    assert long.head == costs.head and long.mtp[0] - costs.mtp[0] == pytest.approx(score)


def test_an_engram_block_costs_its_projections_not_its_table():
    import dataclasses

    from models.deepseek_v3 import get_flavor
    from models.deepseek_v3.stats import stage_unit_costs
    from models.engram import EngramArgs

    args = get_flavor("debugmodel")
    engram = EngramArgs(layer_ids=(2,))
    plain = stage_unit_costs(args, 64)["blocks"]
    with_engram = stage_unit_costs(dataclasses.replace(args, engram=engram), 64)["blocks"]
    extra = [b - a for a, b in zip(plain, with_engram)]
    assert extra[:2] + extra[3:] == [0.0] * 5
    # wk and wv (memory_dim -> dim), three norms, the depthwise conv: far less than the table.
    assert 6 * 2 * engram.memory_dim * args.dim <= extra[2] < 6 * 3 * engram.memory_dim * args.dim


def test_the_plan_is_the_one_reader_of_the_pipeline_options():
    """Every ``pp*`` option of ``[parallelism]`` is a field of `PipelinePlan`, which reads them by
    name: a new option cannot be forgotten there, and nothing else copies them."""
    import dataclasses

    from trainer.config import Parallelism, load_config

    options = {f.name for f in dataclasses.fields(Parallelism) if f.name == "pp" or f.name.startswith("pp_")}
    assert options == {f.name for f in dataclasses.fields(PipelinePlan)}
    cfg = load_config(["--parallelism.pp", "2", "--parallelism.pp_schedule", "DualPipeV",
                       "--parallelism.pp_layout", "Et*2|t*2|t|tL"])
    plan = Layout.from_config(cfg.parallelism, 2).pipeline
    assert plan == PipelinePlan(pp=2, pp_schedule="DualPipeV", pp_stages_per_rank=2, pp_microbatches=4,
                                pp_layout="Et*2|t*2|t|tL")
