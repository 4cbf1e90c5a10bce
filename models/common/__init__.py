"""Model building blocks shared by the model families: MLA attention (+ masks), RoPE/YaRN, SwiGLU FFN.

RMSNorm is `torch.nn.RMSNorm` (fused kernels, no custom code needed).
"""

from models.common.attention import MLA, AttentionMask, build_attention_mask, document_ids
from models.common.ffn import FeedForward
from models.common.rope import (
    ROPE_TYPES,
    apply_rotary_emb,
    precompute_freqs_cis,
    yarn_mscale,
    yarn_rope_attention_factor,
    yarn_softmax_factor,
)

__all__ = [
    "MLA",
    "ROPE_TYPES",
    "AttentionMask",
    "FeedForward",
    "apply_rotary_emb",
    "build_attention_mask",
    "document_ids",
    "precompute_freqs_cis",
    "yarn_mscale",
    "yarn_rope_attention_factor",
    "yarn_softmax_factor",
]
