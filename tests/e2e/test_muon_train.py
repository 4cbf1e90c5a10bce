"""Muon (with QK-clip) through run_train.sh in every layout: the same losses as one process.

fp32, deterministic, global batch 8, the debug model at seq_len 32 (tests/e2e/test_layout_parity.py's
settings). FSDP 2 and pp 2 x FSDP 2 run 6 steps of their own. Launches are shared: one process (in this one: tests/e2e/in_process.py) and HSDP 2x2
run 6 steps with a checkpoint at step 3; FSDP 4 x EP 2 resumes HSDP 2x2's step-3 checkpoint (into
FSDP's strided shards on top of the expert shards, efsdp 2), TP 2 the single process's, and each
continues the single process's steps 4-6 (rel 1e-5). So every layout's Muon steps, with their
optimizer state, and resuming Muon state into another layout (sharded to sharded, and whole to
tensor-parallel) are checked together. (Six steps, not more: Newton-Schulz on every matrix makes a
CPU step ~0.5 s, and every launch pays it.) QK-clip clips at steps 3 and 6 (`qk_clip_every 3`, a
threshold below the debug model's max logits): step 3's clip shapes every later step, and HSDP
2x2 clips it itself. Step 6's clip changes no logged loss, so TP 2 (where QK-clip is refused)
runs without it and still compares.
"""

import shutil
from pathlib import Path

import pytest
from in_process import COMMON, assert_close, run_layout, run_main

MUON = ["--optimizer.name", "muon", "--no-validation.enable"]
STEPS, MID = 6, 3
CLIP = ["--optimizer.qk_clip", "--optimizer.qk_clip_every", str(MID), "--optimizer.qk_clip_threshold", "0.17"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", str(MID), "--checkpoint.keep_latest_k", "0"]
# (processes, [parallelism] and local-batch flags) for the global batch 8
SINGLE = (1, ["--training.local_batch_size", "8"])
FSDP_4_EP_2 = (4, ["--parallelism.dp_shard", "4", "--parallelism.ep", "2", "--training.local_batch_size", "2"])
HSDP_2X2 = (4, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2", "--training.local_batch_size", "2"])
TP_2 = (2, ["--parallelism.tp", "2", "--training.local_batch_size", "8"])
# Straight runs of their own (no checkpoint): Newton-Schulz on owners across a data-parallel group,
# and across pipeline stages (owners are balanced over all ranks, trainer/muon_owners.py).
STRAIGHT = {
    "fsdp_2": (2, ["--parallelism.dp_shard", "2", "--training.local_batch_size", "4"]),
    "pp_2_fsdp_2": (4, ["--parallelism.pp", "2", "--parallelism.dp_shard", "2", "--training.local_batch_size", "4"]),
}
# Constant LR after a 2-step warmup: the LR of a step does not depend on training.steps.
SCHEDULE = ["--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0"]
RUN = [*COMMON, *MUON, *CKPT, *SCHEDULE, "--training.steps", str(STEPS)]


def _resumed(tmp: Path, name: str, source: Path, nproc: int, args: list[str]) -> dict[int, dict]:
    run_dir = tmp / name
    shutil.copytree(source, run_dir / "checkpoint" / source.name)
    return run_layout(run_dir, nproc, args)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, STEPS steps, checkpoints at MID and STEPS: (metrics by step, run folder)."""
    run_dir = tmp_path_factory.mktemp("muon") / "single"
    return run_layout(run_dir, SINGLE[0], [*RUN, *CLIP, *SINGLE[1]]), run_dir


@pytest.fixture(scope="module")
def runs(single):
    tmp = single[1].parent
    nproc, flags = HSDP_2X2
    out = {"single": single[0], "hsdp_2x2": run_layout(tmp / "hsdp_2x2", nproc, [*RUN, *CLIP, *flags])}
    for name, source, clip, (nproc, flags) in (("fsdp_4_ep_2", "hsdp_2x2", CLIP, FSDP_4_EP_2), ("tp_2", "single", [], TP_2)):
        out[name] = _resumed(tmp, name, tmp / source / "checkpoint" / f"step-{MID}", nproc, [*RUN, *clip, *flags])
    out["root"] = tmp
    return out


def test_layouts_and_resumes_match_one_process(runs):
    single = runs["single"]
    assert single[STEPS]["loss"] < single[1]["loss"]
    assert single[MID]["qk_clipped_heads"] > 0  # the clip at step MID acted
    for step in range(1, STEPS + 1):
        assert_close(f"hsdp_2x2 step {step}", runs["hsdp_2x2"][step]["loss"], single[step]["loss"])
    assert_close(f"hsdp_2x2 step {MID} max logit", runs["hsdp_2x2"][MID]["max_logit"], single[MID]["max_logit"])
    for name in ("fsdp_4_ep_2", "tp_2"):
        assert sorted(s for s in runs[name] if "loss" in runs[name][s]) == list(range(MID + 1, STEPS + 1)), name
        for step in range(MID + 1, STEPS + 1):
            assert_close(f"{name} resumed, step {step}", runs[name][step]["loss"], single[step]["loss"])
        log = (runs["root"] / name / "train.log").read_text()
        assert "resumed from" in log and "starts afresh" not in log


def test_switching_optimizer_on_resume(single, tmp_path, capfd):
    """AdamW over a Muon checkpoint: one line, exit 2; with checkpoint.reset_optimizer it goes on at
    the schedule's LR for the step after the checkpoint's. (Both runs in this process:
    tests/e2e/in_process.py.)"""
    run_dir = tmp_path / "switch"
    last = single[1] / "checkpoint" / f"step-{STEPS}"
    shutil.copytree(last, run_dir / "checkpoint" / last.name)
    args = [*COMMON, *CKPT, *SCHEDULE, "--no-validation.enable", *SINGLE[1], "--training.steps", str(STEPS + 1)]
    assert run_main(tmp_path, "--job.dump_folder", str(run_dir), *args) == 2
    (line,) = [x for x in capfd.readouterr().err.splitlines() if "optimizer state" in x]
    assert "muon/float32" in line and "AdamW/float32" in line and "--checkpoint.reset_optimizer" in line
    resumed = run_layout(run_dir, 1, [*args, "--checkpoint.reset_optimizer"])
    assert sorted(s for s in resumed if "loss" in resumed[s]) == [STEPS + 1]  # weights and step from the checkpoint
    assert resumed[STEPS + 1]["lr"] == pytest.approx(single[0][STEPS]["lr"])  # warmup over: the schedule's peak LR
    assert "starts afresh" in (run_dir / "train.log").read_text()


@pytest.mark.parametrize("name", list(STRAIGHT))
def test_owned_newton_schulz_layouts_match_one_process(single, name):
    nproc, flags = STRAIGHT[name]
    got = run_layout(single[1].parent / name, nproc, [*COMMON, *MUON, *SCHEDULE, *CLIP, "--training.steps", str(STEPS),
                                                      *flags])
    for step in range(1, STEPS + 1):
        assert_close(f"{name} step {step}", got[step]["loss"], single[0][step]["loss"])
