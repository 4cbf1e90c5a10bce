"""HF safetensors interop: FP8 block dequantisation, DCP <-> HF conversion round trip, and logits of
an imported (sharded, and FP8-quantised) HF checkpoint against `transformers`."""

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import trainer.progress  # noqa: E402
from models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs, get_flavor  # noqa: E402
from models.deepseek_v3.hf_io import (  # noqa: E402
    CONFIG_FILE,
    INDEX_FILE,
    args_from_hf_config,
    dequantize_fp8_block,
    read_hf_config,
    read_hf_state_dict,
    rope_mismatches,
)
from models.deepseek_v3.state_dict_adapter import to_hf_config  # noqa: E402
from models.moe import MoEArgs  # noqa: E402
from tests.helpers import Touches, tamper_metadata  # noqa: E402
from trainer.checkpoint import load_hf_weights, read_model_state_dict, save_model_checkpoint  # noqa: E402

pytestmark = pytest.mark.numerics  # docs/numerics.md

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("convert_hf", REPO / "scripts" / "convert_hf.py")
convert_hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert_hf)

VOCAB = 160
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def tiny_args(mtp_depth: int = 0) -> DeepSeekV3ModelArgs:
    return DeepSeekV3ModelArgs(
        vocab_size=VOCAB, dim=64, inter_dim=96, moe_inter_dim=32, n_layers=3, n_dense_layers=1, n_heads=4,
        moe=MoEArgs(
            num_experts=8, num_shared_experts=1, top_k=3, score_func="sigmoid", route_norm=True,
            route_scale=2.5, num_expert_groups=4, num_limited_groups=2, load_balance_coeff=1e-3,
        ),
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        max_seq_len=64, original_seq_len=64, mtp_depth=mtp_depth, eos_id=1,
    )


def quantize_fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's scheme written out block by block: scale = amax / 448 per block."""
    rows, cols = w.shape
    scale = torch.empty(math.ceil(rows / block), math.ceil(cols / block))
    q = torch.empty(rows, cols, dtype=FP8)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = blk.abs().max().clamp_min(1e-12) / FP8_MAX
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / scale[i, j]).to(FP8)
    return q, scale


def reference_dequant(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            sl = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
            out[sl] = q[sl].float() * scale[i, j]
    return out


def test_fp8_block_dequant_ragged_edges(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(300, 200) * torch.logspace(-2, 1, 200)  # column blocks of very different ranges
    q, scale = quantize_fp8_block(w)
    assert scale.shape == (3, 2)
    safetensors_torch.save_file(
        {"layer.weight": q, "layer.weight_scale_inv": scale, "norm.weight": torch.ones(200, dtype=torch.bfloat16)},
        str(tmp_path / "model.safetensors"),
    )
    sd = read_hf_state_dict(tmp_path)
    assert set(sd) == {"layer.weight", "norm.weight"}
    assert sd["layer.weight"].dtype == torch.float32 and sd["norm.weight"].dtype == torch.bfloat16
    assert torch.equal(sd["layer.weight"], reference_dequant(q, scale))
    # Within e4m3 error: 3 mantissa bits (relative 2^-4) above the block's subnormal floor.
    floor = scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200] * 2.0**-9
    assert ((sd["layer.weight"] - w).abs() <= w.abs() * 2.0**-4 + floor).all()
    with pytest.raises(ValueError, match="does not fit"):
        dequantize_fp8_block(q, scale[:, :1])
    safetensors_torch.save_file({"layer.weight": q}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no layer.weight_scale_inv"):
        read_hf_state_dict(tmp_path)


def _model_with_routing_bias(args: DeepSeekV3ModelArgs, seed: int, bias_std: float) -> DeepSeekV3Model:
    """A random model whose MoE layers have a non-zero `expert_bias` (zero after init)."""
    torch.manual_seed(seed)
    model = DeepSeekV3Model(args)
    model.init_weights()
    with torch.no_grad():
        for layer in model.layers.values():
            if layer.moe_enabled:
                layer.ffn.expert_bias.normal_(0.0, bias_std)
    return model


def test_dcp_hf_round_trip_is_identity(tmp_path, capsys):
    args = tiny_args(mtp_depth=1)
    model = _model_with_routing_bias(args, seed=1, bias_std=0.1)
    native = model.state_dict()
    save_model_checkpoint(native, tmp_path / "dcp", args)

    files = convert_hf.export_hf(tmp_path / "dcp", tmp_path / "hf", max_shard_gb=64 * 1024 / 1024**3)
    assert len(files) > 1
    index = json.loads((tmp_path / "hf" / INDEX_FILE).read_text())
    assert {f.name for f in files} == set(index["weight_map"].values())
    assert read_hf_config(tmp_path / "hf") == json.loads(json.dumps(to_hf_config(args)))

    back = read_model_state_dict(convert_hf.import_hf(tmp_path / "hf", tmp_path / "dcp2"))
    assert back.keys() == native.keys()
    for key, tensor in native.items():
        assert torch.equal(back[key], tensor), key
    # `export --ema` of a checkpoint without a parameter EMA: one line (tests/unit/test_checkpoint.py exports one).
    assert convert_hf.main(["export", str(tmp_path / "dcp"), str(tmp_path / "hf_ema"), "--ema"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the progress lines (not a tty), then the error
    assert err[-1].startswith("error: ") and err[-1].endswith("holds no parameter EMA (it was saved without --ema.enable)")
    assert all(line.startswith("convert_hf: ") for line in err[:-1]), err


def test_convert_hf_reports_its_shards_on_stderr_and_leaves_stdout_alone(tmp_path, capsys, monkeypatch):
    """Off a terminal (pytest's stderr) trainer/progress.py's plain lines: one per shard with
    PLAIN_EVERY_S 0, only the final one otherwise; stdout is the one result line either way."""
    args = tiny_args()
    save_model_checkpoint(DeepSeekV3Model(args).state_dict(), tmp_path / "dcp", args)
    runs = {}
    for name, every in (("quiet", float("inf")), ("chatty", 0.0)):
        monkeypatch.setattr(trainer.progress, "PLAIN_EVERY_S", every)
        hf, back = tmp_path / f"hf_{name}", tmp_path / f"dcp_{name}"
        shard_gb = str(64 * 1024 / 1024**3)
        assert convert_hf.main(["export", str(tmp_path / "dcp"), str(hf), "--max-shard-gb", shard_gb]) == 0
        assert convert_hf.main(["import", str(hf), str(back)]) == 0
        runs[name] = capsys.readouterr()
    quiet, chatty = runs["quiet"], runs["chatty"]
    assert quiet.out.replace("quiet", "chatty") == chatty.out and "shards" not in chatty.out
    shards = len(list((tmp_path / "hf_chatty").glob("*.safetensors")))
    tensors = len(json.loads((tmp_path / "hf_chatty" / INDEX_FILE).read_text())["weight_map"])
    assert shards > 1
    for what in ("written", "read"):
        lines = [line for line in chatty.err.splitlines() if line.startswith(f"convert_hf: shards {what}: ")]
        assert len(lines) == shards + 1, chatty.err
        assert lines[0].startswith(f"convert_hf: shards {what}: 1/{shards} ") and "s left" in lines[0]
        assert lines[-1].startswith(f"convert_hf: shards {what}: {shards}/{shards} (100%), tensors {tensors}, done in")
    assert [line.split(":")[1] for line in quiet.err.splitlines()] == [" shards written", " shards read"]


def test_pickled_weights_are_never_loaded(tmp_path, capsys):
    """A `pytorch_model.bin` (a pickle) is refused by name, not unpickled; `export` of a checkpoint
    whose `.metadata` would run code stops with exit 2 and one line naming the file."""
    args = tiny_args()
    sentinel = tmp_path / "ran"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / CONFIG_FILE).write_text(json.dumps(to_hf_config(args)))
    torch.save(Touches(sentinel, {}), hf / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"holds pickled PyTorch weights \(pytorch_model\.bin\), which are not read"):
        load_hf_weights(hf, DeepSeekV3Model(args), args)
    assert convert_hf.main(["import", str(hf), str(tmp_path / "dcp")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "pytorch_model.bin" in err and "convert them to safetensors" in err

    dcp = save_model_checkpoint(DeepSeekV3Model(args).state_dict(), tmp_path / "ours", args)
    tamper_metadata(dcp, sentinel)
    assert convert_hf.main(["export", str(dcp), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: {dcp / '.metadata'} holds a pickle naming the global ")
    assert not sentinel.exists() and not (tmp_path / "out").exists()


def random_hf_model(args: DeepSeekV3ModelArgs):
    config = transformers.DeepseekV3Config(**to_hf_config(args))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param)) if "norm" in name else param.normal_(0.0, 0.1)
        for layer in model.model.layers[args.n_dense_layers:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(args.moe.num_experts))
    return model


def our_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    args = args_from_hf_config(read_hf_config(folder))
    model = DeepSeekV3Model(args)
    model.init_weights()
    load_hf_weights(folder, model, args)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def test_imported_logits_match_transformers(tmp_path):
    hf_model = random_hf_model(tiny_args())
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / INDEX_FILE).is_file()
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf_model(tokens).logits
    ours = our_logits(tmp_path / "hf", tokens)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-4

    # The same weights FP8-quantised (every projection matrix, as DeepSeek ships them): our import
    # dequantises; transformers gets the reference dequantisation of the same file.
    hf_sd = read_hf_state_dict(tmp_path / "hf")
    fp8_sd, dequant_sd = {}, {}
    for key, w in hf_sd.items():
        if w.ndim == 2 and "proj" in key:
            q, scale = quantize_fp8_block(w.float())
            fp8_sd[key], fp8_sd[key + "_scale_inv"] = q, scale
            dequant_sd[key] = reference_dequant(q, scale)
        else:
            fp8_sd[key] = dequant_sd[key] = w
    for name, sd in (("fp8", fp8_sd), ("dequant", dequant_sd)):
        (tmp_path / name).mkdir()
        safetensors_torch.save_file(sd, str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
        (tmp_path / name / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    ref_model = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "dequant", attn_implementation="eager")
    with torch.no_grad():
        ref8 = ref_model.eval()(tokens).logits
    ours8 = our_logits(tmp_path / "fp8", tokens)
    assert ((ours8 - ref8).abs().max() / ref8.abs().max()).item() <= 1e-4
    assert not torch.equal(ours8, ours)  # quantisation did change the weights


# DeepSeek-V3's released config.json (huggingface.co/deepseek-ai/DeepSeek-V3), shapes shrunk where
# they do not enter the rope settings (we only build args from it, never a model).
DEEPSEEK_V3_CONFIG = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "first_k_dense_replace": 3, "num_attention_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "num_nextn_predict_layers": 1,
    "max_position_embeddings": 163840, "rope_theta": 10000, "rms_norm_eps": 1e-6, "eos_token_id": 1,
    "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
}


@pytest.mark.parametrize("max_seq_len", [128, 4096, 8192])
def test_rope_scaling_is_the_configs_at_any_seq_len(max_seq_len):
    args = args_from_hf_config(DEEPSEEK_V3_CONFIG, max_seq_len=max_seq_len)
    assert args.yarn_enabled and args.softmax_scale == pytest.approx(0.13523, abs=5e-6)
    assert args.rope_attention_factor == 1.0
    out = to_hf_config(args)
    assert out["max_position_embeddings"] == 163840
    assert out["rope_scaling"] == {**DEEPSEEK_V3_CONFIG["rope_scaling"], "rope_type": "yarn"}
    assert args_from_hf_config(out, max_seq_len=max_seq_len) == args


def test_flavor_carries_the_release_rope_settings(tmp_path, caplog):
    assert rope_mismatches(get_flavor("671B"), DEEPSEEK_V3_CONFIG) == []
    assert args_from_hf_config(DEEPSEEK_V3_CONFIG).max_position_embeddings == get_flavor("671B").max_position_embeddings
    disabled = dataclasses.replace(get_flavor("671B"), rope_type="default")
    assert rope_mismatches(disabled, DEEPSEEK_V3_CONFIG) == ["rope_type: 'default' vs 'yarn'"]
    # initial_load_format = "hf" builds the model from the flavor: a differing config.json is logged.
    args = tiny_args()
    hf_model = random_hf_model(dataclasses.replace(args, rope_type="yarn", rope_factor=4.0, original_seq_len=32))
    hf_model.save_pretrained(tmp_path)
    model = DeepSeekV3Model(args)
    model.init_weights()
    with caplog.at_level("WARNING"):
        load_hf_weights(tmp_path, model, args)
    assert "rope_type: 'default' vs 'yarn'" in caplog.text and "rope_factor" not in caplog.text


def test_rope_scaling_absent_keys_and_unsupported_types():
    no_mscale = {k: v for k, v in DEEPSEEK_V3_CONFIG["rope_scaling"].items() if not k.startswith("mscale")}
    args = args_from_hf_config({**DEEPSEEK_V3_CONFIG, "rope_scaling": no_mscale}, max_seq_len=64)
    # transformers: no mscale_all_dim -> plain softmax scale; no mscale -> cos/sin times mscale(40, 1).
    assert args.softmax_scale == pytest.approx(192**-0.5)
    assert args.rope_attention_factor == pytest.approx(0.1 * math.log(40) + 1)
    assert to_hf_config(args)["rope_scaling"] == {**no_mscale, "rope_type": "yarn"}
    plain = args_from_hf_config({**DEEPSEEK_V3_CONFIG, "rope_scaling": None}, max_seq_len=64)
    assert not plain.yarn_enabled and to_hf_config(plain)["rope_scaling"] is None
    for bad, match in (({"type": "linear", "factor": 2.0}, "'linear' is not supported"),
                       ({**no_mscale, "attention_factor": 1.0}, "attention_factor"),
                       ({"type": "yarn", "factor": 4.0}, "original_max_position_embeddings")):
        with pytest.raises(ValueError, match=match):
            args_from_hf_config({**DEEPSEEK_V3_CONFIG, "rope_scaling": bad})


def test_bf16_export_and_import_keep_router_bias_fp32(tmp_path):
    args = tiny_args(mtp_depth=1)
    model = _model_with_routing_bias(args, seed=2, bias_std=1e-3)
    save_model_checkpoint(model.state_dict(), tmp_path / "dcp", args)
    convert_hf.export_hf(tmp_path / "dcp", tmp_path / "hf", dtype="bfloat16")
    hf_sd = read_hf_state_dict(tmp_path / "hf")
    bias_keys = [k for k in hf_sd if k.endswith("e_score_correction_bias")]
    assert bias_keys and f"model.layers.{args.n_layers}.mlp.gate.e_score_correction_bias" in bias_keys
    for key, tensor in hf_sd.items():
        assert tensor.dtype == (torch.float32 if key in bias_keys else torch.bfloat16), key
    # Bit-exact fp32 values, not bf16 ones converted back.
    assert torch.equal(hf_sd["model.layers.1.mlp.gate.e_score_correction_bias"], model.layers["1"].ffn.expert_bias)
    back = read_model_state_dict(convert_hf.import_hf(tmp_path / "hf", tmp_path / "dcp2", dtype="bfloat16"))
    assert back["layers.1.ffn.expert_bias"].dtype == torch.float32
    assert back["layers.1.attn.wqkv_a.weight"].dtype == torch.bfloat16


def test_transformers_loads_export_without_unexpected_keys(tmp_path):
    """MTP is exported as DeepSeek names it, `model.layers.{n_layers}.*`; transformers skips it
    knowingly (`_keys_to_ignore_on_load_unexpected`, DeepSeek-V3's layer 61), so a model of V3's
    depth loads with no unexpected and no missing key. (Any other depth: the MTP keys are reported
    as unexpected, which is harmless; see docs/checkpoints.md.)"""
    args = DeepSeekV3ModelArgs(
        vocab_size=VOCAB, dim=16, inter_dim=16, moe_inter_dim=8, n_layers=61, n_dense_layers=60, n_heads=1,
        moe=MoEArgs(num_experts=4, num_shared_experts=1, top_k=2, score_func="sigmoid", load_balance_coeff=1e-3),
        q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        max_seq_len=16, mtp_depth=1, eos_id=1,
    )
    torch.manual_seed(3)
    model = DeepSeekV3Model(args)
    model.init_weights()
    save_model_checkpoint(model.state_dict(), tmp_path / "dcp", args)
    convert_hf.export_hf(tmp_path / "dcp", tmp_path / "hf")
    assert any(k.startswith("model.layers.61.") for k in read_hf_state_dict(tmp_path / "hf"))
    _, info = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"] and not info["mismatched_keys"]


@pytest.mark.parametrize("seq_len", [128, 4096, 8192])
def test_trainer_keeps_the_flavors_yarn_at_any_seq_len_unless_disabled(seq_len):
    from trainer.config import load_config
    from trainer.model_args import build_model_args

    argv = ["--model.flavor", "671B", "--training.seq_len", str(seq_len)]
    args = build_model_args(load_config(argv), 129280, 1)
    assert args.max_seq_len == seq_len and args.yarn_enabled
    assert args.softmax_scale == pytest.approx(0.13523, abs=5e-6)
    off = build_model_args(load_config([*argv, "--model.disable_yarn"]), 129280, 1)
    assert not off.yarn_enabled and off.softmax_scale == pytest.approx(192**-0.5)
    assert "YaRN factor 40 over 4096" in args.describe_positions() and "plain RoPE" in off.describe_positions()
