"""The dry run: one training step of one rank of a world of any size, rehearsed on this CPU.

``python -m trainer.train --job.config_file X.toml --job.dry_run --dry_run.world_size 2048`` builds
the trainer as ``run_train.sh`` would on 2048 GPUs (the config, the pre-launch check, the memory-fit
check, the meshes, the pipeline split, every ``apply_*``, the optimizer, the checkpointer) for one
rank, then runs one step's forwards, backwards and optimizer step, and reports

* the rank's peak tensor memory by category (``MemTracker``: parameters, gradients, optimizer
  states, activations and temporaries, communication buffers) beside the estimator's figure
  (trainer/memory.py);
* every collective of the step: its name, group size, count and bytes.

How one process stands for 2048 (docs/planning.md):

* The process group is torch's ``fake`` backend (``FakeStore``): every group of every mesh exists,
  its collectives return at once without exchanging anything.
* Every tensor after the meta-device build is a fake tensor (``FakeTensorMode``): shapes, dtypes and
  the tensors' lifetimes are real, storage is not; the step computes nothing.
* What a fake tensor cannot give is replaced, and the report says so: the all-to-all's split sizes
  (the routing's counts are data) are the balanced split the estimator assumes
  (``BalancedSplitDispatcher``); the step's host read (loss and gradient norm) reads zeros; the
  pipeline schedule's warm-up vote, which reads a received value, is skipped for torch's static
  mode (the stages' shapes are given up front, trainer/parallel/pipeline_step.py).
* flex attention (CUDA only) runs as sdpa and ``training.compile`` is off: the saved activations'
  shapes are those of the eager model.

Under pipeline parallelism the ranks differ; by default the dry run rehearses the pp ranks that can
peak (``peak_pp_ranks``), with ``dry_run.ranks all_stages`` every pp rank. Each rank's measured
peak plus the CUDA terms (``cuda_terms_gib``) is checked against ``dry_run.gpu_memory_gib``: a rank
that does not fit makes the dry run end with a one-line verdict and ``EXIT_DOES_NOT_FIT``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import multiprocessing
import resource
import tempfile
import time
import weakref
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.tensor import DTensor, _sharding_prop
from torch.utils._python_dispatch import TorchDispatchMode

from models.deepseek_v3.stats import stage_unit_costs
from trainer.config import ConfigError, JobConfig
from trainer.config.check import check_model_fit
from trainer.config.layout import Layout
from trainer.config.pipeline_layout import PipelineCosts, PipelinePlan
from trainer.layout_planner import RESERVE_GIB
from trainer.memory import GiB, check_fits
from trainer.model_args import build_model_args, resolve_flavor
from trainer.parallel.expert_parallel import AllToAllTokenDispatcher
from trainer.parallel.pipeline_step import PipelineStep
from trainer.profiling import StepBreakdown
from trainer.progress import phase
from trainer.runtime import resolve_path
from trainer.train import Trainer

logger = logging.getLogger("trainer")

# The c10d operators a collective reaches the dispatcher as (torch.distributed's calls and
# ProcessGroup methods: "c10d"; DTensor and funcol: "_c10d_functional", with autograd).
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
_NOT_COLLECTIVES = {"wait_tensor", "wait", "monitored_barrier_", "_wrap_tensor_autograd"}
# The argument of FSDP2's collectives that is its communication buffer.
_FSDP_BUFFERS = {"_allgather_base_": 0, "_reduce_scatter_base_": 1}


class Collective(NamedTuple):
    """One collective call: operator, group size, the bytes of its largest tensor (the whole
    buffer: an all-gather's output, a reduce-scatter's input, an all-reduce's or a point-to-point's
    tensor, an all-to-all's input) and the shapes of its tensors, in argument order."""

    name: str
    group_size: int
    nbytes: int
    shapes: tuple[tuple[int, ...], ...]


class CollectiveRecorder(TorchDispatchMode):
    """Records every collective a step issues (``calls``, in issue order). Works the same on the
    fake backend and on gloo, so a dry run's list compares with a real run's; the MoE-overlap tests
    compare the ranks' sequences with it (tests/distributed/moe_overlap_worker.py)."""

    def __init__(self, tracker: MemTracker | None = None):
        super().__init__()
        self.calls: list[Collective] = []
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor turns it into local ops and collectives, seen again here
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace in _COLLECTIVE_NAMESPACES and name not in _NOT_COLLECTIVES:
            flat = [*args, *kwargs.values()]
            tensors = [t for a in flat for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
            size = next((s for s in map(_group_size, flat) if s is not None), 1)
            nbytes = max((t.numel() * t.element_size() for t in tensors), default=0)
            self.calls.append(Collective(name.rstrip("_"), size, nbytes, tuple(tuple(t.shape) for t in tensors)))
        out = func(*args, **kwargs)
        if self.tracker is not None and name in _FSDP_BUFFERS:
            # FSDP's flat all-gather output and reduce-scatter input: communication buffers.
            self.tracker._update_and_maybe_create_winfos(args[_FSDP_BUFFERS[name]], _MemRefType.OTH)
        return out

    def summary(self) -> list[dict]:
        """One row per (collective, group size): count and bytes (total and largest)."""
        rows: dict[tuple[str, int], dict] = {}
        for name, size, nbytes, _ in self.calls:
            row = rows.setdefault((name, size), {"collective": name, "group_size": size, "count": 0, "bytes": 0,
                                                 "largest_bytes": 0})
            row["count"] += 1
            row["bytes"] += nbytes
            row["largest_bytes"] = max(row["largest_bytes"], nbytes)
        return sorted(rows.values(), key=lambda r: -r["bytes"])


def _group_size(arg) -> int | None:
    """The size of the process group ``arg`` names (a ProcessGroup, or funcol's group name)."""
    if isinstance(arg, dist.ProcessGroup):
        return arg.size()
    if isinstance(arg, torch.ScriptObject):
        try:
            return dist.ProcessGroup.unbox(arg).size()
        except (RuntimeError, AttributeError):
            return None
    if isinstance(arg, str) and arg:
        try:
            return dist.distributed_c10d._resolve_process_group(arg).size()
        except (RuntimeError, ValueError, KeyError):
            return None
    return None


class _ForwardOnlyModTracker(ModTracker):
    """torch's ``ModTracker`` without its gradient hooks. Its backward bookkeeping hangs a
    multi-gradient hook on every module's inputs and outputs; under a zero-bubble schedule the
    weight pass runs one ``autograd.grad`` per parameter group, each reaching only some of a
    module's inputs, and the hook buffers those partial gradients per graph task forever: the
    dry run of a zero-bubble schedule then grew with the micro-batches (671B DualPipeV: 945 GiB,
    debug ZBVZeroBubble + full AC: 0.08 GiB per micro-batch), a run without the tracker does not
    (benchmarks/RESULTS.md). The memory tracker needs only ``is_bw`` (torch's: a graph task is
    running) and the forward hooks; its per-module backward statistics are not reported."""

    def _fw_pre_hook(self, mod, input):
        self._get_append_fn(weakref.ref(mod), self._get_mod_name(mod), False)()
        if self._user_pre_fw_hook is not None:
            self._user_pre_fw_hook(mod, input)

    def _fw_post_hook(self, mod, input, output):
        if self._user_post_fw_hook is not None:
            self._user_post_fw_hook(mod, input, output)
        self._get_pop_fn(weakref.ref(mod), self._get_mod_name(mod), False)()


class StepMemTracker(MemTracker):
    """torch's ``MemTracker`` over a step that runs the model (or a pipeline stage) once per
    micro-batch: its module statistics, which this report does not use, refuse a second forward of
    a root module. Tensors are tracked as before: the module's parameters were at its first call."""

    def __init__(self):
        super().__init__()
        self._mod_tracker = _ForwardOnlyModTracker()

    def _pre_fw_hook(self, module, inputs) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            return
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state) -> None:
        """The device's peak only: torch's also walks every module's statistics at every operator,
        most of a dry run's time."""
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[dev] = snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)


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


class DryRunTrainer(Trainer):
    """The Trainer's build for rank ``rank`` of ``cfg.dry_run.world_size`` on the fake process
    group, its tensors fake from the model's materialization on; no data, no run folder."""

    def __init__(self, cfg: JobConfig, rank: int):
        self.rank = rank
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.work_dir = tempfile.TemporaryDirectory(prefix="dry_run_")
        self.estimates: dict[str, dict] = {}
        super().__init__(cfg, model_args=self._model_args_without_tokenizer(cfg))

    @staticmethod
    def _model_args_without_tokenizer(cfg: JobConfig):
        """The flavor's EOS when the tokenizer file is not on this machine (the model's shape, the
        flavor's either way, is all a dry run needs of it); None: the tokenizer's, as a run builds it."""
        if resolve_path(cfg.model.tokenizer_path).is_file():
            return None
        flavor = resolve_flavor(cfg)
        return build_model_args(cfg, flavor.vocab_size, flavor.eos_id)

    def _world_size(self) -> int:
        return self.cfg.dry_run.world_size

    def _init_process_group(self) -> None:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if not dist.is_initialized():
            dist.init_process_group("fake", store=FakeStore(), rank=self.rank, world_size=self._world_size())

    def _use_collective_timeout(self, key: str) -> None:
        self.collective_timeout_key = key  # the fake backend has no timeouts to set

    def _open_run_folder(self) -> None:
        self.run_dir = Path(self.work_dir.name)

    def _build_tokenizer(self):
        return super()._build_tokenizer() if resolve_path(self.cfg.model.tokenizer_path).is_file() else None

    def _check_memory_fit(self, available_memory: int | None) -> None:
        """The check a run makes on its GPU (``dry_run.gpu_memory_gib``; refuses what cannot fit),
        and the estimator's figure for this CPU's tensors only (what the tracker counts)."""
        self.estimates = self.estimate(int(self.cfg.dry_run.gpu_memory_gib * GiB))

    def estimate(self, gpu: int = 1 << 62) -> dict[str, dict]:
        """The estimator's figures on CUDA (refused above ``gpu`` bytes) and for this CPU's tensors."""
        fits = (self.cfg, self.model_args, self.parallel_dims)
        return {"cuda": check_fits(*fits, torch.device("cuda"), gpu),
                "tensors": check_fits(*fits, torch.device("cpu"), 1 << 62)}

    def _build_model(self, model_args, available_memory) -> None:
        super()._build_model(model_args, available_memory)
        for module in self.model.modules():
            if isinstance(getattr(module, "dispatcher", None), AllToAllTokenDispatcher):
                module.dispatcher.__class__ = BalancedSplitDispatcher

    def _materialize(self, model: torch.nn.Module) -> None:
        # The meshes' and FSDP's own set-up read their rank tensors, so only from here on is
        # every tensor fake: storage without values, nothing to draw.
        with self.fake_mode:
            model.to_empty(device=self.device)

    def _build_training_pieces(self) -> None:
        with self.fake_mode:
            super()._build_training_pieces()

    def _build_data(self) -> None:
        self.token_group, self.train_loader, self.validator = None, None, None

    def _build_observability(self) -> None:
        self.breakdown = StepBreakdown(False, self.device)  # nothing is logged or profiled

    def _resume(self) -> None:
        self._build_checkpointer()  # the plan; a dry run loads nothing

    @staticmethod
    def _read_step_values(values: torch.Tensor) -> list[float]:
        return [0.0] * values.numel()  # fake tensors hold no values

    def fake_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        t = self.cfg.training
        with self.fake_mode:
            return [
                (torch.randint(self.model_args.vocab_size, (t.local_batch_size, t.seq_len), device=self.device),) * 2
                for _ in range(self.grad_accum_steps)
            ]

    def _create_optimizer_states(self) -> None:
        """The optimizer's states as every step after the first holds them through its forward
        and backward (torch makes them at the first ``step``): one step on zero gradients."""
        with self.fake_mode:
            params = [p for p in self.model.parameters() if p.requires_grad]
            for p in params:
                p.grad = torch.zeros_like(p)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def rehearse_step(self) -> dict:
        """One training step under the memory tracker and the collective recorder."""
        if isinstance(self.parallel, PipelineStep):
            schedule = self.parallel.schedule(self.device, train=True)
            schedule._warmup_p2p = _static_warmup(schedule)
        batches = self.fake_batches()
        self._create_optimizer_states()
        # DTensor derives an operator's global output shape by running it on whole-size fake tensors,
        # in the fake mode it finds active: ours, where the tracker would count them (a 256-expert
        # weight of 671B is 14 GiB). Found no fake mode, it makes one of its own, which the tracker
        # ignores (it counts only ops of the mode it was entered in).
        own_propagation = mock.patch.object(_sharding_prop, "detect_fake_mode", lambda *args: None)
        memory, collectives = track_step(self, batches, self.fake_mode, Float32GroupedMM(), own_propagation)
        return {"memory": memory, "collectives": collectives}

    def close(self) -> None:
        self.checkpointer.close()
        dist.destroy_process_group()
        self.work_dir.cleanup()


def track_step(trainer: Trainer, batches, *contexts) -> tuple[dict[str, float], list[dict]]:
    """``trainer.train_step(batches)`` under the memory tracker and the collective recorder, inside
    ``contexts`` (the dry run's fake mode; none for a real run): the peak GiB by category and the
    collectives. The same code measures a dry run and a real run (tests/distributed/test_dry_run.py)."""
    tracker = StepMemTracker()
    recorder = CollectiveRecorder(tracker)
    tracker.track_external(trainer.model, trainer.optimizer)
    own = _snapshot(tracker, "current")  # this rank's parameter shards and buffers
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        stack.enter_context(tracker)
        stack.enter_context(recorder)
        trainer.train_step(batches)
    peak = _snapshot(tracker, "peak")
    held = own.get("Parameter", 0) + own.get("Buffer", 0)
    gib = {
        "params": held,
        "grads": peak.get("Gradient", 0),
        "optimizer_states": peak.get("Optstate", 0),
        "activations": peak.get("Activation", 0),
        "temporaries": peak.get("Temp", 0),
        # Parameters gathered from other ranks (FSDP's unsharded blocks) and FSDP's flat buffers.
        "comm_buffers": peak.get("Parameter", 0) + peak.get("Buffer", 0) - held + peak.get("Other", 0),
        "total": peak.get("Total", 0),
    }
    return {k: v / GiB for k, v in gib.items()}, recorder.summary()


def _snapshot(tracker: MemTracker, kind: str) -> dict[str, int]:
    """The tracker's snapshot of this process's one device, bytes by category name."""
    snap = next(iter(tracker.get_tracker_snapshot(kind).values()), {})
    return {getattr(k, "value", k): v for k, v in snap.items()}


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
            (s.first, s.last, sum(i < args.n_dense_layers for i in s.layers),
             sum(i >= args.n_dense_layers for i in s.layers), len(engram.intersection(s.layers)))
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
    phase(f"dry run: rehearsing rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of "
          f"{cfg.dry_run.world_size}, one after the other")
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
    trainer = DryRunTrainer(cfg, rank)
    try:
        built = time.perf_counter()
        phase(f"{who}: built in {built - start:.0f} s; rehearsing one training step ...")
        step = trainer.rehearse_step()
        phase(f"{who}: step rehearsed in {time.perf_counter() - built:.0f} s; writing the report")
        report = _report(trainer, rank, step, notes, built - start, time.perf_counter() - built)
    finally:
        trainer.close()
    print(format_report(report), flush=True)
    return report


def _report(trainer: DryRunTrainer, rank: int, step: dict, notes: list[str], build_s: float, step_s: float) -> dict:
    dims = trainer.parallel_dims
    stages = [s.spec.index for s in trainer.parallel.stages] if isinstance(trainer.parallel, PipelineStep) else []
    balanced = any(isinstance(m.dispatcher, BalancedSplitDispatcher) for m in trainer.model.modules()
                   if hasattr(m, "dispatcher"))
    if balanced:
        notes = [*notes, "all-to-all split sizes: the balanced split (every ep rank sends each an equal share; the "
                 "estimator's assumption): the routing's counts are data, which fake tensors do not hold"]
    # The estimator's figure for this rank's pipeline position (its fullest rank's without pp).
    pp_rank = dims.mesh("pp").get_local_rank() if dims.pp_enabled else 0
    # Without training.check_memory_fit the build made no estimate; the report still has one.
    estimates = trainer.estimates or trainer.estimate()
    est = {k: v.get("gib_per_pp_rank", [v["gib"]["total"]])[pp_rank] for k, v in estimates.items()}
    cuda_terms = cuda_terms_gib(estimates["cuda"])
    gpu = trainer.cfg.dry_run.gpu_memory_gib
    need = step["memory"]["total"] + sum(cuda_terms.values())
    return {
        "cuda_terms_gib": cuda_terms, "need_gib": need, "gpu_memory_gib": gpu, "fits": need <= gpu,
        "rank": rank, "world_size": dims.world_size, "layout": dims.describe(), "stages": stages,
        "flavor": trainer.cfg.model.flavor, "memory_gib": step["memory"], "collectives": step["collectives"],
        "estimate_gib": est, "notes": notes, "build_s": build_s, "step_s": step_s,
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
        f"  estimator (trainer/memory.py): {r['estimate_gib']['tensors']:.2f} GiB of tensors "
        f"({r['estimate_gib']['cuda']:.2f} GiB on a CUDA device with its allocator and workspace terms)",
        "  collectives of one step (group size, count, total and largest bytes):",
        *(f"    {c['collective']:<24} group {c['group_size']:>5}  x{c['count']:<5} {c['bytes'] / 2**20:12.1f} MiB"
          f"  (largest {c['largest_bytes'] / 2**20:.1f} MiB)" for c in r["collectives"]),
        *(f"  note: {n}" for n in r["notes"]),
        f"  on a {r['gpu_memory_gib']:g} GiB GPU: {m['total']:.2f} GiB measured + "
        + " + ".join(f"{v:.2f} {k}" for k, v in r["cuda_terms_gib"].items())
        + f" = {r['need_gib']:.2f} GiB: {'fits' if r['fits'] else 'does not fit'}",
        f"  built in {r['build_s']:.1f} s, step rehearsed in {r['step_s']:.1f} s, peak RSS {r['peak_rss_gib']:.2f} GiB",
    ]
    return "\n".join(lines)


def cuda_terms_gib(cuda_estimate: dict) -> dict[str, float]:
    """What a GPU needs beyond the tensors the dry run measures (GiB): the estimator's CUDA terms
    (trainer/memory.py: the caching allocator's rounding of the parameter-like tensors, the cuBLAS
    workspace) and the planner's reserve for what torch's allocator does not hold (CUDA context,
    NCCL buffers, fragmentation; trainer/layout_planner.py)."""
    g = cuda_estimate["gib"]
    return {"allocator rounding": g["allocator_rounding"], "cuBLAS workspace": g["cublas_workspace"],
            "CUDA context, NCCL and fragmentation": RESERVE_GIB}


def verdict(reports: list[dict]) -> str:
    """One line: whether every rehearsed rank's measured peak plus the CUDA terms fits its GPU."""
    worst = max(reports, key=lambda r: r["need_gib"])
    where = f"rank {worst['rank']} (pipeline stage(s) {worst['stages']})" if worst["stages"] else f"rank {worst['rank']}"
    if worst["fits"]:
        return (f"dry run: fits: every rehearsed rank's measured peak plus the CUDA terms is within "
                f"{worst['gpu_memory_gib']:g} GiB (largest: {where}, {worst['need_gib']:.1f} GiB)")
    return (f"dry run: does not fit: {where} needs {worst['need_gib']:.1f} GiB (measured peak "
            f"{worst['memory_gib']['total']:.1f} + CUDA terms {sum(worst['cuda_terms_gib'].values()):.1f}) > "
            f"dry_run.gpu_memory_gib {worst['gpu_memory_gib']:g}; lower training.local_batch_size or seq_len, use "
            f"activation_checkpoint.mode full, or shard over more devices (docs/planning.md)")


# The dry run's exit code when a rehearsed rank does not fit (2 is a config error, refused before
# any rank is built; docs/planning.md).
EXIT_DOES_NOT_FIT = 3


def main(cfg: JobConfig) -> int:
    try:
        reports = dry_run(cfg)
    except ConfigError as e:
        if dist.is_initialized():
            dist.destroy_process_group()
        from trainer.launch_files import report_user_error

        return report_user_error(f"config error: {e}")
    line = verdict(reports)
    print(line, flush=True)
    return 0 if all(r["fits"] for r in reports) else EXIT_DOES_NOT_FIT


