"""Muon maths against from-scratch references written here, the parameter split, bf16 states."""

import math

import pytest
import torch
from torch import nn

from models.deepseek_v3 import DeepSeekV3Model, get_flavor
from trainer.config import JobConfig
from trainer.optim.build import build_optimizer
from trainer.optim.muon import MuonAdamW, batched_newton_schulz, muon_params, orthogonalize, rms_matched_scale

pytestmark = pytest.mark.numerics  # docs/numerics.md


def reference_newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's quintic iteration X <- aX + (b XX^T + c (XX^T)^2) X on the wide orientation,
    after scaling X to Frobenius norm 1, all in bf16."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.to(torch.bfloat16)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp_min(1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(16, 24), (40, 12)])
def test_newton_schulz_matches_reference(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    ours = orthogonalize(g, 5)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), reference_newton_schulz(g).float(), atol=3e-2, rtol=0)
    # Orthogonalised: the singular values land near 1 (Muon's iteration leaves them in ~[0.6, 1.2]).
    s = torch.linalg.svdvals(ours.float())
    assert s.min() > 0.5 and s.max() < 1.3, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 8, 20), (4, 48, 16)])
def test_expert_stack_is_orthogonalised_per_matrix(shape, dtype):
    """One batched call per stack gives each matrix's own result, bitwise on CPU in both dtypes
    (torch's bf16 kernel per matrix, docs/optimizers.md)."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    stacked = orthogonalize(g, 5, dtype)
    assert stacked.dtype == dtype
    for e in range(shape[0]):
        assert torch.equal(stacked[e], orthogonalize(g[e], 5, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 7, 9), (6, 9, 7), (5, 3, 5), (4, 8, 20)])
def test_a_matrix_gets_the_same_bits_in_any_batch(shape, dtype):
    """An expert matrix's update does not depend on which batch it is orthogonalised in: an owner's
    bucket (a few matrices, from position 0) and one process's whole stack (at position e) give it
    the same bits. Odd sizes are the hard case: in a contiguous batch their matrices start off a
    16-byte boundary, where MKL's AVX2 GEMM rounded them otherwise (trainer.optim.muon._apart)."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    whole = batched_newton_schulz(g, 5, dtype)
    for start in range(shape[0]):
        for stop in range(start + 1, shape[0] + 1):
            part = batched_newton_schulz(g[start:stop].clone(), 5, dtype)
            assert torch.equal(part, whole[start:stop]), (start, stop)


def test_step_reads_nothing_from_the_device_and_counts_steps_per_group():
    import dataclasses

    from trainer.diagnostics import HostReadCounter

    args = dataclasses.replace(get_flavor("debugmodel"), n_layers=2, dim=32, inter_dim=64, moe_inter_dim=16, n_heads=2,
                               kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, vocab_size=64)
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    cfg = JobConfig().optimizer
    cfg.name, cfg.state_dtype = "muon", "bfloat16"
    opt, _ = build_optimizer(model, cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    reads = HostReadCounter("cpu")
    with reads:
        opt.step()
    assert sum(reads.counts.values()) == 0, reads.counts
    assert [g["step"] for g in opt.param_groups if not g["muon"]] == [2, 2]
    assert not any("step" in s for s in opt.state.values())


def test_ns_dtype_auto_follows_the_hardware(monkeypatch, caplog):
    from trainer.optim.build import ns_dtype_for

    cpu = [torch.zeros(2)]
    assert ns_dtype_for("bfloat16", cpu) == torch.bfloat16 and ns_dtype_for("float32", cpu) == torch.float32
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with caplog.at_level("INFO", logger="trainer"):
        assert ns_dtype_for("auto", cpu) == torch.float32
    assert "Newton-Schulz in float32 (muon_ns_dtype = auto on a CPU without AMX" in caplog.text
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert ns_dtype_for("auto", cpu) == torch.bfloat16
    gpu = type("FakeCudaParam", (), {"device": torch.device("cuda", 0)})()
    assert ns_dtype_for("auto", [gpu]) == torch.bfloat16


def test_rms_matched_scale():
    # An A x B matrix with unit singular values has RMS 1/sqrt(max(A, B)); the scale lifts it to
    # AdamW's typical update RMS 0.2.
    for a, b in [(64, 256), (256, 64), (100, 100)]:
        assert rms_matched_scale(torch.Size([a, b])) == pytest.approx(0.2 * math.sqrt(max(a, b)))
        u, _, vh = torch.linalg.svd(torch.randn(a, b, dtype=torch.float64), full_matrices=False)
        ortho = u @ vh
        rms = (ortho * rms_matched_scale(ortho.shape)).pow(2).mean().sqrt()
        assert rms.item() == pytest.approx(0.2, rel=1e-9)
    assert rms_matched_scale(torch.Size([8, 64, 256])) == pytest.approx(0.2 * 16)  # expert stack: its matrices


def _reference_muon(w, grads, lr, wd, mu, nesterov):
    """Muon written out: EMA momentum, Nesterov look-ahead, NS, decoupled decay, Moonlight's scale."""
    w, buf = w.clone(), torch.zeros_like(w)
    for g in grads:
        buf = mu * buf + (1 - mu) * g
        u = (1 - mu) * g + mu * buf if nesterov else buf
        o = torch.stack([reference_newton_schulz(m) for m in u]) if u.ndim == 3 else reference_newton_schulz(u)
        w = w * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(w.shape[-2:])) * o.float()
    return w


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("shape", [(24, 16), (2, 12, 20)])
def test_muon_step_matches_reference(shape, nesterov):
    gen = torch.Generator().manual_seed(2)
    w0 = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(3)]
    p = nn.Parameter(w0.clone())
    opt = MuonAdamW([{"params": [p], "muon": True}], lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                    momentum=0.9, nesterov=nesterov)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    expected = _reference_muon(w0, grads, lr=0.02, wd=0.1, mu=0.9, nesterov=nesterov)
    # bf16 Newton-Schulz: the two bf16 programs round differently; lr x scale x bf16 eps bounds it.
    torch.testing.assert_close(p.detach(), expected, atol=2e-3, rtol=0)
    buf = 0
    for g in grads:
        buf = 0.9 * buf + 0.1 * g
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], buf, atol=1e-6, rtol=1e-6)


def test_muon_equals_torch_muon_on_plain_matrices():
    gen = torch.Generator().manual_seed(3)
    ours, theirs = nn.Parameter(torch.randn(32, 48, generator=gen)), nn.Parameter(torch.empty(32, 48))
    theirs.data.copy_(ours.data)
    opt = MuonAdamW([{"params": [ours], "muon": True}], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.Muon([theirs], lr=0.01, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        g = torch.randn(32, 48, generator=gen)
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert torch.equal(ours, theirs)


def test_adamw_part_equals_torch_adamw_and_bf16_states():
    gen = torch.Generator().manual_seed(4)
    w0 = torch.randn(64, 16, generator=gen)
    params = {k: nn.Parameter(w0.clone()) for k in ("torch", "fp32", "bf16")}
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opts = {
        "torch": torch.optim.AdamW([params["torch"]], foreach=False, **kw),
        "fp32": MuonAdamW([params["fp32"]], **kw),
        "bf16": MuonAdamW([params["bf16"]], state_dtype=torch.bfloat16, **kw),
    }
    for _ in range(5):
        g = torch.randn(64, 16, generator=gen)
        for k, opt in opts.items():
            params[k].grad = g.clone()
            opt.step()
    torch.testing.assert_close(params["fp32"], params["torch"], atol=1e-6, rtol=1e-6)
    state = opts["bf16"].state[params["bf16"]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert params["bf16"].dtype == torch.float32
    # bf16 moments (8 mantissa bits): the updates differ from fp32's by about their relative precision.
    torch.testing.assert_close(params["bf16"], params["torch"], atol=5e-4, rtol=0)


def test_parameter_split_and_groups():
    args = get_flavor("debugmodel")
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for p in muon_params(model)}
    for n in muon:
        assert n.startswith(("layers.", "mtp.")), n
        assert not n.endswith(("norm.weight", "gate.weight")), n
    assert "layers.1.ffn.experts.w1" in muon and "layers.0.attn.wq.weight" in muon
    assert "mtp.0.eh_proj.weight" in muon and "layers.2.ffn.shared_experts.w2.weight" in muon
    adamw = set(names.values()) - muon
    assert {"embed.weight", "head.weight", "layers.1.ffn.gate.weight", "norm.weight"} <= adamw
    assert all(n.endswith(("norm.weight", "gate.weight")) or n in ("embed.weight", "head.weight") for n in adamw)

    cfg = JobConfig().optimizer
    cfg.name, cfg.state_dtype = "muon", "bfloat16"
    opt, _ = build_optimizer(model, cfg)
    (group,) = [g for g in opt.param_groups if g["muon"]]
    assert {names[id(p)] for p in group["params"]} == muon
    assert sum(len(g["params"]) for g in opt.param_groups) == len(names)
    loss = model(torch.randint(0, args.vocab_size, (1, 16))).logits.float().square().mean()
    loss.backward()
    opt.step()
    assert all(v.dtype == torch.bfloat16 for s in opt.state.values() for k, v in s.items() if k != "step")


@pytest.mark.parametrize("name,state_dtype", [("AdamW", "float32"), ("AdamW", "bfloat16"), ("muon", "float32"),
                                              ("muon", "bfloat16")])
def test_memory_estimate_counts_the_optimizer_state(name, state_dtype):
    from trainer.planning.memory import GiB, estimate

    args = get_flavor("debugmodel")
    model = DeepSeekV3Model(args)
    cfg = JobConfig().optimizer
    cfg.name, cfg.state_dtype = name, state_dtype
    # One Newton-Schulz iteration (of 5): the iterations shape Muon's update, not the state it keeps
    # (the momentum buffers the estimate counts), and on CPU they are most of this test's time.
    cfg.muon_ns_steps = 1
    opt, _ = build_optimizer(model, cfg)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    held = sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items() if k != "step")
    est = estimate("debugmodel", 1, 1, 1, 1, 64, 1, "none", model_args=args, device_type="cpu",
                   optimizer=name, state_dtype=state_dtype)
    assert est["gib"]["optimizer"] * GiB == pytest.approx(held, rel=1e-9)


@pytest.mark.parametrize("argv, words", [
    (["--optimizer.name", "lion"], ["optimizer.name = 'lion'", "AdamW, Adam, muon"]),
    (["--optimizer.name", "muon", "--optimizer.qk_clip", "--optimizer.qk_clip_threshold", "0"],
     ["optimizer.qk_clip_threshold must be > 0"]),
    (["--optimizer.qk_clip_threshold", "-5"], ["optimizer.qk_clip_threshold must be > 0"]),
    (["--optimizer.name", "Adam", "--optimizer.state_dtype", "bfloat16"],
     ["state_dtype = 'bfloat16' is for AdamW and muon"]),
])
def test_bad_optimizer_input_is_one_line(capsys, tmp_path, argv, words):
    from trainer.config.check import main

    assert main(["--world-size", "2", "--job.dump_folder", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err


def test_muon_options_with_adamw_warn():
    from trainer.config import load_config

    warnings = load_config(["--optimizer.muon_momentum", "0.9", "--optimizer.qk_clip_every", "4"]).warnings()
    assert warnings == [
        "optimizer.muon_momentum = 0.9 is ignored: optimizer.name is AdamW.",
        "optimizer.qk_clip_every = 4 is ignored: optimizer.qk_clip is false.",
    ]
    assert load_config(["--optimizer.name", "muon", "--optimizer.muon_momentum", "0.9"]).warnings() == []
