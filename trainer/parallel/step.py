"""What one training step owes the parallel layout (docs/architecture.md: config -> build ->
parallelize -> step -> loop).

``parallelize_model`` returns a ``ParallelStep`` with the model. The trainer's step calls it at
fixed points and never asks which parallelisms are on:

- ``prepare``: Engram hashing with the step's own ``NgramHasher`` (on the full sequences:
  n-grams cross chunk borders), the context-parallel split and the global valid-token counts,
  all before the first backward;
- ``loss_context``: loss parallelism around the step's forwards and backwards (entered once);
- ``microbatches``: what FSDP does between micro-batches;
- ``reduce_losses`` / ``finish_grads``: the global loss sums, TP partial grads, Engram table
  grads and the gradient clip across every mesh (trainer/parallel/grad_norm.py).

On one process each of these is a no-op or the plain single-device computation. Build-time work
(materializing the weights, choosing the loss function) is ``parallelize.py``'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from models.deepseek_v3 import mtp_loss
from models.engram import NgramHasher, engram_table_params
from trainer.distributed import all_reduce_sum
from trainer.loss import IGNORE_INDEX, count_valid, cross_entropy_sum
from trainer.parallel.context_parallel import ContextParallel
from trainer.parallel.engram_parallel import reduce_table_grads, sharded_lookup
from trainer.parallel.fsdp import set_reshard_after_backward
from trainer.parallel.grad_norm import clip_grad_norm_
from trainer.parallel.parallel_dims import ParallelDims
from trainer.parallel.tensor_parallel import maybe_loss_parallel, replicate_partial_grads, replicated_value


@dataclass
class Targets:
    """What one micro-batch's loss compares with: next-token labels and, under context
    parallelism, the MTP targets (shifted on the full sequence, then split)."""

    labels: torch.Tensor
    mtp_labels: list[torch.Tensor] | None = None
    """None: each MTP depth shifts ``labels`` itself."""

    def mtp_targets(self, depth: int) -> list[torch.Tensor]:
        """Depth k predicts labels shifted by k + 1: its last k + 1 positions have no target."""
        if self.mtp_labels is not None:
            return self.mtp_labels
        return [self.labels[:, k + 1 :] for k in range(depth)]

    def mtp_loss_sum(self, mtp_logits: list[torch.Tensor]) -> torch.Tensor:
        if self.mtp_labels is None:
            return mtp_loss(mtp_logits, self.labels, ignore_index=IGNORE_INDEX)[0]
        return sum(map(cross_entropy_sum, mtp_logits, self.mtp_labels))


@dataclass
class MicroBatch:
    """One micro-batch as this rank feeds it to the model."""

    inputs: torch.Tensor
    targets: Targets
    model_kwargs: dict = field(default_factory=dict)
    """Engram ids and, under context parallelism, global positions and the attention mask."""

    @property
    def labels(self) -> torch.Tensor:
        return self.targets.labels


class ParallelStep:
    """The layout's share of a step for ``model`` (a whole model or, under pipeline parallelism,
    one stage of it).

    Args:
        engram_hasher: hashes the token ids for exactly ``model``'s Engram layers (an
            ``NgramHasher`` built with ``layer_ids=model.engram_layer_ids``); None when it has none.
        pp: ProcessGroup or 1-D DeviceMesh of the pipeline stages, over which the gradient norm
            is summed; None = the whole model is here.
    """

    def __init__(
        self,
        model: nn.Module,
        dims: ParallelDims,
        context_parallel: ContextParallel | None = None,
        keep_weights_between_microbatches: bool = False,
        engram_hasher: NgramHasher | None = None,
        pp=None,
    ):
        layer_ids = tuple(getattr(model, "engram_layer_ids", ()))
        hashed = tuple(engram_hasher.layer_ids) if engram_hasher is not None else ()
        if hashed != layer_ids:
            raise ValueError(
                f"ParallelStep: the Engram hasher covers layers {list(hashed)}, the model holds Engram layers "
                f"{list(layer_ids)}; build it with NgramHasher(args, compression, layer_ids=model.engram_layer_ids)"
            )
        self.model = model
        self.dims = dims
        self.loss_mesh = dims.mesh_or_none("loss")
        self.context_parallel = context_parallel
        self.keep_weights = keep_weights_between_microbatches
        self.engram_hasher = engram_hasher
        self.pp = pp
        self.replica_groups = None
        # Row-sharded Engram tables: each rank's rows count once in the gradient norm.
        lookup = sharded_lookup(model)
        self.table_group = lookup.group if lookup is not None else None

    def join_replica_groups(self, groups) -> None:
        """Fault-tolerant replica groups (trainer/parallel/replica_groups.py): every global sum and
        the gradients are also summed over the live groups, after this group's own reductions."""
        self.replica_groups = groups

    @property
    def loss_degree(self) -> int:
        """Ranks whose per-rank means (the MoE balance loss) are averaged into the global one."""
        return self.dims.loss_degree

    def prepare_batch(self, inputs: torch.Tensor, labels: torch.Tensor) -> MicroBatch:
        engram_ids = self.engram_hasher(inputs) if self.engram_hasher is not None else None
        cp = self.context_parallel
        if cp is None:
            return MicroBatch(inputs, Targets(labels), {"engram_ids": engram_ids})
        # Keep this rank's head-tail chunks of every sequence.
        shard = cp.shard_batch(inputs, labels, engram_ids)
        kwargs = {"engram_ids": shard.engram_ids, "positions": shard.positions, "attn_mask": shard.attn_mask}
        return MicroBatch(shard.tokens, Targets(shard.labels, shard.mtp_labels), kwargs)

    def prepare(
        self, batches: list[tuple[torch.Tensor, torch.Tensor]], mtp_depth: int
    ) -> tuple[list[MicroBatch], torch.Tensor, torch.Tensor]:
        """The step's micro-batches and its global counts of valid next-token and MTP targets
        (fp32 device scalars; exact up to 2^24 tokens per step; no host read)."""
        micro = [self.prepare_batch(inputs, labels) for inputs, labels in batches]
        device = micro[0].labels.device
        n_valid = sum(count_valid(mb.labels) for mb in micro)
        n_mtp = sum(count_valid(t) for mb in micro for t in mb.targets.mtp_targets(mtp_depth))
        counts = torch.stack([torch.as_tensor(n, device=device) for n in (n_valid, n_mtp)])
        # Every rank divides by the global counts (all data and context ranks), so the summed
        # gradients are those of the global mean.
        n_valid, n_mtp = self.global_sum(counts).float().unbind()
        return micro, n_valid, n_mtp.clamp_min(1)

    def loss_context(self):
        """Loss parallelism (vocab-sharded logits under TP) around forwards and backwards."""
        return maybe_loss_parallel(self.dims.tp_enabled)

    def microbatches(self, micro: list[MicroBatch]) -> Iterator[MicroBatch]:
        """``micro`` in order; where FSDP only casts (one process), its bf16 weights stay
        gathered until the last backward: one cast per step, not per micro-batch."""
        for i, mb in enumerate(micro):
            if self.keep_weights:
                set_reshard_after_backward(self.model, i == len(micro) - 1)
            yield mb

    @staticmethod
    def value(t: torch.Tensor) -> torch.Tensor:
        """The plain (replicated) value of a loss computed under ``loss_context``."""
        return replicated_value(t)

    def aux_scale(self, n_micro: int) -> float:
        """What turns each forward's balance loss (a per-rank mean) into its share of the global mean."""
        return 1.0 / (n_micro * self.loss_degree)

    def forward_backward(self, micro: list[MicroBatch], objective: Callable, autocast: Callable) -> tuple:
        """Forward and backward of every micro-batch. ``objective(out, targets, aux_scale)`` gives
        (the tensor to differentiate, its cross-entropy and MTP terms); returns this rank's sums
        of those two terms (detached)."""
        loss_total = torch.zeros((), device=micro[0].labels.device)
        mtp_total = torch.zeros((), device=micro[0].labels.device)
        aux_scale = self.aux_scale(len(micro))
        for mb in self.microbatches(micro):
            with autocast():
                out = self.model(mb.inputs, labels=mb.labels, **mb.model_kwargs)
                loss, ce, mtp = objective(out, mb.targets, aux_scale)
            loss.backward()
            loss_total += self.value(ce.detach())
            mtp_total += self.value(mtp.detach())
        return loss_total, mtp_total

    def eval_loss_sum(
        self, inputs: torch.Tensor, labels: torch.Tensor, autocast: Callable
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's summed next-token cross-entropy (MTP excluded) and valid-target count for
        one full batch, so that ``step_sum`` of them over the ranks gives the global ones."""
        mb = self.prepare_batch(inputs, labels)
        with autocast(), self.loss_context():
            logits = self.model(mb.inputs, **mb.model_kwargs).logits
            loss_sum = self.value(cross_entropy_sum(logits, mb.labels))
        return loss_sum, count_valid(mb.labels)

    def per_stage(self, name: str, value: float) -> dict[str, float]:
        """A per-rank figure (peak memory) for the metrics: this rank's."""
        return {name: value}

    def reduce_losses(self, *losses: torch.Tensor) -> torch.Tensor:
        """Sums of this rank's step losses over all ranks (and the live replica groups), stacked."""
        totals = self.step_sum(torch.stack(losses))
        if self.replica_groups is not None:
            self.replica_groups.sum_(totals)
        return totals

    def step_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum of a step value (loss, validation sums) over every rank holding a share of it,
        within this replica group: a group validates on its own, outside the groups' lock-step."""
        return all_reduce_sum(tensor, self.loss_mesh)

    def finish_grads(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Makes every gradient final (TP partial sums, Engram table replicas) and clips them by
        their global norm (``max_norm <= 0``: measure only); returns the norm before clipping."""
        if self.replica_groups is not None:
            self.replica_groups.sum_grads_(params)
        if self.dims.tp_enabled:
            replicate_partial_grads(params)
        reduce_table_grads(self.model)  # Engram table shards: sum over the ranks holding the same rows
        # The tables are looked up here, not when this step was built: materializing the meta
        # model (to_empty) replaces its parameter objects.
        tables = engram_table_params(self.model) if self.table_group is not None else ()
        return clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf, tables, self.table_group, self.pp)

    def global_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over every rank that saw different tokens (the "loss" mesh: data and
        context ranks, and the live replica groups); a no-op on one process. MoE token counts and
        validation sums use it."""
        all_reduce_sum(tensor, self.loss_mesh)
        if self.replica_groups is not None:
            self.replica_groups.sum_(tensor)
        return tensor
