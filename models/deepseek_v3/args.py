"""Architecture hyper-parameters of a DeepSeek-V3 model.

Every field has a default (together they describe the tiny `debugmodel`), so a custom shape is
`DeepSeekV3ModelArgs(dim=512, n_layers=4, moe=MoEArgs(num_experts=16, top_k=2))` or
`dataclasses.replace(get_flavor("16B"), n_layers=2)`. Names follow DeepSeek's reference
`ModelArgs`; see `state_dict_adapter.to_hf_config` for the HF `DeepseekV3Config` equivalents.
"""

import math
from dataclasses import dataclass, field

from models.common.attention import ATTN_BACKENDS, ATTN_MASK_TYPES
from models.common.rope import ROPE_TYPES, yarn_rope_attention_factor, yarn_softmax_factor
from models.engram import EngramArgs
from models.moe import MoEArgs


def _debug_moe_args() -> MoEArgs:
    return MoEArgs(
        num_experts=8,
        num_shared_experts=2,
        top_k=2,
        score_func="sigmoid",
        route_norm=True,
        route_scale=1.0,
        num_expert_groups=4,
        num_limited_groups=2,
        use_grouped_mm=True,
        load_balance_coeff=1e-3,
        seq_aux_loss_alpha=0.0,
    )


@dataclass
class DeepSeekV3ModelArgs:
    """Shape and numerics of a DeepSeek-V3 model (all sizes in elements)."""

    vocab_size: int = 8192
    """Vocabulary size (embedding rows and output-head columns)."""
    dim: int = 128
    """Model (residual stream) width."""
    inter_dim: int = 384
    """Hidden width of the dense SwiGLU FFN of the leading `n_dense_layers` layers."""
    moe_inter_dim: int = 128
    """Hidden width of one routed (and one shared) expert."""
    n_layers: int = 6
    """Transformer blocks of the main model (MTP blocks not included)."""
    n_dense_layers: int = 1
    """Leading blocks with a dense FFN instead of an MoE (DeepSeek `first_k_dense_replace`)."""
    n_heads: int = 4
    """Attention heads."""
    moe: MoEArgs = field(default_factory=_debug_moe_args)
    """Routing and balancing settings of every MoE block."""
    q_lora_rank: int = 0
    """Rank of the query bottleneck (`wq_a` -> `q_norm` -> `wq_b`); 0 = one projection `wq`."""
    kv_lora_rank: int = 64
    """Width of the compressed key/value latent."""
    qk_nope_head_dim: int = 32
    """Per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int = 16
    """Per-head query/key width with rotary embedding (the rope key is shared by all heads)."""
    v_head_dim: int = 32
    """Per-head value width."""
    max_seq_len: int = 2048
    """Rope table length: the longest sequence this instance runs (the trainer sets it to
    `training.seq_len`). It never changes the positional encoding or the softmax scale: those are
    properties of the model (the fields below), so a YaRN model trains the same function at any length."""
    max_position_embeddings: int = 2048
    """The model's context length (HF `max_position_embeddings`), written to `config.json` on export;
    DeepSeek's releases: 163840 (4096 x YaRN factor 40). Metadata: the rope math does not read it."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_type: str = "default"
    """"default" (plain RoPE) or "yarn" (YaRN-extended RoPE and softmax scale, as in DeepSeek's
    released V2/V3 weights; HF `rope_scaling.type`)."""
    rope_factor: float = 40.0
    """YaRN context-extension factor (HF `rope_scaling.factor`)."""
    original_seq_len: int = 4096
    """YaRN: context length of pre-training, before the extension (HF `original_max_position_embeddings`)."""
    beta_fast: float = 32.0
    """YaRN: dims rotating more than this many times over `original_seq_len` are not interpolated."""
    beta_slow: float = 1.0
    """YaRN: dims rotating fewer than this many times are fully interpolated."""
    mscale: float = 1.0
    """YaRN (HF `rope_scaling.mscale`): with `mscale_all_dim`, sets the rope cos/sin factor
    `yarn_mscale(f, mscale) / yarn_mscale(f, mscale_all_dim)` (1 when they are equal); 0 = absent."""
    mscale_all_dim: float = 1.0
    """YaRN (HF `rope_scaling.mscale_all_dim`, DeepSeek reference `mscale`): the softmax scale is
    multiplied by `(0.1 * mscale_all_dim * ln(rope_factor) + 1) ** 2`; 0 = absent (no factor)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    mtp_depth: int = 1
    """Multi-token-prediction modules (0 = none); module k predicts the token k + 2 ahead."""
    attn_backend: str = "sdpa"
    """Attention kernel: "sdpa" (CPU and GPU) or "flex" (GPU only)."""
    attn_mask_type: str = "causal"
    """"causal" (what HF `transformers` inference computes), or "block_causal" (no attention across
    documents separated by `eos_id`; after an EOS in a packed row the logits then differ from HF
    inference on that row, which attends across it: train with "causal" for HF-identical behaviour)."""
    eos_id: int = 0
    """End-of-document token id (used by the "block_causal" mask)."""
    init_std: float = 0.02
    """Base init std; the output projections of block l use `init_std / sqrt(2 * (l + 1))`."""
    tie_embeddings: bool = False
    """Share the embedding matrix with the output head."""
    engram: EngramArgs | None = None
    """Engram conditional memory at `engram.layer_ids` (0-based blocks); None = no Engram."""

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):
            self.moe = MoEArgs(**self.moe)
        if isinstance(self.engram, dict):
            self.engram = EngramArgs(**self.engram)
        if self.engram is not None and max(self.engram.layer_ids) >= self.n_layers:
            raise ValueError(f"engram.layer_ids {self.engram.layer_ids} must be < n_layers={self.n_layers}")
        positive = (
            "vocab_size", "dim", "inter_dim", "moe_inter_dim", "n_layers", "n_heads", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_seq_len", "max_position_embeddings",
            "original_seq_len",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"DeepSeekV3ModelArgs.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(
                f"n_dense_layers must be in [0, n_layers={self.n_layers}], got {self.n_dense_layers}"
            )
        if self.q_lora_rank < 0:
            raise ValueError(f"q_lora_rank must be >= 0 (0 = no query bottleneck), got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (rope rotates pairs), got {self.qk_rope_head_dim}")
        if self.mtp_depth < 0:
            raise ValueError(f"mtp_depth must be >= 0, got {self.mtp_depth}")
        if self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"attn_backend must be one of {ATTN_BACKENDS}, got {self.attn_backend!r}")
        if self.attn_mask_type not in ATTN_MASK_TYPES:
            raise ValueError(f"attn_mask_type must be one of {ATTN_MASK_TYPES}, got {self.attn_mask_type!r}")
        if not 0 <= self.eos_id < self.vocab_size:
            raise ValueError(f"eos_id must be in [0, vocab_size={self.vocab_size}), got {self.eos_id}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.yarn_enabled and not (
            self.rope_factor >= 1 and self.beta_fast >= self.beta_slow > 0 and min(self.mscale, self.mscale_all_dim) >= 0
        ):
            raise ValueError(
                "YaRN needs rope_factor >= 1, beta_fast >= beta_slow > 0 and mscale, mscale_all_dim >= 0; got "
                f"rope_factor={self.rope_factor}, beta_fast={self.beta_fast}, beta_slow={self.beta_slow}, "
                f"mscale={self.mscale}, mscale_all_dim={self.mscale_all_dim}"
            )
        if self.rope_theta <= 1 or self.norm_eps <= 0 or self.init_std <= 0:
            raise ValueError(
                "rope_theta must be > 1 and norm_eps, init_std > 0; got "
                f"rope_theta={self.rope_theta}, norm_eps={self.norm_eps}, init_std={self.init_std}"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn_enabled(self) -> bool:
        """Whether the model uses YaRN: a property of the model (`rope_type`), never of the table length."""
        return self.rope_type == "yarn"

    @property
    def softmax_scale(self) -> float:
        """`qk_head_dim ** -0.5`, times `yarn_softmax_factor` under YaRN (DeepSeek's reference
        `MLA.__init__` and `transformers`' DeepseekV3 attention)."""
        scale = 1.0 / math.sqrt(self.qk_head_dim)
        if self.yarn_enabled:
            scale *= yarn_softmax_factor(self.rope_factor, self.mscale_all_dim)
        return scale

    @property
    def rope_attention_factor(self) -> float:
        """Multiplier of the rope cos/sin table (`yarn_rope_attention_factor`; 1 without YaRN)."""
        if not self.yarn_enabled:
            return 1.0
        return yarn_rope_attention_factor(self.rope_factor, self.mscale, self.mscale_all_dim)

    def describe_positions(self) -> str:
        """One line for the run log: the rope variant, the softmax scale and the rope table length."""
        if self.yarn_enabled:
            rope = (
                f"YaRN factor {self.rope_factor:g} over {self.original_seq_len} positions "
                f"(context {self.max_position_embeddings}, mscale {self.mscale:g}, mscale_all_dim {self.mscale_all_dim:g})"
            )
        else:
            rope = f"plain RoPE (theta {self.rope_theta:g})"
        return f"{rope} | softmax scale {self.softmax_scale:.5f} | rope table {self.max_seq_len}"
