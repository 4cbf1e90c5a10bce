"""The dry run: one training step of one rank of a world of any size, rehearsed on this CPU.

``python -m trainer.train --job.config_file X.toml --job.dry_run --dry_run.world_size 2048`` builds
the trainer as ``run_train.sh`` would on 2048 GPUs (the config, the pre-launch check, the memory-fit
check, the meshes, the pipeline split, every ``apply_*``, the optimizer) for one
rank, then runs one step's forwards, backwards and optimizer step, and reports

* the rank's peak tensor memory by category (``MemTracker``: parameters, gradients, optimizer
  states, activations and temporaries, communication buffers) beside the estimator's figure
  (trainer/planning/memory.py);
* every collective of the step: its name, group size, count and bytes.

How one process stands for 2048 (docs/planning.md):

* The process group is torch's ``fake`` backend (``FakeStore``), chosen by the configuration where
  the process group is made (``job.dry_run``: rank ``dry_run.rank`` of ``dry_run.world_size``,
  trainer/distributed.py ``init_distributed``): every group of every mesh exists, its collectives
  return at once without exchanging anything.
* Every tensor after the meta-device build is a fake tensor (``FakeTensorMode``): shapes, dtypes and
  the tensors' lifetimes are real, storage is not; the step computes nothing.
* What a fake tensor cannot give is replaced, and the report says so: the all-to-all's split sizes
  (the routing's counts are data) are the balanced split the estimator assumes
  (``BalancedSplitDispatcher``); the step's host read (loss and gradient norm) reads zeros; the
  pipeline schedule's warm-up vote, which reads a received value, is skipped for torch's static
  mode (the stages' shapes are given up front, trainer/parallel/pipeline_step.py).
* flex attention (CUDA only) runs as sdpa and ``training.compile`` is off: the saved activations'
  shapes are those of the eager model.

The Trainer is the run's own (trainer/trainer.py), built as a rehearsal: its one ``rehearsal``
argument is the fake tensor mode, and it builds no run folder, data, observability or checkpointer.
The measuring tools are trainer/diagnostics/'s (``track_step``: torch's ``MemTracker`` and the
collective recorder), the same that measure a real run's step.

Under pipeline parallelism the ranks differ; by default the dry run rehearses the pp ranks that can
peak (``peak_pp_ranks``), with ``dry_run.ranks all_stages`` every pp rank. Each rank's measured
peak plus the CUDA terms (``cuda_terms_gib``) is checked against ``dry_run.gpu_memory_gib``: a rank
that does not fit makes the dry run end with a one-line verdict and ``EXIT_DOES_NOT_FIT``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import resource
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from models.deepseek_v3.stats import stage_unit_costs
from trainer.config import ConfigError, JobConfig
from trainer.config.check import check_model_fit
from trainer.config.layout import Layout
from trainer.config.pipeline_layout import PipelineCosts, PipelinePlan
from trainer.diagnostics.memory_tracker import own_shape_propagation, track_step
from trainer.distributed import destroy_distributed
from trainer.model_args import build_model_args, resolve_flavor
from trainer.parallel.expert_parallel import AllToAllTokenDispatcher
from trainer.parallel.pipeline_step import PipelineStep
from trainer.planning.fit_check import check_fits
from trainer.planning.layout_planner import RESERVE_GIB
from trainer.progress import phase
from trainer.runtime import resolve_path
from trainer.trainer import Trainer

logger = logging.getLogger("trainer")


class BalancedSplitDispatcher(AllToAllTokenDispatcher):
    """The all-to-all dispatcher with the balanced split the estimator assumes: every ep rank sends
    an equal share of its rows to every other (fake tensors hold no routing counts to read)."""

    def split_sizes(
        self, send_counts: torch.Tensor, recv_counts: torch.Tensor, rows: int
    ) -> tuple[list[int], list[int]]:
        share, extra = divmod(rows, self.ep_size)
        splits = [share + (r < extra) for r in range(self.ep_size)]
        return splits, list(splits)


class Float32GroupedMM(TorchDispatchMode):
    """``torch._grouped_mm`` on fp32 fake tensors: the CPU kernel takes fp32, its shape function
    (the meta kernel) only bf16. The shape comes from a bf16 call, the result is fp32, as the CPU
    kernel's. Entered below the tracker, which sees only the fp32 result."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype == torch.float32:
            a, b, *rest = args
            return func(a.to(torch.bfloat16), b.to(torch.bfloat16), *rest, **kwargs).to(torch.float32)
        return func(*args, **kwargs)


def _static_warmup(stages_of_schedule):
    """The schedule's warm-up without its vote: the fake backend delivers no value to read, and
    every stage's shapes are given (trainer/parallel/pipeline_step.py), so torch's static mode."""
    from torch.distributed.pipelining.stage import InferenceMode

    def warmup(stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    return warmup


def build_rehearsal(cfg: JobConfig, rank: int) -> Trainer:
    """The Trainer's build for rank ``rank`` of ``cfg.dry_run.world_size`` on the fake process
    group (``job.dry_run``), its tensors fake from the model's materialization on; the all-to-alls'
    split is the balanced one."""
    cfg = dataclasses.replace(cfg, dry_run=dataclasses.replace(cfg.dry_run, rank=rank))
    trainer = Trainer(
        cfg, model_args=_model_args_without_tokenizer(cfg), rehearsal=FakeTensorMode(allow_non_fake_inputs=True)
    )
    for module in trainer.model.modules():
        if isinstance(getattr(module, "dispatcher", None), AllToAllTokenDispatcher):
            module.dispatcher.__class__ = BalancedSplitDispatcher
    return trainer


def _model_args_without_tokenizer(cfg: JobConfig):
    """The flavor's EOS when the tokenizer file is not on this machine (the model's shape, the
    flavor's either way, is all a dry run needs of it); None: the tokenizer's, as a run builds it."""
    if resolve_path(cfg.model.tokenizer_path).is_file():
        return None
    flavor = resolve_flavor(cfg)
    return build_model_args(cfg, flavor.vocab_size, flavor.eos_id)


def estimate(trainer: Trainer) -> dict[str, dict]:
    """The estimator's figures on CUDA and for this CPU's tensors (what the tracker counts)."""
    fits = (trainer.cfg, trainer.model_args, trainer.parallel_dims)
    return {
        "cuda": check_fits(*fits, torch.device("cuda"), 1 << 62),
        "tensors": check_fits(*fits, torch.device("cpu"), 1 << 62),
    }


def _fake_batches(trainer: Trainer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    t = trainer.cfg.training
    with trainer.rehearsal:
        return [
            (torch.randint(trainer.model_args.vocab_size, (t.local_batch_size, t.seq_len), device=trainer.device),) * 2
            for _ in range(trainer.grad_accum_steps)
        ]


def _create_optimizer_states(trainer: Trainer) -> None:
    """The optimizer's states as every step after the first holds them through its forward and
    backward (torch makes them at the first ``step``): one step on zero gradients."""
    with trainer.rehearsal:
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)


def rehearse_step(trainer: Trainer) -> dict:
    """One training step under the memory tracker and the collective recorder."""
    if isinstance(trainer.parallel, PipelineStep):
        schedule = trainer.parallel.schedule(trainer.device, train=True)
        schedule._warmup_p2p = _static_warmup(schedule)
    batches = _fake_batches(trainer)
    _create_optimizer_states(trainer)
    memory, collectives = track_step(trainer, batches, trainer.rehearsal, Float32GroupedMM(), own_shape_propagation())
    return {"memory": memory, "collectives": collectives}


def default_ranks(cfg: JobConfig) -> list[int]:
    """``dry_run.rank``, or the ranks ``dry_run.ranks`` names: rank 0 without pipelining; under
    pipelining the first rank of each pp rank that can peak (``peak_pp_ranks``), or of every pp rank
    (``all_stages``: every stage rehearsed). The data, expert, context and tensor ranks of one pp rank
    hold equal shares (the all-to-all's split is the balanced one), so one of them stands for all."""
    if cfg.dry_run.rank >= 0:
        return [cfg.dry_run.rank]
    layout = Layout.from_job(cfg, cfg.dry_run.world_size)
    if layout.pp == 1:
        return [0]
    plan = layout.pipeline
    pp_ranks = range(plan.pp) if cfg.dry_run.ranks == "all_stages" else peak_pp_ranks(cfg, plan)
    return [r * (cfg.dry_run.world_size // plan.pp) for r in pp_ranks]


def peak_pp_ranks(cfg: JobConfig, plan: PipelinePlan) -> list[int]:
    """The pp ranks whose memory can be the largest, from the layout: pp ranks whose stages hold the
    same (embedding, head and MTP, dense blocks, MoE blocks with their experts, Engram blocks,
    stage by stage) differ only in how many micro-batches of each stage they keep in flight, and
    that count moves one way along the ranks: under 1F1B, GPipe and the looped schedules rank r
    keeps no more than rank r - 1, so the lowest rank of each such class peaks; under a V schedule
    (rank r holds stages r and 2 pp - 1 - r) rank r keeps 2 pp - r - 1 micro-batches of its first
    stage and r + 1 of its second at the deepest point of the warm-up (torch's ZBV and DualPipeV),
    a peak linear in r, so the lowest or the highest rank of each class peaks. DualPipeV's rank r
    also ends its step with r + 1 weight passes waiting; ``pp_max_deferred_weight_passes`` = N
    holds that at N from rank N - 1 on, where fewer micro-batches stay in flight with each rank:
    rank N - 1 can peak too. docs/planning.md."""
    args = resolve_flavor(cfg)
    specs = plan.split(args.n_layers, args.mtp_depth, PipelineCosts(**stage_unit_costs(args, cfg.training.seq_len)))
    engram = set(cfg.engram.layer_ids) if cfg.engram.enable else set()

    def holds(rank: int) -> tuple:
        return tuple(
            (
                s.first,
                s.last,
                sum(i < args.n_dense_layers for i in s.layers),
                sum(i >= args.n_dense_layers for i in s.layers),
                len(engram.intersection(s.layers)),
            )
            for s in plan.rank_stages(specs, rank)
        )

    classes: dict[tuple, list[int]] = {}
    for rank in range(plan.pp):
        classes.setdefault(holds(rank), []).append(rank)
    ends = (min, max) if plan.v_shaped else (min,)
    peaks = {end(ranks) for ranks in classes.values() for end in ends}
    cap = plan.pp_max_deferred_weight_passes
    if plan.pp_schedule == "DualPipeV" and 0 < cap <= plan.pp:
        peaks.add(cap - 1)
    return sorted(peaks)


def rehearsal_config(cfg: JobConfig) -> tuple[JobConfig, list[str]]:
    """The config the dry run builds, and what it changed from the user's and why."""
    notes = []
    model, training = cfg.model, cfg.training
    if model.attn_backend == "flex":
        model = dataclasses.replace(model, attn_backend="sdpa")
        notes.append("model.attn_backend flex -> sdpa (flex attention runs on CUDA only)")
    if training.compile:
        notes.append("training.compile off (the eager model's saved activations)")
    training = dataclasses.replace(training, compile=False, device="cpu")
    return dataclasses.replace(cfg, model=model, training=training), notes


def dry_run(cfg: JobConfig) -> list[dict]:
    """Rehearses ``default_ranks(cfg)``; returns one report per rank (also printed). Rank 0 alone
    runs in this process; other ranks run one after the other, each in a fresh process: torch keeps
    state of a destroyed process group's meshes that a fake world of another rank in the same
    process trips over ("Could not resolve the process group registered under the name ...")."""
    check_model_fit(cfg, Layout.from_job(cfg, cfg.dry_run.world_size))  # run_train.sh's pre-launch check
    cfg, notes = rehearsal_config(cfg)
    ranks = default_ranks(cfg)
    phase(
        f"dry run: rehearsing rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of "
        f"{cfg.dry_run.world_size}, one after the other"
    )
    if ranks == [0]:
        reports = [rehearse_rank(cfg, 0, notes)]
    else:
        reports = []
        for rank in ranks:
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                reports.append(pool.submit(rehearse_rank, cfg, rank, notes).result())
    if cfg.dry_run.output_json:
        Path(cfg.dry_run.output_json).write_text(json.dumps(reports, indent=1))
    return reports


def rehearse_rank(cfg: JobConfig, rank: int, notes: list[str]) -> dict:
    """Builds rank ``rank``, rehearses its step, prints and returns its report."""
    start = time.perf_counter()
    who = f"dry run: rank {rank} of {cfg.dry_run.world_size}"
    phase(f"{who}: building the trainer (model, parallelism, optimizer) ...")
    trainer = build_rehearsal(cfg, rank)
    try:
        built = time.perf_counter()
        phase(f"{who}: built in {built - start:.0f} s; rehearsing one training step ...")
        step = rehearse_step(trainer)
        phase(f"{who}: step rehearsed in {time.perf_counter() - built:.0f} s; writing the report")
        report = _report(trainer, rank, step, notes, built - start, time.perf_counter() - built)
    finally:
        trainer.close()
    print(format_report(report), flush=True)
    return report


def _report(trainer: Trainer, rank: int, step: dict, notes: list[str], build_s: float, step_s: float) -> dict:
    dims = trainer.parallel_dims
    stages = [s.spec.index for s in trainer.parallel.stages] if isinstance(trainer.parallel, PipelineStep) else []
    balanced = any(
        isinstance(m.dispatcher, BalancedSplitDispatcher) for m in trainer.model.modules() if hasattr(m, "dispatcher")
    )
    if balanced:
        notes = [
            *notes,
            "all-to-all split sizes: the balanced split (every ep rank sends each an equal share; the "
            "estimator's assumption): the routing's counts are data, which fake tensors do not hold",
        ]
    # The estimator's figure for this rank's pipeline position (its fullest rank's without pp).
    pp_rank = dims.mesh("pp").get_local_rank() if dims.pp_enabled else 0
    estimates = estimate(trainer)
    est = {k: v.get("gib_per_pp_rank", [v["gib"]["total"]])[pp_rank] for k, v in estimates.items()}
    cuda_terms = cuda_terms_gib(estimates["cuda"])
    gpu = trainer.cfg.dry_run.gpu_memory_gib
    need = step["memory"]["total"] + sum(cuda_terms.values())
    return {
        "cuda_terms_gib": cuda_terms,
        "need_gib": need,
        "gpu_memory_gib": gpu,
        "fits": need <= gpu,
        "rank": rank,
        "world_size": dims.world_size,
        "layout": dims.describe(),
        "stages": stages,
        "flavor": trainer.cfg.model.flavor,
        "memory_gib": step["memory"],
        "collectives": step["collectives"],
        "estimate_gib": est,
        "notes": notes,
        "build_s": build_s,
        "step_s": step_s,
        # Linux reports the peak resident set in KiB: this process's, the dry run's own cost.
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def format_report(r: dict) -> str:
    m = r["memory_gib"]
    where = f", pipeline stage(s) {r['stages']}" if r["stages"] else ""
    lines = [
        f"dry run: rank {r['rank']} of {r['world_size']}{where} | {r['flavor']} | {r['layout']}",
        f"  peak tensor memory {m['total']:.2f} GiB: parameters {m['params']:.2f}, gradients {m['grads']:.2f}, "
        f"optimizer states {m['optimizer_states']:.2f}, activations {m['activations']:.2f}, "
        f"backward temporaries {m['temporaries']:.2f}, communication buffers {m['comm_buffers']:.2f}",
        f"  estimator (trainer/planning/memory.py): {r['estimate_gib']['tensors']:.2f} GiB of tensors "
        f"({r['estimate_gib']['cuda']:.2f} GiB on a CUDA device with its allocator and workspace terms)",
        "  collectives of one step (group size, count, total and largest bytes):",
        *(
            f"    {c['collective']:<24} group {c['group_size']:>5}  x{c['count']:<5} {c['bytes'] / 2**20:12.1f} MiB"
            f"  (largest {c['largest_bytes'] / 2**20:.1f} MiB)"
            for c in r["collectives"]
        ),
        *(f"  note: {n}" for n in r["notes"]),
        f"  on a {r['gpu_memory_gib']:g} GiB GPU: {m['total']:.2f} GiB measured + "
        + " + ".join(f"{v:.2f} {k}" for k, v in r["cuda_terms_gib"].items())
        + f" = {r['need_gib']:.2f} GiB: {'fits' if r['fits'] else 'does not fit'}",
        f"  built in {r['build_s']:.1f} s, step rehearsed in {r['step_s']:.1f} s, peak RSS {r['peak_rss_gib']:.2f} GiB",
    ]
    return "\n".join(lines)


def cuda_terms_gib(cuda_estimate: dict) -> dict[str, float]:
    """What a GPU needs beyond the tensors the dry run measures (GiB): the estimator's CUDA terms
    (trainer/planning/memory.py: the caching allocator's rounding of the parameter-like tensors, the cuBLAS
    workspace) and the planner's reserve for what torch's allocator does not hold (CUDA context,
    NCCL buffers, fragmentation; trainer/planning/layout_planner.py)."""
    g = cuda_estimate["gib"]
    return {
        "allocator rounding": g["allocator_rounding"],
        "cuBLAS workspace": g["cublas_workspace"],
        "CUDA context, NCCL and fragmentation": RESERVE_GIB,
    }


def verdict(reports: list[dict]) -> str:
    """One line: whether every rehearsed rank's measured peak plus the CUDA terms fits its GPU."""
    worst = max(reports, key=lambda r: r["need_gib"])
    where = (
        f"rank {worst['rank']} (pipeline stage(s) {worst['stages']})" if worst["stages"] else f"rank {worst['rank']}"
    )
    if worst["fits"]:
        return (
            f"dry run: fits: every rehearsed rank's measured peak plus the CUDA terms is within "
            f"{worst['gpu_memory_gib']:g} GiB (largest: {where}, {worst['need_gib']:.1f} GiB)"
        )
    return (
        f"dry run: does not fit: {where} needs {worst['need_gib']:.1f} GiB (measured peak "
        f"{worst['memory_gib']['total']:.1f} + CUDA terms {sum(worst['cuda_terms_gib'].values()):.1f}) > "
        f"dry_run.gpu_memory_gib {worst['gpu_memory_gib']:g}; lower training.local_batch_size or seq_len, use "
        f"activation_checkpoint.mode full, or shard over more devices (docs/planning.md)"
    )


# The dry run's exit code when a rehearsed rank does not fit (2 is a config error, refused before
# any rank is built; docs/planning.md).
EXIT_DOES_NOT_FIT = 3


def main(cfg: JobConfig) -> int:
    try:
        reports = dry_run(cfg)
    except ConfigError as e:
        destroy_distributed()  # a process group made before the mistake was found
        from trainer.launch_files import report_user_error

        return report_user_error(f"config error: {e}")
    line = verdict(reports)
    print(line, flush=True)
    return 0 if all(r["fits"] for r in reports) else EXIT_DOES_NOT_FIT
