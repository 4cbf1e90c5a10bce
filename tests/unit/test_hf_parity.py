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

from models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs, DeepSeekV3StateDictAdapter, get_flavor  # noqa: E402
from models.deepseek_v3.state_dict_adapter import to_hf_config  # noqa: E402
from models.moe import MoEArgs  # noqa: E402

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
    [(False, {}), (True, {}), (True, {"q_lora_rank": 0, "tie_embeddings": True})],
    ids=["plain_rope", "yarn", "yarn_q_proj_tied"],
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
