"""Hyper-parameters of one mixture-of-experts block."""

from dataclasses import dataclass

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass
class MoEArgs:
    """Routing and balancing settings shared by every MoE layer of a model.

    Defaults describe a small softmax router; the DeepSeek-V3 flavour sets sigmoid scores,
    8 groups / 4 limited groups, `route_norm=True` and `route_scale=2.5`.
    """

    num_experts: int = 8
    """Routed experts per layer."""
    num_shared_experts: int = 1
    """Shared experts, fused into one SwiGLU `num_shared_experts * inter_dim` wide (0 = none)."""
    top_k: int = 2
    """Routed experts chosen per token."""
    score_func: str = "softmax"
    """Router score function: "softmax" or "sigmoid"."""
    route_norm: bool = False
    """Renormalise the top-k gate values to sum to 1."""
    route_scale: float = 1.0
    """Factor applied to the gate values after the optional normalisation."""
    num_expert_groups: int = 1
    """Expert groups for group-limited routing (DeepSeek `n_group`)."""
    num_limited_groups: int = 1
    """Groups a token may route into (DeepSeek `topk_group`)."""
    use_grouped_mm: bool = True
    """Run experts with `torch._grouped_mm`; False uses a per-expert loop (same numbers, but it
    reads the split sizes on the host: one device sync per MoE layer)."""
    load_balance_coeff: float | None = 1e-3
    """Aux-loss-free bias update speed gamma per optimizer step; None disables `expert_bias`."""
    seq_aux_loss_alpha: float = 0.0
    """Weight of the sequence-wise balance loss (0 = off)."""

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}"
            )
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(
                f"score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}"
            )
        if self.num_expert_groups < 1 or self.num_experts % self.num_expert_groups:
            raise ValueError(
                f"num_expert_groups={self.num_expert_groups} must be >= 1 and divide "
                f"num_experts={self.num_experts}"
            )
        if not 1 <= self.num_limited_groups <= self.num_expert_groups:
            raise ValueError(
                f"num_limited_groups must be in [1, num_expert_groups={self.num_expert_groups}], "
                f"got {self.num_limited_groups}"
            )
        experts_per_group = self.num_experts // self.num_expert_groups
        if self.top_k > self.num_limited_groups * experts_per_group:
            raise ValueError(
                f"top_k={self.top_k} exceeds the experts reachable through "
                f"num_limited_groups={self.num_limited_groups} groups of {experts_per_group} "
                f"(num_experts / num_expert_groups)"
            )
        if self.num_limited_groups < self.num_expert_groups and experts_per_group < 2:
            # Groups are ranked by the sum of their two best scores.
            raise ValueError(
                f"group-limited routing needs >= 2 experts per group; num_experts="
                f"{self.num_experts} / num_expert_groups={self.num_expert_groups} gives "
                f"{experts_per_group}"
            )
        if self.route_scale <= 0:
            raise ValueError(f"route_scale must be > 0, got {self.route_scale}")
        if self.load_balance_coeff is not None and self.load_balance_coeff < 0:
            raise ValueError(
                f"load_balance_coeff must be >= 0 or None, got {self.load_balance_coeff}"
            )
        if self.seq_aux_loss_alpha < 0:
            raise ValueError(f"seq_aux_loss_alpha must be >= 0, got {self.seq_aux_loss_alpha}")

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.num_expert_groups
