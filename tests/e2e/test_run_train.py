"""run_train.sh as a user runs it: the bundled config, CLI overrides, errors."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from trainer.run_folder import latest_run_folder
from trainer.train import main

REPO = Path(__file__).resolve().parents[2]


def run_train(tmp_path, *args, env=None, timeout=900):
    full_env = {**os.environ, "NGPU": "1", **(env or {})}
    return subprocess.run(
        ["bash", str(REPO / "run_train.sh"), "--job.dump_folder", str(tmp_path / "run"), *args],
        cwd=tmp_path,  # any working directory must do
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(tmp_path):
    lines = (latest_run_folder(tmp_path / "run") / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.slow
def test_debug_model_learns_the_bundled_corpus(tmp_path):
    # In this process, as `trainer.train.main` with run_train.sh's default config (what an NGPU=1
    # run_train.sh execs; tests/e2e/test_reruns.py launches that command five times): a launch
    # would add the ~4 s import of torch to what this test proves, the learning.
    assert main(["--job.config_file", str(REPO / "train_configs/debug_model.toml"), "--job.dump_folder",
                 str(tmp_path / "run"), "--training.steps", "50", "--validation.freq", "25"]) == 0
    records = read_metrics(tmp_path)
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert set(val) == {0, 25, 50}
    # 50 steps are ~51k tokens: enough to pass the corpus's unigram entropy (6.9 nats) from
    # 9.5, a drop of ~28% (measured 9.49 -> 6.79); the 200-step quickstart reaches ~6.0.
    assert val[50] <= 0.75 * val[0], val
    assert val[25] < val[0]
    train_steps = [r for r in records if "loss" in r]
    assert train_steps[-1]["step"] == 50
    for key in ("grad_norm", "lr", "tokens_per_sec", "tflops", "memory_gib", "moe_imbalance", "data_wait_pct"):
        assert key in train_steps[-1], key
    run_dir = latest_run_folder(tmp_path / "run")
    log = (run_dir / "train.log").read_text()
    for needle in ("resolved config", "git revision", "torch", "device cpu", "params total", "FLOPs/token",
                   "optional features: none"):
        assert needle in log, needle
    assert (run_dir / "config.toml").exists()


def test_config_typo_fails_before_any_work(tmp_path):
    proc = run_train(tmp_path, "--training.stpes", "5")
    assert proc.returncode == 2
    assert "did you mean --training.steps" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_unknown_flavor_names_the_choices(tmp_path):
    proc = run_train(tmp_path, "--model.flavor", "debugmodle", "--training.steps", "1")
    assert proc.returncode == 2
    assert "debugmodel" in proc.stderr and "Traceback" not in proc.stderr


def test_help_lists_options(capsys):
    # `python -m trainer.train --help` (README) in this process: the module's __main__ guard only
    # calls main(), which every NGPU=1 run_train.sh launch above runs; a new process would add the
    # ~4 s import of torch to prove nothing more.
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "--training.compile" in out and "--model.flavor" in out


def test_a_stop_without_checkpoints_says_the_rerun_starts_over(tmp_path):
    """A stop (here the time limit) of a run that saves nothing must not advise a resume (issue 44):
    the same command would train from step 0 again. The header lists the switched-on features."""
    assert main(["--job.config_file", str(REPO / "train_configs/debug_model.toml"), "--job.dump_folder",
                 str(tmp_path / "run"), "--training.steps", "5", "--training.time_limit_minutes", "1e-6",
                 "--validation.enable=false", "--activation_checkpoint.mode", "full"]) == 0
    log = (latest_run_folder(tmp_path / "run") / "train.log").read_text()
    assert "stopped at step 0 (time limit" in log, log[-2000:]
    assert "nothing was saved and the same command starts again from step 0" in log
    assert "resume with the same command" not in log
    assert "optional features: activation checkpointing full" in log
