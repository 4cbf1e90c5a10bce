"""Optimizer construction and the once-per-step MoE bias update."""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from models.engram import engram_table_params
from models.moe import MoE
from models.moe.balance import apply_expert_bias_update, load_imbalance_stats, reset_expert_counts
from trainer.optim.engram import EngramOffloadStep, offload_engram_group, register_table_state_hooks
from trainer.optim.muon import STATE_DTYPES, MuonAdamW, muon_params
from trainer.step_hooks import StepHook

logger = logging.getLogger("trainer")


def _implementation_kwargs(implementation: str, params: list[torch.Tensor]) -> dict:
    if implementation == "fused":
        return {"fused": True}
    if implementation == "foreach":
        return {"foreach": True}
    if implementation == "for-loop":
        return {"foreach": False}
    # auto: the fused kernels exist for CUDA and (since torch 2.4) CPU; meta or mixed
    # devices fall back to torch's own default choice.
    devices = {p.device.type for p in params}
    if len(devices) == 1 and devices <= {"cuda", "cpu"}:
        return {"fused": True}
    return {}


def cpu_has_bf16_matrix_units() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware tiles (Intel AMX): there a bf16 matmul
    is several times faster than fp32. Elsewhere, AVX-512 BF16 included, oneDNN's bf16 matmul is
    slower than fp32 (benchmarks/RESULTS.md, "Newton-Schulz dtype on CPU"). A capability flag, not
    a timing, so every rank and every restart of a run decides the same (a resume stays exact).
    ``torch.cpu._is_amx_tile_supported`` is private; a torch without it counts as no AMX."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


def ns_dtype_for(setting: str, params: list[torch.Tensor]) -> torch.dtype:
    """`muon_ns_dtype`: `bfloat16` / `float32` as given; `auto` is bf16 on GPUs and on CPUs with
    bf16 matrix units (`cpu_has_bf16_matrix_units`), fp32 on other CPUs. Logged once."""
    if setting != "auto":
        return STATE_DTYPES[setting]
    if any(p.device.type == "cuda" for p in params):
        why, dtype = "a GPU", torch.bfloat16
    elif cpu_has_bf16_matrix_units():
        why, dtype = "a CPU with AMX bf16 tiles", torch.bfloat16
    else:
        why, dtype = f"a CPU without AMX ({torch.backends.cpu.get_cpu_capability()}): fp32 multiplies faster", torch.float32
    logger.info("muon: Newton-Schulz in %s (muon_ns_dtype = auto on %s)", str(dtype).removeprefix("torch."), why)
    return dtype


def build_optimizer(
    model: nn.Module, opt_cfg, engram_cfg=None, expert_replicas=None
) -> tuple[torch.optim.Optimizer, list[StepHook]]:
    """The optimizer of the ``[optimizer]`` section, and the step hooks it needs (the Engram
    tables' CPU-resident optimizer, `EngramOffloadStep`, when ``offload_optimizer_state`` is on).

    Matrices and embeddings decay; 1-D parameters (norm scales) do not, as in Megatron
    and nanoGPT: decaying a norm scale towards zero only fights the next layer.
    ``name = "muon"`` moves the block matrices (``trainer.optim.muon.muon_params``) to a Muon group,
    tagged ``"muon": True``; the rest keeps AdamW. ``muon`` or ``state_dtype = "bfloat16"``
    builds ``trainer.optim.muon.MuonAdamW``, otherwise it is ``torch.optim.AdamW`` / ``Adam``.
    Engram tables (``[engram]`` section) get their own group, tagged ``"engram": True``:
    LR x ``lr_multiplier`` and ``weight_decay`` (0 by default, i.e. plain Adam). Their state
    is checkpointed in a layout-independent form (row-sharded over the engram mesh, also when
    it lives on the CPU with ``offload_optimizer_state``). ``expert_replicas`` (the tp mesh, or
    None) is where Muon's expert matrices are replicated beyond their own mesh (``MuonAdamW``).
    """
    tables = engram_table_params(model) if engram_cfg is not None and engram_cfg.enable else []
    muon = muon_params(model) if opt_cfg.name == "muon" else []
    excluded = {id(p) for p in tables + muon}
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad and id(p) not in excluded:
            (decay if p.ndim >= 2 else no_decay).append(p)
    ours = opt_cfg.name == "muon" or opt_cfg.state_dtype != "float32"
    # Plain tensors and DTensors cannot share one fused / foreach kernel call of torch's AdamW (TP
    # without FSDP keeps the MoE router and routed experts plain): one group per kind. MuonAdamW
    # steps each local tensor and keeps the same groups in every layout (DCP matches them by index).
    kinds = ((False, True),) if ours else ((False,), (True,))
    groups = [
        {"params": [p for p in params if isinstance(p, DTensor) in kind], "weight_decay": wd}
        for params, wd in ((decay, opt_cfg.weight_decay), (no_decay, 0.0))
        for kind in kinds
    ]
    if muon:
        groups.append({"params": muon, "weight_decay": opt_cfg.weight_decay, "muon": True})
    groups = [g for g in groups if g["params"]]
    if tables:
        groups.append(
            {"params": tables, "lr": opt_cfg.lr * engram_cfg.lr_multiplier,
             "weight_decay": engram_cfg.weight_decay, "engram": True}
        )
    kwargs = dict(lr=opt_cfg.lr, betas=(opt_cfg.beta1, opt_cfg.beta2), eps=opt_cfg.eps)
    if ours:
        optimizer = MuonAdamW(
            groups, **kwargs, weight_decay=opt_cfg.weight_decay, momentum=opt_cfg.muon_momentum,
            nesterov=opt_cfg.muon_nesterov, ns_steps=opt_cfg.muon_ns_steps,
            state_dtype=STATE_DTYPES[opt_cfg.state_dtype],
            ns_dtype=ns_dtype_for(opt_cfg.muon_ns_dtype, decay + no_decay + muon), expert_replicas=expert_replicas,
        )
    elif opt_cfg.name == "AdamW":
        kwargs.update(_implementation_kwargs(opt_cfg.implementation, decay + no_decay + tables))
        optimizer = torch.optim.AdamW(groups, **kwargs)
    elif opt_cfg.name == "Adam":
        # Adam's weight_decay is L2 added to the gradient, not decoupled.
        kwargs.update(_implementation_kwargs(opt_cfg.implementation, decay + no_decay + tables))
        optimizer = torch.optim.Adam(groups, **kwargs)
    else:
        raise ValueError(f"optimizer.name must be AdamW, Adam or muon, got {opt_cfg.name!r}")
    offloaded = offload_engram_group(optimizer) if tables and engram_cfg.offload_optimizer_state else None
    if tables:
        register_table_state_hooks(optimizer, model, offloaded)
    return optimizer, [EngramOffloadStep(optimizer, offloaded)] if offloaded is not None else []


def optimizer_signature(optimizer: torch.optim.Optimizer) -> str:
    """What made an optimizer's state, as ``name/state_dtype`` (``muon/bfloat16``, ``AdamW/float32``):
    checkpoints record it, and resuming one into another is refused (``checkpoint.reset_optimizer``)."""
    if isinstance(optimizer, MuonAdamW):
        name = "muon" if any(g["muon"] for g in optimizer.param_groups) else "AdamW"
        return f"{name}/{str(optimizer.state_dtype).removeprefix('torch.')}"
    return f"{type(optimizer).__name__}/float32"


class ExpertBiasUpdater(StepHook):
    """The aux-loss-free bias update, once per optimizer step, right before it.

    ``reduce_counts`` is where a parallel run sums the counts over data and context ranks.
    The update stays on the device; the load-imbalance statistics are read back only when
    ``metrics()`` is asked for (on logging steps). ``pp_mesh``: the pipeline ranks, over which the
    layers are split (None: no PP); only the statistics cross it (each stage updates its own layers).
    """

    def __init__(self, model: nn.Module, reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None, pp_mesh=None):
        named = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
        self.modules = [m for _, m in named]
        self.layer_keys = [_layer_key(name) for name, _ in named]
        self.reduce_counts = reduce_counts
        self.pp_group = pp_mesh.get_group() if pp_mesh is not None else None
        self._ratios: torch.Tensor | None = None

    def before_optimizer(self, skip: bool) -> None:
        if skip:  # a non-finite step: its counts must not steer the next update
            reset_expert_counts(self.modules)
        elif self.modules:
            self._ratios = apply_expert_bias_update(self.modules, self.reduce_counts)

    def metrics(self) -> dict[str, float]:
        """max/mean expert load of the last update, averaged over MoE layers, and the worst
        layer's (one host read); empty before the first."""
        ratios = self._ratios
        if self.pp_group is not None:
            # Every stage's layers, in the model's order, as one process averages them (a
            # collective of every pipeline rank, on logging steps only).
            mine = list(zip(self.layer_keys, ratios.tolist() if ratios is not None else []))
            stages = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(stages, mine, group=self.pp_group)
            ordered = [ratio for _, ratio in sorted(pair for stage in stages for pair in stage)]
            ratios = torch.tensor(ordered, dtype=torch.float32) if ordered else None
        stats = load_imbalance_stats(ratios)
        if not stats:
            return {}
        return {"moe_imbalance": stats["moe/load_imbalance/mean"], "moe_imbalance_worst": stats["moe/load_imbalance/max"]}


def _layer_key(name: str) -> tuple[bool, int]:
    """Where an MoE (``layers.3.ffn``, ``mtp.0.block.ffn``) comes in the whole model's order."""
    part, index = name.split(".")[:2]
    return part == "mtp", int(index)
