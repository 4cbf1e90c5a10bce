"""``Trainer`` owns the pieces of one run (model, optimizer, schedule, data, metrics), built in
phases; ``train`` runs it. The command (``python -m trainer.train``) is trainer/train.py, which
builds a Trainer or, for ``--job.dry_run``, the dry run's rehearsal of one (trainer/dry_run.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import math
import os
import time

import torch

from models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs, count_params, flops_per_token
from models.engram import NgramHasher, build_token_compression, engram_metrics
from trainer.checkpoint import CheckpointManager
from trainer.config import ConfigError, JobConfig
from trainer.config.data_mix import parse_mixture
from trainer.config.replica_groups import job_world_size
from trainer.data import build_dataloader, build_tokenizer
from trainer.data.mixture import build_mixture_dataloader
from trainer.distributed import (
    destroy_distributed,
    from_rank0,
    init_distributed,
    is_rank0,
    local_rank_from_env,
    set_collective_timeout,
    world_size_from_env,
)
from trainer.fault_tolerance import NonFiniteGuard, StopRequest
from trainer.launch_files import previous_attempt_failure
from trainer.metrics import (
    MetricsLogger,
    ThroughputWindow,
    is_log_step,
    peak_flops_for,
    peak_memory_gib,
)
from trainer.model_args import build_model_args, resolve_flavor
from trainer.optim.build import ExpertBiasUpdater, build_optimizer
from trainer.optim.ema import ParameterEMA
from trainer.optim.lr_schedule import build_lr_scheduler
from trainer.optim.qk_clip import QKClip
from trainer.parallel import ParallelDims, build_loss_function, materialize, parallelize_model
from trainer.parallel.replica_groups import LiveState, build_replica_groups
from trainer.planning.fit_check import check_fits
from trainer.planning.memory import GiB
from trainer.profiling import Profiler, StepBreakdown
from trainer.run_folder import open_run_folder
from trainer.run_header import log_run_header
from trainer.runtime import (
    keep_freed_host_memory,
    resolve_path,
    select_device,
    set_seed_and_determinism,
    setup_logging,
)
from trainer.step_hooks import StepHook
from trainer.validate import MixtureValidator, Validator

logger = logging.getLogger("trainer")


class Trainer:
    """The pieces of one run, built in phases: the process and its run folder, the model, the
    training pieces (optimizer, schedule, step object), the data and validation, observability,
    resume.

    Args:
        cfg: the job.
        model_args: the model's shape; None = the config's flavor with the tokenizer's vocabulary
            (``build_model_args``). A benchmark passes its own here.
        available_memory: bytes the run may take on its device, for the memory-fit check
            (``training.check_memory_fit``); None = what the device reports.
        rehearsal: None for a run. For a rehearsal (the dry run, trainer/dry_run.py: ``job.dry_run``,
            whose process group is the fake one of ``dry_run.world_size`` ranks) the tensor mode
            its tensors live in (a ``FakeTensorMode``): the weights and the training pieces are
            made inside it, and the parts a rehearsal has no use for (the run folder, the data and
            validation, observability, the checkpointer and resume) are not built.

    The data are the Trainer's own: ``next_microbatches`` reads its loader. A caller with other
    data passes its micro-batches to ``train_step`` (tests/distributed/parity_worker.py does).
    """

    def __init__(
        self,
        cfg: JobConfig,
        model_args: DeepSeekV3ModelArgs | None = None,
        available_memory: int | None = None,
        rehearsal: contextlib.AbstractContextManager | None = None,
    ):
        self.cfg = cfg
        self.rehearsal = rehearsal
        self._start_process(model_args)
        if rehearsal is not None:
            self._build_model(model_args, available_memory)
            with rehearsal:
                self._build_training_pieces()
            self.breakdown = StepBreakdown(False, self.device)  # nothing is logged or profiled
            self._build_step_state()  # nothing to resume
            return
        self._open_run_folder()
        self._build_model(model_args, available_memory)
        self._build_training_pieces()
        self._build_data()
        self._build_observability()
        self._resume()

    def _start_process(self, model_args: DeepSeekV3ModelArgs | None) -> None:
        """The layout, the device, the process group and its meshes, the seed and the batch split;
        a typo in the flavor, or heads / experts the layout cannot split, fail here, before the
        run folder exists."""
        cfg, t = self.cfg, self.cfg.training
        # With [fault_tolerance] this launch is one dp_replicate slice of the job's layout
        # (trainer/config/replica_groups.py): its meshes are the slice's, its batch split the job's.
        world_size = cfg.dry_run.world_size if cfg.job.dry_run else world_size_from_env()
        job = ParallelDims.from_job(cfg, job_world_size(cfg, world_size))
        self.parallel_dims = job.replica_group() if cfg.fault_tolerance.enable else job
        shape = model_args or resolve_flavor(cfg)
        self.parallel_dims.check_shapes(t.seq_len, n_heads=shape.n_heads, num_experts=shape.moe.num_experts)
        mtp_depth = shape.mtp_depth if model_args else cfg.model.mtp_depth_for(shape.mtp_depth)
        self.parallel_dims.check_stages(shape.n_layers, mtp_depth)
        self.device = select_device(t.device, local_rank_from_env())
        if cfg.model.attn_backend == "flex" and self.device.type != "cuda":
            raise ConfigError(
                "model.attn_backend = 'flex' needs a CUDA device (flex attention has no CPU backward); "
                "use --model.attn_backend sdpa"
            )
        # A dry run is rank dry_run.rank of its world, on the fake process group.
        fake = (cfg.dry_run.rank, world_size) if cfg.job.dry_run else None
        init_distributed(self.device, cfg.comm.init_timeout_seconds, fake)
        self.replica_groups = build_replica_groups(cfg.fault_tolerance, job.dp_replicate, self.device)
        self.parallel_dims.build_meshes(self.device.type)
        # The meshes' groups start with torch's backend default (30 min gloo, 10 min NCCL): the
        # build's collectives on them (a resharding load) get the start-up bound, as the default
        # group's do.
        self._use_collective_timeout("init_timeout_seconds")
        self.dp_rank, self.dp_world = self.parallel_dims.dp_rank_and_degree()
        if cfg.fault_tolerance.enable:  # this group's data ranks are the job's, after the groups before it
            self.dp_rank += cfg.fault_tolerance.replica_id * self.dp_world
            self.dp_world *= job.dp_replicate
        self.job_world_size = job.world_size
        set_seed_and_determinism(t.seed, t.deterministic)
        self.grad_accum_steps = job.check_batch(t.local_batch_size, t.global_batch_size)

    def _use_collective_timeout(self, key: str) -> None:
        """Every process group of the run waits at most ``comm.<key>`` seconds in a collective from
        now on; a timeout's message names the key."""
        self.collective_timeout_key = key
        set_collective_timeout(getattr(self.cfg.comm, key))

    def _open_run_folder(self) -> None:
        """The run folder, its log and the config's warnings."""
        cfg, t = self.cfg, self.cfg.training
        resumable = cfg.checkpoint.enable
        self.run_dir = open_run_folder(
            self.replica_groups.run_folder(cfg.job.dump_folder), resumable, is_rank0(), from_rank0
        )
        setup_logging(self.run_dir / "train.log")
        if not is_rank0():
            logging.getLogger("trainer").setLevel(logging.WARNING)
        logger.info(
            "run folder %s (%s)", self.run_dir.resolve(),
            "resumable: every rerun continues it" if resumable else "a fresh run: a new folder under job.dump_folder",
        )
        for warning in cfg.warnings() if is_rank0() else ():
            logger.warning("config warning: %s", warning)
        if self.device.type == "cpu" and t.cpu_keep_freed_memory:
            if keep_freed_host_memory():
                logger.info("host memory: freed blocks are kept for reuse (training.cpu_keep_freed_memory)")
            else:
                logger.warning("training.cpu_keep_freed_memory: the C library is not glibc; its malloc is left as it is")

    def _build_model(self, model_args: DeepSeekV3ModelArgs | None, available_memory: int | None) -> None:
        """The tokenizer, the model's shape and the model: checked to fit, built on the meta
        device, laid out by ``parallelize_model`` (which gives the step object) and materialized."""
        cfg, t = self.cfg, self.cfg.training
        self.tokenizer = tok = self._build_tokenizer()
        self.model_args = model_args or build_model_args(cfg, tok.vocab_size, tok.eos_id)
        self.parallel_dims.check_shapes(t.seq_len, vocab_size=self.model_args.vocab_size)
        if t.check_memory_fit:  # before a build that could not fit
            self._check_memory_fit(available_memory)
        with torch.device("meta"):
            model = DeepSeekV3Model(self.model_args)
        hasher = None
        if self.model_args.engram is not None:
            # Every rank derives the same map, primes and multipliers from the tokenizer and seed.
            compression = build_token_compression(lambda i: tok.decode([i]), tok.vocab_size, tok.pad_id)
            hasher = NgramHasher(self.model_args.engram, compression, model.engram_layer_ids).to(self.device)
        model, self.parallel = parallelize_model(
            model, self.parallel_dims, cfg.parallelism, t, cfg.activation_checkpoint, cfg.quantize, cfg.engram,
            self.device.type, hasher,
        )
        if cfg.fault_tolerance.enable:
            self.parallel.join_replica_groups(self.replica_groups)
        if self.rehearsal is None:
            materialize(model, self.device, self.cfg.training.seed)
        else:
            # The meshes' and FSDP's own set-up read their rank tensors, so only from here on is
            # every tensor of a rehearsal fake: storage without values, nothing to draw.
            with self.rehearsal:
                model.to_empty(device=self.device)
        model.train()
        if model.engram_layer_ids:  # (a pipeline rank may hold none)
            table_stats = engram_metrics(model)
            logger.info(
                "engram: layers %s, %d compressed ids (of %d), %d table rows = %.1f MiB on this rank",
                list(self.model_args.engram.layer_ids), hasher.num_compressed, tok.vocab_size,
                table_stats["engram/table_rows_per_rank"], table_stats["engram/table_bytes_per_rank"] / 2**20,
            )
        self.model = model

    def _build_tokenizer(self):
        """The tokenizer; None in a rehearsal without its file, which is given the model's shape."""
        m = self.cfg.model
        path = resolve_path(m.tokenizer_path)
        if self.rehearsal is not None and not path.is_file():
            return None
        return build_tokenizer(path, parse_special_tokens=m.parse_special_tokens)

    def _check_memory_fit(self, available_memory: int | None) -> None:
        """The estimate against the device's memory; a dry run's against the GPU it rehearses
        (``dry_run.gpu_memory_gib``), whatever device it runs on."""
        device = self.device
        if self.cfg.job.dry_run:
            device, available_memory = torch.device("cuda"), int(self.cfg.dry_run.gpu_memory_gib * GiB)
        check_fits(self.cfg, self.model_args, self.parallel_dims, device, available_memory)

    def _build_training_pieces(self) -> None:
        """What a step uses beside the model and its step object (precision, loss, optimizer,
        schedule, MoE bias and QK-clip updates)."""
        cfg, t, o = self.cfg, self.cfg.training, self.cfg.optimizer
        self.autocast_dtype = torch.bfloat16 if t.mixed_precision_param == "bfloat16" else None
        # [training] compile: parallelize_model compiled every block before to_empty, which is
        # fine because compilation is lazy (traced at the first step, on the real weights); the
        # loss gets its compiled twin here (docs/compile.md).
        self.loss_fn = build_loss_function(self.parallel_dims, t.compile)
        # TP leaves the routed experts whole on every tp rank (trainer/parallel/tensor_parallel.py).
        self.optimizer, optimizer_hooks = build_optimizer(
            self.model, cfg.optimizer, cfg.engram, expert_replicas=self.parallel_dims.mesh_or_none("tp")
        )
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)
        # The step's optional parts (trainer/step_hooks.py), called at the same points of every step.
        # The parameter EMA comes first: it reads the weights before any hook writes them (trainer/optim/ema.py).
        self.ema = ParameterEMA(self.model, cfg.ema.decay, cfg.ema.update_every) if cfg.ema.enable else None
        self.step_hooks: list[StepHook] = [
            *([self.ema] if self.ema is not None else []),
            ExpertBiasUpdater(self.model, self.parallel.global_sum, self.parallel_dims.mesh_or_none("pp")),
            *optimizer_hooks,
        ]
        if o.qk_clip:
            self.step_hooks.append(QKClip(
                self.model, o.qk_clip_threshold, o.qk_clip_every, self.parallel.loss_mesh,
                self.parallel_dims.mesh_or_none("tp"), self.parallel_dims.mesh_or_none("pp"),
            ))

    def _build_data(self) -> None:
        """The training loader and the validation."""
        cfg, t = self.cfg, self.cfg.training
        # The loaders' shared tokenisation exchanges token arrays over its own gloo group.
        multi = self.parallel_dims.world_size > 1
        self.token_group = torch.distributed.new_group(backend="gloo") if multi else None
        self.mixture = parse_mixture(t.dataset_mix)
        # The loader is its own iterator (continuing from its state): the Trainer's data stream.
        if self.mixture:  # paths resolved as `_loader` resolves one
            sources = [dataclasses.replace(s, path=s.path and str(resolve_path(s.path))) for s in self.mixture]
            self.train_loader = build_mixture_dataloader(
                tokenizer=self.tokenizer, sources=sources, seq_len=t.seq_len, **self._batch_split()
            )
        else:
            self.train_loader = self._loader(t.dataset, t.dataset_path, "train", infinite=True)
        self.validator = self._build_validator() if cfg.validation.enable else None

    def _batch_split(self, dp: tuple[int, int] | None = None) -> dict:
        """The loaders' batch split and order: this rank's share of the global batch, the seed.
        ``dp``: (this rank's data rank, their number); None = the job's."""
        t = self.cfg.training
        dp_rank, dp_world = dp or (self.dp_rank, self.dp_world)
        return dict(
            batch_size=t.local_batch_size, global_batch_size=self.grad_accum_steps * t.local_batch_size * self.dp_world,
            dp_rank=dp_rank, dp_world_size=dp_world, token_group=self.token_group, seed=t.seed,
        )

    def _loader(self, dataset: str, path: str | None, split: str, infinite: bool):
        """Training data (infinite), split over the job's data ranks; validation data (finite) over
        this replica group's only: with [fault_tolerance] each group scores every validation batch
        itself (``ParallelStep.step_sum`` is group-local)."""
        t = self.cfg.training
        dp = None if infinite else self.parallel_dims.dp_rank_and_degree()
        return build_dataloader(
            tokenizer=self.tokenizer,
            dataset=dataset,
            dataset_path=str(resolve_path(path)) if path else None,
            seq_len=t.seq_len,
            split=split,
            infinite=infinite,
            **self._batch_split(dp),
        )

    def _build_validator(self) -> Validator | MixtureValidator:
        v, t = self.cfg.validation, self.cfg.training
        if self.mixture and v.dataset is None:  # each source's held-out split
            return MixtureValidator(
                {s.name: (s.weight, self._validator(s.dataset, s.path, "validation")) for s in self.mixture}
            )
        dataset = v.dataset or t.dataset
        path = v.dataset_path or (t.dataset_path if v.dataset is None else None)
        # A separate validation dataset is read whole; the training dataset gives its held-out split.
        return self._validator(dataset, path, "validation" if v.dataset is None else "train")

    def _validator(self, dataset: str, path: str | None, split: str) -> Validator:
        return Validator(
            self.model, self.parallel, self.autocast, lambda: self._loader(dataset, path, split, infinite=False),
            self.cfg.validation.steps, self.device, self.ema if self.cfg.ema.validate else None,
        )

    def _build_observability(self) -> None:
        """The model's counts for the throughput, the metrics writers, the profilers, the run header."""
        cfg, t = self.cfg, self.cfg.training
        self.n_params, self.n_active = count_params(self.model_args, include_mtp=self.model_args.mtp_depth > 0)
        self.flops_per_token = flops_per_token(self.model_args, t.seq_len)
        self.peak_flops = peak_flops_for(self.device, cfg.metrics.peak_flops)
        self.metrics = MetricsLogger(cfg.metrics, self.run_dir, cfg.to_dict(), t.steps, enabled=is_rank0())
        self.profiler = Profiler(cfg.profiling, self.run_dir, self.device)
        self.breakdown = StepBreakdown(cfg.profiling.step_breakdown, self.device)
        log_run_header(self)

    def _resume(self) -> None:
        """The checkpointer, and the run's state from its last checkpoint when there is one."""
        self._build_checkpointer()
        # torchrun --max-restarts (run_train.sh's RESTARTS) starts the same command again after a
        # worker failed: a resumable run's folder is the dump folder itself, so the load below
        # picks up the newest complete checkpoint and names it.
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restart:
            logger.info(
                "restart %d of at most %s (torchrun --max-restarts) after %s: %s", restart,
                os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?"), previous_attempt_failure() or "a worker failed",
                "resuming from the newest complete checkpoint" if self.cfg.checkpoint.enable
                else "checkpoint.enable is off, so it trains again from step 0, in a new run folder",
            )
        resumed = self.checkpointer.load()
        if resumed is not None:
            self.step = int(resumed["step"])
            self.nonfinite.load_state_dict(resumed)
            self._note_data_shape_changes(resumed)
        live = LiveState(
            self.model, self.optimizer, self.lr_scheduler, self.train_loader, self._train_state, self._load_train_state
        )
        self.replica_groups.track(live, self.step)

    def _train_state(self) -> dict:
        """The counters a checkpoint and a healing replica group carry beside the weights."""
        return {"step": self.step, **self.nonfinite.state_dict(), **self._data_shape()}

    def _load_train_state(self, state: dict) -> None:
        logger.info("healed: step %d, model, optimizer, schedule and data position from a live replica group",
                    state["step"])
        self.step = int(state["step"])
        self.nonfinite.load_state_dict(state)

    def _build_step_state(self) -> None:
        """The step counter and the non-finite guard, at their start."""
        self.step = 0
        self.nonfinite = NonFiniteGuard(self.cfg.training.max_skipped_steps)

    def _build_checkpointer(self) -> None:
        """The step state and the checkpointer (nothing loaded yet)."""
        self._build_step_state()
        self.checkpointer = CheckpointManager(
            self.cfg.checkpoint, self.run_dir, model=self.model, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, dataloader=self.train_loader, model_args=self.model_args,
            device=self.device, pipeline_share=self.parallel_dims.pp_enabled, ema=self.ema,
        )

    def _data_shape(self) -> dict[str, int]:
        """Saved with every checkpoint: a resume may change them, but should say so."""
        return {"seq_len": self.cfg.training.seq_len, "global_batch_size": self.train_loader.global_batch_size}

    def _note_data_shape_changes(self, saved: dict) -> None:
        changed = [
            f"training.{k} {int(saved[k])} -> {v}" for k, v in self._data_shape().items() if int(saved.get(k, v)) != v
        ]
        if changed:
            logger.warning(
                "note: resumed with %s; the data continues from the saved position, cut to the new shape (the "
                "loss curve is not the one the saved settings would have given)", ", ".join(changed),
            )

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def next_microbatches(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float]:
        """All micro-batches of one optimizer step, fetched up front so the global count
        of valid tokens is known before the first backward."""
        start = time.perf_counter()
        batches = []
        for _ in range(self.grad_accum_steps):
            inputs, labels = next(self.train_loader)
            batches.append((inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)))
        return batches, time.perf_counter() - start

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
        """Forward and backward of every micro-batch, then one optimizer step; the layout's
        share (batch split, global counts and sums, gradient finishing) is `self.parallel`'s."""
        micro, n_valid, n_valid_mtp = self.parallel.prepare(batches, self.model_args.mtp_depth)
        for hook in self.step_hooks:
            hook.before_forward(self.step)
        objective = functools.partial(self.objective, n_valid=n_valid, n_valid_mtp=n_valid_mtp)
        with self.parallel.loss_context():
            loss_total, mtp_total = self.parallel.forward_backward(micro, objective, self.autocast)
        self.breakdown.mark("forward_backward")
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.step == self.cfg.training.debug_inject_nan_step:
            loss_total = self._inject_nan(loss_total, params)
        totals = self.parallel.reduce_losses(loss_total, mtp_total)
        grad_norm = self.parallel.finish_grads(params, self.cfg.training.max_norm)
        self.breakdown.mark("reduce_clip")
        lr = self.optimizer.param_groups[0]["lr"]
        # The step's one host read. Checked before the step, so a NaN never reaches the weights
        # nor the MoE bias. The schedule still advances: LR stays a function of the step.
        loss_value, mtp_value, norm_value = self._read_step_values(torch.cat([totals, grad_norm.to(totals).view(1)]))
        # A step in which a replica group failed is repeated, not skipped: its sums are incomplete.
        commit = self.replica_groups.should_commit()
        skip = not commit or self.nonfinite.should_skip(self.step, loss_value, norm_value)
        for hook in self.step_hooks:
            hook.before_optimizer(skip)
        if not skip:
            self.optimizer.step()
        for hook in self.step_hooks:
            hook.after_optimizer(stepped=not skip)
        if self.replica_groups.committed:
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.breakdown.mark("optimizer")
        stats = {"loss": loss_value, "grad_norm": norm_value, "lr": lr}
        if self.cfg.fault_tolerance.enable:
            # The live groups, and this step's seconds in the quorum and the commit vote (a heal included).
            stats["replica_groups"] = self.replica_groups.live
            stats["quorum_s"] = self.replica_groups.quorum_seconds
        if self.model_args.mtp_depth:
            stats["mtp_loss"] = mtp_value
        return stats

    def _read_step_values(self, values: torch.Tensor) -> list[float]:
        if self.rehearsal is not None:
            return [0.0] * values.numel()  # a rehearsal's tensors hold no values
        return values.tolist()

    def objective(
        self, out, targets, aux_scale: float, n_valid: torch.Tensor, n_valid_mtp: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What one micro-batch's backward differentiates (next-token loss over the global valid
        count, the MoE balance loss, the weighted MTP loss), with its next-token and MTP terms."""
        loss = self.loss_fn(out.logits, targets.labels) / n_valid
        objective = loss + out.aux_loss * aux_scale
        mtp = torch.zeros((), device=loss.device)
        if out.mtp_logits:
            mtp = targets.mtp_loss_sum(out.mtp_logits) / n_valid_mtp
            objective = objective + self.cfg.model.mtp_loss_weight * mtp
        return objective, loss, mtp

    @staticmethod
    def _inject_nan(loss_total: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        """``training.debug_inject_nan_step``: the step's loss and gradients turn NaN, as a diverged
        step's would, to test the skip (docs/checkpoints.md). A test hook, applied to the step's
        results rather than written into its loss."""
        for p in params:
            p.grad.mul_(math.nan)
        return loss_total * math.nan

    def logged_metrics(self) -> dict:
        """Metrics that need host reads of their own, gathered on logging steps only: Engram
        gate statistics (over the steps since the last call) and every step hook's."""
        stats = engram_metrics(self.model)
        for hook in self.step_hooks:
            stats.update(hook.metrics())
        return stats

    def train(self, stop: StopRequest | None = None) -> None:
        """Train to `training.steps`, or until `stop` (installed by the caller; by default one
        of this call's own) asks to save and stop."""
        t = self.cfg.training
        own_stop = stop is None
        if own_stop:
            stop = StopRequest(t.time_limit_minutes).install()
        # A stop that came while the run was built: nothing was trained, nothing to save.
        stop_reason = stop.reason()
        if t.compile and stop_reason is None:
            # Compilation is lazy: the first step (and the first validation) trace and compile
            # every block, minutes of silence on a CPU without this line.
            logger.info("compiling ... (torch.compile traces the model at its first step; the steps after are faster)")
        if self.validator is not None and self.step == 0 and stop_reason is None:
            self.metrics.log({"step": 0, **self.validator.record()})
        logger.info("training for %d steps", t.steps)
        gc.disable()
        # Per device: the step's global tokens over all ranks (TP and CP ranks share tokens).
        tokens_per_step = self.grad_accum_steps * t.local_batch_size * t.seq_len * self.dp_world
        window = ThroughputWindow(tokens_per_step / self.job_world_size, self.flops_per_token, self.peak_flops)
        # The groups made after the meshes (pipeline, tokenisation, async checkpoint) too: the first
        # step compiles, and one rank may finish that much later than another.
        self._use_collective_timeout("init_timeout_seconds")
        try:
            while self.step < t.steps and stop_reason is None:
                stop_reason = self._train_one_step(stop, window)
                if self.collective_timeout_key != "train_timeout_seconds":
                    self._use_collective_timeout("train_timeout_seconds")
        except torch.OutOfMemoryError:
            self.profiler.on_oom(self.step)
            raise
        finally:
            gc.enable()
            if own_stop:
                stop.uninstall()
            self.profiler.close()
            self.checkpointer.wait()
        if stop_reason is not None and self.cfg.checkpoint.enable:
            logger.info("stopped at step %d (%s); resume with the same command", self.step, stop_reason)
        elif stop_reason is not None:
            logger.info(
                "stopped at step %d (%s); checkpoint.enable is off, so nothing was saved and the same command "
                "starts again from step 0 (add --checkpoint.enable to make a stop resumable)", self.step, stop_reason,
            )
        logger.info("training finished at step %d; run folder %s", self.step, self.run_dir.resolve())

    def _train_one_step(self, stop: StopRequest, window: ThroughputWindow) -> str | None:
        """The next step with its checkpoint, logging and validation; returns why to stop, if so."""
        t = self.cfg.training
        self.replica_groups.start_step(self.step)  # may heal this group: step, weights and data from a live one
        # Only replica groups repeat a step (one that a group failed in): only they need its data position.
        position = self.train_loader.state_dict() if self.cfg.fault_tolerance.enable else None
        self.step += 1
        if self.step % t.gc_freq == 0:
            gc.collect()
        self.profiler.step_begin(self.step)
        step_start = time.perf_counter()
        batches, data_wait = self.next_microbatches()
        self.breakdown.begin(data_wait)
        stats = self.train_step(batches)
        if not self.replica_groups.committed:
            # A replica group failed during the step: no group committed it; it is repeated on the same
            # batch by the groups of the next quorum.
            logger.warning("step %d not committed (a replica group failed in it); repeating it", self.step)
            self.profiler.step_end(self.step)
            self.step -= 1
            self.train_loader.load_state_dict(position)
            return stop.reason()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        window.add(time.perf_counter() - step_start, data_wait)
        # After the clock: writing a trace or snapshot is not step time.
        self.profiler.step_end(self.step)
        stop_reason = stop.reason()
        self.checkpointer.maybe_save(
            self.step, self._train_state(),
            last=self.step == t.steps, force=stop_reason is not None,
        )
        is_log = is_log_step(self.step, t.steps, self.cfg.metrics.log_freq, stop_reason is not None)
        is_val = self.validator is not None and (self.step % self.cfg.validation.freq == 0 or self.step == t.steps)
        if is_log or is_val:
            record = {
                "step": self.step, **stats, **self.train_loader.metrics(), **self.logged_metrics(), **window.record()
            }
            record.update(self.parallel.per_stage("memory_gib", peak_memory_gib(self.device)))
            record.update(self.breakdown.window_record())
            if not math.isfinite(stats["loss"]):
                logger.warning("step %d: non-finite loss %s", self.step, stats["loss"])
            if is_val:
                record.update(self.validator.record())
            self.metrics.log(record)
        return stop_reason

    def close(self) -> None:
        self.replica_groups.close()
        if self.rehearsal is None:  # a rehearsal built neither
            self.checkpointer.close()
            self.metrics.close()
        if self.ema is not None:
            self.ema.close()
        destroy_distributed()

