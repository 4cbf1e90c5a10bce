"""QK-clip, the "Clip" of MuonClip (Kimi K2), for MLA attention.

On a clip step every MLA module records its per-head largest pre-softmax logit during the step's
forwards (`MLA.record_max_logit`); after the optimizer step the maxima are reduced over the data
and context ranks, and each head whose maximum passed the threshold gets `gamma = threshold / max`
folded into its weights (`rescale_heads`): its query-nope rows (`wq` / `wq_b`) and key-nope rows
(`wkv_b`) times `sqrt(gamma)`, its rotary query rows times `gamma`. The rotary key is one row block
of `wkv_a` / `wqkv_a` shared by all heads, so it stays untouched and the head's rotary query takes
the whole factor: every logit of the head scales by exactly `gamma` (the same inputs give a max of
`threshold`). Values are untouched. Clip steps are every `qk_clip_every`-th step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

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
    scale = scale.to(weight.dtype)[:, None]
    if isinstance(weight, DTensor) and not all(isinstance(p, Replicate) for p in weight.placements):
        # FSDP's dim-0 shards cut through heads: scale the whole matrix (gathered, one at a
        # time) and keep this rank's part, as Muon's step does.
        local_tensor(weight).copy_(local_part(weight.full_tensor().mul_(scale), weight))
    else:
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
    """

    def __init__(self, model: nn.Module, threshold: float, every: int, mesh=None):
        self.layers = mla_modules(model)
        self.threshold = threshold
        self.every = every
        self.group = mesh.get_group() if mesh is not None else None
        self.active = False
        self._max: torch.Tensor | None = None  # [layers, heads] of the last clip step
        self._clipped: torch.Tensor | None = None

    def before_forward(self, step: int) -> None:
        self.active = step % self.every == 0
        for _, attn in self.layers:
            attn.record_max_logit, attn.max_logit = self.active, None

    def after_optimizer(self, stepped: bool) -> None:
        """After the optimizer step (`stepped` False: skipped, nothing to clip)."""
        for _, attn in self.layers:
            attn.record_max_logit = False
        if not (self.active and stepped and self.layers):
            return
        maxes = torch.stack([
            attn.max_logit if attn.max_logit is not None else torch.zeros(attn.n_heads) for _, attn in self.layers
        ])
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=self.group)
        gamma = (self.threshold / maxes).clamp(max=1.0)
        clipped = gamma < 1
        for (_, attn), g, any_clipped in zip(self.layers, gamma, clipped.any(dim=1).tolist()):
            if any_clipped:
                rescale_heads(attn, g)
        self._max, self._clipped = maxes, clipped

    def metrics(self) -> dict[str, float]:
        """Per layer, the largest pre-softmax logit of the last clip step (before clipping), and
        how many heads were clipped; empty before the first clip step."""
        if self._max is None:
            return {}
        per_layer = self._max.amax(dim=1).tolist()
        stats = {f"max_logit/{name}": v for (name, _), v in zip(self.layers, per_layer)}
        stats["max_logit"] = max(per_layer)
        stats["qk_clipped_heads"] = int(self._clipped.sum())
        return stats
