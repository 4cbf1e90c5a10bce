"""ParallelDims validation: runs without any process group (the errors come before it)."""

import pytest

from trainer.parallel.parallel_dims import ParallelDims, ParallelDimsError


def dims(world, **kw):
    base = dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1, ep=1, ep_as_cp=False)
    base.update(kw)
    return ParallelDims(world_size=world, **base)


def test_infers_dp_shard_and_degrees():
    d = dims(16, dp_replicate=2, tp=2, ep=2)
    assert d.dp_shard == 4
    assert (d.fsdp_degree, d.efsdp, d.dp_degree, d.loss_degree) == (4, 2, 8, 8)
    assert d.fsdp_enabled and d.hsdp_enabled and d.ep_enabled and d.tp_enabled and not d.cp_enabled


def test_ep_borrows_from_dp_shard_times_cp():
    d = dims(8, dp_shard=2, cp=4, ep=8)
    assert (d.efsdp, d.fsdp_degree, d.dp_degree, d.context_degree) == (1, 8, 2, 4)


def test_ep_as_cp_shards_the_sequence_over_ep():
    d = dims(8, ep=4, ep_as_cp=True)
    assert (d.dp_shard, d.context_degree, d.dp_degree, d.loss_degree) == (8, 4, 2, 8)
    assert d.context_mesh_name == "ep"


def test_single_process_has_no_meshes():
    d = dims(1)
    d.build_meshes("cpu")
    assert not d.meshes_built and d.mesh_or_none("loss") is None
    assert d.dp_rank_and_degree() == (0, 1)


@pytest.mark.parametrize(
    "world, kw, words",
    [
        (8, dict(dp_replicate=3), ["dp_replicate x cp x tp = 3 x 1 x 1 = 3", "does not divide", "8"]),
        (8, dict(dp_shard=3), ["= 3 != world size 8", "dp_shard = 8"]),
        (8, dict(dp_shard=2, tp=2), ["= 4 != world size 8", "dp_shard = 4"]),
        (4, dict(dp_shard=2, cp=2, ep=3), ["ep = 3 must divide dp_shard x cp = 2 x 2 = 4", "[1, 2, 4]"]),
        (8, dict(cp=2, ep=2, ep_as_cp=True), ["cp must be 1", "--parallelism.ep 4"]),
        (8, dict(ep_as_cp=True), ["ep_as_cp needs parallelism.ep > 1"]),
        (8, dict(tp=0), ["parallelism.tp must be >= 1"]),
        (8, dict(dp_shard=0), ["dp_shard must be >= 1, or -1"]),
    ],
)
def test_impossible_layouts_say_what_would_fit(world, kw, words):
    with pytest.raises(ParallelDimsError) as err:
        dims(world, **kw)
    for w in words:
        assert w in str(err.value)


def test_engram_degree_splits_the_ranks_that_see_different_tokens():
    d = dims(16, dp_replicate=2, tp=2, engram=-1)
    assert (d.loss_degree, d.engram, d.engram_enabled) == (8, 8, True)  # -1: all token ranks
    assert dims(8, cp=2, engram=4).engram == 4  # cp ranks hold different tokens too
    assert not dims(4).engram_enabled
    assert "engram 2" in dims(4, engram=2).describe()


@pytest.mark.parametrize(
    "world, kw, words",
    [
        (8, dict(tp=2, engram=8), ["embedding_parallel_degree = 8 must divide", "= 4 (tensor-parallel", "[1, 2, 4]"]),
        (6, dict(engram=4), ["dp_replicate x dp_shard x cp = 1 x 6 x 1 = 6", "[1, 2, 3, 6]", "-1 for all 6"]),
    ],
)
def test_impossible_engram_degrees_say_what_would_fit(world, kw, words):
    with pytest.raises(ParallelDimsError) as err:
        dims(world, **kw)
    for w in words:
        assert w in str(err.value)


def test_one_validator_for_config_and_meshes():
    """ParallelDims adds meshes to the torch-free Layout; their errors are config errors."""
    from trainer.config import ConfigError
    from trainer.config.layout import Layout

    assert issubclass(ParallelDims, Layout) and issubclass(ParallelDimsError, ConfigError)
    assert Layout(world_size=8, **dict(dp_replicate=2, dp_shard=-1, cp=1, tp=2, ep=2, ep_as_cp=False)).dp_shard == 2


def test_batch_split_gives_the_accumulation_steps():
    d = dims(4, dp_shard=2, tp=2)
    assert d.check_batch(local_batch_size=2, global_batch_size=-1) == 1
    assert d.check_batch(local_batch_size=2, global_batch_size=8) == 2
    with pytest.raises(ParallelDimsError, match="global_batch_size = 6 .* 2 x 2; pick a multiple of 4"):
        d.check_batch(local_batch_size=2, global_batch_size=6)
    # ep_as_cp: the ep ranks share samples, so fewer ranks read different ones.
    assert dims(4, ep=2, ep_as_cp=True).check_batch(local_batch_size=1, global_batch_size=4) == 2


@pytest.mark.parametrize(
    "world, kw, shapes, words",
    [
        (2, dict(cp=2), dict(seq_len=102), ["seq_len = 102 must be a multiple of 2 x parallelism.cp = 4", "104"]),
        (4, dict(ep=4, ep_as_cp=True), dict(seq_len=100), ["2 x parallelism.ep (ep_as_cp) = 8"]),
        (2, dict(tp=2), dict(seq_len=101), ["seq_len = 101 must be a multiple of parallelism.tp = 2"]),
        (6, dict(tp=3, cp=2), dict(seq_len=20), ["multiple of parallelism.tp = 3 x the context degree 2", "use seq_len 24"]),
        (3, dict(tp=3), dict(seq_len=255, n_heads=4), ["parallelism.tp = 3 must divide the model's n_heads = 4", "[1, 2, 4]"]),
        (4, dict(ep=4), dict(seq_len=8, num_experts=6), ["parallelism.ep = 4 must divide the model's num_experts = 6"]),
        (2, dict(tp=2), dict(seq_len=8, vocab_size=8191), ["vocab_size = 8191"]),
    ],
)
def test_shapes_the_splits_must_divide(world, kw, shapes, words):
    with pytest.raises(ParallelDimsError) as err:
        dims(world, **kw).check_shapes(**shapes)
    for w in words:
        assert w in str(err.value)


def test_shapes_that_split_evenly_pass():
    dims(4, tp=2, cp=2).check_shapes(seq_len=24, n_heads=4, num_experts=8, vocab_size=8192)
    dims(1).check_shapes(seq_len=101, n_heads=3, num_experts=7, vocab_size=8191)
