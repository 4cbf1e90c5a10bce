"""Muon (with QK-clip) through run_train.sh in every layout: the same losses as one process.

fp32, deterministic, global batch 8, the debug model at seq_len 32 (tests/e2e/test_layout_parity.py's
settings). FSDP 2 and pp 2 x FSDP 2 (owned Newton-Schulz within a data-parallel group and across
pipeline stages) run 6 steps of their own. Launches are shared: one process (in this one: tests/e2e/in_process.py, a checkpoint
every step) and HSDP 2x2 (a checkpoint at step 3) run 6 steps; FSDP 4 x EP 2 resumes HSDP 2x2's
step-3 checkpoint (into FSDP's strided shards on top of the expert shards, efsdp 2) and continues
the single process's steps 4-6, TP 2 resumes the single process's step-1 checkpoint and continues
its steps 2-6 (rel 1e-5). So every layout's Muon steps, with their optimizer state, and resuming
Muon state into another layout (sharded to sharded, and whole to tensor-parallel) are checked
together. (Six steps, not more: Newton-Schulz on every matrix makes a CPU step ~0.5 s, and every
launch pays it.) QK-clip clips at steps 2, 4 and 6 (`qk_clip_every 2`, a threshold below the debug
model's max logits) in every run, the resumed layouts' clips their own: TP 2's with each rank's
heads gathered and its own rows scaled. The clips' max logits (every layer) and clipped heads are
compared too. A compiled one-process run with QK-clip (inductor, in this process) compares its
five steps with the eager one's and proves clip and non-clip steps run the graphs traced at step 1.
"""

import shutil
from pathlib import Path

import pytest
import torch
from in_process import COMMON, assert_close, run_layout, run_main
from torch._dynamo.utils import counters

pytestmark = pytest.mark.numerics  # docs/numerics.md

MUON = ["--optimizer.name", "muon", "--no-validation.enable"]
STEPS, MID, CLIP_EVERY = 6, 3, 2
CLIP = ["--optimizer.qk_clip", "--optimizer.qk_clip_every", str(CLIP_EVERY), "--optimizer.qk_clip_threshold", "0.17"]
CLIP_STEPS = range(CLIP_EVERY, STEPS + 1, CLIP_EVERY)
COMPILED_STEPS = 5
CKPT = ["--checkpoint.enable", "--checkpoint.interval", str(MID), "--checkpoint.keep_latest_k", "0"]
# (processes, [parallelism] and local-batch flags) for the global batch 8
SINGLE = (1, ["--training.local_batch_size", "8"])
FSDP_4_EP_2 = (4, ["--parallelism.dp_shard", "4", "--parallelism.ep", "2", "--training.local_batch_size", "2"])
HSDP_2X2 = (4, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2", "--training.local_batch_size", "2"])
TP_2 = (2, ["--parallelism.tp", "2", "--training.local_batch_size", "8"])
# Resumed layouts: name -> (the run whose checkpoint it resumes, at which step, its layout). TP 2
# resumes step 1 so that its five steps (2-6) clip three times (2, 4, 6).
RESUMED = {"fsdp_4_ep_2": ("hsdp_2x2", MID, FSDP_4_EP_2), "tp_2": ("single", 1, TP_2)}
# Straight runs of their own (no checkpoint): Newton-Schulz on owners across a data-parallel group,
# and across pipeline stages (owners are balanced over all ranks, trainer/optim/muon_owners.py).
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
    """One process, STEPS steps, a checkpoint every step: (metrics by step, run folder)."""
    run_dir = tmp_path_factory.mktemp("muon") / "single"
    return run_layout(run_dir, SINGLE[0], [*RUN, *CLIP, *SINGLE[1], "--checkpoint.interval", "1"]), run_dir


@pytest.fixture(scope="module")
def runs(single):
    tmp = single[1].parent
    nproc, flags = HSDP_2X2
    out = {"single": single[0], "hsdp_2x2": run_layout(tmp / "hsdp_2x2", nproc, [*RUN, *CLIP, *flags])}
    for name, (source, step, (nproc, flags)) in RESUMED.items():
        out[name] = _resumed(tmp, name, tmp / source / "checkpoint" / f"step-{step}", nproc, [*RUN, *CLIP, *flags])
    out["root"] = tmp
    return out


def test_layouts_and_resumes_match_one_process(runs):
    single = runs["single"]
    assert single[STEPS]["loss"] < single[1]["loss"]
    assert all(single[step]["qk_clipped_heads"] > 0 for step in CLIP_STEPS)  # every clip acted
    for step in range(1, STEPS + 1):
        assert_close(f"hsdp_2x2 step {step}", runs["hsdp_2x2"][step]["loss"], single[step]["loss"])
    _assert_same_clips("hsdp_2x2", runs["hsdp_2x2"], single, CLIP_STEPS)
    for name, (_, resumed_at, _) in RESUMED.items():
        steps = list(range(resumed_at + 1, STEPS + 1))
        assert sorted(s for s in runs[name] if "loss" in runs[name][s]) == steps, name
        for step in steps:
            assert_close(f"{name} resumed, step {step}", runs[name][step]["loss"], single[step]["loss"])
        _assert_same_clips(name, runs[name], single, [s for s in CLIP_STEPS if s > resumed_at])
        log = (runs["root"] / name / "train.log").read_text()
        assert "resumed from" in log and "starts afresh" not in log


def _assert_same_clips(name: str, run: dict[int, dict], single: dict[int, dict], steps) -> None:
    """The same max logit (every head of every layer, gathered over the ranks) and the same heads
    clipped as one process, at each clip step."""
    for step in steps:
        assert run[step]["qk_clipped_heads"] == single[step]["qk_clipped_heads"], (name, step)
        for key in (k for k in single[step] if k.startswith("max_logit")):
            assert_close(f"{name} step {step} {key}", run[step][key], single[step][key])


@pytest.mark.slow  # inductor compiles the debug model's blocks (CPU: most of a minute)
def test_compiled_with_qk_clip_matches_eager(single, tmp_path):
    """One process compiled (inductor) with QK-clip, 5 steps without checkpoints (the constant LR
    after warmup makes them the 6-step run's first five): the eager run's losses and clips, and the
    clip steps (2, 4) and the others run the graphs traced at step 1: three over the run (dense
    block, MoE block, loss; MTP's MoE block shares its trace), where a recompile or a graph break
    at a clip step would have added one."""
    torch._dynamo.reset()
    counters.clear()
    args = [*COMMON, *MUON, *SCHEDULE, *CLIP, *SINGLE[1], "--training.steps", str(COMPILED_STEPS), "--training.compile"]
    compiled = run_layout(tmp_path / "compiled", 1, args)
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"]
    assert sorted(s for s in compiled if "loss" in compiled[s]) == list(range(1, COMPILED_STEPS + 1))
    for step in range(1, COMPILED_STEPS + 1):
        assert_close(f"compiled step {step}", compiled[step]["loss"], single[0][step]["loss"])
    _assert_same_clips("compiled", compiled, single[0], [s for s in CLIP_STEPS if s <= COMPILED_STEPS])


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
    _assert_same_clips(name, got, single[0], CLIP_STEPS)
