"""DeepSeek-V3 model: parameter counts, masks, MTP, meta-device build, flavors."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from models.common.attention import build_attention_mask, document_ids
from models.deepseek_v3 import (
    DeepSeekV3Model,
    DeepSeekV3ModelArgs,
    count_params,
    flavor_names,
    flops_per_token,
    get_flavor,
    mtp_loss,
)
from models.deepseek_v3.mtp import mtp_input_ids

pytestmark = pytest.mark.numerics  # docs/numerics.md

EOS = 1


def small_args(**overrides) -> DeepSeekV3ModelArgs:
    """The debug model, shrunk further for fast CPU tests (3 layers, 1 dense)."""
    base = get_flavor("debugmodel")
    fields = dict(vocab_size=256, dim=64, inter_dim=128, moe_inter_dim=64, n_layers=3, eos_id=EOS, max_seq_len=128)
    fields.update(overrides)
    return dataclasses.replace(base, **fields)


def build(args: DeepSeekV3ModelArgs, seed: int = 0) -> DeepSeekV3Model:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


# ---- parameter counts (meta device, no memory) -------------------------------------------------


@pytest.mark.parametrize(
    "flavor, total, total_tol, active, active_tol",
    [
        # DeepSeek's published figures (V3, V2, V2-Lite): active excludes the input embedding.
        ("671B", 671e9, 0.01, 37e9, 0.03),
        ("236B", 236e9, 0.02, 21e9, 0.03),
        ("16B", 15.7e9, 0.03, 2.4e9, 0.03),
    ],
)
def test_param_counts(flavor, total, total_tol, active, active_tol):
    args = get_flavor(flavor)
    n_total, n_active = count_params(args)
    print(f"{flavor}: total {n_total / 1e9:.2f}B active {n_active / 1e9:.2f}B")
    assert n_total == pytest.approx(total, rel=total_tol)
    assert n_active == pytest.approx(active, rel=active_tol)
    # The output head counts as active, the input embedding does not; tied, it is the head.
    _, tied_active = count_params(dataclasses.replace(args, tie_embeddings=True))
    assert tied_active == n_active


def test_mtp_counted_only_on_request_and_flops_convention():
    args = get_flavor("671B")
    total, active = count_params(args)
    total_mtp, active_mtp = count_params(args, include_mtp=True)
    # One V3 MTP module is ~11.5B (the HF release's 14B also stores copies of embedding and head).
    assert 10e9 < total_mtp - total < 13e9 and active_mtp > active
    seq = 4096
    no_mtp = flops_per_token(args, seq, include_mtp=False)
    attention = 6 * args.n_layers * args.n_heads * (args.qk_head_dim + args.v_head_dim) * seq
    # MFU's FLOPs: 6 x active params (which leave out the embedding lookup) + attention.
    assert no_mtp == pytest.approx(6 * active + attention, rel=1e-6)
    assert flops_per_token(args, seq) > no_mtp


# ---- flavors and args ---------------------------------------------------------------------------


def test_flavors_are_fresh_and_valid():
    assert set(flavor_names()) >= {"debugmodel", "16B", "236B", "671B", "proxy_1b"}
    first = get_flavor("671B")
    first.moe.top_k = 1
    first.n_layers = 1
    again = get_flavor("671B")
    assert again.moe.top_k == 8 and again.n_layers == 61
    # The torch-free table spells out the debug model, which is also the dataclass defaults.
    assert get_flavor("debugmodel") == DeepSeekV3ModelArgs()
    # The debug model with DeepSeek-V3's embedding (129,280 rows, EOS 1) and nothing else changed.
    assert get_flavor("debugmodel_v3vocab") == DeepSeekV3ModelArgs(vocab_size=129280, eos_id=1)
    # The debug model with two more blocks (DualPipeV at pp 4) and nothing else changed.
    assert get_flavor("debugmodel_8blocks") == DeepSeekV3ModelArgs(n_layers=8)
    proxy_total, _ = count_params(get_flavor("proxy_1b"))
    assert 0.8e9 < proxy_total < 1.3e9


def test_unknown_flavor_names_nearest():
    with pytest.raises(ValueError, match="'671B'"):
        get_flavor("617B")


def test_args_validation_messages():
    with pytest.raises(ValueError, match="n_dense_layers"):
        DeepSeekV3ModelArgs(n_layers=2, n_dense_layers=3)
    with pytest.raises(ValueError, match="attn_mask_type"):
        DeepSeekV3ModelArgs(attn_mask_type="sliding")
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        DeepSeekV3ModelArgs(qk_rope_head_dim=15)
    args = DeepSeekV3ModelArgs(moe={"num_experts": 4, "top_k": 2})
    assert args.moe.num_experts == 4


# ---- build and init -----------------------------------------------------------------------------


def test_meta_build_and_init_weights():
    args = small_args(rope_type="yarn", max_seq_len=256, original_seq_len=4096)  # YaRN on at any table length
    model = build(args)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert not tensor.is_meta, name
        assert torch.isfinite(tensor).all(), name
    assert model.freqs_cis.shape == (args.max_seq_len, args.qk_rope_head_dim)
    assert list(model.layers) == [str(i) for i in range(args.n_layers)]
    assert not model.layers["0"].moe_enabled and model.layers["1"].moe_enabled
    # freqs_cis is derived state: not in the checkpoint.
    assert "freqs_cis" not in model.state_dict()
    assert args.softmax_scale > args.qk_head_dim**-0.5


def test_tied_embeddings_survive_to_empty():
    model = build(small_args(tie_embeddings=True, mtp_depth=0))
    assert model.head.weight is model.embed.weight


# ---- masks --------------------------------------------------------------------------------------


def test_document_ids_eos_belongs_to_its_document():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 0, 1, 1, 2, 3]]


def test_causality():
    model = build(small_args()).eval()
    tokens = torch.randint(2, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    t = 20
    changed[:, t] = (changed[:, t] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens).logits, model(changed).logits
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_block_causal_without_eos_equals_causal():
    causal = build(small_args()).eval()
    block = build(small_args(attn_mask_type="block_causal")).eval()
    tokens = torch.randint(2, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(causal(tokens).logits, block(tokens).logits, rtol=1e-5, atol=1e-5)


def test_block_causal_isolates_documents():
    model = build(small_args(attn_mask_type="block_causal")).eval()
    gen = torch.Generator().manual_seed(2)
    doc1, doc2 = torch.randint(2, 256, (1, 10), generator=gen), torch.randint(2, 256, (1, 14), generator=gen)
    eos = torch.tensor([[EOS]])
    packed = torch.cat([doc1, eos, doc2], dim=1)
    other = torch.cat([torch.randint(2, 256, (1, 10), generator=gen), eos, doc2], dim=1)
    n1 = doc1.shape[1] + 1  # the EOS belongs to document 1
    with torch.no_grad():
        logits, other_logits = model(packed).logits, model(other).logits
        alone = model(packed[:, :n1]).logits
    # Document 2 (same positions) does not see what document 1 contains.
    torch.testing.assert_close(logits[:, n1:], other_logits[:, n1:], rtol=1e-5, atol=1e-5)
    # Document 1, EOS included, is unaffected by what follows it.
    torch.testing.assert_close(logits[:, :n1], alone, rtol=1e-5, atol=1e-5)
    assert build_attention_mask(packed, "block_causal", EOS, "sdpa").shape == (1, 1, 25, 25)


def test_flex_backend_fails_clearly_on_cpu():
    tokens = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        build_attention_mask(tokens, "causal", EOS, "flex")


# ---- multi-token prediction ---------------------------------------------------------------------


def test_mtp_input_alignment():
    labels = torch.tensor([[10, 11, -100, 13]])
    assert mtp_input_ids(labels, 0).tolist() == [[10, 11, 0, 13]]
    assert mtp_input_ids(labels, 1).tolist() == [[11, 0, 13, 0]]


def test_mtp_loss_grads_and_eval():
    args = small_args(mtp_depth=2)
    model = build(args)
    tokens = torch.randint(2, 256, (2, 17), generator=torch.Generator().manual_seed(3))
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, 5] = -100
    out = model(inputs, labels)
    assert len(out.mtp_logits) == 2 and out.mtp_logits[1].shape == out.logits.shape
    loss_sum, n_valid = mtp_loss(out.mtp_logits, labels)
    # depth k scores S - k - 1 targets per row; one label is ignored (it is a target of both depths).
    assert n_valid.item() == 2 * (15 + 14) - 2
    assert torch.isfinite(loss_sum) and loss_sum.dtype == torch.float32
    expected0 = F.cross_entropy(out.mtp_logits[0][:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
    expected1 = F.cross_entropy(out.mtp_logits[1][:, :-2].flatten(0, 1), labels[:, 2:].flatten(), reduction="sum")
    torch.testing.assert_close(loss_sum, expected0 + expected1)
    (loss_sum / n_valid + out.aux_loss).backward()
    for name, param in model.mtp.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert model.mtp[0].eh_proj.weight.grad.abs().sum() > 0
    assert model.embed.weight.grad is not None

    model.eval()
    with torch.no_grad():
        assert model(inputs, labels).mtp_logits == []
    model.train()
    assert model(inputs).mtp_logits == []


def test_aux_loss_sums_moe_layers():
    moe = dataclasses.replace(get_flavor("debugmodel").moe, seq_aux_loss_alpha=0.01)
    model = build(small_args(moe=moe, mtp_depth=0))
    out = model(torch.randint(2, 256, (2, 16)))
    assert out.aux_loss.dim() == 0 and out.aux_loss.dtype == torch.float32
    assert out.aux_loss.item() > 0 and out.aux_loss.requires_grad
