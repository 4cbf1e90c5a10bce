"""The DeepSeek-V3 flavors' fields as plain data: `DeepSeekV3ModelArgs(**flavor_fields(name))`.

It lives outside `models.deepseek_v3`, whose package imports torch, because the torch-free
pre-launch check (trainer/config/check.py) reads the shapes (block count, MTP depth, heads,
experts) to refuse a layout that does not fit the model before any process starts.
`models.deepseek_v3.flavors.get_flavor` builds the model arguments from it.

Shapes of `16B`, `236B` and `671B` are those of DeepSeek-V2-Lite, DeepSeek-V2 and DeepSeek-V3
(their inference configs), each with its release's YaRN `rope_scaling` (factor 40 over 4096
original positions, context 163840). `debugmodel` (the dataclass defaults, spelled out),
`debugmodel_v3vocab` (the same with V3's vocabulary), `debugmodel_8blocks` (the same with 8 blocks)
and `proxy_1b` are from-scratch shapes with plain RoPE.
"""

import difflib


def _table() -> dict[str, dict]:
    """Built on every call: callers get dicts of their own."""
    # Tiny, every feature on (sigmoid group-limited routing, shared experts, expert bias, MTP),
    # so CPU tests exercise all code paths.
    debugmodel = dict(
        vocab_size=8192, dim=128, inter_dim=384, moe_inter_dim=128, n_layers=6, n_dense_layers=1, n_heads=4,
        moe=dict(
            num_experts=8, num_shared_experts=2, top_k=2, score_func="sigmoid", route_norm=True,
            route_scale=1.0, num_expert_groups=4, num_limited_groups=2, use_grouped_mm=True,
            load_balance_coeff=1e-3, seq_aux_loss_alpha=0.0,
        ),
        q_lora_rank=0, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, mtp_depth=1,
    )
    return {
        "debugmodel": debugmodel,
        # debugmodel's widths with DeepSeek-V3's vocabulary (its tokenizer's 128,815 ids in V3's 129,280
        # rows, EOS 1): CPU tests of a run with DeepSeek's real tokenizer.json (docs/continued_pretraining.md).
        "debugmodel_v3vocab": {**debugmodel, "moe": dict(debugmodel["moe"]), "vocab_size": 129280, "eos_id": 1},
        # debugmodel with 8 blocks, the fewest that DualPipeV at pp 4 (8 stages, a block or more each)
        # can split: CPU tests of a 4-rank V pipeline (tests/distributed/test_ac_schedules.py).
        "debugmodel_8blocks": {**debugmodel, "moe": dict(debugmodel["moe"]), "n_layers": 8},
        # V3's structure (sigmoid group-limited routing, q bottleneck, shared expert, MTP) at ~1B total
        # / ~0.3B active parameters with V3's vocabulary: trains at seq 4096 on one 80 GB GPU.
        "proxy_1b": dict(
            vocab_size=129280, dim=1024, inter_dim=4096, moe_inter_dim=384, n_layers=12, n_dense_layers=1, n_heads=16,
            moe=dict(
                num_experts=64, num_shared_experts=1, top_k=8, score_func="sigmoid", route_norm=True,
                route_scale=2.5, num_expert_groups=8, num_limited_groups=4, load_balance_coeff=1e-3,
                seq_aux_loss_alpha=1e-4,
            ),
            q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
            max_seq_len=4096, max_position_embeddings=4096, mtp_depth=1, eos_id=1,
        ),
        # config.json of DeepSeek-V2-Lite: rope_scaling yarn, factor 40 over 4096, mscale 0.707 (both)
        "16B": dict(
            vocab_size=102400, dim=2048, inter_dim=10944, moe_inter_dim=1408, n_layers=27, n_dense_layers=1,
            n_heads=16,
            moe=dict(
                num_experts=64, num_shared_experts=2, top_k=6, score_func="softmax", route_norm=False,
                route_scale=1.0, num_expert_groups=1, num_limited_groups=1, load_balance_coeff=1e-3,
            ),
            q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            max_seq_len=4096, mtp_depth=0, eos_id=100001,
            rope_type="yarn", max_position_embeddings=163840, mscale=0.707, mscale_all_dim=0.707,
        ),
        "236B": dict(
            vocab_size=102400, dim=5120, inter_dim=12288, moe_inter_dim=1536, n_layers=60, n_dense_layers=1,
            n_heads=128,
            moe=dict(
                num_experts=160, num_shared_experts=2, top_k=6, score_func="softmax", route_norm=False,
                route_scale=16.0, num_expert_groups=8, num_limited_groups=3, load_balance_coeff=1e-3,
            ),
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            max_seq_len=4096, mtp_depth=0, eos_id=100001,
            rope_type="yarn", max_position_embeddings=163840, mscale=0.707, mscale_all_dim=0.707,
        ),
        # config.json of DeepSeek-V3: rope_scaling yarn, factor 40 over 4096, mscale 1.0 (both)
        "671B": dict(
            vocab_size=129280, dim=7168, inter_dim=18432, moe_inter_dim=2048, n_layers=61, n_dense_layers=3,
            n_heads=128,
            moe=dict(
                num_experts=256, num_shared_experts=1, top_k=8, score_func="sigmoid", route_norm=True,
                route_scale=2.5, num_expert_groups=8, num_limited_groups=4, load_balance_coeff=1e-3,
                seq_aux_loss_alpha=1e-4,
            ),
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            max_seq_len=4096, mtp_depth=1, eos_id=1,
            rope_type="yarn", max_position_embeddings=163840, mscale=1.0, mscale_all_dim=1.0,
        ),
    }


def flavor_names() -> list[str]:
    """Names accepted by `flavor_fields` (and `get_flavor`)."""
    return list(_table())


def flavor_fields(name: str) -> dict:
    """The `DeepSeekV3ModelArgs` fields of flavor `name` (a fresh dict; `moe` a dict of `MoEArgs`
    fields); unknown names raise ValueError."""
    table = _table()
    if name not in table:
        close = difflib.get_close_matches(name, table, n=1, cutoff=0.0)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown DeepSeek-V3 flavor {name!r}{hint} (valid: {', '.join(table)})")
    return table[name]
