"""QK-clip, the "Clip" of MuonClip (Kimi K2), for MLA attention.

On a clip step every MLA module records its per-head largest pre-softmax logit during the step's
forwards (`MLA.record_max_logit`, a tensor flag: compiled blocks read it in their graph, see
`MLA._record_max_logit`); after the optimizer step the maxima are gathered over the tensor-parallel
ranks (each holds a contiguous block of the heads) and reduced over the data and context ranks, and
each head whose maximum passed the threshold gets `gamma = threshold / max` folded into its weights
(`rescale_heads`): its query-nope rows (`wq` / `wq_b`) and key-nope rows (`wkv_b`) times
`sqrt(gamma)`, its rotary query rows times `gamma`. The rotary key is one row block of `wkv_a` /
`wqkv_a` shared by all heads, so it stays untouched and the head's rotary query takes the whole
factor: every logit of the head scales by exactly `gamma` (the same inputs give a max of
`threshold`). Values are untouched. Clip steps are every `qk_clip_every`-th step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from models.common.attention import MLA
from trainer.distributed import local_part, local_tensor
from trainer.step_hooks import StepHook

_WRAPPERS = ("._orig_mod", "._checkpoint_wrapped_module")  # compile and activation-checkpoint wrappers


def mla_modules(model: nn.Module) -> list[tuple[str, MLA]]:
    """(block name, its MLA) for every attention layer (`layers.3`, `mtp.0.block`)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, MLA):
            for wrapper in _WRAPPERS:
                name = name.replace(wrapper, "")
            found.append((name.removesuffix(".attn"), module))
    return found


def _scale_rows(weight: torch.Tensor, scale: torch.Tensor) -> None:
    """Row r of the whole `weight` times `scale[r]`, on whatever rows this rank holds."""
    scale = scale.to(weight.dtype)[:, None]
    if isinstance(weight, DTensor):
        # TP's column split and FSDP's dim-0 shards (strided over TP's) cut through the heads: take
        # the rows' scales in the weight's own layout (a local slice of the expanded scales, no
        # communication) and scale the local shard in place.
        scale = local_part(scale.expand(weight.shape), weight)
    local_tensor(weight).mul_(scale)


@torch.no_grad()
def rescale_heads(attn: MLA, gamma: torch.Tensor) -> None:
    """Multiplies every logit of head h by `gamma[h]` (see the module docstring)."""
    heads = gamma.numel()
    root = gamma.sqrt()[:, None]
    nope = root.expand(heads, attn.qk_nope_head_dim)
    q_scale = torch.cat([nope, gamma[:, None].expand(heads, attn.qk_rope_head_dim)], dim=1)
    k_scale = torch.cat([nope, torch.ones_like(root).expand(heads, attn.v_head_dim)], dim=1)
    _scale_rows((attn.wq if attn.q_lora_rank == 0 else attn.wq_b).weight, q_scale.flatten())
    _scale_rows(attn.wkv_b.weight, k_scale.flatten())


class QKClip(StepHook):
    """Turns logit recording on for clip steps and clips after their optimizer step.

    Args:
        model: the (parallelised) model; its MLA modules are the ones this rank holds.
        threshold: largest max logit a head keeps (`optimizer.qk_clip_threshold`).
        every: clip every N-th step (`optimizer.qk_clip_every`).
        mesh: the data and context ranks whose maxima are combined (None: one process).
        tp_mesh: the tensor-parallel ranks, over which the heads are split (None: no TP).
        pp_mesh: the pipeline ranks, over which the layers are split (None: no PP); only the
            metrics cross it (each stage clips its own layers).
    """

    def __init__(self, model: nn.Module, threshold: float, every: int, mesh=None, tp_mesh=None, pp_mesh=None):
        self.layers = mla_modules(model)
        self.threshold = threshold
        self.every = every
        self.group = mesh.get_group() if mesh is not None else None
        self.tp_group = tp_mesh.get_group() if tp_mesh is not None else None
        self.pp_group = pp_mesh.get_group() if pp_mesh is not None else None
        tp = tp_mesh.size() if tp_mesh is not None else 1
        for _, attn in self.layers:
            # On the CPU whatever the model's device: the eager `if` and the compiled `torch.cond`
            # read it without a device synchronisation (inductor takes a CPU predicate with CUDA
            # operands since pytorch#169199, December 2025, before torch 2.11).
            attn.record_max_logit = torch.zeros((), dtype=torch.bool)
            attn.max_logit = torch.full((attn.n_heads // tp,), float("-inf"), device=local_tensor(attn.wkv_b.weight).device)
        self.active = False
        self._max: torch.Tensor | None = None  # [layers, heads] of the last clip step
        self._clipped: torch.Tensor | None = None

    def before_forward(self, step: int) -> None:
        self.active = step % self.every == 0
        for _, attn in self.layers:
            attn.record_max_logit.fill_(self.active)
            if self.active:
                attn.max_logit.fill_(float("-inf"))

    def _all_heads_max(self) -> torch.Tensor:
        """`[layers, n_heads]`: every head's max logit over every rank that saw other tokens or
        holds other heads (-inf for a layer no forward reached)."""
        local = torch.stack([attn.max_logit for _, attn in self.layers])
        if self.tp_group is not None:
            # ColwiseParallel gives tp rank r the r-th contiguous block of heads: the gathered
            # blocks, in rank order along the head dim, are the heads in model order.
            blocks = [torch.empty_like(local) for _ in range(dist.get_world_size(self.tp_group))]
            dist.all_gather(blocks, local, group=self.tp_group)
            local = torch.cat(blocks, dim=1)
        if self.group is not None:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
        return local

    def after_optimizer(self, stepped: bool) -> None:
        """After the optimizer step (`stepped` False: skipped, nothing to clip)."""
        for _, attn in self.layers:
            attn.record_max_logit.fill_(False)
        if not (self.active and stepped and self.layers):
            return
        maxes = self._all_heads_max()
        clipped = maxes > self.threshold
        gamma = torch.where(clipped, self.threshold / maxes, torch.ones_like(maxes))
        for (_, attn), g, any_clipped in zip(self.layers, gamma, clipped.any(dim=1).tolist()):
            if any_clipped:
                rescale_heads(attn, g)
        self._max, self._clipped = maxes, clipped

    def metrics(self) -> dict[str, float]:
        """Per layer, the largest pre-softmax logit of the last clip step (before clipping), and
        how many heads were clipped; empty before the first clip step."""
        if self._max is None:
            return {}
        per_layer = dict(zip((f"max_logit/{name}" for name, _ in self.layers), self._max.amax(dim=1).tolist()))
        clipped = int(self._clipped.sum())
        if self.pp_group is not None:
            # Each stage holds its own layers: every stage's, as one process reports them (a
            # collective of every pipeline rank, on logging steps only).
            stages = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(stages, (per_layer, clipped), group=self.pp_group)
            per_layer = {k: v for layers, _ in stages for k, v in layers.items()}
            clipped = sum(n for _, n in stages)
        return {**per_layer, "max_logit": max(per_layer.values()), "qk_clipped_heads": clipped}
