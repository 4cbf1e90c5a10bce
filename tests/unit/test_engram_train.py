"""`CONFIG_FILE=train_configs/debug_engram.toml ./run_train.sh` trains on one CPU process."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from trainer.config import ConfigError, load_config
from trainer.train import build_model_args

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


@pytest.mark.slow
def test_debug_engram_trains(tmp_path):
    env = {**os.environ, "NGPU": "1", "CONFIG_FILE": "train_configs/debug_engram.toml", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", str(REPO / "run_train.sh"), "--job.dump_folder", str(tmp_path / "run"),
         "--training.steps", "30", "--training.seq_len", "128", "--validation.freq", "30",
         "--validation.steps", "4", "--metrics.log_freq", "10", "--no-job.print_config"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "engram: layers [1, 3]" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert val[30] <= 0.85 * val[0], val
    last = records[-1]
    for layer in (1, 3):
        assert 0 < last[f"engram/gate_mean/layer{layer}"] < 1
        assert last[f"engram/gate_std/layer{layer}"] > 0
    assert last["engram/table_rows_per_rank"] > 8 * 4099
    assert last["engram/table_bytes_per_rank"] == 4 * 16 * last["engram/table_rows_per_rank"]
