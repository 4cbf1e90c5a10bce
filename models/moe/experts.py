"""Routed experts as stacked SwiGLU weights, run with grouped GEMMs or a per-expert loop."""

import torch
import torch.nn.functional as F
from torch import nn


def _grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` can run on `x`'s device and dtype.

    The CUDA kernels are bf16-only (and so is the meta kernel that torch.compile traces
    with); the CPU eager kernel also takes fp32, which keeps fp32 unit tests on this path.
    Everything else (e.g. fp32 on CUDA) uses the per-expert loop.
    """
    if x.dtype == torch.bfloat16:
        return True
    return x.device.type == "cpu" and x.dtype == torch.float32 and not torch.compiler.is_compiling()


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU FFNs `w2(silu(w1 x) * w3 x)` with stacked weights.

    Args:
        dim: model dimension.
        inter_dim: hidden dimension of each expert.
        num_experts: experts held by this module (all routed experts, or the local ones
            under expert parallelism).
        use_grouped_mm: run `torch._grouped_mm`; False (or an unsupported dtype/device)
            runs one matmul per expert with identical results.
    """

    def __init__(self, dim: int, inter_dim: int, num_experts: int, use_grouped_mm: bool = True):
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, inter_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, inter_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, inter_dim, dim))

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(w1, w2, w3)` as the forward computes with them: `[num_experts, ...]` tensors of the
        experts this module runs. The one place the forward reads its weights, so that a
        parallel wrapper storing them differently (expert parallelism keeps them as shards of
        the global stack) can hand the same math its local tensors."""
        return self.w1, self.w2, self.w3

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Applies expert e to its rows.

        Args:
            x: [N, dim] rows sorted by expert (expert 0's rows first).
            num_tokens_per_expert: [E] int, rows per expert (zeros allowed), summing to at
                most N. The dispatchers align each group's start (padding rows included in
                the counts) and leave a padding tail, whose outputs are unspecified.

        Returns:
            [N, dim] in x's dtype, or in the autocast dtype when autocast is on.
        """
        if torch.is_autocast_enabled(x.device.type):
            # `_grouped_mm` has no autocast rule (the loop's F.linear has): cast the rows here so
            # both paths, eager and compiled, run in the autocast dtype (bf16 -> grouped mm).
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if self.use_grouped_mm and _grouped_mm_supported(x):
            return self._forward_grouped(x, num_tokens_per_expert)
        return self._forward_loop(x, num_tokens_per_expert)

    def _forward_grouped(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # Group ends stay on the device: no host read. Rows past offsets[-1] (padding tail) come
        # out uninitialised; they are never read back and the weight gradients only sum rows
        # inside the groups.
        offsets = torch.cumsum(num_tokens_per_expert, dim=0).to(torch.int32)
        # `.to` is a no-op unless autocast made x lower precision than the fp32 weights.
        w1, w2, w3 = (w.to(x.dtype).transpose(-2, -1) for w in self.stacked_weights())
        h = F.silu(torch._grouped_mm(x, w1, offs=offsets))
        h = h * torch._grouped_mm(x, w3, offs=offsets)
        return torch._grouped_mm(h, w2, offs=offsets)

    def _forward_loop(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # The fallback path reads the split sizes on the host (`.tolist()`, a device sync):
        # fine eagerly; under compile they are captured as unbacked symbols. The padding tail
        # gets zeros.
        sizes = num_tokens_per_expert.tolist()
        tail = x.shape[0] - sum(sizes)
        *chunks, rest = torch.split(x, [*sizes, tail], dim=0)
        w1, w2, w3 = self.stacked_weights()
        outs = [
            F.linear(F.silu(F.linear(chunk, w1[e])) * F.linear(chunk, w3[e]), w2[e])
            for e, chunk in enumerate(chunks)
        ]
        return torch.cat([*outs, rest.new_zeros(rest.shape[0], w2.shape[1])], dim=0)

    def init_weights(self, init_std: float) -> None:
        # Same convention as the dense FeedForward: fixed std for the input projection,
        # the caller's (depth-scaled) std for the others.
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=init_std)
