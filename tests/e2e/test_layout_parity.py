"""One run, any layout, as run_train.sh's workers run it (gloo on CPU, fp32, deterministic).

The same config with ``--training.global_batch_size 8`` gives the same per-step losses, gradient
norms (over the warmup) and validation losses on 1 process and in every layout: the loader's
global batch order (trainer/data/datasets.py), the layout-invariant init
(trainer/parallel/weight_init.py) and the validation over the same held-out global batches. A
checkpoint taken at step 5 resumes in another layout and continues the uninterrupted run's losses:
FSDP 2 in 1 process and in HSDP 2x2 x EP 2; 1F1B pp 2 in 1 process, in pp 2 x FSDP 2 and in ZBV
pp 2 (stages 0 and 3 on rank 0); 1F1B pp 2 x FSDP 2 in DualPipeV pp 2 x FSDP 2 x EP 2; 1 process in
Interleaved1F1B pp 2 (four stages). The zero-bubble schedules run with FSDP, HSDP's replicate
dimension, EP, CP and Engram's split tables; every activation checkpointing mode under every
schedule: tests/distributed/test_ac_schedules.py (one launch per world size, not one per layout).

Starting processes is the suite's cost (each spends ~4 s importing torch), so runs are shared
between tests through one module-scoped fixture and one run proves several things: the four 10-step
checkpointed runs (STRAIGHT) check their layout's parity on all ten steps, and the layouts a
checkpoint is resumed into (RESUMED_INTO) check theirs on the resumed steps 6-10 and the step-10
validation, against the 1-process run's, instead of a 5-step run of their own. Six runs go
through run_train.sh as a user launches them (LAUNCHED: FSDP, 1F1B pp, both, HSDP x EP resuming
FSDP's checkpoint, DualPipeV x FSDP x EP with the MoE overlap, EP-as-CP under pp); the 1-process
runs call `trainer.train.main` in this process (tests/e2e/in_process.py `run_main`), every other
run calls it in the ranks of one 4-process spawn (tests/e2e/layout_parity_worker.py), as a
torchrun worker does. Layouts other run_train.sh tests train: FSDP 4 x EP 2 and HSDP 2x2
(tests/e2e/test_muon_train.py), EP-as-CP across two nodes with TP (tests/e2e/test_multinode.py).

Bound: rel 1e-5 (sharding only reorders fp32 sums; observed ~1e-7). The debug model at seq_len 32
keeps each run to seconds.
"""

import json
import shutil
import subprocess
from pathlib import Path

import layout_parity_worker
import pytest
from in_process import COMMON, assert_close, metrics_by_step, run_layout

from trainer.diagnostics import spawn_local_jobs

pytestmark = pytest.mark.numerics  # docs/numerics.md

REPO = Path(__file__).resolve().parents[2]
# Warmup over steps 1-5 and no decay: steps 1-5 have the same LR in a 5-step and a 10-step run, so
# a 5-step run compares with the first five steps of the 1-process 10-step run.
SCHEDULE = ["--lr_scheduler.warmup_steps", "5", "--lr_scheduler.decay_ratio", "0"]
PARITY = [*COMMON, *SCHEDULE, "--training.steps", "5", "--validation.freq", "5"]
RESUME = [
    *COMMON, *SCHEDULE, "--training.steps", "10", "--validation.freq", "5",
    "--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "0",
]
STRAIGHT = ("single", "fsdp_2", "pp_2", "pp_2_fsdp_2")
# Layout -> the STRAIGHT layout whose step-5 checkpoint it resumes (test_checkpoint_resumes_in_another_layout).
RESUMED_INTO = {
    "hsdp_2x2_ep_2": "fsdp_2", "pp_2_fsdp_2": "pp_2", "pp_2_zbv": "pp_2", "pp_2_interleaved": "single",
    # 1F1B pp 2 x FSDP 2 (2 stages) -> DualPipeV (4 stages) with experts over 2 ranks (issue 30).
    "pp_2_dualpipev_fsdp_2_ep_2": "pp_2_fsdp_2",
}
RESUMES = [("fsdp_2", "single"), ("pp_2", "single"), *((source, layout) for layout, source in RESUMED_INTO.items())]


def _schedule(name: str) -> list[str]:
    return ["--parallelism.pp", "2", "--parallelism.pp_schedule", name]


# name -> (processes, [parallelism] and local-batch flags)
LAYOUTS = {
    # Local batch 2 of the global 8 over 2 ranks: two accumulated micro-batches per step.
    "fsdp_2": (2, ["--parallelism.dp_shard", "2", "--training.local_batch_size", "2"]),
    "hsdp_2x2_ep_2": (
        4,
        ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2", "--parallelism.ep", "2",
         "--training.local_batch_size", "2"],
    ),
    # Pipeline parallelism (issue 20), MTP on (the debug model's depth 1).
    "pp_2": (2, ["--parallelism.pp", "2", "--training.local_batch_size", "8"]),
    "pp_2_interleaved": (
        2, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "Interleaved1F1B", "--training.local_batch_size", "8"],
    ),
    "pp_2_zbv": (2, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "ZBVZeroBubble", "--training.local_batch_size", "8"]),
    # The MoE all-to-all overlap (issue 31): two accumulated micro-batches as one (B_0, F_1) pair.
    "fsdp_2_ep_2_moe_overlap": (
        2, ["--parallelism.dp_shard", "2", "--parallelism.ep", "2", "--parallelism.moe_overlap", "--training.local_batch_size", "2"],
    ),
    "pp_2_fsdp_2": (4, ["--parallelism.pp", "2", "--parallelism.dp_shard", "2", "--training.local_batch_size", "4"]),
    "pp_2_fsdp_2_ep_2": (
        4, ["--parallelism.pp", "2", "--parallelism.dp_shard", "2", "--parallelism.ep", "2", "--training.local_batch_size", "4"],
    ),
    "pp_2_tp_2": (4, ["--parallelism.pp", "2", "--parallelism.tp", "2", "--training.local_batch_size", "8"]),
    "pp_2_cp_2": (4, ["--parallelism.pp", "2", "--parallelism.cp", "2", "--training.local_batch_size", "8"]),
    "pp_2_ep_2_as_cp": (
        4, ["--parallelism.pp", "2", "--parallelism.ep", "2", "--parallelism.ep_as_cp", "--training.local_batch_size", "8"],
    ),
    # The zero-bubble schedules with data and context parallelism (issue 30): stage modules are FSDP
    # roots whose units keep their parameters from forward to the step's one gradient reduction.
    "pp_2_dualpipev_fsdp_2_ep_2": (
        4,
        ["--parallelism.pp", "2", "--parallelism.pp_schedule", "DualPipeV", "--parallelism.dp_shard", "2",
         "--parallelism.ep", "2", "--training.local_batch_size", "4"],
    ),
    # The same with DualPipeV's OVERLAP_F_B actions interleaved MoE node by MoE node (issue 31): the
    # cost split leaves stage 0 the dense block alone (torch's path), stages 1-3 run in nodes.
    "pp_2_dualpipev_fsdp_2_ep_2_moe_overlap": (
        4,
        ["--parallelism.pp", "2", "--parallelism.pp_schedule", "DualPipeV", "--parallelism.dp_shard", "2",
         "--parallelism.ep", "2", "--parallelism.moe_overlap", "--training.local_batch_size", "4"],
    ),
    "pp_2_zbv_fsdp_2": (
        4, [*_schedule("ZBVZeroBubble"), "--parallelism.dp_shard", "2", "--training.local_batch_size", "4"],
    ),
    "pp_2_interleaved_zb_dp_replicate_2": (
        4, [*_schedule("InterleavedZeroBubble"), "--parallelism.dp_replicate", "2", "--training.local_batch_size", "4"],
    ),
    "pp_2_dualpipev_cp_2": (4, [*_schedule("DualPipeV"), "--parallelism.cp", "2", "--training.local_batch_size", "8"]),
}
SINGLE = (1, ["--training.local_batch_size", "8"])
# Engram blocks 1 and 3 on different pipeline stages (0-1 | 2-5), tables whole or split over 2 ranks.
ENGRAM = ["--job.config_file", str(REPO / "train_configs" / "debug_engram.toml")]
ENGRAM_PP = ["--parallelism.pp", "2", "--parallelism.pp_layout", "Et*2|t*4L"]
ENGRAM_LAYOUTS = {
    "engram_pp_2": (2, [*ENGRAM, *ENGRAM_PP, "--training.local_batch_size", "8"]),
    "engram_pp_2_fsdp_2_table_2": (
        4,
        [*ENGRAM, *ENGRAM_PP, "--parallelism.dp_shard", "2", "--training.local_batch_size", "4",
         "--engram.embedding_parallel_degree", "2"],
    ),
    # Four stages, split by cost: the Engram blocks' tables are looked up inside DualPipeV's stages.
    "engram_pp_2_dualpipev_fsdp_2_table_2": (
        4,
        [*ENGRAM, *_schedule("DualPipeV"), "--parallelism.dp_shard", "2", "--training.local_batch_size", "4",
         "--engram.embedding_parallel_degree", "2"],
    ),
}


# Runs through run_train.sh (its pre-launch check, torchrun and its workers), as a user launches
# them: a 2- and a 4-process straight run of each family (FSDP, 1F1B pp, both) whose checkpoints
# the other layouts resume, HSDP x EP resuming FSDP's checkpoint, DualPipeV x FSDP x EP with the
# MoE overlap and EP-as-CP under pp. Every other multi-process run calls the same
# `trainer.train.main` in the ranks of one 4-process spawn (tests/e2e/layout_parity_worker.py):
# each launch would spend ~20 s of CPU starting torchrun and importing torch in every process,
# more than the run itself. HSDP x EP and EP-as-CP cannot follow another layout in the same
# processes (their expert weights' init then resolves a process group of the run before; also
# tests/distributed/muon_owner_worker.py, "hsdp_2x2"): a user's process runs one layout.
LAUNCHED = (
    "fsdp_2_straight",
    "pp_2_straight",
    "pp_2_fsdp_2_straight",
    "fsdp_2_resumed_hsdp_2x2_ep_2",
    "pp_2_dualpipev_fsdp_2_ep_2_moe_overlap",
    "pp_2_ep_2_as_cp",
)


def _layout(name: str) -> tuple[int, list[str]]:
    return SINGLE if name == "single" else LAYOUTS[name]


def _straight_name(name: str) -> str:
    """The run of `name`'s 10 steps, checkpointed at step 5 and 10."""
    return f"{name}_straight"


def _resumed_name(source: str, layout: str) -> str:
    """The run of `layout` resuming `source`'s 10-step run from its step-5 checkpoint, to step 10."""
    return f"{source}_resumed_{layout}"


def _plan() -> dict[str, tuple[int, list[str], str | None]]:
    """Every run of the module: name -> (processes, arguments, the run whose step-5 checkpoint it
    resumes or None), each source before the runs that resume it."""
    plan: dict[str, tuple[int, list[str], str | None]] = {}
    for name in STRAIGHT:
        nproc, flags = _layout(name)
        plan[_straight_name(name)] = (nproc, [*RESUME, *flags], None)
    for source, layout in RESUMES:
        nproc, flags = _layout(layout)
        plan[_resumed_name(source, layout)] = (nproc, [*RESUME, *flags], _straight_name(source))
    for name, (nproc, flags) in LAYOUTS.items():
        if name not in STRAIGHT and name not in RESUMED_INTO:
            plan[name] = (nproc, [*PARITY, *flags], None)
    plan["engram_single"] = (SINGLE[0], [*PARITY, *ENGRAM, *SINGLE[1]], None)
    for name, (nproc, flags) in ENGRAM_LAYOUTS.items():
        plan[name] = (nproc, [*PARITY, *flags], None)
    return plan


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[int, dict]]:
    """Run name -> its records by step, and ``.root``: the folder holding each run's dump folder.
    One-process runs in this process, then the LAUNCHED runs (the checkpoints' sources among them),
    then all the other runs in one spawn of 4 ranks, each on the first ranks it needs."""
    root = tmp_path_factory.mktemp("layout_parity")
    plan = _plan()
    for name, (nproc, args, source) in plan.items():
        if source is not None:
            step5 = root / source / "checkpoint" / "step-5"
            shutil.copytree(step5, root / name / "checkpoint" / step5.name)
        if nproc == 1 or name in LAUNCHED:
            run_layout(root / name, nproc, args)
    # The 4-process runs first: ranks 2 and 3 then leave while ranks 0 and 1 run the 2-process
    # ones, instead of waiting in the next 4-process run's rendezvous.
    spawned = sorted((name for name, (nproc, _, _) in plan.items() if nproc > 1 and name not in LAUNCHED),
                     key=lambda name: -plan[name][0])
    jobs = {
        name: (layout_parity_worker.run, (str(root), ["--job.dump_folder", str(root / name), *plan[name][1]]),
               plan[name][0])
        for name in spawned
    }
    codes = spawn_local_jobs(jobs, 4, timeout=1800)
    assert all(set(job) == {0} for job in codes.values()), codes
    records = RunRecords({name: metrics_by_step(root / name) for name in plan})
    records.root = root
    return records


class RunRecords(dict):
    """The runs' records by name; ``root``: the folder of their dump folders."""

    root: Path


def _straight(runs, name: str) -> dict[int, dict]:
    return runs[_straight_name(name)]


def _resumed(runs, source: str, layout: str) -> dict[int, dict]:
    return runs[_resumed_name(source, layout)]


def _parity_run(runs, name: str) -> tuple[dict[int, dict], range, tuple[int, ...]]:
    """The layout's records, the trained steps they cover and the validated steps to compare."""
    if name in STRAIGHT:
        return _straight(runs, name), range(1, 11), (0, 5, 10)
    if name in RESUMED_INTO:
        return _resumed(runs, RESUMED_INTO[name], name), range(6, 11), (10,)
    return runs[name], range(1, 6), (0, 5)


def _assert_parity(
    layout: str, got: dict, steps: range, validated: tuple[int, ...], single: dict, last_norm_step: int = 5
) -> None:
    assert [s for s in got if "loss" in got[s]] == list(steps)
    for step in steps:
        assert_close(f"{layout} step {step} loss", got[step]["loss"], single[step]["loss"])
    # Gradient norms over the warmup only: at step 9 the norm spikes (1.9 -> 4.2) and is
    # ill-conditioned, 2e-4 to 1e-3 apart between layouts whose losses agree to 5e-7.
    for step in (s for s in steps if s <= last_norm_step):
        assert_close(f"{layout} step {step} grad_norm", got[step]["grad_norm"], single[step]["grad_norm"])
    for step in validated:
        assert_close(f"{layout} step {step} val_loss", got[step]["val_loss"], single[step]["val_loss"])
    # Not a constant: the model trains, and step 1 is not the layout-independent ln(vocab).
    assert single[5]["loss"] < single[1]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_and_validation_match_one_process(runs, layout):
    single, _, _ = _parity_run(runs, "single")
    got, steps, validated = _parity_run(runs, layout)
    _assert_parity(layout, got, steps, validated, single)
    if "--parallelism.pp" in LAYOUTS[layout][1]:  # rank 0 logs every stage's peak memory
        last = got[steps[-1]]
        assert last["memory_gib"] == max(last["memory_gib_pp0"], last["memory_gib_pp1"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(ENGRAM_LAYOUTS))
def test_engram_pipeline_matches_one_process(runs, layout):
    single, got = runs["engram_single"], runs[layout]
    # Gradient norms at steps 1 and 2 only, by the arithmetic (docs/engram.md, "Parity with one
    # process"): step 1's gradients differ from one process's by the order of their fp32 sums
    # alone, and step 2's also by the first Adam update, g / (|g| + eps) per entry, which moves the
    # weights by the same bits except where |g| is near eps. From there the gate's derivative
    # 1 / (2 sqrt(|s|)) (up to 500 at its 1e-6 floor) multiplies the last bits each step in
    # key_norm's and query_norm's gradients (2e-7, 2.6e-5, 4.5e-4 apart at steps 1-3 for pp 2 x
    # FSDP 2 x split tables), so later norms test the CPU's rounding, not the layout: the step-5
    # norm was 3.7e-6 apart on an AVX-512 Xeon, 1.06e-5 on an AVX2 EPYC. The losses, which the
    # gate barely moves, agree to 2e-7 over all five steps on both.
    _assert_parity(layout, got, range(1, 6), (0, 5), single, last_norm_step=2)


@pytest.mark.slow
@pytest.mark.parametrize("source, layout", RESUMES)
def test_checkpoint_resumes_in_another_layout(runs, source, layout):
    straight = _straight(runs, source)
    resumed = _resumed(runs, source, layout)
    assert sorted(s for s in resumed if "loss" in resumed[s]) == list(range(6, 11))
    for step in range(6, 11):
        assert_close(f"{source} resumed in {layout}, step {step}", resumed[step]["loss"], straight[step]["loss"])
    log = (runs.root / _resumed_name(source, layout) / "train.log").read_text()
    assert "resumed from" in log and "not restored" not in log and "restart from the seed" not in log


@pytest.mark.slow
def test_pp_2_checkpoint_exports_to_hf(runs, tmp_path):
    """A pipelined run's checkpoint holds the whole model under its global names: the HF export
    of it has every weight, the first stage's embedding and the last stage's head and MTP block."""
    step10 = runs.root / _straight_name("pp_2") / "checkpoint" / "step-10"
    proc = subprocess.run(
        ["python", str(REPO / "scripts" / "convert_hf.py"), "export", str(step10), str(tmp_path / "hf")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    names = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.kv_a_layernorm.weight"} <= set(names)
    assert any(name.startswith("model.layers.6.") for name in names)  # the MTP block, after the 6 main blocks
