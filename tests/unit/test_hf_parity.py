"""Logit parity with HF `transformers` DeepseekV3ForCausalLM, and state-dict adapter round trips.

The HF model is built from `to_hf_config(args)` (so the config mapping is tested too), given
random weights (norms around 1, a non-zero `e_score_correction_bias`), saved with
`save_pretrained`, and the safetensors file is converted with our adapter.
"""

import dataclasses
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from models.common.rope import precompute_freqs_cis  # noqa: E402
from models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs, DeepSeekV3StateDictAdapter, get_flavor  # noqa: E402
from models.deepseek_v3.hf_io import args_from_hf_config, read_hf_config  # noqa: E402
from models.deepseek_v3.state_dict_adapter import to_hf_config  # noqa: E402
from models.moe import MoEArgs  # noqa: E402

pytestmark = pytest.mark.numerics  # docs/numerics.md

VOCAB = 160
N_EXPERTS = 8


def tiny_args(yarn: bool, mtp_depth: int = 0) -> DeepSeekV3ModelArgs:
    """Group-limited sigmoid routing (4 groups, 2 allowed), q bottleneck on, all MoE after layer 0."""
    return DeepSeekV3ModelArgs(
        vocab_size=VOCAB, dim=64, inter_dim=96, moe_inter_dim=32, n_layers=3, n_dense_layers=1, n_heads=4,
        moe=MoEArgs(
            num_experts=N_EXPERTS, num_shared_experts=1, top_k=3, score_func="sigmoid", route_norm=True,
            route_scale=2.5, num_expert_groups=4, num_limited_groups=2, load_balance_coeff=1e-3,
        ),
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        # YaRN is the model's (rope_type), whatever the rope table length max_seq_len: here the
        # table (64) is no longer than the original context, and YaRN is still on.
        rope_type="yarn" if yarn else "default", max_seq_len=64, max_position_embeddings=256,
        original_seq_len=64, rope_factor=4.0, mscale=0.8, mscale_all_dim=0.8,
        mtp_depth=mtp_depth, eos_id=1,
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def random_hf_model(args: DeepSeekV3ModelArgs):
    config = transformers.DeepseekV3Config(**to_hf_config(args))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
        for layer in model.model.layers[args.n_dense_layers:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(N_EXPERTS))
    return model


@pytest.mark.parametrize(
    "yarn, overrides",
    [
        (False, {}),
        (True, {}),
        (True, {"q_lora_rank": 0, "tie_embeddings": True}),
        # mscale != mscale_all_dim: transformers then scales cos/sin by their ratio as well.
        (True, {"mscale": 1.0, "mscale_all_dim": 0.5}),
        (True, {"mscale": 0.0, "mscale_all_dim": 0.0}),
    ],
    ids=["plain_rope", "yarn", "yarn_q_proj_tied", "yarn_mscale_ratio", "yarn_no_mscale"],
)
def test_logits_match_hf(tmp_path, yarn, overrides):
    args = dataclasses.replace(tiny_args(yarn), **overrides)
    hf_model = random_hf_model(args)
    if yarn:
        assert hf_model.config.rope_parameters["rope_type"] == "yarn"
        assert args.softmax_scale == pytest.approx(hf_model.model.layers[0].self_attn.scaling, rel=1e-12)
    hf_model.save_pretrained(tmp_path)
    hf_sd = safetensors_torch.load_file(os.path.join(tmp_path, "model.safetensors"))
    # transformers fuses experts in memory but writes the per-expert checkpoint names.
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in hf_sd

    model = DeepSeekV3Model(args)
    model.init_weights()
    model.load_state_dict(DeepSeekV3StateDictAdapter(args).from_hf(hf_sd), strict=True)
    model.eval()
    assert model.layers["1"].ffn.expert_bias.abs().sum() > 0

    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, ref = model(tokens).logits, hf_model(tokens).logits
    assert rel_err(ours, ref) <= 1e-4


# rope_scaling and context of DeepSeek-V3's released config.json (huggingface.co/deepseek-ai/DeepSeek-V3).
DEEPSEEK_V3_ROPE = {
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
}


def test_yarn_config_from_transformers_trains_shorter(tmp_path):
    """A transformers config with yarn whose context equals the original length, run at a shorter
    seq_len than both: YaRN (frequencies and softmax scale) stays on, and logits match."""
    args = tiny_args(yarn=False)
    config = dict(to_hf_config(args), max_position_embeddings=64, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 0.8,
    })
    hf_model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config))
    hf_model.config._attn_implementation = "eager"
    torch.manual_seed(5)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param)) if "norm" in name else param.normal_(0.0, 0.1)
        for layer in hf_model.model.layers[args.n_dense_layers:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(N_EXPERTS))
    hf_model.eval().save_pretrained(tmp_path)

    seq_len = 32
    ours_args = args_from_hf_config(read_hf_config(tmp_path), max_seq_len=seq_len)
    assert ours_args.yarn_enabled and ours_args.max_position_embeddings == ours_args.original_seq_len == 64
    hf_attn = hf_model.model.layers[0].self_attn
    assert ours_args.softmax_scale == pytest.approx(hf_attn.scaling, rel=1e-12)
    assert ours_args.softmax_scale > ours_args.qk_head_dim**-0.5
    hf_sd = safetensors_torch.load_file(os.path.join(tmp_path, "model.safetensors"))
    model = DeepSeekV3Model(ours_args)
    model.init_weights()
    model.load_state_dict(DeepSeekV3StateDictAdapter(ours_args).from_hf(hf_sd), strict=True)
    model.eval()
    tokens = torch.randint(0, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ours, ref = model(tokens).logits, hf_model(tokens).logits
    assert rel_err(ours, ref) <= 1e-4
    # The same weights without YaRN compute something else: the test can tell them apart.
    plain = DeepSeekV3Model(dataclasses.replace(ours_args, rope_type="default"))
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert rel_err(plain.eval()(tokens).logits, ref) > 1e-2


@pytest.mark.parametrize("seq_len", [128, 4096, 8192])
def test_deepseek_v3_softmax_scale_at_any_seq_len(seq_len):
    """DeepSeek-V3's released rope settings give transformers' softmax scale 0.13523 and its rope
    table, whatever the training seq_len; the 671B flavor carries the same settings."""
    # Tiny widths, DeepSeek-V3's head dims (qk_rope 64, qk_nope 128): only these enter the scale.
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=0, **DEEPSEEK_V3_ROPE,
    )
    hf_scale = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(config, 0).scaling
    assert hf_scale == pytest.approx(0.13523, abs=5e-6)
    flavor = dataclasses.replace(get_flavor("671B"), max_seq_len=seq_len)
    imported = args_from_hf_config(dict(config.to_dict(), **DEEPSEEK_V3_ROPE), max_seq_len=seq_len)
    for args in (flavor, imported):
        assert args.softmax_scale == pytest.approx(hf_scale, rel=1e-12)

    rotary = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(config)
    positions = torch.arange(seq_len)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    half = flavor.qk_rope_head_dim // 2  # transformers repeats the angles: cat(freqs, freqs)
    table = precompute_freqs_cis(
        flavor.qk_rope_head_dim, seq_len, flavor.rope_theta, flavor.rope_factor, flavor.original_seq_len,
        flavor.beta_fast, flavor.beta_slow, flavor.rope_attention_factor,
    )
    torch.testing.assert_close(table, torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1), rtol=0, atol=2e-5)


def test_block_causal_differs_from_hf_after_eos(tmp_path):
    """As documented next to `attn_mask_type`: `block_causal` equals HF inference up to the first
    EOS of a row and differs after it; `causal` equals it everywhere."""
    args = tiny_args(yarn=False)
    hf_model = random_hf_model(args)
    hf_model.save_pretrained(tmp_path)
    native = DeepSeekV3StateDictAdapter(args).from_hf(
        safetensors_torch.load_file(os.path.join(tmp_path, "model.safetensors"))
    )
    tokens = torch.randint(2, VOCAB, (2, 48), generator=torch.Generator().manual_seed(7))
    tokens[:, 20] = args.eos_id
    with torch.no_grad():
        ref = hf_model(tokens).logits
        for mask_type in ("causal", "block_causal"):
            model = DeepSeekV3Model(dataclasses.replace(args, attn_mask_type=mask_type))
            model.load_state_dict(native)
            ours = model.eval()(tokens).logits
            assert rel_err(ours[:, :21], ref[:, :21]) <= 1e-4
            assert (rel_err(ours[:, 21:], ref[:, 21:]) <= 1e-4) == (mask_type == "causal")


def test_to_hf_loads_into_transformers(tmp_path):
    """The other direction: our weights + config, written with to_hf, read by from_pretrained."""
    args = tiny_args(yarn=True)
    torch.manual_seed(2)
    model = DeepSeekV3Model(args)
    model.init_weights()
    with torch.no_grad():
        for layer in model.layers.values():
            if layer.moe_enabled:
                layer.ffn.expert_bias.normal_(0.0, 0.1)
    model.eval()
    adapter = DeepSeekV3StateDictAdapter(args)
    safetensors_torch.save_file(adapter.to_hf(model.state_dict()), os.path.join(tmp_path, "model.safetensors"))
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(to_hf_config(args), f)
    hf_model = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()

    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, ref = model(tokens).logits, hf_model(tokens).logits
    assert rel_err(ours, ref) <= 1e-4


def test_round_trip_is_identity():
    args = tiny_args(yarn=False, mtp_depth=1)
    torch.manual_seed(4)
    model = DeepSeekV3Model(args)
    model.init_weights()
    adapter = DeepSeekV3StateDictAdapter(args)
    native = model.state_dict()
    hf_sd = adapter.to_hf(native)
    mtp = f"model.layers.{args.n_layers}."
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "shared_head.head.weight", "embed_tokens.weight", "mlp.experts.7.down_proj.weight"):
        assert mtp + name in hf_sd
    back = adapter.from_hf(hf_sd)
    assert back.keys() == native.keys()
    for key, tensor in native.items():
        assert torch.equal(back[key], tensor), key


def test_from_hf_tolerates_missing_mtp_and_rejects_bad_keys():
    args = tiny_args(yarn=False, mtp_depth=1)
    model = DeepSeekV3Model(args)
    model.init_weights()
    adapter = DeepSeekV3StateDictAdapter(args)
    hf_sd = {k: v for k, v in adapter.to_hf(model.state_dict()).items() if f"layers.{args.n_layers}." not in k}
    native = adapter.from_hf(hf_sd)
    result = model.load_state_dict(native, strict=False)
    assert result.missing_keys and all(k.startswith("mtp.") for k in result.missing_keys)
    assert not result.unexpected_keys

    with pytest.raises(KeyError, match="model.layers.0.self_attn.bogus.weight"):
        adapter.from_hf({**hf_sd, "model.layers.0.self_attn.bogus.weight": torch.zeros(1)})
    incomplete = {k: v for k, v in hf_sd.items() if k != "model.layers.2.mlp.experts.5.up_proj.weight"}
    with pytest.raises(KeyError, match=r"layers\.2\.ffn\.experts\.w3"):
        adapter.from_hf(incomplete)
    no_norm = {k: v for k, v in hf_sd.items() if k != "model.norm.weight"}
    with pytest.raises(KeyError, match="norm.weight"):
        adapter.from_hf(no_norm)
    with pytest.raises(KeyError, match="not_ours"):
        adapter.to_hf({"not_ours": torch.zeros(1)})

    # A checkpoint with an MTP layer loads into a model without MTP; an extra ordinary layer does not.
    with_mtp = adapter.to_hf(model.state_dict())
    no_mtp_adapter = DeepSeekV3StateDictAdapter(dataclasses.replace(args, mtp_depth=0))
    assert not any(k.startswith("mtp.") for k in no_mtp_adapter.from_hf(with_mtp))
    shorter = DeepSeekV3StateDictAdapter(dataclasses.replace(args, n_layers=2, mtp_depth=0))
    with pytest.raises(KeyError, match=r"model\.layers\.2\."):
        shorter.from_hf(hf_sd)


def test_full_size_config_maps_to_hf():
    config = transformers.DeepseekV3Config(**to_hf_config(get_flavor("671B")))
    assert (config.n_routed_experts, config.n_group, config.topk_group) == (256, 8, 4)
    assert config.first_k_dense_replace == 3 and config.num_hidden_layers == 61
    with pytest.raises(ValueError, match="sigmoid"):
        to_hf_config(get_flavor("16B"))
