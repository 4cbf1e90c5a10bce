"""Token-choice top-k router with DeepSeek-V3 group-limited routing."""

import torch
import torch.nn.functional as F
from torch import nn

from models.moe.args import MoEArgs


def count_tokens_per_expert(selected_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Counts how often each expert appears along the last dim: [..., n] int -> [..., E] fp32.

    Sort and binary search: a static output shape (compiles without graph breaks, unlike
    `bincount`) and no atomic scatter-add (`histc` has no CPU kernel for integer inputs).
    """
    sorted_experts = selected_experts.sort(dim=-1).values
    bounds = torch.arange(num_experts + 1, device=selected_experts.device)
    bounds = bounds.expand(*selected_experts.shape[:-1], num_experts + 1).contiguous()
    return torch.searchsorted(sorted_experts, bounds).diff(dim=-1).float()


class _GatherDistinct(torch.autograd.Function):
    """`values.gather(-1, index)` for indices distinct along the last dim (a top-k choice): the
    backward writes each gradient to its own slot with a plain scatter instead of gather's
    scatter-add, which is an atomic add on GPUs."""

    @staticmethod
    def forward(ctx, values, index):
        ctx.save_for_backward(index)
        ctx.shape = values.shape
        return values.gather(-1, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.shape).scatter_(-1, index, grad), None


class TokenChoiceTopKRouter(nn.Module):
    """Chooses `top_k` experts per token and their gate values.

    Matches HF `DeepseekV3TopkRouter`: scores in fp32; the expert bias (aux-loss-free
    balancing) only shifts the *choice*, the gate values are the raw scores of the chosen
    experts; with groups, a token may only pick from the `num_limited_groups` groups whose
    two best biased scores sum highest. (DeepSeek-V2 ranked groups by their single best score;
    the V3 rule is used for every score function.)
    """

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.score_func = args.score_func
        self.route_norm = args.route_norm
        self.route_scale = args.route_scale
        self.num_expert_groups = args.num_expert_groups
        self.num_limited_groups = args.num_limited_groups
        self.experts_per_group = args.experts_per_group
        # The name `weight` lets HF's `mlp.gate.weight` load without renaming inside the module.
        self.weight = nn.Parameter(torch.empty(args.num_experts, dim))

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Routes tokens.

        Args:
            x: [T, dim] tokens.
            expert_bias: [E] fp32 selection bias, or None.

        Returns:
            top_scores: [T, K] fp32 gate values (normalised and scaled as configured).
            selected_experts: [T, K] int64 expert ids, in no particular order.
            scores: [T, E] fp32 scores of all experts (softmax or sigmoid, no bias).
        """
        # fp32 routing: bf16 logits flip near-tied top-k choices between runs and layouts.
        logits = F.linear(x.float(), self.weight.float())
        if self.score_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()

        scores_for_choice = scores if expert_bias is None else scores + expert_bias
        if self.num_limited_groups < self.num_expert_groups:
            scores_for_choice = self._mask_unselected_groups(scores_for_choice)
        selected_experts = scores_for_choice.topk(self.top_k, dim=-1, sorted=False).indices

        top_scores = _GatherDistinct.apply(scores, selected_experts)
        if self.route_norm:
            # Same epsilon as HF, which keeps parity and guards an all-zero sigmoid row.
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale
        return top_scores, selected_experts, scores

    def _mask_unselected_groups(self, scores_for_choice: torch.Tensor) -> torch.Tensor:
        """Sets the scores of experts outside each token's best groups to -inf."""
        num_tokens = scores_for_choice.shape[0]
        grouped = scores_for_choice.view(num_tokens, self.num_expert_groups, self.experts_per_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        best_groups = group_scores.topk(self.num_limited_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best_groups, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, -1)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.weight, mean=0.0, std=init_std)
