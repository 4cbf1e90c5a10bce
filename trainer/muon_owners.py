"""Owned Newton-Schulz: each sharded Muon matrix is orthogonalised by one rank.

Newton-Schulz (NS) needs a whole matrix. Gathering every sharded matrix on every rank and
orthogonalising it there makes each rank pay the whole model's NS whatever the world size.
Instead (as torchtitan's DistMuon, Megatron's layer-wise distributed optimizer and Dion do):

* every matrix held by several ranks (its DTensor mesh: FSDP, HSDP's replicas, TP, a pipeline
  stage's data-parallel ranks) gets one owner, by longest-processing-time-first balancing of the
  NS cost over all ranks, starting from the expert stacks each rank orthogonalises anyway
  (`assign_owners`): a pure function of the shapes and rank count, so every rank computes the
  same owners, and benchmarks/optim_bench.py computes the 671B figures with the same code;
* the matrices move in buckets of whole tensors, one `all_to_all_single` per bucket and
  direction (`OwnedExchange`): each holder sends its part of the update to the owner, the owner
  assembles the matrix, orthogonalises it, and sends each holder its part of the result. Replicas
  (HSDP's replicate dim, replicated placements) send nothing: the first replica's parts make the
  matrix; every replica gets the result.

Where each element of a rank's part sits in the whole matrix is read from DTensor itself
(`trainer.distributed.local_flat_indices`), so every placement DTensor has (FSDP's strided shards
on TP's, uneven shards) moves exactly, and the owner's matrix is bitwise the gathered one: every
layout's update stays one process's. The index maps are exchanged once, when the plan is built.
Hand-rolled rather than DTensor redistributions: those would be one collective per parameter and
would deliver every matrix to every rank of its mesh.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.distributed import all_gather_objects, is_first_replica, local_flat_indices, mesh_ranks


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


def _exchange(send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
    recv = send.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv, send, recv_splits, send_splits)
    return recv


def consecutive_runs(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """The indices of `sizes` in consecutive runs summing to at most `limit` (or one item)."""
    runs: list[list[int]] = [[]]
    total = 0
    for i, size in enumerate(sizes):
        if runs[-1] and total + size > limit:
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += size
    return runs


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
    """Moves this rank's sharded Muon matrices `params` (2-D DTensors held by several ranks) to
    their owners and the results back, in buckets of at most `bucket_bytes` of whole matrices, over
    the default process group. `base_flops` is the NS work this rank does anyway (its expert
    stacks). Building it is a collective of all ranks (the matrix lists and index maps, once).

    Owners are chosen over all ranks, not only a matrix's holders: a pipeline stage's ranks hold
    only that stage's matrices, and stages differ in NS work (the debug model's first stage has
    twice the second's), so owners within the stage would leave the busiest rank's work where
    the stage split put it."""

    def __init__(self, params: Sequence[DTensor], base_flops: float, ns_steps: int, bucket_bytes: int):
        self.params = list(params)
        # What moves to the owners: the updates, in the parameters' dtype.
        self.dtype = self.params[0].dtype if self.params else torch.float32
        self.device = self.params[0].device if self.params else torch.device("cpu")
        seen: dict[tuple[int, ...], int] = {}
        mine = []
        for p in self.params:
            holders = tuple(mesh_ranks(p.device_mesh))
            seen[holders] = seen.get(holders, -1) + 1
            mine.append(((holders, seen[holders]), tuple(p.shape), p.element_size()))
        gathered = all_gather_objects((mine, base_flops))
        catalogue = {key: (shape, size) for entries, _ in gathered for key, shape, size in entries}
        # One order on every rank: by holders, then position in the holders' common parameter order.
        self.keys = sorted(catalogue)
        self.shapes = [catalogue[k][0] for k in self.keys]
        costs = [ns_flops(shape, ns_steps) for shape in self.shapes]
        self.owners = assign_owners(costs, len(gathered), [base for _, base in gathered])
        self.local = {key: i for i, (key, _, _) in enumerate(mine)}
        sizes = [math.prod(shape) * catalogue[k][1] for k, shape in zip(self.keys, self.shapes)]
        self.buckets = [self._plan(b, dist.get_rank(), len(gathered)) for b in consecutive_runs(sizes, bucket_bytes)]

    def _plan(self, members: list[int], me: int, world: int) -> _Bucket:
        b = _Bucket()
        # Matrices this rank holds, by owner; matrices this rank owns, by holder.
        to = [[m for m in members if self.owners[m] == r and self.keys[m] in self.local] for r in range(world)]
        held_by = [[m for m in members if self.owners[m] == me and r in self.keys[m][0]] for r in range(world)]
        order = [m for r in range(world) for m in to[r]]
        local = {m: self.params[self.local[self.keys[m]]] for m in order}
        indices = {m: local_flat_indices(local[m]) for m in order}
        first = {m: is_first_replica(local[m]) for m in order}
        device = self.device
        # Sizes first (each holder's part of each matrix, and whether it is a first replica), then
        # the index maps themselves: both as the results will move, holders -> owner.
        sizes = torch.tensor([v for m in order for v in (indices[m].numel(), int(first[m]))], dtype=torch.int64,
                             device=device)
        got_sizes = _exchange(sizes, [2 * len(t) for t in to], [2 * len(h) for h in held_by])
        got = [[] for _ in range(world)]
        flat = got_sizes.tolist()
        pos = 0
        for r in range(world):
            got[r] = [(flat[pos + 2 * j], flat[pos + 2 * j + 1]) for j in range(len(held_by[r]))]
            pos += 2 * len(held_by[r])
        empty = torch.empty(0, dtype=torch.int64, device=device)
        idx = torch.cat([indices[m] for m in order]) if order else empty
        sent = [sum(indices[m].numel() for m in to[r]) for r in range(world)]
        got_idx = _exchange(idx, sent, [sum(n for n, _ in got[r]) for r in range(world)])
        offsets = {}
        for m in members:
            if self.owners[m] == me:
                offsets[m] = b.numel
                shape = torch.Size(self.shapes[m])
                b.owned.append((m, b.numel, shape))
                b.numel += shape.numel()
        gather, scatter, pos = [], [], 0
        for r in range(world):
            gathered = 0
            for (n, is_first), m in zip(got[r], held_by[r]):
                part = got_idx[pos:pos + n] + offsets[m]
                pos += n
                scatter.append(part)
                if is_first:
                    gather.append(part)
                    gathered += n
            b.recv_splits.append(gathered)
            b.back_send_splits.append(sum(n for n, _ in got[r]))
        b.gather_idx = torch.cat(gather) if gather else empty
        b.scatter_idx = torch.cat(scatter) if scatter else empty
        b.send_params = [self.local[self.keys[m]] for m in order if first[m]]
        b.send_splits = [sum(indices[m].numel() for m in to[r] if first[m]) for r in range(world)]
        b.back_recv_splits = sent
        b.back_params = [(self.local[self.keys[m]], local[m].to_local().shape) for m in order]
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
            back = _exchange(flat.index_select(0, b.scatter_idx), b.back_send_splits, b.back_recv_splits)
            pos = 0
            for i, shape in b.back_params:
                out[i] = back[pos:pos + shape.numel()].view(shape)
                pos += shape.numel()
        return out

    def _send(self, b: _Bucket, updates: Sequence[torch.Tensor]):
        parts = [updates[i].reshape(-1).to(self.dtype) for i in b.send_params]
        send = torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype, device=self.device)
        recv = send.new_empty(sum(b.recv_splits))
        work = dist.all_to_all_single(recv, send, b.recv_splits, b.send_splits, async_op=True)
        return recv, work
