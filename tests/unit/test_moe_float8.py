"""float8 routed experts: torchao's float8 grouped GEMM receives every expert matmul.

The float8 kernel itself is CUDA SM90+ only (the refusal on CPU is tested in test_quantize.py);
here torchao's entry point is replaced by a recorder that runs the high-precision grouped mm, so
the wiring (which matmuls reach it, with which group offsets) is checked on CPU.
"""

import dataclasses

import pytest
import torch

from models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs
from trainer.config import Quantize
from trainer.quantize import convert_to_float8

moe_tensor = pytest.importorskip("torchao.prototype.moe_training.tensor")


def test_routed_expert_matmuls_reach_torchaos_float8_grouped_gemm(monkeypatch):
    calls = []

    def recorder(a, b, offs, config):
        calls.append((tuple(a.shape), tuple(b.shape), offs.clone()))
        return torch._grouped_mm(a, b, offs=offs)

    monkeypatch.setattr(moe_tensor, "_quantize_then_scaled_grouped_mm", recorder)
    args = dataclasses.replace(DeepSeekV3ModelArgs(), n_layers=2, mtp_depth=0, max_seq_len=16)
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    model.init_weights()
    convert_to_float8(model, Quantize(float8=True, emulate=True, float8_experts=True))
    tokens = torch.randint(2, args.vocab_size, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens).logits.float().sum().backward()

    # One MoE layer: w1, w3, w2 of the routed experts, on all T * K rows, with device offsets.
    assert [(a, b) for a, b, _ in calls] == [
        ((32 * 2, args.dim), (8, args.dim, args.moe_inter_dim)),
        ((32 * 2, args.dim), (8, args.dim, args.moe_inter_dim)),
        ((32 * 2, args.moe_inter_dim), (8, args.moe_inter_dim, args.dim)),
    ]
    offsets = calls[0][2]
    assert offsets.dtype == torch.int32 and offsets[-1] == 32 * 2
    assert model.layers["1"].ffn.experts.w1.grad is not None
