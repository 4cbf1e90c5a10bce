"""Named architecture presets ("flavors") as Python data.

`get_flavor(name)` builds a fresh `DeepSeekV3ModelArgs` on every call, so callers may change the
result (e.g. `dataclasses.replace(get_flavor("16B"), vocab_size=tok.n_vocab)`) without affecting
anyone else. Shapes of `16B`, `236B` and `671B` are those of DeepSeek-V2-Lite, DeepSeek-V2 and
DeepSeek-V3 (their inference configs).

Positional settings are part of the model, not of the run: the three released shapes carry
their release's YaRN `rope_scaling` (factor 40 over 4096 original positions, context 163840),
so they compute what the released weights compute at any training `seq_len`; `max_seq_len` is
only the rope table length, which the trainer sets to its sequence length. `debugmodel` and
`proxy_1b` are from-scratch shapes with plain RoPE. A run that wants YaRN off says so
(`model.disable_yarn`).
"""

import difflib
from collections.abc import Callable

from models.deepseek_v3.args import DeepSeekV3ModelArgs
from models.moe import MoEArgs


def _debugmodel() -> DeepSeekV3ModelArgs:
    # The dataclass defaults are the debug model: tiny, every feature on (sigmoid group-limited
    # routing, shared experts, expert bias, MTP), so CPU tests exercise all code paths.
    return DeepSeekV3ModelArgs()


def _deepseek_v2_lite() -> DeepSeekV3ModelArgs:
    return DeepSeekV3ModelArgs(
        vocab_size=102400, dim=2048, inter_dim=10944, moe_inter_dim=1408,
        n_layers=27, n_dense_layers=1, n_heads=16,
        moe=MoEArgs(
            num_experts=64, num_shared_experts=2, top_k=6, score_func="softmax",
            route_norm=False, route_scale=1.0, num_expert_groups=1, num_limited_groups=1,
            load_balance_coeff=1e-3,
        ),
        q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_seq_len=4096, mtp_depth=0, eos_id=100001,
        # config.json of DeepSeek-V2-Lite: rope_scaling yarn, factor 40 over 4096, mscale 0.707 (both)
        rope_type="yarn", max_position_embeddings=163840, mscale=0.707, mscale_all_dim=0.707,
    )


def _deepseek_v2() -> DeepSeekV3ModelArgs:
    return DeepSeekV3ModelArgs(
        vocab_size=102400, dim=5120, inter_dim=12288, moe_inter_dim=1536,
        n_layers=60, n_dense_layers=1, n_heads=128,
        moe=MoEArgs(
            num_experts=160, num_shared_experts=2, top_k=6, score_func="softmax",
            route_norm=False, route_scale=16.0, num_expert_groups=8, num_limited_groups=3,
            load_balance_coeff=1e-3,
        ),
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_seq_len=4096, mtp_depth=0, eos_id=100001,
        rope_type="yarn", max_position_embeddings=163840, mscale=0.707, mscale_all_dim=0.707,
    )


def _deepseek_v3() -> DeepSeekV3ModelArgs:
    return DeepSeekV3ModelArgs(
        vocab_size=129280, dim=7168, inter_dim=18432, moe_inter_dim=2048,
        n_layers=61, n_dense_layers=3, n_heads=128,
        moe=MoEArgs(
            num_experts=256, num_shared_experts=1, top_k=8, score_func="sigmoid",
            route_norm=True, route_scale=2.5, num_expert_groups=8, num_limited_groups=4,
            load_balance_coeff=1e-3, seq_aux_loss_alpha=1e-4,
        ),
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_seq_len=4096, mtp_depth=1, eos_id=1,
        # config.json of DeepSeek-V3: rope_scaling yarn, factor 40 over 4096, mscale 1.0 (both)
        rope_type="yarn", max_position_embeddings=163840, mscale=1.0, mscale_all_dim=1.0,
    )


def _proxy_1b() -> DeepSeekV3ModelArgs:
    # V3's structure (sigmoid group-limited routing, q bottleneck, shared expert, MTP) at ~1B total
    # / ~0.3B active parameters with V3's vocabulary: trains at seq 4096 on one 80 GB GPU.
    return DeepSeekV3ModelArgs(
        vocab_size=129280, dim=1024, inter_dim=4096, moe_inter_dim=384,
        n_layers=12, n_dense_layers=1, n_heads=16,
        moe=MoEArgs(
            num_experts=64, num_shared_experts=1, top_k=8, score_func="sigmoid",
            route_norm=True, route_scale=2.5, num_expert_groups=8, num_limited_groups=4,
            load_balance_coeff=1e-3, seq_aux_loss_alpha=1e-4,
        ),
        q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        max_seq_len=4096, max_position_embeddings=4096, mtp_depth=1, eos_id=1,
    )


def _builders() -> dict[str, Callable[[], DeepSeekV3ModelArgs]]:
    return {
        "debugmodel": _debugmodel,
        "proxy_1b": _proxy_1b,
        "16B": _deepseek_v2_lite,
        "236B": _deepseek_v2,
        "671B": _deepseek_v3,
    }


def flavor_names() -> list[str]:
    """Names accepted by `get_flavor`."""
    return list(_builders())


def get_flavor(name: str) -> DeepSeekV3ModelArgs:
    """A fresh `DeepSeekV3ModelArgs` for flavor `name`; unknown names raise ValueError."""
    builders = _builders()
    if name not in builders:
        close = difflib.get_close_matches(name, builders, n=1, cutoff=0.0)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown DeepSeek-V3 flavor {name!r}{hint} (valid: {', '.join(builders)})")
    return builders[name]()
