"""Owned Newton-Schulz: each sharded Muon matrix is orthogonalised by one rank of its group.

Newton-Schulz (NS) needs a whole matrix. Gathering every sharded matrix on every rank and
orthogonalising it there makes each rank pay the whole model's NS whatever the world size.
Instead (as torchtitan's DistMuon, Megatron's layer-wise distributed optimizer and Dion do):

* the ranks that hold a matrix (its DTensor mesh: FSDP, HSDP's replicas, TP, a pipeline stage's
  data-parallel ranks) agree on one owner per matrix, by longest-processing-time-first balancing
  of the NS cost (`assign_owners`): a pure function of the shapes and the group size, so every
  rank computes the same owners with no communication, and benchmarks/optim_bench.py computes
  the 671B figures with the same code (`owned_ns_flops`);
* the matrices move in buckets of whole tensors, one `all_to_all_single` per bucket and
  direction (`OwnedExchange`): each holder sends its part of the update to the owner, the owner
  assembles the matrix, orthogonalises it, and sends each holder its part of the result. Replicas
  (HSDP's replicate dim, replicated placements) send nothing: the first replica's parts make the
  matrix; every replica gets the result.

Where each element of a rank's part sits in the whole matrix is read from DTensor itself
(`trainer.distributed.local_flat_indices`), so every placement DTensor has (FSDP's strided shards
on TP's, uneven shards) moves exactly, and the owner's matrix is bitwise the gathered one: every
layout's update stays one process's. The index maps are exchanged once, when the plan is built.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.distributed import is_first_replica, local_flat_indices, mesh_ranks


def ns_flops(shape: Sequence[int], ns_steps: int) -> float:
    """FLOPs of `ns_steps` quintic NS iterations on an `A x B` matrix, or on each matrix of a stack
    `[..., A, B]`: per iteration `X X^T` (2 s^2 l), `G G` (2 s^3) and `(.) X` (2 s^2 l), s and l the
    short and long dims, i.e. `2 ns_steps s^2 (2 l + s)`."""
    s, l = sorted(shape[-2:])
    count = 1
    for n in shape[:-2]:
        count *= n
    return 2.0 * count * ns_steps * s * s * (2 * l + s)


def assign_owners(costs: Sequence[float], ranks: int, base: Sequence[float] | None = None) -> list[int]:
    """The owner (0 .. ranks-1) of each of the matrices costing `costs`: longest processing time
    first, each to the least-loaded rank (ties to the lower rank, equal costs in their given order),
    starting from `base` (work the ranks already have). Deterministic: the same on every rank."""
    heap = [(0.0 if base is None else float(base[r]), r) for r in range(ranks)]
    heapq.heapify(heap)
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(heap)
        owners[i] = r
        heapq.heappush(heap, (load + costs[i], r))
    return owners


def owned_ns_flops(shapes: Sequence[Sequence[int]], ranks: int, ns_steps: int) -> list[float]:
    """NS FLOPs of each of a group's `ranks` ranks for matrices `shapes` sharded over that group,
    owners from `assign_owners` (what `OwnedExchange` does)."""
    costs = [ns_flops(s, ns_steps) for s in shapes]
    per_rank = [0.0] * ranks
    for cost, owner in zip(costs, assign_owners(costs, ranks)):
        per_rank[owner] += cost
    return per_rank


def _exchange(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    recv = send.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    return recv


@dataclass
class _Bucket:
    """One bucket's static layout. Sending side: `send_splits` (elements to each group rank, this
    rank's parts of their matrices, first replicas only) and, for the results, `back_recv_splits`
    and `back_params` (position in the plan, local shape) in arrival order. Owner side: its matrices
    (`owned`: position, offset in the assembled buffer, shape), `gather_idx` (where each received
    element goes), `recv_splits`, `scatter_idx` and `back_send_splits` (each holder's part)."""

    send_params: list[int] = field(default_factory=list)
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)
    gather_idx: torch.Tensor | None = None
    owned: list[tuple[int, int, torch.Size]] = field(default_factory=list)
    numel: int = 0
    scatter_idx: torch.Tensor | None = None
    back_send_splits: list[int] = field(default_factory=list)
    back_recv_splits: list[int] = field(default_factory=list)
    back_params: list[tuple[int, torch.Size]] = field(default_factory=list)


class OwnedExchange:
    """Moves the sharded Muon matrices `params` (DTensors, all on meshes of the same ranks) to
    their owners and the results back, in buckets of at most `bucket_bytes` of whole matrices.
    Building it is a collective of the group (index maps, once)."""

    def __init__(self, params: Sequence[DTensor], ns_steps: int, bucket_bytes: int):
        self.params = list(params)
        ranks = mesh_ranks(self.params[0].device_mesh)
        world = dist.get_world_size()
        # The group's own process group: the params' mesh may span several mesh dims (HSDP's
        # replicate and shard, FSDP x TP); only its members create it (a pipeline stage's ranks).
        self.group = (dist.group.WORLD if ranks == list(range(world))
                      else dist.new_group(ranks, use_local_synchronization=True))
        self.size = len(ranks)
        self.owners = assign_owners([ns_flops(p.shape, ns_steps) for p in self.params], self.size)
        me = dist.get_rank(self.group)
        self.buckets = [self._plan(b, me) for b in self._bucketed(bucket_bytes)]

    def _bucketed(self, bucket_bytes: int) -> list[list[int]]:
        buckets: list[list[int]] = [[]]
        size = 0
        for i, p in enumerate(self.params):
            nbytes = p.numel() * p.element_size()
            if buckets[-1] and size + nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(i)
            size += nbytes
        return buckets

    def _plan(self, members: list[int], me: int) -> _Bucket:
        b = _Bucket()
        by_owner = [[i for i in members if self.owners[i] == r] for r in range(self.size)]
        order = [i for r in range(self.size) for i in by_owner[r]]
        indices = {i: local_flat_indices(self.params[i]) for i in order}
        first = {i: is_first_replica(self.params[i]) for i in order}
        device = self.params[0].device
        # Sizes first (each holder's part of each matrix, and whether it is a first replica), then
        # the index maps themselves: both as the results will move, holders -> owner.
        sizes = torch.tensor([v for i in order for v in (indices[i].numel(), int(first[i]))], dtype=torch.int64,
                             device=device)
        counts = [2 * len(by_owner[r]) for r in range(self.size)]
        got = _exchange(sizes, counts, [2 * len(by_owner[me])] * self.size, self.group).view(
            self.size, len(by_owner[me]), 2).tolist()
        idx = torch.cat([indices[i] for i in order]) if order else torch.empty(0, dtype=torch.int64, device=device)
        sent = [sum(indices[i].numel() for i in by_owner[r]) for r in range(self.size)]
        got_idx = _exchange(idx, sent, [sum(n for n, _ in got[r]) for r in range(self.size)], self.group)
        offsets = {}
        for i in by_owner[me]:
            offsets[i] = b.numel
            b.owned.append((i, b.numel, self.params[i].shape))
            b.numel += self.params[i].numel()
        gather, scatter, pos = [], [], 0
        for r in range(self.size):
            gathered = 0
            for (n, is_first), i in zip(got[r], by_owner[me]):
                part = got_idx[pos:pos + n] + offsets[i]
                pos += n
                scatter.append(part)
                if is_first:
                    gather.append(part)
                    gathered += n
            b.recv_splits.append(gathered)
            b.back_send_splits.append(sum(n for n, _ in got[r]))
        empty = torch.empty(0, dtype=torch.int64, device=device)
        b.gather_idx = torch.cat(gather) if gather else empty
        b.scatter_idx = torch.cat(scatter) if scatter else empty
        b.send_params = [i for i in order if first[i]]
        b.send_splits = [sum(indices[i].numel() for i in by_owner[r] if first[i]) for r in range(self.size)]
        b.back_recv_splits = sent
        b.back_params = [(i, self.params[i].to_local().shape) for i in order]
        return b

    def run(self, updates: Sequence[torch.Tensor], orthogonalize, dtype: torch.dtype) -> list[torch.Tensor]:
        """This rank's part of `orthogonalize(M)` (of dtype `dtype`) for each matrix `M` whose
        parts `updates` are (local tensors, in `params` order); `orthogonalize` runs here only on
        this rank's own matrices. The next bucket's matrices travel while this one's are
        orthogonalised."""
        out: list[torch.Tensor | None] = [None] * len(self.params)
        pending = self._send(self.buckets[0], updates)
        for k, b in enumerate(self.buckets):
            recv, work = pending
            if k + 1 < len(self.buckets):
                pending = self._send(self.buckets[k + 1], updates)
            work.wait()
            full = recv.new_empty(b.numel)
            full.index_copy_(0, b.gather_idx, recv)
            results = [orthogonalize(full[off:off + shape.numel()].view(shape)).reshape(-1) for _, off, shape in b.owned]
            flat = torch.cat(results) if results else full.new_empty(0, dtype=dtype)
            back = _exchange(flat.index_select(0, b.scatter_idx), b.back_send_splits, b.back_recv_splits, self.group)
            pos = 0
            for i, shape in b.back_params:
                out[i] = back[pos:pos + shape.numel()].view(shape)
                pos += shape.numel()
        return out

    def _send(self, b: _Bucket, updates: Sequence[torch.Tensor]):
        parts = [updates[i].reshape(-1) for i in b.send_params]
        send = torch.cat(parts) if parts else updates[0].new_empty(0)
        recv = send.new_empty(sum(b.recv_splits))
        work = dist.all_to_all_single(recv, send, b.recv_splits, b.send_splits, group=self.group, async_op=True)
        return recv, work
