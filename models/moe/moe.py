"""DeepSeek-V3 mixture-of-experts block: router, routed experts, shared experts."""

import torch
from torch import nn

from models.common.ffn import FeedForward
from models.moe.args import MoEArgs
from models.moe.dispatcher import LocalTokenDispatcher, TokenDispatcher
from models.moe.experts import GroupedExperts
from models.moe.router import TokenChoiceTopKRouter, count_tokens_per_expert


class MoE(nn.Module):
    """Routed experts plus always-on shared experts.

    Args:
        dim: model dimension.
        inter_dim: hidden dimension of one expert (the shared FFN is
            `num_shared_experts * inter_dim` wide).
        args: routing and balancing settings.

    Buffers:
        expert_bias [E] fp32: aux-loss-free selection bias (None when
            `load_balance_coeff` is None), updated by `balance.apply_expert_bias_update`
            (the trainer's `ExpertBiasUpdater.step`, once per optimizer step).
        tokens_per_expert [E] fp32: routed-token counts accumulated by training forwards
            since the last bias update, each micro-batch's forward counted once
            (models/common/forward_stats.py).
    """

    forward_statistics = ("tokens_per_expert",)

    def __init__(self, dim: int, inter_dim: int, args: MoEArgs):
        super().__init__()
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.load_balance_coeff = args.load_balance_coeff
        self.seq_aux_loss_alpha = args.seq_aux_loss_alpha

        self.gate = TokenChoiceTopKRouter(dim, args)
        self.experts = GroupedExperts(dim, inter_dim, args.num_experts, args.use_grouped_mm)
        self.shared_experts = (
            FeedForward(dim, args.num_shared_experts * inter_dim)
            if args.num_shared_experts > 0
            else None
        )
        self.dispatcher: TokenDispatcher = LocalTokenDispatcher(args.num_experts)

        self.register_buffer(
            "expert_bias",
            torch.zeros(args.num_experts, dtype=torch.float32)
            if args.load_balance_coeff is not None
            else None,
            persistent=True,
        )
        self.register_buffer(
            "tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.float32), persistent=True
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Args: x [B, S, dim]. Returns (out [B, S, dim], aux_loss: 0-dim fp32)."""
        bsz, seqlen, dim = x.shape
        tokens = x.reshape(-1, dim)  # [B * S, dim]
        top_scores, selected_experts, scores = self.gate(tokens, self.expert_bias)

        self.count_routed(selected_experts)
        routed_x, num_tokens_per_expert, ctx = self.dispatcher.dispatch(
            tokens, selected_experts, top_scores
        )
        routed_out = self.experts(routed_x, num_tokens_per_expert)
        # Computed before combine() so an all-to-all dispatcher can overlap it with the exchange.
        shared_out = self.shared_experts(tokens) if self.shared_experts is not None else None
        out = self.dispatcher.combine(routed_out, ctx, tokens.shape)
        if shared_out is not None:
            out = out + shared_out

        aux_loss = self._sequence_balance_loss(scores, selected_experts, bsz, seqlen)
        return out.view(bsz, seqlen, dim), aux_loss

    @torch.no_grad()
    def count_routed(self, selected_experts: torch.Tensor) -> None:
        """Adds a training forward's routing (`selected_experts` [T, K]) to `tokens_per_expert`,
        in place so the buffer keeps its identity (and compile sees a mutation, not a rebinding)."""
        if self.training:
            self.tokens_per_expert.add_(count_tokens_per_expert(selected_experts.reshape(-1), self.num_experts))

    def _sequence_balance_loss(
        self, scores: torch.Tensor, selected_experts: torch.Tensor, bsz: int, seqlen: int
    ) -> torch.Tensor:
        """Sequence-wise balance loss, DeepSeek-V3 report eqs. 17-20, averaged over sequences.

        Per sequence: f_i = E / (K * S) * (tokens choosing i), P_i = mean over tokens of the
        scores normalised to sum to 1 per token; loss = alpha * sum_i f_i * P_i. Only P_i
        carries gradient. Under context parallelism "sequence" means the local shard.
        """
        if self.seq_aux_loss_alpha == 0:
            return scores.new_zeros(())
        scores = scores.view(bsz, seqlen, self.num_experts)
        norm_scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        prob = norm_scores.mean(dim=1)  # [B, E]
        per_sequence = selected_experts.view(bsz, seqlen * self.top_k)
        counts = count_tokens_per_expert(per_sequence, self.num_experts)
        frac = counts * (self.num_experts / (self.top_k * seqlen))  # [B, E]
        return self.seq_aux_loss_alpha * (frac * prob).sum(dim=-1).mean()

    def init_weights(self, init_std: float) -> None:
        self.gate.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        with torch.no_grad():
            if self.expert_bias is not None:
                self.expert_bias.zero_()
            self.tokens_per_expert.zero_()
