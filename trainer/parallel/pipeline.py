"""Pipeline parallelism's split of the model into this rank's stages (the schedule that runs
them is trainer/parallel/pipeline_step.py).

`apply_pipeline` is the house order's first step: it keeps, of the single-device model, only the
blocks of this rank's stages, and sets `embed` / `norm` / `head` / `mtp` to None where the rank
holds none of its stages'. The `layers` dict keeps the blocks' names, so parameter names, and with
them DCP checkpoints and the layout-invariant initial weights, are those of the whole model: a
checkpoint reshards across pp degrees and schedules. `parallelize_stage` then runs the usual
`apply_*` chain on that share, on the stage's own sub-meshes (every mesh but "world" and "pp" lies
inside one stage), and wraps each stage in a `StageModule` before FSDP, which makes every stage
module the root of its blocks' units.

The split weighs each block, the embedding, the head (with its vocabulary and the loss) and each
MTP module at their training FLOPs (`models.deepseek_v3.stats.stage_unit_costs`), so the stage
holding the head, the loss and MTP takes fewer blocks; `parallelism.pp_layout` overrides it.

Between stages flow the residual stream and the running sum of the MoE balance losses, so the loss
on the last stage holds every stage's balance term and its gradient reaches every stage through the
schedule. MTP on the last stage embeds the labels: with a V schedule the last stage shares the
first stage's rank and its embedding; otherwise the last stage's rank holds a replica of the
embedding whose gradient is summed with the first stage's (pipeline_step.py). Engram blocks are
looked up on whatever stage holds them, with the ids the step hashed for that stage's blocks.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from models.deepseek_v3.model import ForwardPlan
from models.deepseek_v3.stats import stage_unit_costs
from trainer.config.pipeline_layout import (
    PipelineCosts,
    StageSpec,
    describe_split,
)
from trainer.parallel.parallel_dims import ParallelDims

__all__ = ["StageModule", "apply_pipeline"]

logger = logging.getLogger("trainer")


def apply_pipeline(model: nn.Module, dims: ParallelDims, seq_len: int) -> list[StageSpec]:
    """Splits ``model`` in place (before any other parallelism) to the stages this pp rank runs,
    and returns them in the order the rank holds them. Logs every stage's share of the work."""
    args = model.args
    plan = dims.pipeline
    costs = PipelineCosts(**stage_unit_costs(args, seq_len))
    specs = plan.split(args.n_layers, args.mtp_depth, costs)
    logger.info(
        "pipeline %s, training FLOPs per token: %s", plan.pp_schedule, describe_split(specs, costs, plan.stage_ranks())
    )
    mine = plan.rank_stages(specs, dims.mesh("pp").get_local_rank())
    _split_model(model, mine)
    return mine


def _split_model(model: nn.Module, specs: list[StageSpec]) -> None:
    """Keeps only what ``specs``' stages run."""
    keep = {str(i) for spec in specs for i in spec.layers}
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    first, last = any(s.first for s in specs), any(s.last for s in specs)
    if not (first or (last and model.mtp is not None)):
        model.embed = None
    if not last:
        model.norm, model.head, model.mtp = None, None, None


class StageModule(nn.Module):
    """One stage's forward over the rank's (split) model, whose modules it shares.

    It registers only its own modules, so ``parameters()`` is what this stage computes with (what
    the zero-bubble schedules take weight gradients of); the rank's model stays the owner that the
    optimizer, checkpoints and the gradient norm see. Build it after every ``apply_*`` that
    replaces blocks (activation checkpointing wraps them) and before FSDP.

    Inputs: the first stage takes the tokens, the others ``(h, aux)`` from the previous stage;
    every stage gets the tokens (for the attention mask), the labels (MTP), the Engram ids of
    its blocks and, under context parallelism, the shard's global positions and attention mask
    as keyword arguments (tensors: torch's split backward differentiates through every tensor
    input and skips the rest). Outputs: ``(h, aux)``, or on the last stage ``(logits, aux, *mtp_logits)``.
    """

    def __init__(self, model: nn.Module, spec: StageSpec):
        super().__init__()
        self.spec = spec
        self.blocks = nn.ModuleList(model.layers[str(i)] for i in spec.layers)
        if spec.first:
            self.embed = model.embed
        if spec.last:
            self.norm, self.head, self.mtp = model.norm, model.head, model.mtp
            if model.mtp is not None:
                self.mtp_embed = model.embed
        # The model's forward pieces, without registering the model (it holds other stages too).
        self._model = (model,)
        # The rank's Engram ids have a slot per Engram block of the rank; these are this stage's.
        rank_engram = list(model.engram_layer_ids)
        self.engram_slots = [rank_engram.index(i) for i in spec.layers if i in rank_engram]

    def forward(self, *acts, tokens, labels=None, engram_ids=None, positions=None, attn_mask=None):
        return self.forward_plan(
            *acts, tokens=tokens, labels=labels, engram_ids=engram_ids, positions=positions, attn_mask=attn_mask
        ).run()

    def forward_plan(self, *acts, tokens, labels=None, engram_ids=None, positions=None, attn_mask=None) -> ForwardPlan:
        """`forward`'s plan (pre, blocks, head) for these inputs (`forward`'s arguments)."""
        return _StagePlan(self, acts, tokens, labels, engram_ids, positions, attn_mask)


class _StagePlan(ForwardPlan):
    """`StageModule.forward`'s plan: the embedding (first stage) or the received ``(h, aux)``, the
    stage's blocks, and the balance losses added to the received ones, with the head on the last
    stage."""

    def __init__(self, stage: StageModule, acts: tuple, tokens, labels, engram_ids, positions, attn_mask):
        if positions is not None:  # one row per micro-batch row (pipeline_step.py): all alike
            positions = positions[0]
        engram_ids = engram_ids[:, :, stage.engram_slots] if stage.engram_slots else None
        super().__init__(stage._model[0], stage.blocks, tokens, positions, attn_mask, engram_ids)
        self.spec, self.acts, self.labels = stage.spec, acts, labels
        self.aux_in = None

    def embed(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if self.spec.first:
            return self.model.embed(self.tokens), []
        h, self.aux_in = self.acts
        return h, []

    def head(self, h: torch.Tensor, aux: torch.Tensor, carried: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if self.aux_in is not None:
            aux = self.aux_in + aux
        if not self.spec.last:
            return h, aux
        logits, mtp_logits, mtp_aux = self.model.forward_head(h, self.labels, self.freqs_cis, self.attn_mask)
        return (logits, aux + mtp_aux, *mtp_logits)
