"""The Engram module of one transformer block (Engram paper, section 2.3).

With e_t the concatenation of the (N-1)*K head rows of token t (d_mem wide) and h_t the block's
residual stream:

    k = W_K e,  v = W_V e
    s = <RMSNorm(h), RMSNorm(k)> / sqrt(dim);  s = sign(s) * sqrt(max(|s|, 1e-6));  alpha = sigmoid(s)
    V = alpha * v
    Y = V + SiLU(conv(RMSNorm(V)))     depthwise causal conv, kernel 4, dilation N, no bias, zero init

and the block adds Y to its residual stream before attention. The zero-initialised conv makes
Y = alpha * v at the start of training.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.engram.args import EngramArgs
from models.engram.hashing import find_primes
from models.engram.table import EngramTable

_GATE_EPS = 1e-6


class Engram(nn.Module):
    """Engram memory of block `layer_id`: its table plus key/value projections, gate and short conv.

    `forward(h, rows)` takes the looked-up rows (the table lookup happens outside, through the
    model's `EngramLookup`, so that embedding parallelism can batch the exchange of all layers).
    """

    forward_statistics = ("gate_stats",)  # models/common/forward_stats.py

    def __init__(self, layer_id: int, dim: int, args: EngramArgs, norm_eps: float = 1e-6):
        super().__init__()
        self.layer_id = layer_id
        self.dim = dim
        self.max_ngram = args.max_ngram
        self.kernel_size = args.kernel_size
        self.table = EngramTable(
            sum(find_primes(args)[layer_id]), args.head_dim, init_seed=args.seed + layer_id, init_std=args.table_init_std
        )
        self.wk = nn.Linear(args.memory_dim, dim, bias=False)
        self.wv = nn.Linear(args.memory_dim, dim, bias=False)
        self.key_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.query_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.conv_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.conv = nn.Conv1d(
            dim, dim, kernel_size=args.kernel_size, dilation=args.max_ngram, groups=dim, bias=False
        )
        # Gate statistics of the forwards since the last `pop_gate_stats` (sum, sum of squares, count).
        self.register_buffer("gate_stats", torch.zeros(3), persistent=False)
        # Context parallelism installs a hook that supplies the conv's left context from other
        # ranks (trainer/parallel/context_parallel.py); None = the sequence is whole on this device.
        self.context_exchange = None

    def forward(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """h: `[B, S, dim]` residual stream; rows: `[B, S, H, D_h]`. Returns Y `[B, S, dim]`."""
        e = rows.flatten(-2).to(h.dtype)  # [B, S, H, D_h] -> [B, S, d_mem]
        k = self.wk(e)
        v = self.wv(e)
        s = (self.query_norm(h).float() * self.key_norm(k).float()).sum(-1) / math.sqrt(self.dim)  # [B, S]
        s = torch.sign(s) * torch.sqrt(s.abs().clamp_min(_GATE_EPS))
        alpha = torch.sigmoid(s)
        with torch.no_grad():
            self.gate_stats += torch.stack(
                [alpha.sum(), alpha.square().sum(), alpha.new_tensor(alpha.numel())]
            ).to(self.gate_stats.dtype)
        value = alpha.unsqueeze(-1).to(v.dtype) * v  # [B, S, dim]
        x = self.conv_norm(value)
        # Causal: the output at t sees t, t-N, ..., t-(kernel-1)*N.
        context = (self.kernel_size - 1) * self.max_ngram
        if self.context_exchange is None:
            conv_out = self._valid_conv(F.pad(x, (0, 0, context, 0)))
        else:
            conv_out = self.context_exchange(x, self._valid_conv, context)
        return value + F.silu(conv_out)

    def _valid_conv(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, context + S, dim]` (the S positions after their left context) -> `[B, S, dim]`."""
        return self.conv(x.transpose(1, 2)).transpose(1, 2)

    @torch.no_grad()
    def pop_gate_stats(self) -> tuple[float, float]:
        """(mean, std) of the gate alpha over the forwards since the last call; resets the sums."""
        total, sq, count = self.gate_stats.tolist()
        self.gate_stats.zero_()
        if count == 0:
            return math.nan, math.nan
        mean = total / count
        return mean, math.sqrt(max(sq / count - mean * mean, 0.0))

    @torch.no_grad()
    def init_weights(self, out_std: float) -> None:
        """Table N(0, table_init_std) by seeded row blocks; W_K std 0.02; W_V (writes into the
        residual stream, like an output projection) the block's depth-scaled `out_std`; conv zero."""
        self.table.init_weights()
        nn.init.trunc_normal_(self.wk.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wv.weight, mean=0.0, std=out_std)
        for norm in (self.key_norm, self.query_norm, self.conv_norm):
            norm.reset_parameters()
        nn.init.zeros_(self.conv.weight)
        self.gate_stats.zero_()


def engram_modules(model: nn.Module) -> list[Engram]:
    """Every Engram module of `model`, in block order."""
    return [m for m in model.modules() if isinstance(m, Engram)]


def engram_table_params(model: nn.Module) -> list[nn.Parameter]:
    """The table weights (their own optimizer group: higher LR, no weight decay)."""
    return [m.table.weight for m in engram_modules(model)]


def engram_metrics(model: nn.Module) -> dict[str, float]:
    """Gate mean/std per Engram layer (since the last call) and table rows/bytes on this rank."""
    out: dict[str, float] = {}
    rows = nbytes = 0
    for m in engram_modules(model):
        mean, std = m.pop_gate_stats()
        out[f"engram/gate_mean/layer{m.layer_id}"] = mean
        out[f"engram/gate_std/layer{m.layer_id}"] = std
        w = m.table.weight
        rows += w.shape[0]
        nbytes += w.numel() * w.element_size()
    if out:
        out["engram/table_rows_per_rank"] = rows
        out["engram/table_bytes_per_rank"] = nbytes
    return out
