"""Worker of tests/distributed/test_cp_attention.py: one gloo rank of context-parallel MLA, and
the same attention on the whole sequence in the same process; puts the largest differences of the
output, the input gradient and every weight gradient (summed over ranks) per case."""

import torch
import torch.distributed as dist

from models.common.attention import MLA, build_attention_mask
from models.common.rope import precompute_freqs_cis
from trainer.diagnostics import init_local_gloo

WORLD = 2
B, S, DIM, EOS = 2, 16, 32, 3
# (mask type, q_lora_rank): both in one launch of the two ranks (a launch costs more than the cases).
CASES = [("causal", 0), ("block_causal", 8)]


def _build(q_lora_rank: int) -> MLA:
    torch.manual_seed(0)
    mla = MLA(
        dim=DIM,
        n_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        softmax_scale=12**-0.5,
    )
    mla.init_weights(0.02)
    return mla


def _errors(mesh, mask_type: str, q_lora_rank: int) -> dict[str, float]:
    from trainer.parallel.context_parallel import ContextParallel, LatentAllGather

    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, DIM, generator=g)
    tokens = torch.randint(0, 8, (B, S), generator=g)  # EOS=3 appears: several documents
    grad_out = torch.randn(B, S, DIM, generator=g)
    freqs = precompute_freqs_cis(4, 64, 10000.0)

    # Reference: the whole sequence on one device.
    ref = _build(q_lora_rank)
    x_ref = x.clone().requires_grad_()
    out_ref = ref(x_ref, freqs[:S], build_attention_mask(tokens, mask_type, EOS, "sdpa"))
    (out_ref * grad_out).sum().backward()

    # Context parallel: this rank's head-tail chunks, global positions, latent all-gather.
    cp = ContextParallel(mesh, mask_type, EOS, "sdpa")
    batch = cp.shard_batch(tokens, tokens)
    mla = _build(q_lora_rank)
    mla.latent_exchange = LatentAllGather(mesh.get_group())
    x_loc = x[:, batch.positions].clone().requires_grad_()
    out = mla(x_loc, freqs[batch.positions], batch.attn_mask)
    (out * grad_out[:, batch.positions]).sum().backward()

    errors = {
        "out": (out - out_ref[:, batch.positions]).abs().max().item(),
        "dx": (x_loc.grad - x_ref.grad[:, batch.positions]).abs().max().item(),
    }
    for name, p in mla.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)  # weight gradients of the shards add up to the full one
        errors[f"d{name}"] = (grad - dict(ref.named_parameters())[name].grad).abs().max().item()
    return errors


def run(rank: int, world: int, port: int, cases: list[tuple[str, int]], queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    init_local_gloo(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
        queue.put((rank, {case: _errors(mesh, *case) for case in cases}))
    finally:
        dist.destroy_process_group()
