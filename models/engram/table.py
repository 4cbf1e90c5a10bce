"""The multi-head Engram table of one layer and the lookup interface the model calls.

The table stacks the (N-1)*K hash heads of a layer into one `[sum(primes), D_h]` weight (head
offsets = exclusive cumsum of the primes, already added by `NgramHasher`). Embedding parallelism
shards the rows; the table then holds rows `[row_start, row_start + weight.shape[0])` of
`num_rows` and the lookup object routes ids to their owners. The model never sees the difference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# Rows drawn per seeded init block: initial values depend only on (seed, global row), so a table
# sharded over any number of ranks starts from exactly the unsharded values.
_INIT_BLOCK_ROWS = 1 << 16


class EngramTable(nn.Module):
    """`weight`: `[num_rows, head_dim]` (or a contiguous row shard of it).

    Args:
        num_rows: rows of the whole table (sum of the layer's head primes).
        head_dim: width D_h of a row.
        init_seed: seed of the row init (per layer, so layers differ).
        init_std: std of the N(0, std) row init.
    """

    def __init__(self, num_rows: int, head_dim: int, init_seed: int, init_std: float = 1.0):
        super().__init__()
        self.num_rows = num_rows
        self.head_dim = head_dim
        self.init_seed = init_seed
        self.init_std = init_std
        self.row_start = 0
        self.weight = nn.Parameter(torch.empty(num_rows, head_dim))

    def shard_(self, row_start: int, num_local_rows: int) -> None:
        """Keep rows `[row_start, row_start + num_local_rows)` only (called by embedding parallelism
        before the optimizer exists; on the meta device, or copying the rows of a built table)."""
        weight = self.weight.detach()
        local = weight[row_start : row_start + num_local_rows].clone()
        self.weight = nn.Parameter(local, requires_grad=self.weight.requires_grad)
        self.row_start = row_start

    @torch.no_grad()
    def init_weights(self) -> None:
        weight, start = self.weight, self.row_start
        if isinstance(weight, DTensor):
            # A whole table sharded by FSDP (embedding_parallel_degree 1): fill the local rows
            # from their global offset, so the values are again those of the unsharded table.
            _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
            weight, start = weight.to_local(), offset[0]
        local_rows = weight.shape[0]
        end = start + local_rows
        if local_rows == 0:
            return
        first_block, last_block = start // _INIT_BLOCK_ROWS, (end - 1) // _INIT_BLOCK_ROWS
        gen = torch.Generator(device=weight.device)
        for block in range(first_block, last_block + 1):
            b_start = block * _INIT_BLOCK_ROWS
            b_rows = min(_INIT_BLOCK_ROWS, self.num_rows - b_start)
            gen.manual_seed(self.init_seed * 1_000_003 + block)
            values = torch.randn(b_rows, self.head_dim, generator=gen, device=weight.device)
            lo, hi = max(start, b_start), min(end, b_start + b_rows)
            weight[lo - start : hi - start].copy_(values[lo - b_start : hi - b_start] * self.init_std)

    def extra_repr(self) -> str:
        return (
            f"num_rows={self.num_rows}, head_dim={self.head_dim}, "
            f"local_rows=[{self.row_start}, {self.row_start + self.weight.shape[0]})"
        )


class EngramLookup:
    """Interface: fetch the rows of every Engram layer of a step.

    Contract:
    - `__call__(tables, ids)` with `tables` the L `EngramTable`s in layer order and `ids`
      `[B, S, L, H]` int64 global rows; returns a sequence whose item i is `[B, S, H, D_h]`
      (the rows of `tables[i]`), differentiable with respect to the tables' weights.
    - Item i may be computed when it is first read; the model reads item i right before
      block `layer_ids[i]` runs, so an implementation can exchange all layers at once
      (precompute) or one layer at a time.
    - Implementations decorate their communication with `torch.compiler.disable`.
    The single-device model uses `LocalEngramLookup`; embedding parallelism swaps in
    `trainer.parallel.engram_parallel.ShardedEngramLookup` (all-to-all to the row owners).
    """

    def __call__(self, tables: Sequence[EngramTable], ids: torch.Tensor) -> Sequence[torch.Tensor]:
        raise NotImplementedError


class LocalEngramLookup(EngramLookup):
    """Whole tables on this device: a plain embedding gather per layer."""

    def __call__(self, tables: Sequence[EngramTable], ids: torch.Tensor) -> list[torch.Tensor]:
        return [F.embedding(ids[:, :, i], table.weight) for i, table in enumerate(tables)]
