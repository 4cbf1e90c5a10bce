"""QK-clip (MuonClip) on MLA: the per-head rescaling against a from-scratch reference, the shared
rotary key untouched, and a clipped head's max logit falling to the threshold."""

import pytest
import torch

from models.common.attention import MLA
from models.common.rope import apply_rotary_emb, precompute_freqs_cis
from trainer.qk_clip import QKClip, rescale_heads

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


def test_recorded_max_logit_matches_reference():
    attn = _mla(0)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(2))
    attn.record_max_logit = True
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
