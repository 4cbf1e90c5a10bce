"""Muon (with QK-clip) through run_train.sh in every layout: the same losses as one process.

fp32, deterministic, global batch 8, the debug model at seq_len 32 (tests/e2e/test_layout_parity.py's
settings). Launches are shared: one process and FSDP 2 run 10 steps with a checkpoint at step 5;
FSDP 4 x EP 2 resumes FSDP 2's step-5 checkpoint, HSDP 2x2 and TP 2 resume the single process's,
and each continues the single process's steps 6-10 (rel 1e-5). So every layout's Muon steps, with
their optimizer state, and resuming Muon state into another layout are checked together.
QK-clip clips at steps 5 and 10 (`qk_clip_every 5`, a threshold below the debug model's max
logits): step 5's clip shapes every later loss, and FSDP 2 clips it itself. Step 10's clip
changes no logged loss, so TP 2 (where QK-clip is refused) runs without it and still compares.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_layout_parity import COMMON, LAYOUTS, SINGLE, _assert_close, _run

from trainer.diagnostics import free_port

REPO = Path(__file__).resolve().parents[2]
MUON = ["--optimizer.name", "muon", "--no-validation.enable"]
CLIP = ["--optimizer.qk_clip", "--optimizer.qk_clip_every", "5", "--optimizer.qk_clip_threshold", "0.17"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "0"]
TP_2 = (2, ["--parallelism.tp", "2", "--training.local_batch_size", "8"])
# Constant LR after a 2-step warmup: the LR of a step does not depend on training.steps.
SCHEDULE = ["--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0"]
TEN = [*COMMON, *MUON, *CKPT, *SCHEDULE, "--training.steps", "10"]


def _resumed(tmp: Path, name: str, source: Path, nproc: int, args: list[str]) -> dict[int, dict]:
    run_dir = tmp / name
    shutil.copytree(source, run_dir / "checkpoint" / source.name)
    return _run(run_dir, nproc, args)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, 10 steps, checkpoints at steps 5 and 10: (metrics by step, run folder)."""
    run_dir = tmp_path_factory.mktemp("muon") / "single"
    return _run(run_dir, SINGLE[0], [*TEN, *CLIP, *SINGLE[1]]), run_dir


@pytest.fixture(scope="module")
def runs(single):
    tmp = single[1].parent
    out = {"single": single[0], "fsdp_2": _run(tmp / "fsdp_2", 2, [*TEN, *CLIP, *LAYOUTS["fsdp_2"][1]])}
    for name, source, clip in (("fsdp_4_ep_2", "fsdp_2", CLIP), ("hsdp_2x2", "single", CLIP), ("tp_2", "single", [])):
        nproc, flags = TP_2 if name == "tp_2" else LAYOUTS[name]
        out[name] = _resumed(tmp, name, tmp / source / "checkpoint" / "step-5", nproc, [*TEN, *clip, *flags])
    out["root"] = tmp
    return out


def test_layouts_and_resumes_match_one_process(runs):
    single = runs["single"]
    assert single[10]["loss"] < single[1]["loss"]
    assert single[5]["qk_clipped_heads"] > 0  # the clip at step 5 acted
    for step in range(1, 11):
        _assert_close(f"fsdp_2 step {step}", runs["fsdp_2"][step]["loss"], single[step]["loss"])
    _assert_close("fsdp_2 step 5 max logit", runs["fsdp_2"][5]["max_logit"], single[5]["max_logit"])
    for name in ("fsdp_4_ep_2", "hsdp_2x2", "tp_2"):
        assert sorted(s for s in runs[name] if "loss" in runs[name][s]) == list(range(6, 11)), name
        for step in range(6, 11):
            _assert_close(f"{name} resumed, step {step}", runs[name][step]["loss"], single[step]["loss"])
        log = (runs["root"] / name / "train.log").read_text()
        assert "resumed from" in log and "starts afresh" not in log


def test_switching_optimizer_on_resume(single, tmp_path):
    """AdamW over a Muon checkpoint: one line, exit 2; with checkpoint.reset_optimizer it goes on at
    the schedule's LR for step 11."""
    run_dir = tmp_path / "switch"
    shutil.copytree(single[1] / "checkpoint" / "step-10", run_dir / "checkpoint" / "step-10")
    args = [*COMMON, *CKPT, *SCHEDULE, "--no-validation.enable", *SINGLE[1], "--training.steps", "11"]
    cmd = ["bash", str(REPO / "run_train.sh"), "--job.dump_folder", str(run_dir), *args]
    env = {"NGPU": "1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = [x for x in proc.stderr.splitlines() if "optimizer state" in x]
    assert "muon/float32" in line and "AdamW/float32" in line and "--checkpoint.reset_optimizer" in line
    resumed = _run(run_dir, 1, [*args, "--checkpoint.reset_optimizer"])
    assert sorted(s for s in resumed if "loss" in resumed[s]) == [11]  # weights and step from the checkpoint
    assert resumed[11]["lr"] == pytest.approx(single[0][10]["lr"])  # warmup over: the schedule's peak LR
    assert "starts afresh" in (run_dir / "train.log").read_text()
