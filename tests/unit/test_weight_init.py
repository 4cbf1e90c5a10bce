"""Layout-invariant initialisation (trainer/parallel/weight_init.py): keyed draws per parameter
name and row block; a shard's draw equals its part of the full tensor's."""

import pytest
import torch

from models.deepseek_v3.args import DeepSeekV3ModelArgs
from models.deepseek_v3.model import DeepSeekV3Model
from models.moe.args import MoEArgs
from trainer.parallel import weight_init
from trainer.parallel.weight_init import init_model_weights


def tiny_model() -> DeepSeekV3Model:
    args = DeepSeekV3ModelArgs(
        vocab_size=64, dim=32, inter_dim=48, moe_inter_dim=16, n_layers=2, n_dense_layers=1, n_heads=2,
        moe=MoEArgs(num_experts=4, num_shared_experts=1, top_k=2, score_func="sigmoid", route_norm=True),
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, max_seq_len=16, mtp_depth=1,
    )
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    model.to_empty(device="cpu")
    return model


def test_same_seed_same_weights_and_the_model_scheme_is_kept():
    a, b, c = tiny_model(), tiny_model(), tiny_model()
    trunc_normal_ = torch.nn.init.trunc_normal_
    torch.manual_seed(0)
    init_model_weights(a, seed=5)
    torch.manual_seed(1)  # the global generator plays no part
    init_model_weights(b, seed=5)
    init_model_weights(c, seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    for name, value in sa.items():
        assert torch.equal(value, sb[name]), name
    assert not torch.equal(sa["layers.1.ffn.experts.w1"], sc["layers.1.ffn.experts.w1"])
    assert torch.nn.init.trunc_normal_ is trunc_normal_  # replaced only during the init
    # The model's own distributions: std 1 embedding, 0.02 input projections, ones for norms.
    assert abs(a.embed.weight.std().item() - 1.0) < 0.1
    assert abs(a.layers["0"].attn.wkv_a.weight.std().item() - 0.02) < 0.003
    head_std = a.args.dim**-0.5
    assert a.head.weight.abs().max() <= 3 * head_std  # truncated at 3 std
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))
    # Every expert and every parameter gets its own values.
    w1 = a.layers["1"].ffn.experts.w1
    assert not torch.equal(w1[0], w1[1])
    assert not torch.equal(a.layers["0"].attn.wkv_a.weight[:4], a.layers["1"].attn.wkv_a.weight[:4])


@pytest.mark.parametrize("dims", [(0,), (1,), (0, 1)])
def test_a_shard_draws_its_part_of_the_full_tensor(monkeypatch, dims):
    """Small row blocks so a tensor spans several; a shard (rows and/or columns, in any order,
    as a strided FSDP shard may be) must get exactly those entries of the full draw."""
    monkeypatch.setattr(weight_init, "BLOCK_ELEMENTS", 24)
    shape = (10, 8)
    full = torch.empty(shape)
    weight_init._fill(full, weight_init._uniform(-1.0, 1.0), key=(3, "w", 0))
    index = [torch.arange(n) for n in shape]
    pick = {0: torch.tensor([7, 8, 2, 3]), 1: torch.tensor([4, 5, 6, 7])}
    for d in dims:
        index[d] = pick[d]
    monkeypatch.setattr(weight_init, "_layout", lambda param: (shape, index))
    part = torch.empty(len(index[0]), len(index[1]))
    weight_init._fill(part, weight_init._uniform(-1.0, 1.0), key=(3, "w", 0))
    assert torch.equal(part, full[index[0]][:, index[1]])
    assert len(set(full.flatten().tolist())) == full.numel()


def test_wrappers_do_not_change_the_weights():
    """Activation checkpointing renames parameters (``_checkpoint_wrapped_module``); the draws
    are keyed by the plain model's names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain, wrapped = tiny_model(), tiny_model()
    for key, block in list(wrapped.layers.items()):
        wrapped.layers[key] = checkpoint_wrapper(block)
    assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_parameters())
    init_model_weights(plain, seed=1)
    init_model_weights(wrapped, seed=1)
    for (name, p), q in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(p, q), name
