"""The dry run (trainer/dry_run.py): the Trainer's real build for one rank of a large world on
the fake process group, its step under fake tensors, and its report checked against a real run.

A dry run of rank 0 builds the debug model in the process that asks for it (a fake process group is
made and destroyed per run), another rank in a fresh one. torch resolves a second fake world's
groups wrongly in a process that ran one already, so each world size below runs the command line
in a process of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import dry_run_worker
import pytest

from trainer.config import load_config
from trainer.diagnostics import spawn_local
from trainer.dry_run import EXIT_DOES_NOT_FIT, default_ranks, dry_run
from trainer.train import main

DEBUG = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "64"]
# What the dry run and the real run at world 2 both run (tests/helpers.py step_trainer's shape).
WORLD_2 = ["--parallelism.dp_shard", "2", "--parallelism.ep", "2"]


REPO = Path(__file__).resolve().parents[2]


def _dry(*args: str) -> dict:
    (report,) = dry_run(load_config([*DEBUG, "--job.dry_run", *args]))
    return report


def _dry_command(tmp_path: Path, *args: str, ngpu: int = 0, fits: bool = True) -> list[dict]:
    """``python -m trainer.train --job.dry_run ...`` in a process of its own, or with `ngpu`
    ``NGPU=ngpu run_train.sh --job.dry_run ...`` (one process all the same, checked against the
    rehearsed world): its JSON report. ``fits``: the verdict expected (exit 0, or exit 3 and a
    one-line "does not fit")."""
    out = tmp_path / "dry_run.json"
    launcher = ["bash", "run_train.sh"] if ngpu else [sys.executable, "-m", "trainer.train"]
    proc = subprocess.run(
        [*launcher, *DEBUG, "--job.dry_run", "--dry_run.output_json", str(out), *args],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "NGPU": str(ngpu or 1)}, capture_output=True, text=True,
        timeout=600,
    )
    assert proc.returncode == (0 if fits else EXIT_DOES_NOT_FIT), proc.stdout[-3000:] + proc.stderr[-3000:]
    verdict = proc.stdout.strip().splitlines()[-1]
    assert verdict.startswith("dry run: fits:" if fits else "dry run: does not fit:"), proc.stdout[-3000:]
    reports = json.loads(out.read_text())
    assert [r["fits"] for r in reports] == [fits] * len(reports)
    # Progress on stderr, a phase a line (stderr is no terminal here: issue 48); stdout holds the
    # reports alone.
    for r in reports:
        who = f"dry run: rank {r['rank']} of {r['world_size']}"
        for phase in ("building the trainer", "built in", "step rehearsed in"):
            assert f"{who}: {phase}" in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.startswith("dry run: rank ") and "building the trainer" not in proc.stdout, proc.stdout[-3000:]
    return reports


def _pairs(collectives: list[dict]) -> Counter:
    return Counter({(c["collective"], c["group_size"]): c["count"] for c in collectives})


@pytest.mark.parametrize(
    "world, args, stages",
    [
        pytest.param(8, ["--parallelism.dp_shard", "4", "--parallelism.ep", "2", "--parallelism.tp", "2"], [], id="8",
                     marks=pytest.mark.slow),
        pytest.param(64, ["--parallelism.dp_shard", "32", "--parallelism.ep", "8", "--parallelism.cp", "2"], [],
                     id="64", marks=pytest.mark.slow),
        # V schedules: rank 0 holds the first and the last stage, the first rank of pp rank 1 the
        # middle two; both can peak (test_default_ranks_are_the_pp_ranks_that_can_peak).
        # On a 1 GiB GPU: the estimate fits, the measured peak plus the 6 GiB CUDA reserve does not.
        pytest.param(8, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "DualPipeV", "--parallelism.dp_shard",
                         "4", "--parallelism.ep", "2", "--training.local_batch_size", "4", "--dry_run.gpu_memory_gib",
                         "1"], [[0, 3], [1, 2]], id="8_pp_does_not_fit", marks=pytest.mark.slow),
        pytest.param(64, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "ZBVZeroBubble", "--parallelism.dp_shard",
                          "32", "--parallelism.ep", "8", "--training.local_batch_size", "4", "--dry_run.rank", "0"],
                     [[0, 3]], id="64_pp", marks=pytest.mark.slow),
    ],
)
def test_dry_run_builds_the_debug_model_at_world(world, args, stages, tmp_path):
    # The V-schedule case goes through run_train.sh on 2 "GPUs", as a user would start it (issue 44).
    fits = "--dry_run.gpu_memory_gib" not in args
    reports = _dry_command(tmp_path, "--dry_run.world_size", str(world), *args, ngpu=2 if stages and world == 8 else 0,
                           fits=fits)
    assert [(r["rank"], r["stages"]) for r in reports] == list(zip(range(0, world, world // len(stages or [[]])),
                                                                    stages or [[]]))
    r = reports[0]
    assert r["world_size"] == world
    pairs = _pairs(r["collectives"])
    cfg = load_config([*DEBUG, "--dry_run.world_size", str(world), *args])
    p = cfg.parallelism
    fsdp = world // (p.pp * p.tp * p.cp * p.dp_replicate) * p.cp
    assert pairs[("_allgather_base", fsdp)] > 0 and pairs[("_reduce_scatter_base", fsdp)] > 0, pairs
    assert pairs[("alltoall_base", p.ep)] > 0, pairs
    if p.pp > 1:
        assert pairs[("send", p.pp)] > 0 and pairs[("recv", p.pp)] > 0, pairs
    if p.tp > 1:
        assert any(name.startswith(("all_gather", "reduce_scatter")) for name, size in pairs if size == p.tp), pairs
    m = r["memory_gib"]
    assert m["total"] > 0 and m["params"] > 0 and m["activations"] > 0 and m["optimizer_states"] > 0
    assert any("balanced split" in note for note in r["notes"])


def test_default_ranks_are_the_pp_ranks_that_can_peak():
    """One rank per class of pp ranks holding the same (trainer/dry_run.py ``peak_pp_ranks``): the
    lowest under 1F1B, the lowest and the highest under a V schedule; Engram's blocks make a class."""
    world = [*DEBUG, "--dry_run.world_size", "64"]
    assert default_ranks(load_config([*world, "--parallelism.pp", "2"])) == [0, 32]
    # A V schedule's rank 0 holds the first and the last stage; rank 1 the middle two, and can peak.
    v = ["--parallelism.pp", "2", "--parallelism.pp_schedule", "ZBVZeroBubble"]
    assert default_ranks(load_config([*world, *v])) == [0, 32]
    assert default_ranks(load_config([*world, "--dry_run.rank", "5"])) == [5]
    pp4 = [*world, "--model.flavor", "16B", "--training.local_batch_size", "8", "--parallelism.pp", "4"]
    # 1F1B: pp ranks 1 and 2 hold 7 MoE blocks each; rank 1 keeps more micro-batches in flight.
    one_f_one_b = [*pp4, "--parallelism.pp_layout", "Et*6|t*7|t*7|t*7L"]
    assert default_ranks(load_config(one_f_one_b)) == [0, 16, 48]
    assert default_ranks(load_config([*one_f_one_b, "--engram.enable", "--engram.layer_ids", "14"])) == [0, 16, 32, 48]
    # DualPipeV: pp ranks 1-3 hold 3 + 4 MoE blocks each; the ends of that class, 1 and 3.
    dual = [*pp4, "--parallelism.pp_schedule", "DualPipeV", "--parallelism.pp_layout", "Et*2|t*3|t*3|t*3|t*4|t*4|t*4|t*4L"]
    assert default_ranks(load_config(dual)) == [0, 16, 48]
    assert default_ranks(load_config([*dual, "--engram.enable", "--engram.layer_ids", "6"])) == [0, 16, 32, 48]
    assert default_ranks(load_config([*dual, "--dry_run.ranks", "all_stages"])) == [0, 16, 32, 48]
    # At most 3 weight passes waiting: from pp rank 2 on each keeps 3, and fewer in flight.
    capped = [*dual, "--parallelism.pp_max_deferred_weight_passes", "3"]
    assert default_ranks(load_config(capped)) == [0, 16, 32, 48]


@pytest.mark.slow
def test_dry_run_collectives_and_peak_match_a_real_two_process_run(tmp_path):
    """Same collectives (names, group sizes, counts) and the same tracked peak within 10% as the
    real gloo run of the layout, whose second step is tracked on real tensors by the same code."""
    shape = ["--model.use_grouped_mm", "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32"]
    real = spawn_local(dry_run_worker.run, 2, str(tmp_path), [*WORLD_2, *shape], timeout=300)
    rank0 = next(r for r in real if r["rank"] == 0)
    dry = _dry("--dry_run.world_size", "2", *WORLD_2, *shape, "--dry_run.rank", "0")
    assert _pairs(dry["collectives"]) == _pairs(rank0["collectives"])
    assert dry["memory_gib"]["total"] == pytest.approx(rank0["memory_gib"]["total"], rel=0.10)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dry_run.world_size", "6", "--parallelism.pp", "4"], "does not divide the world size 6"),
        (["--dry_run.world_size", "8", "--dry_run.rank", "8"], "dry_run.rank 8 is outside"),
        (["--dry_run.world_size", "8", "--model.flavor", "999B"], "model.flavor"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert main([*DEBUG, "--job.dry_run", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
