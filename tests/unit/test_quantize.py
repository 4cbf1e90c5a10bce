"""float8 via torchao ([quantize], trainer/quantize.py): which modules convert, CPU numerics, errors."""

import dataclasses
import sys

import pytest
import torch

from models.deepseek_v3 import DeepSeekV3Model, get_flavor
from trainer.config import ConfigError, Quantize, load_config
from trainer.parallel.parallel_dims import ParallelDims
from trainer.parallel.parallelize import parallelize_model
from trainer.quantize import check_float8_support, convert_to_float8

pytest.importorskip("torchao.float8")

ARGS = dataclasses.replace(get_flavor("debugmodel"), max_seq_len=32)


def _model(convert=None) -> DeepSeekV3Model:
    with torch.device("meta"):
        model = DeepSeekV3Model(ARGS)
    if convert is not None:
        convert(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model.train()


def _loss_and_grads(model, tokens):
    out = model(tokens, labels=tokens)
    loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_float8_through_parallelize_converts_linears_but_not_router_or_head():
    cfg = load_config(["--quantize.float8", "--quantize.emulate", "--training.mixed_precision_param", "float32"])
    dims = ParallelDims.from_config(cfg.parallelism, 1)
    model = _model(
        lambda m: parallelize_model(
            m, dims, cfg.parallelism, cfg.training, cfg.activation_checkpoint, cfg.quantize, cfg.engram, "cpu"
        )
    )
    from torchao.float8.float8_linear import Float8Linear

    plain = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    converted = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert plain == ["head"]  # filtered by name; every other debugmodel Linear is 16-aligned
    assert {"layers.0.attn.wq", "layers.1.ffn.shared_experts.w2", "mtp.0.eh_proj"} <= set(converted)
    # The router gate is a bare parameter (scores in fp32), never a Linear: it must stay plain.
    assert type(model.layers["1"].ffn.gate.weight.data) is torch.Tensor

    # Emulated float8 on CPU: forward + backward run, and the loss stays near the fp32 one.
    reference = _model()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    loss8, grads8 = _loss_and_grads(model, tokens)
    loss32, grads32 = _loss_and_grads(reference, tokens)
    assert abs(float(loss8) - float(loss32)) < 1e-2 * float(loss32)
    g8, g32 = grads8["layers.0.attn.wq.weight"], grads32["layers.0.attn.wq.weight"]
    assert torch.isfinite(g8).all()
    # float8 grads are close to the fp32 ones, but not equal (the casts really happen).
    cos = torch.nn.functional.cosine_similarity(g8.flatten(), g32.flatten(), dim=0)
    assert 0.95 < float(cos) and not torch.equal(g8, g32)


def test_float8_experts_wrap_routed_experts_only():
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor

    q = Quantize(float8=True, float8_experts=True)
    with torch.device("meta"):
        model = DeepSeekV3Model(ARGS)
    converted = convert_to_float8(model, q)
    assert converted["experts"] == [f"layers.{i}.ffn.experts" for i in range(1, 6)] + ["mtp.0.block.ffn.experts"]
    moe = model.layers["1"].ffn
    assert all(isinstance(getattr(moe.experts, w).data, Float8TrainingWeightWrapperTensor) for w in ("w1", "w2", "w3"))
    assert not isinstance(moe.gate.weight.data, Float8TrainingWeightWrapperTensor)


@pytest.mark.parametrize(
    "qcfg, device, tp, expected",
    [
        (Quantize(float8=True), "cpu", False, "--quantize.emulate"),
        (Quantize(float8=True, emulate=True, float8_experts=True), "cpu", False, "--no-quantize.float8_experts"),
        (Quantize(float8=True, emulate=True), "cpu", True, "tensor parallelism"),
    ],
)
def test_float8_refused_with_the_fix(qcfg, device, tp, expected):
    with pytest.raises(ConfigError, match=expected):
        check_float8_support(qcfg, device, tp)


def test_float8_without_torchao(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import now raises ImportError
    with pytest.raises(ConfigError, match="needs torchao"):
        check_float8_support(Quantize(float8=True, emulate=True), "cpu")


def test_float8_experts_needs_float8():
    with pytest.raises(ConfigError, match="--quantize.float8"):
        load_config(["--quantize.float8_experts"])
