"""QK-clip under TP 2 x FSDP 2, run inside tests/distributed/parity_worker.py's 4-rank job
(`check()`, on every rank; asserted by tests/distributed/test_parity.py): the per-head maxima
gathered over the tp ranks into model order and maxed over the data ranks, and the heads' rows
scaled on each rank's shards, where FSDP's dim-0 shards of TP's head blocks cut through a head,
give one process's weights and metrics. The recording under TP runs through run_train.sh in
tests/e2e/test_muon_train.py.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from models.deepseek_v3 import DeepSeekV3Model, get_flavor
from trainer.optim.qk_clip import QKClip

DP, TP = 2, 2
# 6 heads: 3 per tp rank, so each FSDP shard of a rank's `wq_b` / `wkv_b` rows holds 1.5 heads.
# One dense and one MoE block; q_lora_rank > 0: `wq_b` (the debug model's `wq` runs in the e2e test).
ARGS = dataclasses.replace(get_flavor("debugmodel"), n_layers=2, mtp_depth=0, n_heads=6, q_lora_rank=16)
THRESHOLD = 1.0
MATRICES = ("wq_b", "wkv_b")


def _model() -> DeepSeekV3Model:
    torch.manual_seed(0)
    model = DeepSeekV3Model(ARGS)
    model.init_weights()
    return model


def maxima(dp_rank: int) -> torch.Tensor:
    """`[layers, heads]` maxima as data rank `dp_rank` records them: each head's largest value
    (above the threshold for 4 + 3 heads) on one of the two data ranks, a smaller one on the other."""
    full = torch.tensor([[0.5, 3.0, 1.5, 0.9, 4.0, 2.0], [2.5, 0.2, 1.0, 8.0, 1.2, 0.7]])
    lower = torch.arange(full.numel()).view_as(full) % DP != dp_rank
    return torch.where(lower, full - 0.4, full)


def one_process() -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The same clip on one process, from the maxima already maxed over the data ranks: its
    metrics, its clipped matrices and the unclipped ones."""
    model = _model()
    clip = QKClip(model, THRESHOLD, every=1)
    before = {f"{n}.{w}": getattr(a, w).weight.detach().clone() for n, a in clip.layers for w in MATRICES}
    clip.before_forward(1)
    for (_, attn), layer_max in zip(clip.layers, torch.maximum(maxima(0), maxima(1))):
        attn.max_logit.copy_(layer_max)
    clip.after_optimizer(stepped=True)
    after = {f"{n}.{w}": getattr(a, w).weight.detach().clone() for n, a in clip.layers for w in MATRICES}
    return clip.metrics(), after, before


def check() -> dict:
    """On every rank of a 4-rank default group; the same summary on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallel.fsdp import apply_fsdp
    from trainer.parallel.tensor_parallel import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp_shard", "tp"))
    model = _model()
    apply_tensor_parallel(model, mesh["tp"])
    apply_fsdp(model, mesh["dp_shard"])
    clip = QKClip(model, THRESHOLD, every=1, mesh=mesh["dp_shard"], tp_mesh=mesh["tp"])
    clip.before_forward(1)
    tp_rank, heads = mesh["tp"].get_local_rank(), ARGS.n_heads // TP
    for (_, attn), layer_max in zip(clip.layers, maxima(mesh["dp_shard"].get_local_rank())):
        attn.max_logit.copy_(layer_max[tp_rank * heads:(tp_rank + 1) * heads])
    clip.after_optimizer(stepped=True)
    metrics, want, before = one_process()
    # Per matrix: the largest difference from one process's, relative to its largest entry, and
    # whether the clip changed it at all; maxed over the ranks.
    summary = torch.zeros(2)
    for name, attn in clip.layers:
        for w in MATRICES:
            got = getattr(attn, w).weight.detach().full_tensor()
            ref = want[f"{name}.{w}"]
            error = (got - ref).abs().max() / ref.abs().max()
            summary = torch.maximum(summary, torch.stack([error, (ref == before[f"{name}.{w}"]).all().float()]))
    summary = torch.cat([summary, torch.tensor([float(clip.metrics() != metrics)])])
    dist.all_reduce(summary, op=dist.ReduceOp.MAX)
    return {
        "max_rel_error": summary[0].item(),
        "a_matrix_unchanged": bool(summary[1]),
        "metrics_differ_on_a_rank": bool(summary[2]),
        "clipped_heads": metrics["qk_clipped_heads"],
        "shard_rows": sorted({attn.wq_b.weight.to_local().shape[0] for _, attn in clip.layers}),
    }
