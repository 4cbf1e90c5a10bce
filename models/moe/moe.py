"""DeepSeek-V3 mixture-of-experts block: router, routed experts, shared experts.

The block's forward is written once, as phases that `MoE.forward` composes: `route` (router and
routed-token counts), the dispatcher's `dispatch` (itself three phases around the token exchange,
models/moe/dispatcher.py), the routed `experts`, `shared`, the dispatcher's `combine`, `output`
and `balance_loss`. The overlapped schedule (trainer/parallel/moe_overlap.py) runs the same phases
as separate nodes, with the exchanges of expert parallelism between them.
"""

from typing import NamedTuple

import torch
from torch import nn

from models.common.ffn import FeedForward
from models.moe.args import MoEArgs
from models.moe.dispatcher import LocalTokenDispatcher, TokenDispatcher
from models.moe.experts import GroupedExperts
from models.moe.router import TokenChoiceTopKRouter, count_tokens_per_expert


class Routing(NamedTuple):
    """The router's decision for one MoE input `[B, S, dim]` (`MoE.route`)."""

    tokens: torch.Tensor  # [T = B * S, dim] the input's tokens
    top_scores: torch.Tensor  # [T, K] fp32 gate values
    selected_experts: torch.Tensor  # [T, K] int64 chosen experts
    scores: torch.Tensor  # [T, E] fp32 router scores (the balance loss reads them)
    shape: torch.Size  # the input's [B, S, dim]


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
        """Args: x [B, S, dim]. Returns (out [B, S, dim], aux_loss: 0-dim fp32).

        The composition of the block's phases (`route`, the dispatcher's `dispatch`, the routed
        `experts`, `shared`, the dispatcher's `combine`, `output`, `balance_loss`); the overlapped
        schedule (trainer/parallel/moe_overlap.py) calls the same phases node by node."""
        routing = self.route(x)
        routed_x, num_tokens_per_expert, ctx = self.dispatcher.dispatch(
            routing.tokens, routing.selected_experts, routing.top_scores
        )
        routed_out = self.experts(routed_x, num_tokens_per_expert)
        # Computed before combine() so an all-to-all dispatcher can overlap it with the exchange.
        shared_out = self.shared(routing.tokens)
        out = self.dispatcher.combine(routed_out, ctx, routing.tokens.shape)
        return self.output(out, shared_out, x.shape), self.balance_loss(routing)

    def route(self, x: torch.Tensor) -> Routing:
        """The router on `x` [B, S, dim]'s tokens, counted in `tokens_per_expert` (training)."""
        tokens = x.reshape(-1, x.shape[-1])  # [B * S, dim]
        top_scores, selected_experts, scores = self.gate(tokens, self.expert_bias)
        self.count_routed(selected_experts)
        return Routing(tokens, top_scores, selected_experts, scores, x.shape)

    def shared(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The shared experts on `tokens` [T, dim] (None without shared experts)."""
        return self.shared_experts(tokens) if self.shared_experts is not None else None

    def output(self, combined: torch.Tensor, shared_out: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
        """The block's output `[B, S, dim]` (`shape`): the combined routed experts' `[T, dim]`
        plus the shared experts'."""
        if shared_out is not None:
            combined = combined + shared_out
        return combined.view(shape)

    @torch.no_grad()
    def count_routed(self, selected_experts: torch.Tensor) -> None:
        """Adds a training forward's routing (`selected_experts` [T, K]) to `tokens_per_expert`,
        in place so the buffer keeps its identity (and compile sees a mutation, not a rebinding)."""
        if self.training:
            self.tokens_per_expert.add_(count_tokens_per_expert(selected_experts.reshape(-1), self.num_experts))

    def balance_loss(self, routing: Routing) -> torch.Tensor:
        """The sequence-wise balance loss of `routing` (`_sequence_balance_loss`)."""
        bsz, seqlen = routing.shape[0], routing.shape[1]
        return self._sequence_balance_loss(routing.scores, routing.selected_experts, bsz, seqlen)

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
