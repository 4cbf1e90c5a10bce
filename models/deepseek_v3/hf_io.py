"""Hugging Face / DeepSeek safetensors checkpoints on disk: sharded reading and writing, FP8
block dequantisation, and `config.json` -> `DeepSeekV3ModelArgs`.

This file is about *files*; `state_dict_adapter.py` is about *names*. Together:

    args = args_from_hf_config(read_hf_config(folder))
    native = DeepSeekV3StateDictAdapter(args).from_hf(read_hf_state_dict(folder))

It lives in `models/` (not `trainer/`) because it needs nothing but torch and safetensors, and a
user converting weights should not have to import the trainer.

DeepSeek's released V3/R1 weights are FP8 (e4m3) with one fp32 `weight_scale_inv` per 128x128
block of each quantised matrix; the true weight is `weight.float() * scale_inv[i // 128, j // 128]`
(DeepSeek's `inference/kernel.py::weight_dequant`). Edge blocks are ragged: a 300-row matrix has
3 row blocks, the last one 44 rows high.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from models.deepseek_v3.args import DeepSeekV3ModelArgs
from models.moe import MoEArgs

FP8_BLOCK = 128
SCALE_SUFFIX = "_scale_inv"  # `X.weight_scale_inv` is the block scale of `X.weight`
INDEX_FILE = "model.safetensors.index.json"
PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth")  # `pytorch_model*.bin` and other torch.save files: refused
CONFIG_FILE = "config.json"
# Tensors that stay fp32 whatever dtype the weights are cast to: the router's bias is added to
# sigmoid scores to pick the top-k experts, and bf16 would round it (DeepSeek's checkpoints and
# `transformers`' `_keep_in_fp32_modules_strict` keep it fp32).
FP32_SUFFIXES = ("e_score_correction_bias",)


class ShardProgress(Protocol):
    """What the readers and writers report their shard files to (trainer/progress.py's `Progress`,
    which scripts/convert_hf.py passes; models/ does not import the trainer): `update(1, tensors=n)`
    per shard, `close(tensors=n)` at the end, n the tensors so far."""

    def update(self, n: int = 1, **counts: int) -> None: ...

    def close(self, **counts: int) -> None: ...


_FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2") if hasattr(torch, name)
)


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`weight` [R, C] (fp8) times its per-block scale `scale_inv` [ceil(R/block), ceil(C/block)]."""
    if weight.ndim != 2:
        raise ValueError(f"FP8 block dequantisation expects a matrix, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    expected = (math.ceil(rows / block), math.ceil(cols / block))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not fit weight {tuple(weight.shape)} "
            f"with {block}x{block} blocks (expected {expected})"
        )
    # Expand each block scale over its block, then cut the ragged last row/column block.
    scale = scale_inv.float().repeat_interleave(block, dim=0)[:rows].repeat_interleave(block, dim=1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def list_safetensors_files(folder: str | Path) -> list[Path]:
    """The shard files of a checkpoint folder: those named by `model.safetensors.index.json`, else
    every `*.safetensors` file in it (a single-file checkpoint)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"HF checkpoint folder not found: {folder}")
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard files that do not exist: {', '.join(missing[:5])}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for pattern in PICKLED_WEIGHTS for p in folder.glob(pattern))
        if pickled:
            # torch.load of these unpickles whatever they hold, and may run code from them.
            raise FileNotFoundError(
                f"{folder} holds pickled PyTorch weights ({', '.join(pickled[:3])}), which are not read: loading "
                "them could run code from the files; convert them to safetensors where you trust them "
                "(transformers: save_pretrained(..., safe_serialization=True))"
            )
        raise FileNotFoundError(f"no *.safetensors files (and no {INDEX_FILE}) in {folder}")
    return files


def read_hf_state_dict(
    folder: str | Path, dtype: torch.dtype | None = None, progress: Callable[[int], ShardProgress] | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of a (sharded) safetensors checkpoint, HF names, on the CPU.

    FP8 weights are dequantised with their `weight_scale_inv` (the scale keys are dropped), to
    `dtype` or fp32. Other floating-point tensors are cast to `dtype` when it is given, except the
    router bias (`FP32_SUFFIXES`), which is read as fp32. The whole
    checkpoint is held in memory: fine up to tens of GB; a 671B import wants a machine with the RAM.
    `progress(shards)`: a display of the shard files read (`ShardProgress`).
    """
    from safetensors import SafetensorError, safe_open

    files = list_safetensors_files(folder)
    shown = progress(len(files)) if progress else None
    raw: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    raw[key] = f.get_tensor(key)
        except SafetensorError as e:
            raise ValueError(f"{path} is not a readable safetensors file: {e}") from None
        if shown:
            shown.update(1, tensors=len(raw))
    if shown:
        shown.close(tensors=len(raw))
    out: dict[str, torch.Tensor] = {}
    for key, tensor in raw.items():
        if key.endswith(SCALE_SUFFIX):
            weight_key = key.removesuffix(SCALE_SUFFIX)
            if weight_key not in raw:
                raise KeyError(f"{key} has no weight {weight_key} to scale")
            continue
        scale = raw.get(key + SCALE_SUFFIX)
        if scale is not None:
            out[key] = dequantize_fp8_block(tensor, scale, dtype=dtype or torch.float32)
        elif tensor.dtype in _FP8_DTYPES:
            raise ValueError(f"{key} is {tensor.dtype} but the checkpoint has no {key}{SCALE_SUFFIX} to dequantise it")
        elif dtype is not None and tensor.is_floating_point():
            out[key] = tensor.to(torch.float32 if key.endswith(FP32_SUFFIXES) else dtype)
        else:
            out[key] = tensor
    return out


def write_hf_checkpoint(
    hf_state_dict: dict[str, torch.Tensor],
    folder: str | Path,
    config: dict | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    dtype: torch.dtype | None = None,
    progress: Callable[[int], ShardProgress] | None = None,
) -> list[Path]:
    """Write `model-0000i-of-0000n.safetensors` shards of at most `max_shard_bytes` (one tensor
    larger than that gets a shard of its own), `model.safetensors.index.json`, and `config.json`
    when `config` is given. Floating-point tensors are cast to `dtype` when it is given, except
    the router bias (`FP32_SUFFIXES`), which is written fp32. `progress(shards)`: a display of the
    shard files written (`ShardProgress`)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes, total = 0, 0
    for key in sorted(hf_state_dict):
        tensor = hf_state_dict[key]
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(torch.float32 if key.endswith(FP32_SUFFIXES) else dtype)
        # safetensors rejects views and tensors that share storage: give each its own memory.
        tensor = tensor.detach().to("cpu").contiguous().clone()
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][key] = tensor
        shard_bytes += size
        total += size
    n = len(shards)
    shown = progress(n) if progress else None
    weight_map, written = {}, []
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
        written.append(folder / name)
        if shown:
            shown.update(1, tensors=len(weight_map))
    if shown:
        shown.close(tensors=len(weight_map))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if config is not None:
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return written


def read_hf_config(folder: str | Path) -> dict:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {folder}")
    return json.loads(path.read_text())


def _rope_args(config: dict, defaults: DeepSeekV3ModelArgs) -> dict:
    """The positional fields of our args from a `config.json`: its `rope_scaling` (DeepSeek's
    releases; `rope_parameters` in `transformers` 5) carried exactly, whatever length a run
    later trains at. A key we could not reproduce raises instead of being dropped silently."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    out = dict(
        rope_theta=rope.get("rope_theta", config.get("rope_theta", defaults.rope_theta)),
        max_position_embeddings=config.get("max_position_embeddings", defaults.max_position_embeddings),
    )
    if rope_type == "default":
        return {**out, "rope_type": "default"}
    if rope_type != "yarn":
        raise ValueError(
            f"config.json rope_scaling type {rope_type!r} is not supported (only 'yarn' and plain RoPE, "
            "as in DeepSeek's releases)"
        )
    if rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
        raise ValueError(
            "config.json rope_scaling sets attention_factor or truncate=false, which DeepSeek's YaRN "
            "does not use; remove them (the factor follows from mscale / mscale_all_dim)"
        )
    if "original_max_position_embeddings" not in rope:
        raise ValueError("config.json rope_scaling of type yarn needs original_max_position_embeddings")
    original = rope["original_max_position_embeddings"]
    # transformers' rule when `factor` is absent: the ratio of the two context lengths.
    factor = rope.get("factor") or out["max_position_embeddings"] / original
    return {
        **out,
        "rope_type": "yarn",
        "rope_factor": factor,
        "original_seq_len": original,
        # transformers reads `beta_* or default`, so an absent or null value means the default.
        "beta_fast": rope.get("beta_fast") or defaults.beta_fast,
        "beta_slow": rope.get("beta_slow") or defaults.beta_slow,
        # 0 marks an absent mscale / mscale_all_dim (transformers then skips that factor).
        "mscale": rope.get("mscale") or 0.0,
        "mscale_all_dim": rope.get("mscale_all_dim") or 0.0,
    }


def args_from_hf_config(config: dict, **overrides) -> DeepSeekV3ModelArgs:
    """The inverse of `state_dict_adapter.to_hf_config`: a DeepSeek-V3 `config.json` dict (as
    DeepSeek releases it or `transformers` writes it) -> our args. `overrides` replace fields
    after the mapping (e.g. `max_seq_len=4096` for a shorter rope table: YaRN and the softmax
    scale stay those of the config's `rope_scaling`)."""
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"only sigmoid-routed DeepSeek-V3 configs are supported, got {config['scoring_func']!r}")
    defaults = DeepSeekV3ModelArgs()
    moe = MoEArgs(
        num_experts=config["n_routed_experts"],
        num_shared_experts=config.get("n_shared_experts") or 0,
        top_k=config["num_experts_per_tok"],
        score_func="sigmoid",
        route_norm=config.get("norm_topk_prob", True),
        route_scale=config.get("routed_scaling_factor", 1.0),
        num_expert_groups=config.get("n_group", 1),
        num_limited_groups=config.get("topk_group", 1),
        # The noaux_tc routing bias is always present in a V3 checkpoint.
        load_balance_coeff=1e-3,
    )
    rope = _rope_args(config, defaults)
    args = dict(
        vocab_size=config["vocab_size"],
        dim=config["hidden_size"],
        inter_dim=config["intermediate_size"],
        moe_inter_dim=config["moe_intermediate_size"],
        n_layers=config["num_hidden_layers"],
        n_dense_layers=config.get("first_k_dense_replace", 0),
        n_heads=config["num_attention_heads"],
        moe=moe,
        q_lora_rank=config.get("q_lora_rank") or 0,
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        max_seq_len=rope["max_position_embeddings"],
        mtp_depth=config.get("num_nextn_predict_layers", 0),
        norm_eps=config.get("rms_norm_eps", defaults.norm_eps),
        init_std=config.get("initializer_range", defaults.init_std),
        tie_embeddings=config.get("tie_word_embeddings", False),
        **rope,
    )
    eos = config.get("eos_token_id")
    if isinstance(eos, int):
        args["eos_id"] = eos
    args.update(overrides)
    return DeepSeekV3ModelArgs(**args)


def rope_mismatches(args: DeepSeekV3ModelArgs, config: dict) -> list[str]:
    """The positional settings in which `args` (e.g. a flavor) differ from a checkpoint's
    `config.json`, as "field: ours vs checkpoint's" strings; empty when the weights will compute
    what they were trained to."""
    theirs = _rope_args(config, DeepSeekV3ModelArgs())
    fields = ["rope_type", "rope_theta"]
    if theirs["rope_type"] == "yarn" and args.yarn_enabled:
        fields += ["rope_factor", "original_seq_len", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"]
    return [f"{f}: {getattr(args, f)!r} vs {theirs[f]!r}" for f in fields if getattr(args, f) != theirs[f]]
