"""QK-clip under TP 2 x FSDP 2 (4 gloo ranks): the per-head maxima gathered over the tp ranks into
model order and maxed over the data ranks, and the heads' rows scaled on each rank's shards, where
FSDP's dim-0 shards of TP's head blocks cut through a head: the same weights and metrics as one
process. (The recording under TP runs through run_train.sh in tests/e2e/test_muon_train.py.)"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from models.deepseek_v3 import DeepSeekV3Model, get_flavor
from trainer.diagnostics import init_local_gloo, spawn_local
from trainer.qk_clip import QKClip, mla_modules

WORLD, DP, TP = 4, 2, 2
# 6 heads: 3 per tp rank, so each FSDP shard of a rank's `wq_b` / `wkv_b` rows holds 1.5 heads.
# One dense and one MoE block; q_lora_rank > 0: `wq_b` (the debug model's `wq` runs in the e2e test).
ARGS = dataclasses.replace(get_flavor("debugmodel"), n_layers=2, mtp_depth=0, n_heads=6, q_lora_rank=16)
THRESHOLD = 1.0


def _model() -> DeepSeekV3Model:
    torch.manual_seed(0)
    model = DeepSeekV3Model(ARGS)
    model.init_weights()
    return model


def _maxima(dp_rank: int) -> torch.Tensor:
    """`[layers, heads]` maxima as data rank `dp_rank` records them: each head's largest value
    (both sides of the threshold) on one of the two data ranks, a smaller one on the other."""
    full = torch.tensor([[0.5, 3.0, 1.5, 0.9, 4.0, 2.0], [2.5, 0.2, 1.0, 8.0, 1.2, 0.7]])
    lower = torch.arange(full.numel()).view_as(full) % DP != dp_rank
    return torch.where(lower, full - 0.4, full)


def _clip(rank: int, world: int, port: int, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallel.fsdp import apply_fsdp
    from trainer.parallel.tensor_parallel import apply_tensor_parallel

    torch.set_num_threads(1)
    init_local_gloo(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp_shard", "tp"))
        model = _model()
        apply_tensor_parallel(model, mesh["tp"])
        apply_fsdp(model, mesh["dp_shard"])
        clip = QKClip(model, THRESHOLD, every=1, mesh=mesh["dp_shard"], tp_mesh=mesh["tp"])
        clip.before_forward(1)
        local = _maxima(mesh["dp_shard"].get_local_rank())
        tp_rank, heads = mesh["tp"].get_local_rank(), ARGS.n_heads // TP
        for (_, attn), layer_max in zip(clip.layers, local):
            attn.max_logit.copy_(layer_max[tp_rank * heads:(tp_rank + 1) * heads])
        clip.after_optimizer(stepped=True)
        _, want = _one_process()
        # Relative differences, not tensors: a tensor put on the queue is shared memory that
        # the rank's exit takes away.
        errors = {
            f"{name}.{w}": ((getattr(attn, w).weight.detach().full_tensor() - want[f"{name}.{w}"]).abs().max()
                            / want[f"{name}.{w}"].abs().max()).item()
            for name, attn in clip.layers for w in ("wq_b", "wkv_b")
        }
        shards = {name: attn.wq_b.weight.to_local().shape[0] for name, attn in clip.layers}
        queue.put((rank, {"metrics": clip.metrics(), "errors": errors, "shard_rows": shards}))
    finally:
        dist.destroy_process_group()


def _one_process() -> tuple[dict, dict]:
    """The same clip on one process, with the maxima already maxed over the data ranks."""
    model = _model()
    clip = QKClip(model, THRESHOLD, every=1)
    clip.before_forward(1)
    for (_, attn), layer_max in zip(clip.layers, torch.maximum(_maxima(0), _maxima(1))):
        attn.max_logit.copy_(layer_max)
    clip.after_optimizer(stepped=True)
    weights = {f"{name}.{w}": getattr(attn, w).weight.detach().clone() for name, attn in mla_modules(model)
               for w in ("wq_b", "wkv_b")}
    return clip.metrics(), weights


@pytest.mark.slow  # 4 spawned ranks
def test_tp_fsdp_clip_matches_one_process():
    results = dict(spawn_local(_clip, WORLD, timeout=300))
    metrics, weights = _one_process()
    assert metrics["qk_clipped_heads"] == 7  # 4 + 3 maxima above 1.0
    unclipped = _model()
    for rank, got in results.items():
        # 3 heads of 48 rows per tp rank, 72 rows per FSDP shard: a shard ends inside a head.
        assert set(got["shard_rows"].values()) == {72}, rank
        assert got["metrics"] == metrics, rank
        assert got["errors"].keys() == weights.keys(), rank
        for name, err in got["errors"].items():
            assert err <= 1e-6, f"rank {rank}: {name} differs by {err} (relative to its largest entry)"
    before = {f"{n}.{w}": getattr(a, w).weight for n, a in mla_modules(unclipped) for w in ("wq_b", "wkv_b")}
    assert all(not torch.equal(before[name], w) for name, w in weights.items())  # the clip changed every matrix
