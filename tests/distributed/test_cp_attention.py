"""Context-parallel MLA on 2 gloo ranks equals single-device attention, forward and backward.

Checks the three pieces together: head-tail chunking, RoPE at global positions, and the
compressed-latent all-gather (whose backward is a reduce-scatter), for causal and
document-causal masks.
"""

import pytest
import torch
import torch.distributed as dist

from models.common.attention import MLA, build_attention_mask
from models.common.rope import precompute_freqs_cis
from trainer.diagnostics import init_local_gloo, spawn_local

pytestmark = pytest.mark.numerics  # docs/numerics.md

WORLD = 2
B, S, DIM, EOS = 2, 16, 32, 3


def _build(q_lora_rank: int) -> MLA:
    torch.manual_seed(0)
    mla = MLA(dim=DIM, n_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8,
              qk_rope_head_dim=4, v_head_dim=6, softmax_scale=12**-0.5)
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


def _worker(rank: int, world: int, port: int, cases: list[tuple[str, int]], queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    init_local_gloo(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
        queue.put((rank, {case: _errors(mesh, *case) for case in cases}))
    finally:
        dist.destroy_process_group()


CASES = [("causal", 0), ("block_causal", 8)]


@pytest.fixture(scope="module")
def cp_errors() -> dict[int, dict]:
    """Both cases in one launch of the two ranks (a launch costs more than the cases)."""
    return dict(spawn_local(_worker, WORLD, CASES, timeout=300))


@pytest.mark.parametrize("mask_type,q_lora_rank", CASES)
def test_cp_latent_attention_matches_full(cp_errors, mask_type, q_lora_rank):
    for rank, by_case in cp_errors.items():
        for name, err in by_case[(mask_type, q_lora_rank)].items():
            assert err < 1e-5, f"rank {rank}: {name} differs by {err}"


def test_load_balanced_positions():
    from trainer.parallel.context_parallel import gathered_positions, load_balanced_positions

    assert load_balanced_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert load_balanced_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(gathered_positions(24, 3).tolist()) == list(range(24))
    with pytest.raises(ValueError, match="multiple of 4"):
        load_balanced_positions(10, 2, 0)


def test_model_positions_argument_defaults_to_arange():
    import dataclasses

    from models.deepseek_v3 import DeepSeekV3Model, get_flavor

    torch.manual_seed(0)
    model = DeepSeekV3Model(dataclasses.replace(get_flavor("debugmodel"), n_layers=2, max_seq_len=32))
    model.init_weights()
    model.eval()
    tokens = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        default = model(tokens).logits
        explicit = model(tokens, positions=torch.arange(16)).logits
    torch.testing.assert_close(explicit, default, rtol=0, atol=0)
