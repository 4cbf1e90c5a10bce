"""Engram configuration errors, and the model args and layout checks the config resolves to."""

from pathlib import Path

import pytest

from trainer.config import ConfigError, load_config
from trainer.model_args import build_model_args
from trainer.parallel.parallel_dims import ParallelDims

REPO = Path(__file__).resolve().parents[2]


def test_engram_config_errors():
    with pytest.raises(ConfigError, match="engram.layer_ids"):
        load_config(["--engram.enable", "--engram.layer_ids", "3,1"])
    with pytest.raises(ConfigError, match="engram.max_ngram"):
        load_config(["--engram.max_ngram", "1"])
    cfg = load_config(["--config", str(REPO / "train_configs/debug_engram.toml"), "--engram.layer_ids", "1,6"])
    with pytest.raises(ConfigError, match="n_layers"):
        build_model_args(cfg, 8192, 0)
    args = build_model_args(load_config(["--config", str(REPO / "train_configs/debug_engram.toml")]), 8192, 0)
    assert args.engram.layer_ids == (1, 3) and args.engram.memory_dim == 128
    assert build_model_args(load_config([]), 8192, 0).engram is None
    with pytest.raises(ConfigError, match="embedding_parallel_degree must be >= 1 or -1"):
        load_config(["--engram.embedding_parallel_degree", "0"])
    # The degree is checked against the layout before any process-group work.
    sharded = ["--config", str(REPO / "train_configs/debug_engram.toml"), "--engram.embedding_parallel_degree"]
    with pytest.raises(ConfigError, match=r"= 3 must divide .* = 4 .*pick one of \[1, 2, 4\]"):
        ParallelDims.from_job(load_config([*sharded, "3"]), world_size=4)
    assert ParallelDims.from_job(load_config([*sharded, "-1"]), world_size=4).engram == 4
    assert ParallelDims.from_job(load_config([*sharded, "-1", "--no-engram.enable"]), world_size=4).engram == 1
