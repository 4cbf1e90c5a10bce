"""Owned Newton-Schulz: each Muon matrix held by several ranks is orthogonalised by one rank.

Newton-Schulz (NS) needs a whole matrix. Gathering every sharded matrix on every rank and
orthogonalising it there makes each rank pay the whole model's NS whatever the world size.
Instead (as torchtitan's DistMuon, Megatron's layer-wise distributed optimizer and Dion do):

* every matrix held by several ranks gets one owner, by longest-processing-time-first balancing
  of the NS cost (`assign_owners`), in one pass over all of them: a 2-D matrix (its DTensor mesh:
  FSDP, HSDP's replicas, TP, a pipeline stage's data-parallel ranks) among all ranks; an expert
  matrix of a stack whose expert-parallel slice several ranks hold (efsdp shards, replicas, and
  TP's ranks, which all hold the same routed experts) among those ranks (`expert_group` joined
  with the tp peers, `_joined_groups`); starting from the NS work each rank does anyway (stacks it holds
  alone). A pure function of the shapes and groups, so every rank computes the same owners, and
  benchmarks/optim_bench.py computes the 671B figures with the same code;
* the matrices move in buckets of whole tensors, one `all_to_all_single` per bucket and
  direction (`OwnedExchange`): each holder sends its part of the update to the owner, the owner
  assembles the matrix, orthogonalises it (expert matrices: one batched call per shape and
  bucket), and sends each holder its part of the result. Of replicas (HSDP's replicate dim,
  replicated placements) one sends: the first replica's parts make a 2-D matrix, and a whole
  expert matrix comes from the owner's own copy or one holder; every replica gets the result.

Where each element of a rank's part of a 2-D matrix sits in the whole matrix is read from DTensor
itself (`trainer.distributed.local_flat_indices`), so every placement DTensor has (FSDP's strided
shards on TP's, uneven shards) moves exactly, and the owner's matrix is bitwise the gathered one:
every layout's update stays one process's. The index maps are exchanged once, when the plan is
built; expert matrices are whole wherever they are held and need none. Hand-rolled rather than
DTensor redistributions: those would be one collective per parameter and would deliver every
matrix to every rank of its mesh.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.distributed import all_gather_objects, is_first_replica, local_flat_indices, local_part, mesh_ranks


def ns_flops(shape: Sequence[int], ns_steps: int) -> float:
    """FLOPs of `ns_steps` quintic NS iterations on an `A x B` matrix, or on each matrix of a stack
    `[..., A, B]`: per iteration `X X^T` (2 s^2 l), `G G` (2 s^3) and `(.) X` (2 s^2 l), s and l the
    short and long dims, i.e. `2 ns_steps s^2 (2 l + s)`."""
    s, l = sorted(shape[-2:])
    count = 1
    for n in shape[:-2]:
        count *= n
    return 2.0 * count * ns_steps * s * s * (2 * l + s)


def assign_owners(
    costs: Sequence[float], ranks: int, base: Sequence[float] | None = None,
    candidates: Sequence[Sequence[int] | None] | None = None, holders: Sequence[Sequence[int] | None] | None = None,
) -> list[int]:
    """The owner (0 .. ranks-1) of each of the matrices costing `costs`: longest processing time
    first, each to the least-loaded rank among its `candidates` (None: any rank; ties to the lower
    rank, equal costs in their given order), starting from `base` (work the ranks already have).
    A matrix some ranks hold whole (`holders`, among its candidates) stays with its least-loaded
    holder while that holder's load is below the least-loaded candidate's plus the matrix's cost
    (balance gives up at most one more matrix's cost, and a layout that already spreads its
    experts evenly moves none).
    Deterministic: the same on every rank.

    One pass over all matrices, whatever their candidate sets, so a rank that takes a large
    matrix takes fewer of the small ones that only its group may own. One heap per candidate set;
    an entry goes stale when its rank takes a matrix through another set (or as a holder), and
    loads only grow, so a stale entry at the top is refreshed before it is used."""
    load = [0.0 if base is None else float(base[r]) for r in range(ranks)]
    heaps: dict[tuple[int, ...] | None, list[tuple[float, int]]] = {}
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        pool = None if candidates is None or candidates[i] is None else tuple(candidates[i])
        if pool not in heaps:
            heaps[pool] = [(load[r], r) for r in (range(ranks) if pool is None else pool)]
            heapq.heapify(heaps[pool])
        heap = heaps[pool]
        while heap[0][0] != load[heap[0][1]]:
            heapq.heapreplace(heap, (load[heap[0][1]], heap[0][1]))
        r = heap[0][1]
        if holders is not None and holders[i]:
            h = min(holders[i], key=lambda x: (load[x], x))
            r = h if load[h] < load[r] + costs[i] else r
        owners[i] = r
        load[r] += costs[i]
        if r == heap[0][1]:
            heapq.heapreplace(heap, (load[r], r))
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


def expert_group(p: torch.Tensor) -> tuple[int, ...]:
    """The ranks among which each expert matrix of the stack `p` (`[E, A, B]`, sharded on dim 0
    only) gets its owner, as far as its own mesh tells: those of its mesh that hold the same
    expert-parallel slice, i.e. its efsdp shards and replicas (the mesh's ranks with this rank's
    "ep" coordinate; every rank of a mesh without an "ep" dim; this rank alone for a plain
    tensor). Expert-parallel ranks hold different experts, so owners stay within the slice and
    experts never cross EP groups. Replicas outside the mesh (TP's, which leaves the routed
    experts whole on every tp rank) join it in `OwnedExchange` (`_joined_groups`)."""
    if not isinstance(p, DTensor):
        return (dist.get_rank(),)
    names = p.device_mesh.mesh_dim_names or ()
    return tuple(mesh_ranks(p.device_mesh, same_as_me="ep" if "ep" in names else None))


@dataclass
class _Bucket:
    """One bucket's static layout. Its matrices are all of one kind: parts with index maps
    (`gather_idx` set), or whole expert matrices. Sending side: `send_pieces` (position in
    `params`, expert index in the local stack or None; one copy of each matrix), `send_splits`, and for the
    results `back_recv_splits` and `back_pieces` (position, expert index, shape) in arrival order.
    Owner side: `owned` (plan index, offset in the assembled or received buffer, shape),
    `recv_splits`, `back_send_splits`; for parts `gather_idx` (where each received element goes)
    and `scatter_idx` / `scatter_spans` (each distinct part once, and where parts repeat, each
    holder's part as a span of those: replicas hold the same part, so the maps stay the matrix's
    size however many replicas there are); for whole matrices `back_order` (the owned matrices
    in the order the holders get them), `kept` / `kept_back` (plan index, position in `params`,
    expert index: owned matrices this rank sends itself, and holds itself) and `silent`."""

    send_pieces: list[tuple[int, int | None]] = field(default_factory=list)
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)
    owned: list[tuple[int, int, torch.Size]] = field(default_factory=list)
    numel: int = 0
    gather_idx: torch.Tensor | None = None
    scatter_idx: torch.Tensor | None = None
    scatter_spans: list[tuple[int, int]] | None = None
    back_order: list[int] = field(default_factory=list)
    back_send_splits: list[int] = field(default_factory=list)
    back_recv_splits: list[int] = field(default_factory=list)
    back_pieces: list[tuple[int, int | None, torch.Size]] = field(default_factory=list)
    kept: list[tuple[int, int, int]] = field(default_factory=list)
    kept_back: list[tuple[int, int, int]] = field(default_factory=list)
    silent: bool = False


class OwnedExchange:
    """Moves this rank's Muon matrices held by several ranks to their owners and the results back,
    over the default process group. `params` are 2-D DTensors on meshes of several ranks (each one
    matrix, in parts) and expert stacks `[E, A, B]` sharded on dim 0 only (or plain) whose
    `expert_group` has several ranks or that `expert_replicas` (this rank and the ranks holding
    the same stacks outside their mesh: its tp peers) replicate (each expert one whole matrix,
    held by one rank per replica). `base_flops` is the NS work this rank does anyway (stacks it
    holds alone). Building it is a collective of all ranks (the matrix lists, once, and the index
    maps of the 2-D parts).

    2-D matrices may be owned by any rank, not only their holders: a pipeline stage's ranks hold
    only that stage's matrices, and stages differ in NS work (the debug model's first stage has
    twice the second's), so owners within the stage would leave the busiest rank's work where the
    stage split put it. Expert matrices are owned within their `expert_group`. Both kinds go
    through one `assign_owners` pass.

    Buckets are consecutive runs of the plan in which no rank assembles more than `bucket_bytes`
    of whole matrices or holds more than `bucket_bytes` of parts, each one all-to-all per
    direction over all ranks: disjoint expert groups share a bucket, so the count of collectives
    follows the busiest rank's bytes, not the world's."""

    def __init__(self, params: Sequence[torch.Tensor], base_flops: float, ns_steps: int, bucket_bytes: int,
                 expert_replicas: Sequence[int] = ()):
        self.params = list(params)
        # What moves to the owners: the updates, in the parameters' dtype.
        self.dtype = self.params[0].dtype if self.params else torch.float32
        self.device = self.params[0].device if self.params else torch.device("cpu")
        me = dist.get_rank()
        seen: dict[tuple, int] = {}
        mine = []  # (key, matrix shape, element size, elements held here, first replica, owner pool)
        local: dict[tuple, tuple[int, int | None]] = {}  # key -> (position in params, expert index)
        for i, p in enumerate(self.params):
            size = p.element_size()
            if p.ndim == 2:
                holders = tuple(mesh_ranks(p.device_mesh))
                n = seen[holders] = seen.get(holders, -1) + 1
                key = (0, holders, n)
                mine.append((key, tuple(p.shape), size, p.to_local().numel(), is_first_replica(p), None))
                local[key] = (i, None)
                continue
            group = expert_group(p)
            n = seen[group, "experts"] = seen.get((group, "experts"), -1) + 1
            experts = (local_part(torch.arange(p.shape[0], device=p.device), p).tolist() if isinstance(p, DTensor)
                       else range(p.shape[0]))
            for j, e in enumerate(experts):
                key = (1, group, n, e)
                mine.append((key, tuple(p.shape[1:]), size, math.prod(p.shape[1:]), True, group))
                local[key] = (i, j)
        gathered = all_gather_objects((mine, base_flops, tuple(expert_replicas)))
        world = len(gathered)
        # An expert's key names the group its own mesh gives; ranks that replicate the stacks
        # outside that mesh (tp peers) hold the same experts under their own groups: one group.
        joined = _joined_groups([key[1] for entries, _, _ in gathered for key, *_ in entries if key[0] == 1]
                                + [replicas for _, _, replicas in gathered if replicas])

        def join(key: tuple) -> tuple:
            return key if key[0] == 0 else (1, joined[key[1]], *key[2:])
        self.local = {join(key): where for key, where in local.items()}
        catalogue: dict[tuple, tuple] = {}
        parts_of: dict[tuple, dict[int, tuple[int, bool]]] = {}  # key -> {holder: (elements, first replica)}
        for r, (entries, _, _) in enumerate(gathered):
            for key, shape, size, numel, first, pool in entries:
                key = join(key)
                catalogue[key] = (shape, size, None if pool is None else key[1])
                parts_of.setdefault(key, {})[r] = (numel, first)
        self.keys = sorted(catalogue, key=_plan_order(catalogue, parts_of))
        self.shapes = [catalogue[k][0] for k in self.keys]
        self.parts = [parts_of[k] for k in self.keys]
        costs = [ns_flops(shape, ns_steps) for shape in self.shapes]
        pools = [catalogue[k][2] for k in self.keys]
        held = [None if pool is None else sorted(parts) for pool, parts in zip(pools, self.parts)]
        self.owners = assign_owners(costs, world, [base for _, base, _ in gathered], pools, held)
        self.buckets = []
        for run in self._runs([catalogue[k][1] for k in self.keys], bucket_bytes):
            plan = self._plan_whole if self.keys[run[0]][0] == 1 else self._plan_parts
            self.buckets.append(plan(run, me, world))

    def owned_keys(self) -> list[tuple]:
        """The plan keys of the matrices this rank orthogonalises."""
        return [k for k, o in zip(self.keys, self.owners) if o == dist.get_rank()]

    def _runs(self, sizes: list[int], limit: int) -> list[list[int]]:
        """The buckets: consecutive runs of the plan (element sizes `sizes`) of one kind, within
        `limit` bytes per rank (see the class docstring), or one matrix."""
        runs: list[list[int]] = []
        owned: dict[int, int] = {}
        held: dict[int, int] = {}
        for m, key in enumerate(self.keys):
            whole = math.prod(self.shapes[m]) * sizes[m]
            parts = {r: n * sizes[m] for r, (n, _) in self.parts[m].items()}
            fits = (runs and self.keys[runs[-1][0]][0] == key[0]
                    and owned.get(self.owners[m], 0) + whole <= limit
                    and all(held.get(r, 0) + b <= limit for r, b in parts.items()))
            if not fits:
                runs.append([])
                owned, held = {}, {}
            runs[-1].append(m)
            owned[self.owners[m]] = owned.get(self.owners[m], 0) + whole
            for r, b in parts.items():
                held[r] = held.get(r, 0) + b
        return runs

    def _plan_parts(self, members: list[int], me: int, world: int) -> _Bucket:
        """A bucket of 2-D matrices in parts: the index maps of the parts go to the owners once."""
        b = _Bucket()
        # Matrices this rank holds, by owner; matrices this rank owns, by holder.
        to = [[m for m in members if self.owners[m] == r and me in self.parts[m]] for r in range(world)]
        held_by = [[m for m in members if self.owners[m] == me and r in self.parts[m]] for r in range(world)]
        order = [m for r in range(world) for m in to[r]]
        local = {m: self.params[self.local[self.keys[m]][0]] for m in order}
        # Each element's place within its matrix; int32 where the matrices allow, to halve what moves.
        wire = torch.int32 if all(math.prod(self.shapes[m]) < 2**31 for m in members) else torch.int64
        indices = [local_flat_indices(local[m]).to(wire) for m in order]
        empty = torch.empty(0, dtype=wire, device=self.device)
        sent = [sum(self.parts[m][me][0] for m in to[r]) for r in range(world)]
        got_idx = _exchange(torch.cat(indices) if indices else empty, sent,
                            [sum(self.parts[m][r][0] for m in held_by[r]) for r in range(world)])
        offsets = {}
        for m in members:
            if self.owners[m] == me:
                offsets[m] = b.numel
                shape = torch.Size(self.shapes[m])
                b.owned.append((m, b.numel, shape))
                b.numel += shape.numel()
        # int32 where it reaches: the maps are kept for the run (a 671B `wo` is 117M elements).
        index_dtype = torch.int32 if b.numel < 2**31 else torch.int64
        gather, distinct, pos = [], [], 0
        b.scatter_spans, starts, size = [], {}, 0
        for r in range(world):
            gathered = 0
            for m in held_by[r]:
                n, is_first = self.parts[m][r]
                part = (got_idx[pos:pos + n].long() + offsets[m]).to(index_dtype)
                pos += n
                # A replica's part is another holder's: found by its ends, confirmed whole.
                key = (m, n, *(part[[0, -1]].tolist() if n else ()))
                start = next((a for a, t in starts.get(key, ()) if torch.equal(t, part)), None)
                if start is None:
                    start, size = size, size + n
                    starts.setdefault(key, []).append((start, part))
                    distinct.append(part)
                b.scatter_spans.append((start, n))
                if is_first:
                    gather.append(part)
                    gathered += n
            b.recv_splits.append(gathered)
            b.back_send_splits.append(sum(self.parts[m][r][0] for m in held_by[r]))
        empty = empty.to(index_dtype)
        b.scatter_idx = torch.cat(distinct) if distinct else empty
        # The first replicas' parts are usually the distinct ones, in order: then one map serves both.
        same = len(gather) == len(distinct) and all(g is d for g, d in zip(gather, distinct))
        b.gather_idx = b.scatter_idx if same else torch.cat(gather) if gather else empty
        if size == sum(n for _, n in b.scatter_spans):
            b.scatter_spans = None  # no part repeated: the distinct parts are the holders' parts, in order
        b.send_pieces = [(self.local[self.keys[m]][0], None) for m in order if self.parts[m][me][1]]
        b.send_splits = [sum(self.parts[m][me][0] for m in to[r] if self.parts[m][me][1]) for r in range(world)]
        b.back_recv_splits = sent
        b.back_pieces = [(self.local[self.keys[m]][0], None, local[m].to_local().shape) for m in order]
        return b

    def _plan_whole(self, members: list[int], me: int, world: int) -> _Bucket:
        """A bucket of whole expert matrices: no index maps, each matrix from one holder to its
        owner, and its result to every holder. Replicas hold the same update, so the sender is the
        owner itself where it holds the matrix, else its holders in turn: replicas share the
        sending instead of the first replica's ranks sending every matrix. What an owner holds
        itself (`kept`, `kept_back`) does not go through the collective, and a bucket in which no
        rank moves anything (`silent`: experts already spread evenly) makes no collective."""
        b = _Bucket()
        first = {}
        for m in members:
            holders = sorted(self.parts[m])
            first[m] = self.owners[m] if self.owners[m] in self.parts[m] else holders[m % len(holders)]
        b.silent = all(first[m] == self.owners[m] and len(self.parts[m]) == 1 for m in members)
        mine = [m for m in members if self.owners[m] == me]
        b.kept = [(m, *self.local[self.keys[m]]) for m in mine if first[m] == me]
        b.kept_back = [(m, *self.local[self.keys[m]]) for m in mine if me in self.parts[m]]
        for r in range(world):
            moved = [] if r == me else members
            sent = [m for m in moved if self.owners[m] == r and first[m] == me]
            b.send_pieces += [self.local[self.keys[m]] for m in sent]
            b.send_splits.append(sum(math.prod(self.shapes[m]) for m in sent))
            got = [m for m in moved if self.owners[m] == me and first[m] == r]
            for m in got:
                b.owned.append((m, b.numel, torch.Size(self.shapes[m])))
                b.numel += math.prod(self.shapes[m])
            b.recv_splits.append(sum(math.prod(self.shapes[m]) for m in got))
            back = [m for m in moved if self.owners[m] == me and r in self.parts[m]]
            b.back_order += back
            b.back_send_splits.append(sum(math.prod(self.shapes[m]) for m in back))
            results = [m for m in moved if self.owners[m] == r and me in self.parts[m]]
            b.back_pieces += [(*self.local[self.keys[m]], torch.Size(self.shapes[m])) for m in results]
            b.back_recv_splits.append(sum(math.prod(self.shapes[m]) for m in results))
        return b

    def _whole_results(self, b: _Bucket, recv: torch.Tensor, updates: Sequence[torch.Tensor], batched):
        """Each owned expert matrix's result, by plan index: received or held here, one `batched`
        call per shape."""
        by_shape: dict[torch.Size, list[tuple[int, torch.Tensor]]] = {}
        for m, off, shape in b.owned:
            by_shape.setdefault(shape, []).append((m, recv[off:off + shape.numel()].view(shape)))
        for m, i, j in b.kept:
            by_shape.setdefault(torch.Size(self.shapes[m]), []).append((m, updates[i][j].to(self.dtype)))
        done = {}
        for items in by_shape.values():
            done.update(zip((m for m, _ in items), batched(torch.stack([x for _, x in items]))))
        return done

    def run(self, updates: Sequence[torch.Tensor], orthogonalize, batched, dtype: torch.dtype) -> list[torch.Tensor]:
        """This rank's part of the orthogonalised update (of dtype `dtype`) of each of `params`,
        given their local `updates` (in `params` order): `orthogonalize(M)` of each 2-D matrix and
        `batched(S)` of stacks `S` of expert matrices run here only on this rank's own matrices,
        one `batched` call per shape and bucket. The next bucket's matrices travel while this
        one's are orthogonalised."""
        out: list[torch.Tensor | None] = [None] * len(self.params)
        for i, p in enumerate(self.params):
            if p.ndim == 3:
                out[i] = torch.empty(updates[i].shape, dtype=dtype, device=updates[i].device)
        pending = self._send(self.buckets[0], updates) if self.buckets else None
        for k, b in enumerate(self.buckets):
            recv, work = pending
            if k + 1 < len(self.buckets):
                pending = self._send(self.buckets[k + 1], updates)
            if work is not None:
                work.wait()
            if b.gather_idx is not None:
                full = recv.new_empty(b.numel)
                full[b.gather_idx] = recv
                results = [orthogonalize(full[off:off + shape.numel()].view(shape)).reshape(-1) for _, off, shape in b.owned]
                flat = torch.cat(results).index_select(0, b.scatter_idx) if results else recv.new_empty(0, dtype=dtype)
                if b.scatter_spans is not None:
                    flat = torch.cat([flat[start:start + n] for start, n in b.scatter_spans])
            else:
                done = self._whole_results(b, recv, updates, batched)
                for m, i, j in b.kept_back:
                    out[i][j].copy_(done[m])
                flat = (torch.cat([done[m].reshape(-1) for m in b.back_order]) if b.back_order
                        else recv.new_empty(0, dtype=dtype))
            back = flat if b.silent else _exchange(flat, b.back_send_splits, b.back_recv_splits)
            pos = 0
            for i, j, shape in b.back_pieces:
                piece = back[pos:pos + shape.numel()].view(shape)
                pos += shape.numel()
                if j is None:
                    out[i] = piece
                else:
                    out[i][j].copy_(piece)
        return out

    def _send(self, b: _Bucket, updates: Sequence[torch.Tensor]):
        parts = [(updates[i] if j is None else updates[i][j]).reshape(-1).to(self.dtype) for i, j in b.send_pieces]
        send = torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype, device=self.device)
        recv = send.new_empty(sum(b.recv_splits))
        if b.silent:
            return recv, None
        work = dist.all_to_all_single(recv, send, b.recv_splits, b.send_splits, async_op=True)
        return recv, work


def _joined_groups(groups: Sequence[Sequence[int]]) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Each of `groups` (rank sets) mapped to the union of the groups it shares a rank with,
    transitively (the connected components of the ranks): an expert group with the groups of the
    ranks replicating its stacks. Groups that share no rank stay as they are."""
    root: dict[int, int] = {}

    def find(r: int) -> int:
        while root.get(r, r) != r:
            r = root[r]
        return r
    for group in groups:
        for r in group[1:]:
            a, b = find(group[0]), find(r)
            if a != b:
                root[max(a, b)] = min(a, b)
    members: dict[int, list[int]] = {}
    for r in sorted({r for group in groups for r in group}):
        members.setdefault(find(r), []).append(r)
    return {tuple(group): tuple(members[find(group[0])]) for group in groups}


def _plan_order(catalogue: dict[tuple, tuple], parts_of: dict[tuple, dict[int, tuple[int, bool]]]):
    """The sort key of the plan: the 2-D matrices by holders and position, then the expert
    matrices by stack position, place in their slice and group. Places go in turn over the
    slice's holders (their first experts, then their second ones, ...), so that `assign_owners`,
    which takes equal costs in plan order, leaves evenly spread experts with their holders; and
    the groups interleave, so that a bucket takes the same places of every group at once (disjoint
    ranks) rather than one group's run."""
    slices: dict[tuple, list[tuple[int, int]]] = {}
    for key in catalogue:
        if key[0] == 1:
            slices.setdefault(key[1:3], []).append((min(parts_of[key]), key[3]))
    place = {}
    for group, experts in slices.items():
        runs: dict[int, list[int]] = {}
        for holder, e in sorted(experts):
            runs.setdefault(holder, []).append(e)
        turns = sorted((i, holder, e) for holder, run in runs.items() for i, e in enumerate(run))
        place.update({(*group, e): i for i, (_, _, e) in enumerate(turns)})

    def order(key: tuple) -> tuple:
        return key if key[0] == 0 else (1, key[2], place[key[1:]], key[1])
    return order
