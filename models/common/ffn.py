"""SwiGLU feed-forward network (DeepSeek naming: w1 = gate, w2 = down, w3 = up)."""

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """`w2(silu(w1 x) * w3 x)`, used by the leading dense layers and as MoE shared experts.

    Args:
        dim: model (input and output) dimension.
        hidden_dim: intermediate dimension.
    """

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float = 0.02) -> None:
        # Like torchtitan: the input projections use a fixed std; the output projection
        # (which writes into the residual stream) uses the caller's (possibly depth-scaled) std.
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)
