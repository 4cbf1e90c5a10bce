"""The model's shape from the config: the flavor preset (models/flavors) with the `[model]` and
`[engram]` options and the tokenizer's EOS applied (its ids checked to fit the flavor's embedding),
resolved once before the build (docs/architecture.md, step 2). Nothing mutates the args after that."""

from __future__ import annotations

import dataclasses

from models.deepseek_v3 import DeepSeekV3ModelArgs, flavor_names, get_flavor
from models.engram import EngramArgs
from trainer.config import ConfigError, JobConfig


def resolve_flavor(cfg: JobConfig) -> DeepSeekV3ModelArgs:
    try:
        return get_flavor(cfg.model.flavor)
    except ValueError as e:
        raise ConfigError(f"model.flavor: {e} (available: {', '.join(flavor_names())})") from None


def build_model_args(cfg: JobConfig, tokenizer_vocab_size: int, eos_id: int) -> DeepSeekV3ModelArgs:
    """Resolves the flavor and every config-derived model value once, before the build.

    The embedding keeps the flavor's rows (a released checkpoint's shape: 129,280 for V3, whose
    tokenizer uses 128,815 ids); the tokenizer's ids must fit in them."""
    args = resolve_flavor(cfg)
    if tokenizer_vocab_size > args.vocab_size:
        raise ConfigError(
            f"the tokenizer {cfg.model.tokenizer_path} has {tokenizer_vocab_size} ids but flavor {cfg.model.flavor!r} embeds "
            f"{args.vocab_size}: use the model's own tokenizer (model.tokenizer_path) or a flavor whose vocabulary "
            "holds it"
        )
    m = cfg.model
    moe = dataclasses.replace(
        args.moe,
        use_grouped_mm=m.use_grouped_mm,
        seq_aux_loss_alpha=m.moe_aux_loss_alpha,
        load_balance_coeff=m.moe_bias_update_speed if m.moe_bias_update_speed > 0 else None,
    )
    engram = build_engram_args(cfg) if cfg.engram.enable else None
    try:
        return dataclasses.replace(
            args,
            moe=moe,
            eos_id=eos_id,
            max_seq_len=cfg.training.seq_len,
            attn_backend=m.attn_backend,
            attn_mask_type=m.attn_mask_type,
            rope_type="default" if m.disable_yarn else args.rope_type,
            mtp_depth=m.mtp_depth_for(args.mtp_depth),
            engram=engram,
        )
    except ValueError as e:
        raise ConfigError(f"[model] options do not fit flavor {cfg.model.flavor!r}: {e}") from None


def build_engram_args(cfg: JobConfig) -> EngramArgs:
    e = cfg.engram
    return EngramArgs(
        layer_ids=tuple(e.layer_ids), max_ngram=e.max_ngram, heads_per_order=e.heads_per_order,
        base_size=e.base_size, head_dim=e.head_dim, seed=e.seed,
    )
