"""QK-clip (MuonClip) on MLA: the per-head rescaling against a from-scratch reference, the shared
rotary key untouched, a clipped head's max logit falling to the threshold, and the recording in
compiled blocks (one graph for clip and non-clip steps)."""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from models.common.attention import MLA
from models.common.rope import apply_rotary_emb, precompute_freqs_cis
from models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs
from trainer.loss import cross_entropy_sum
from trainer.optim.qk_clip import QKClip, rescale_heads
from trainer.parallel.compile import apply_compile

pytestmark = pytest.mark.numerics  # docs/numerics.md

NOPE, ROPE, V, HEADS = 8, 4, 6, 3


def _mla(q_lora_rank: int) -> MLA:
    torch.manual_seed(0)
    attn = MLA(dim=32, n_heads=HEADS, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=NOPE,
               qk_rope_head_dim=ROPE, v_head_dim=V, softmax_scale=(NOPE + ROPE) ** -0.5)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.5 if p.ndim == 2 else 1.0)
    return attn


def _forward(attn: MLA, x: torch.Tensor) -> None:
    freqs = precompute_freqs_cis(ROPE, x.shape[1], 10000.0)
    attn(x, freqs, None)


@pytest.mark.parametrize("q_lora_rank", [0, 12])
def test_rescale_heads_matches_reference(q_lora_rank):
    attn = _mla(q_lora_rank)
    before = {n: p.detach().clone() for n, p in attn.named_parameters()}
    gamma = torch.tensor([0.25, 1.0, 0.64])
    rescale_heads(attn, gamma)
    q_name = "wq.weight" if q_lora_rank == 0 else "wq_b.weight"
    q_ref = before[q_name].view(HEADS, NOPE + ROPE, -1).clone()
    k_ref = before["wkv_b.weight"].view(HEADS, NOPE + V, -1).clone()
    for h in range(HEADS):
        q_ref[h, :NOPE] *= gamma[h].sqrt()  # query nope part
        q_ref[h, NOPE:] *= gamma[h]  # rotary query part takes the whole factor
        k_ref[h, :NOPE] *= gamma[h].sqrt()  # key nope part; the value rows stay
    after = dict(attn.named_parameters())
    torch.testing.assert_close(after[q_name].detach(), q_ref.view_as(before[q_name]), rtol=1e-6, atol=0)
    torch.testing.assert_close(after["wkv_b.weight"].detach(), k_ref.view_as(before["wkv_b.weight"]), rtol=1e-6, atol=0)
    for name in before.keys() - {q_name, "wkv_b.weight"}:  # wkv_a / wqkv_a hold the shared rotary key
        assert torch.equal(after[name], before[name]), name


@pytest.mark.parametrize("q_lora_rank", [0, 12])
def test_clipped_heads_max_logit_falls_to_threshold(q_lora_rank):
    attn = _mla(q_lora_rank)
    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(1))
    clip = QKClip(attn, threshold=1.0, every=1)  # the module itself is the "model"
    clip.before_forward(1)
    _forward(attn, x)
    assert attn.max_logit.shape == (HEADS,)
    before = attn.max_logit.clone()
    ordered = before.sort().values
    clip.threshold = float(ordered[1] + ordered[2]) / 2  # clips the largest head only
    clip.after_optimizer(stepped=True)
    stats = clip.metrics()
    assert stats["max_logit"] == pytest.approx(float(before.max()))
    assert stats["qk_clipped_heads"] == 1
    clip.before_forward(2)
    _forward(attn, x)
    after = attn.max_logit
    expected = before.clamp(max=clip.threshold)
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-6)


def test_only_heads_above_the_threshold_are_clipped():
    """A head whose logits are all negative, or that no forward reached (-inf), keeps its weights
    (`threshold / max` would be a negative or zero gamma)."""
    attn = _mla(0)
    before = attn.wq.weight.detach().clone().view(HEADS, NOPE + ROPE, -1)
    clip = QKClip(attn, threshold=1.0, every=1)
    clip.before_forward(1)
    attn.max_logit.copy_(torch.tensor([-2.0, float("-inf"), 4.0]))
    clip.after_optimizer(stepped=True)
    assert clip.metrics()["qk_clipped_heads"] == 1
    after = attn.wq.weight.detach().view(HEADS, NOPE + ROPE, -1)
    assert torch.equal(after[:2], before[:2])
    torch.testing.assert_close(after[2, :NOPE], before[2, :NOPE] * 0.5, rtol=1e-6, atol=0)


def test_recorded_max_logit_matches_reference():
    attn = _mla(0)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(2))
    QKClip(attn, threshold=1.0, every=1).before_forward(1)
    _forward(attn, x)
    freqs = precompute_freqs_cis(ROPE, 7, 10000.0)
    q = attn.wq(x).view(2, 7, HEADS, NOPE + ROPE)
    kv, k_pe = attn.wkv_a(x).split([16, ROPE], dim=-1)
    k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs)
    k_nope = attn.wkv_b(attn.kv_norm(kv)).view(2, 7, HEADS, NOPE + V)[..., :NOPE]
    q_pe = apply_rotary_emb(q[..., NOPE:], freqs)
    logits = (torch.einsum("bshd,bthd->bhst", q[..., :NOPE], k_nope)
              + torch.einsum("bshd,btd->bhst", q_pe, k_pe[:, :, 0])) * attn.softmax_scale
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    ref = logits.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(attn.max_logit, ref.detach(), rtol=1e-5, atol=1e-5)


def _small_model() -> DeepSeekV3Model:
    """One dense block (one compiled graph; an MoE block would triple the tracing time), no MTP;
    the same weights each call."""
    args = dataclasses.replace(DeepSeekV3ModelArgs(), n_layers=1, mtp_depth=0, max_seq_len=16)
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    model.init_weights()
    return model


def _clipped_steps(model: DeepSeekV3Model, steps: int, armed_from: int | None = None) -> list[dict]:
    """SGD steps with QK-clip every second step (a threshold that clips); from step `armed_from`
    on a recompile raises. Returns each step's loss, QK-clip metrics and the graph count."""
    clip = QKClip(model, threshold=0.05, every=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = []
    for step in range(1, steps + 1):
        tokens = torch.randint(2, 8192, (2, 17), generator=torch.Generator().manual_seed(step))
        armed = armed_from is not None and step >= armed_from
        with torch._dynamo.config.patch(error_on_recompile=armed):
            clip.before_forward(step)
            out = model(tokens[:, :-1], labels=tokens[:, 1:])
            loss = cross_entropy_sum(out.logits, tokens[:, 1:]) / tokens[:, 1:].numel()
            (loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        clip.after_optimizer(stepped=True)
        records.append({"loss": loss.item(), **clip.metrics(), "graphs": counters["stats"]["unique_graphs"]})
    return records


def test_compiled_recording_adds_no_graph_and_no_recompile():
    """Compiled blocks record the max logits through a `torch.cond` on the flag tensor: clip and
    non-clip steps run the one graph traced at step 1, with recompiles
    armed from step 2, the first clip step, and give the eager run's max logits, clips and losses.
    Dynamo's "eager" backend: guards, recompiles and graph breaks are dynamo's (a third of
    aot_eager's time); inductor runs it in tests/e2e/test_muon_train.py."""
    eager = _clipped_steps(_small_model(), 4)
    torch._dynamo.reset()
    counters.clear()
    model = _small_model()
    assert apply_compile(model, backend="eager") == 1
    compiled = _clipped_steps(model, 4, armed_from=2)
    assert [r["graphs"] for r in compiled] == [1] * 4  # fullgraph=True: a graph break would have raised
    assert "qk_clipped_heads" not in eager[0] and eager[1]["qk_clipped_heads"] > 0 and eager[3]["qk_clipped_heads"] > 0
    for step, (got, want) in enumerate(zip(compiled, eager), start=1):
        assert got.keys() == want.keys(), step
        for key in want.keys() - {"graphs"}:
            assert got[key] == pytest.approx(want[key], rel=1e-5), (step, key)
