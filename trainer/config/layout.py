"""The parallel layout's arithmetic: the one place that checks parallel degrees.

`Layout` validates the degrees of `[parallelism]` (and Engram's table split) against the world
size and derives every degree the run needs; `ParallelDims` (trainer/parallel/parallel_dims.py)
extends it with the device meshes. Torch-free, so `run_train.sh` checks a layout before it starts
any process (`python -m trainer.config.check`) with the same code the workers run.

The rank layout and the meshes built on it are described in trainer/parallel/parallel_dims.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

from trainer.config.fields import ConfigError
from trainer.config.pipeline_layout import PipelinePlan, schedule_problems


class LayoutError(ConfigError):
    """Degrees that do not fit the world size or the model (found before any process-group work)."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def degree_problems(p) -> list[str]:
    """What is wrong with the degrees of `p` (a `[parallelism]` section or a `Layout`) whatever
    the world size: one message each."""
    problems = [
        f"parallelism.{name} must be >= 1, got {getattr(p, name)}."
        for name in ("pp", "dp_replicate", "cp", "tp", "ep")
        if getattr(p, name) < 1
    ]
    if p.dp_shard != -1 and p.dp_shard < 1:
        problems.append(f"parallelism.dp_shard must be >= 1, or -1 to infer it, got {p.dp_shard}.")
    if p.ep_as_cp and p.cp != 1:
        problems.append(
            f"parallelism.ep_as_cp uses the expert dim as the context dim, so parallelism.cp must be 1 "
            f"(got cp={p.cp}); set --parallelism.cp 1 and shard the sequence with --parallelism.ep {p.ep * p.cp}."
        )
    elif p.ep_as_cp and p.ep < 2:
        problems.append(
            f"parallelism.ep_as_cp needs parallelism.ep > 1 (got ep={p.ep}); "
            "set --parallelism.ep or drop --parallelism.ep_as_cp."
        )
    return problems


@dataclass
class Layout:
    """Validated degrees (``dp_shard = -1`` and ``engram = -1`` resolved) and the degrees derived
    from them; raises LayoutError on construction when they do not fit ``world_size``."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    ep_as_cp: bool
    world_size: int
    engram: int = 1
    # The mesh the Engram table rows are split over (ParallelDims), with "<name>_replicate".
    engram_mesh_name: ClassVar[str] = "engram"
    pipeline: PipelinePlan = field(default_factory=PipelinePlan)

    def __post_init__(self) -> None:
        self._validate_degrees()
        self._validate_engram()
        self._validate_pipeline()

    def _validate_degrees(self) -> None:
        w = self.world_size
        if w < 1:
            raise LayoutError(f"world size must be >= 1, got {w}")
        problems = degree_problems(self)
        if problems:
            raise LayoutError(" ".join(problems))
        if w % self.pp:
            raise LayoutError(
                f"parallelism.pp = {self.pp} does not divide the world size {w} (NNODES x NGPU): every pipeline "
                f"stage needs the same ranks; pick pp in {divisors(w)}"
            )
        others = self.pp * self.dp_replicate * self.cp * self.tp
        # pp is named only when it is on, so a run without pipelining reads the familiar product.
        pp_name, pp_value = ("pp x ", f"{self.pp} x ") if self.pp > 1 else ("", "")
        if self.dp_shard == -1:
            if w % others:
                raise LayoutError(
                    f"cannot infer parallelism.dp_shard: {pp_name}dp_replicate x cp x tp = {pp_value}{self.dp_replicate} x "
                    f"{self.cp} x {self.tp} = {others} does not divide the world size {w} (NNODES x NGPU); pick "
                    f"parallelism degrees whose product divides {w} (divisors: {divisors(w)})"
                )
            self.dp_shard = w // others
        product = others * self.dp_shard
        if product != w:
            fit = f"dp_shard = {w // others} (or dp_shard = -1 to infer it)"
            if w % others:
                fit = f"degrees whose product is {w} (or dp_shard = -1 to infer it)"
            elif self.ep > 1 and (w // others * self.cp) % self.ep:
                # That dp_shard would fail the ep check below: advise what passes both.
                fit = (
                    f"a world size that is a multiple of {others * self.ep // math.gcd(self.ep, self.cp)} "
                    f"(dp_shard = {w // others} would leave dp_shard x cp = {w // others * self.cp}, which "
                    f"ep = {self.ep} does not divide)"
                )
            raise LayoutError(
                f"parallelism {pp_name}dp_replicate x dp_shard x cp x tp = {pp_value}{self.dp_replicate} x "
                f"{self.dp_shard} x {self.cp} x {self.tp} = {product} != world size {w}; use {fit}"
            )
        block = self.dp_shard * self.cp
        if self.ep > 1 and block % self.ep:
            raise LayoutError(
                f"parallelism.ep = {self.ep} must divide dp_shard x cp = {self.dp_shard} x {self.cp} = {block} "
                f"(expert parallelism borrows those ranks); pick ep in {divisors(block)}"
            )

    def _validate_engram(self) -> None:
        """The Engram table is split over ranks that see different tokens (dp_replicate x
        dp_shard x cp); the degree must divide their number. -1 = all of them."""
        tokens = self.loss_degree
        if self.engram == -1:
            self.engram = tokens
        where = (
            f"the ranks that see different tokens: dp_replicate x dp_shard x cp = {self.dp_replicate} x "
            f"{self.dp_shard} x {self.cp} = {tokens} (tensor-parallel ranks share tokens)"
        )
        if self.engram < 1 or tokens % self.engram:
            raise LayoutError(
                f"engram.embedding_parallel_degree = {self.engram} must divide {where}; pick one of "
                f"{divisors(tokens)}, or -1 for all {tokens}"
            )

    def _validate_pipeline(self) -> None:
        """The schedule's stage and micro-batch needs."""
        problems = self.pipeline.problems()
        if problems:
            raise LayoutError("; ".join(problems))

    # ----------------------------------------------------------------- what must divide what
    def check_batch(self, local_batch_size: int, global_batch_size: int) -> int:
        """The gradient-accumulation steps of one optimizer step (global_batch_size -1 = one
        micro-batch per data-parallel rank). Under pp each accumulation micro-batch is one
        schedule run that cuts its rows into ``pp_microbatches``, which must divide them."""
        micro = self.pipeline.pp_microbatches
        if self.pp_enabled and local_batch_size % micro:
            raise LayoutError(
                f"parallelism.pp_microbatches = {micro} must divide training.local_batch_size = "
                f"{local_batch_size} (each local batch is one pipeline run); pick pp_microbatches in "
                f"{self._fitting_microbatches(local_batch_size) or 'none: raise local_batch_size'}"
            )
        per_step = local_batch_size * self.dp_degree
        if global_batch_size == -1:
            return 1
        if global_batch_size % per_step:
            raise LayoutError(
                f"training.global_batch_size = {global_batch_size} is not a multiple of local_batch_size x "
                f"data-parallel degree = {local_batch_size} x {self.dp_degree}; pick a multiple of {per_step}"
            )
        return global_batch_size // per_step

    def _fitting_microbatches(self, local_batch_size: int) -> list[int]:
        """The micro-batch counts that divide the local batch and that the schedule takes."""
        plan = self.pipeline
        return [d for d in divisors(local_batch_size)
                if not schedule_problems(plan.pp_schedule, plan.pp, plan.pp_stages_per_rank, d)]

    def check_shapes(
        self,
        seq_len: int,
        n_heads: int | None = None,
        num_experts: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """Shapes the layout splits must divide evenly: `seq_len` always, the model's sizes where
        given (the pre-launch check passes heads and experts from the flavor table, the trainer
        also the tokenizer's vocabulary)."""
        problems = []
        context = self.context_degree
        if context > 1 and seq_len % (2 * context):
            key = "parallelism.ep (ep_as_cp)" if self.ep_as_cp else "parallelism.cp"
            problems.append(
                f"training.seq_len = {seq_len} must be a multiple of 2 x {key} = {2 * context}: context "
                f"parallelism cuts each sequence into 2 x {context} load-balanced chunks; use seq_len "
                f"{_round_to(seq_len, 2 * context)}"
            )
        elif self.tp > 1 and (seq_len // context) % self.tp:
            problems.append(
                f"training.seq_len = {seq_len} must be a multiple of parallelism.tp = {self.tp}"
                + (f" x the context degree {context}" if context > 1 else "")
                + f": tensor parallelism shards the sequence of the norms (sequence parallel); use seq_len "
                f"{_round_to(seq_len, self.tp * context * (2 if context > 1 else 1))}"
            )
        for key, value, degree, name in (
            ("n_heads", n_heads, self.tp, "parallelism.tp"),
            ("vocab_size", vocab_size, self.tp, "parallelism.tp"),
            ("num_experts", num_experts, self.ep, "parallelism.ep"),
        ):
            if value is not None and value % degree:
                problems.append(
                    f"{name} = {degree} must divide the model's {key} = {value}; "
                    f"pick {name} in {[d for d in divisors(value) if d <= 64]}"
                )
        if problems:
            raise LayoutError("; ".join(problems))

    def check_stages(self, n_layers: int, mtp_depth: int) -> None:
        """The pipeline's stages fit the model's blocks (the pre-launch check and the trainer
        check this, before any work)."""
        if self.pp_enabled:
            self.pipeline.split(n_layers, mtp_depth)

    # ----------------------------------------------------------------- degrees
    @property
    def pp(self) -> int:
        """Pipeline degree, the outermost dim of the world (the plan's ``pp``)."""
        return self.pipeline.pp

    @property
    def pp_enabled(self) -> bool:
        return self.pipeline.enabled

    @property
    def efsdp(self) -> int:
        """Expert FSDP degree: dp_shard x cp / ep."""
        return self.dp_shard * self.cp // self.ep

    @property
    def fsdp_degree(self) -> int:
        return self.dp_shard * self.cp

    @property
    def dp_degree(self) -> int:
        """Ranks that read different samples (the data loader's world size)."""
        if self.ep_as_cp:
            return self.dp_replicate * self.efsdp
        return self.dp_replicate * self.dp_shard

    @property
    def loss_degree(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def context_degree(self) -> int:
        """How many ranks split one sample's sequence."""
        return self.ep if self.ep_as_cp else self.cp

    @property
    def context_mesh_name(self) -> str:
        return "ep" if self.ep_as_cp else "cp"

    @property
    def engram_enabled(self) -> bool:
        """Engram tables are row-sharded (over the ``engram_mesh_name`` mesh)."""
        return self.engram > 1

    @property
    def engram_replicate_mesh_name(self) -> str:
        return self.engram_mesh_name + "_replicate"

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards parameters whenever dp_shard x cp > 1 (cp ranks share the weights)."""
        return self.fsdp_degree > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.fsdp_enabled

    @property
    def data_parallel_enabled(self) -> bool:
        """Any replication of weights (gradients must be reduced)."""
        return self.dp_replicate > 1 or self.fsdp_enabled

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def context_enabled(self) -> bool:
        return self.context_degree > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def loss_enabled(self) -> bool:
        return self.loss_degree > 1

    def describe(self) -> str:
        parts = [f"{k} {getattr(self, k)}" for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")]
        if self.ep_as_cp:
            parts.append("ep_as_cp")
        pipeline = f" | {self.pipeline.describe()}" if self.pp_enabled else ""
        return f"world size {self.world_size} = " + " x ".join(parts[:5]) + " | " + ", ".join(parts[5:]) + (
            f" | data-parallel {self.dp_degree}, fsdp {self.fsdp_degree}, efsdp {self.efsdp}"
        ) + (f", engram {self.engram}" if self.engram_enabled else "") + pipeline

    @classmethod
    def from_config(cls, parallelism, world_size: int, engram=None):
        """From the ``[parallelism]`` section (and ``[engram]``, when enabled, for its table split)."""
        p = parallelism
        use_engram = engram is not None and engram.enable
        return cls(
            dp_replicate=p.dp_replicate,
            dp_shard=p.dp_shard,
            cp=p.cp,
            tp=p.tp,
            ep=p.ep,
            ep_as_cp=p.ep_as_cp,
            world_size=world_size,
            engram=engram.embedding_parallel_degree if use_engram else 1,
            pipeline=PipelinePlan.from_config(p),
        )

    def replica_group(self):
        """One ``dp_replicate`` slice of this layout (the world of one fault-tolerant replica group,
        trainer/config/replica_groups.py): the same degrees inside it, no replicate dim of its own."""
        return dataclasses.replace(self, dp_replicate=1, world_size=self.world_size // self.dp_replicate)

    @classmethod
    def from_job(cls, cfg, world_size: int):
        """The run's layout from a whole `JobConfig`, with every check the config alone allows:
        degrees against the world size, the batch split, the sequence split."""
        layout = cls.from_config(cfg.parallelism, world_size, cfg.engram)
        t = cfg.training
        layout.check_batch(t.local_batch_size, t.global_batch_size)
        layout.check_shapes(t.seq_len)
        return layout


def _round_to(value: int, multiple: int) -> int:
    """The nearest positive multiple of `multiple` to `value`."""
    return max(multiple, round(value / multiple) * multiple)
