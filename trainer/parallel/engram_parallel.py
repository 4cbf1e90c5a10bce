"""Embedding parallelism for Engram tables: row-sharded tables and the all-to-all lookup.

Sharding (FlagScale PR 1147's scheme). Each Engram table's rows are split contiguously over a
1-D process group ("engram" mesh): `rows_per_rank = ceil(num_rows / W)`, rank r owns rows
`[r * rows_per_rank, min((r + 1) * rows_per_rank, num_rows))` (the last shard is shorter, and
may be empty for tiny tables). A lookup of global row `i` goes to `owner = i // rows_per_rank`:

    distinct ids per (owner, layer) (unique, bincount) -> all_to_all_single of the counts
    all_to_all_single of the ids             -> owners gather their local rows
    all_to_all_single of the rows back       (autograd: its backward sends row grads to the owner)

so the tables get dense per-shard gradients that already sum every rank's tokens of the group.
With `precompute=True` the lookups of all Engram layers of a step share one count exchange and
one pair of all-to-alls; otherwise each layer exchanges when the model first reads its rows.
The rows' all-to-all is asynchronous and waited on when the first Engram layer reads its rows,
so on GPU it overlaps the blocks before that layer.

Gradients: table grads need no reduction within the engram group; ranks holding the *same*
shard in different engram groups (e.g. engram degree 2 in a world of 4) sum theirs with
`all_reduce_table_grads` over the replicate group. In the gradient norm each shard counts once:
`trainer/parallel/grad_norm.py` sums the tables' local squares over the engram group only.

Trainer wiring (`trainer/parallel/parallelize.py`, `Trainer.train_step`): `apply_engram_parallel`
over the "engram" mesh of `ParallelDims` (degree > 1), or `replicate_engram_tables` (degree 1 in a
multi-process run: whole tables on every rank, grads summed over the "loss" mesh). Either way the
tables must not be sharded by FSDP (that would all-gather them every step): FSDP is applied
inside `tables_hidden_from_fsdp(model)`. In the training step `reduce_table_grads` runs after the
last backward, then `ParallelStep.finish_grads` clips with each shard counted once.

Checkpoints: the tables' `state_dict()` entries are `DTensor`s with `Shard(0)` placement over
the engram mesh, so DCP reshards them to any other degree; their optimizer state (and the
CPU-resident Adam that may hold it) is `trainer/optim/engram.py`'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from models.engram import EngramLookup, EngramTable, LocalEngramLookup, engram_modules, engram_table_params
from trainer.distributed import all_reduce_sum


def _as_group(mesh_or_group) -> dist.ProcessGroup:
    """A 1-D DeviceMesh or a ProcessGroup (None = the default group) -> ProcessGroup."""
    if mesh_or_group is None:
        return dist.group.WORLD
    if hasattr(mesh_or_group, "get_group"):
        if mesh_or_group.ndim != 1:
            raise ValueError(f"the engram mesh must be 1-D, got a {mesh_or_group.ndim}-D mesh")
        return mesh_or_group.get_group()
    return mesh_or_group


def shard_rows(num_rows: int, world: int, rank: int) -> tuple[int, int, int]:
    """(rows_per_rank, first row, number of rows) of `rank`'s contiguous shard."""
    rows_per_rank = math.ceil(num_rows / world)
    start = min(rank * rows_per_rank, num_rows)
    return rows_per_rank, start, min(rows_per_rank, num_rows - start)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward is the reverse all-to-all (grads return to the sender).

    The forward is asynchronous: it appends its work handle to `pending`, and the output must
    not be read before that handle is waited on (`_PendingRows` does it on first read)."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, pending):
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        pending.append(
            dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group, async_op=True)
        )
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        grad_in = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return grad_in, None, None, None, None


class _PendingRows(Sequence):
    """Each Engram layer's rows, cut from the all-to-all's output when the layer first reads them.

    The rows' all-to-all is still in flight when `exchange` returns; the first read waits for
    it. The model reads item i right before block `layer_ids[i]`, so on GPU the exchange runs
    under the compute of the blocks before the first Engram layer (and the embedding).
    """

    def __init__(self, back: torch.Tensor, sender_pos: torch.Tensor, shapes: list[torch.Size], pending: list):
        self.back, self.sender_pos, self.pending = back, sender_pos, pending
        self.slices, start = [], 0
        for shape in shapes:
            n = math.prod(shape[:-1])
            self.slices.append((start, n, shape))
            start += n

    def __len__(self) -> int:
        return len(self.slices)

    @torch.compiler.disable
    def __getitem__(self, i: int) -> torch.Tensor:
        while self.pending:
            self.pending.pop().wait()
        start, n, shape = self.slices[i]
        return self.back.index_select(0, self.sender_pos[start : start + n]).view(shape)


class ShardedEngramLookup(EngramLookup):
    """`EngramLookup` over row-sharded tables (see the module docstring).

    Args:
        group: the engram process group (or a 1-D DeviceMesh).
        precompute: exchange all layers at once (one count exchange + one all-to-all pair per
            forward) instead of one exchange per layer.
        replicate_group: ranks holding the same shard in other engram groups (their table
            grads are summed by `reduce_table_grads`); None = no replicas.
    """

    def __init__(self, group, precompute: bool = True, replicate_group=None):
        self.group = _as_group(group)
        self.world = dist.get_world_size(self.group)
        self.precompute = precompute
        self.mesh = group if hasattr(group, "get_group") else None
        self.replicate_group = _as_group(replicate_group) if replicate_group is not None else None

    def __call__(self, tables: Sequence[EngramTable], ids: torch.Tensor) -> Sequence[torch.Tensor]:
        if self.precompute:
            return self.exchange(tables, [ids[:, :, i] for i in range(len(tables))])
        return _LazyRows(self, tables, ids)

    @torch.compiler.disable
    def exchange(self, tables: Sequence[EngramTable], ids: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """ids[l]: `[..., H]` global rows of `tables[l]` -> rows `[..., H, D_h]` per layer (the
        rows' all-to-all completes when a layer's rows are first read)."""
        world, n_layers = self.world, len(tables)
        device = ids[0].device
        # Key of an id: (owner, layer, row in the owner's shard), as one int64 sorted in that order.
        stride = max(math.ceil(table.num_rows / world) for table in tables)
        keys = []
        for layer, (table, layer_ids) in enumerate(zip(tables, ids)):
            rows_per_rank = math.ceil(table.num_rows / world)
            flat = layer_ids.reshape(-1)
            owner = flat // rows_per_rank
            keys.append((owner * n_layers + layer) * stride + flat - owner * rows_per_rank)
        # Sender side: each distinct row is asked for once, grouped by destination rank, then by
        # layer. This also sums a row's gradient over this rank's tokens before it is sent (the
        # backward of `_PendingRows`' index_select), in token order as the local lookup does, so
        # the owner adds one partial sum per rank: on two ranks the gradients are bit for bit
        # those of whole tables (docs/engram.md, "Parity with one process"). On CUDA `unique`
        # waits for the device, next to the split sizes' read below.
        unique, sender_pos = torch.unique(torch.cat(keys), return_inverse=True)
        send_ids = unique % stride
        send_counts = torch.bincount(unique // stride, minlength=world * n_layers)  # [W * L], (dest, layer)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # -> [W * L], (src, layer)
        # One host sync for all split sizes.
        send_wl, recv_wl = send_counts.view(world, n_layers), recv_counts.view(world, n_layers)
        sizes = torch.cat([send_wl.sum(1), recv_wl.sum(1), recv_wl.sum(0)]).tolist()
        input_splits, output_splits, per_layer = sizes[:world], sizes[world : 2 * world], sizes[2 * world :]
        recv_ids = send_ids.new_empty(sum(output_splits))
        dist.all_to_all_single(recv_ids, send_ids, output_splits, input_splits, group=self.group)

        # Owner side: the received ids come grouped by (source, layer); regroup by layer to
        # gather from each local shard, then restore the received order.
        recv_layer = torch.repeat_interleave(
            torch.arange(n_layers, device=device).repeat(world), recv_counts
        )
        by_layer = torch.argsort(recv_layer, stable=True)
        chunks = recv_ids[by_layer].split(per_layer)
        rows = torch.cat([F.embedding(chunk, t.weight) for chunk, t in zip(chunks, tables)])
        rows = rows.index_select(0, _inverse(by_layer))
        pending: list = []
        back = _AllToAll.apply(rows, input_splits, output_splits, self.group, pending)  # sender order
        shapes = [torch.Size((*layer_ids.shape, table.weight.shape[1])) for table, layer_ids in zip(tables, ids)]
        # sender_pos[j]: the row of `back` that answers the j-th id of `torch.cat(ids)`.
        return _PendingRows(back, sender_pos, shapes, pending)


class _LazyRows(Sequence):
    """Rows of layer i, exchanged when first read (precompute off)."""

    def __init__(self, lookup: ShardedEngramLookup, tables: Sequence[EngramTable], ids: torch.Tensor):
        self.lookup, self.tables, self.ids = lookup, tables, ids
        self.cache: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.tables)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i not in self.cache:
            self.cache[i] = self.lookup.exchange([self.tables[i]], [self.ids[:, :, i]])[0]
        return self.cache[i]


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def apply_engram_parallel(model: nn.Module, mesh_or_group, precompute: bool = True, replicate=None) -> None:
    """Shard every Engram table of `model` over the 1-D engram group and swap in the sharded
    lookup. Run before the optimizer is built: on a meta-device model (then `init_weights`
    fills each shard with exactly the unsharded values) or on a built one (rows are copied).

    Given a DeviceMesh, the tables' `state_dict()` entries become `DTensor`s sharded on dim 0
    (the row layout above is DTensor's `Shard(0)` layout), so a DCP checkpoint saved at one
    degree loads at another; `load_state_dict` accepts such DTensors or full tensors.
    `replicate`: mesh or group of the ranks holding the same shards (see `reduce_table_grads`)."""
    group = _as_group(mesh_or_group)
    mesh = mesh_or_group if hasattr(mesh_or_group, "get_group") else None
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    for module in engram_modules(model):
        _, start, n_rows = shard_rows(module.table.num_rows, world, rank)
        module.table.shard_(start, n_rows)
        if mesh is not None:
            module.table._register_state_dict_hook(_ShardedTableStateDict(mesh))
            module.table._register_load_state_dict_pre_hook(_load_table_rows, with_module=True)
    model.engram_lookup = ShardedEngramLookup(mesh_or_group, precompute=precompute, replicate_group=replicate)


class ReplicatedEngramLookup(LocalEngramLookup):
    """Whole tables on every rank of a multi-process run (embedding_parallel_degree 1): a local
    gather, with the table grads summed over `replicate_group` (every rank seeing other tokens).
    FSDP must not shard these tables either: the model reads them before their block's FSDP
    unit gathers its parameters, and gathering whole tables every step is what Engram avoids."""

    group = None  # no engram group: nothing is sharded
    mesh = None

    def __init__(self, replicate_group):
        self.replicate_group = _as_group(replicate_group)


def replicate_engram_tables(model: nn.Module, replicate) -> None:
    """Keep `model`'s Engram tables whole on every rank (see `ReplicatedEngramLookup`)."""
    if engram_modules(model):
        model.engram_lookup = ReplicatedEngramLookup(replicate)


def sharded_lookup(model: nn.Module) -> ShardedEngramLookup | ReplicatedEngramLookup | None:
    """The model's multi-process lookup (row-sharded or replicated tables), or None for a
    single-process model (or one without Engram)."""
    lookup = getattr(model, "engram_lookup", None)
    return lookup if isinstance(lookup, (ShardedEngramLookup, ReplicatedEngramLookup)) else None


@contextmanager
def tables_hidden_from_fsdp(model: nn.Module) -> Iterator[None]:
    """Detach the tables of a multi-process lookup from the module tree while FSDP wraps `model`,
    so that FSDP neither shards them nor all-gathers them; they are plain parameters afterwards
    (the optimizer, `state_dict` and `.to_empty` see them as before)."""
    modules = engram_modules(model) if sharded_lookup(model) is not None else []
    tables = [m._modules.pop("table") for m in modules]
    try:
        yield
    finally:
        for m, table in zip(modules, tables):
            m.table = table


def reduce_table_grads(model: nn.Module) -> None:
    """Sum the table grads over the replicate group; call once per step after the last backward
    (the backward all-to-all already summed the engram group's tokens into each shard)."""
    lookup = sharded_lookup(model)
    if lookup is not None and lookup.replicate_group is not None:
        all_reduce_table_grads(model, lookup.replicate_group)


class _ShardedTableStateDict:
    """state_dict hook: the local rows as a `DTensor` view (shares storage: DCP loads in place)."""

    def __init__(self, mesh):
        self.mesh = mesh

    def __call__(self, table: EngramTable, state_dict, prefix, local_metadata):
        key = prefix + "weight"
        state_dict[key] = row_sharded(state_dict[key], table, self.mesh)
        return state_dict


def row_sharded(local: torch.Tensor, table: EngramTable, mesh) -> DTensor:
    """The local rows of `table` as a view of the whole table (`Shard(0)` over the engram mesh)."""
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False,
        shape=torch.Size((table.num_rows, table.head_dim)), stride=(table.head_dim, 1),
    )


def _load_table_rows(table: EngramTable, state_dict, prefix, *args) -> None:
    """load_state_dict pre-hook: keep this shard's rows of a full tensor or a DTensor."""
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = local_rows(state_dict[key], table)


def local_rows(value: torch.Tensor, table: EngramTable) -> torch.Tensor:
    """This shard's rows of a table-shaped full tensor or DTensor (other values unchanged)."""
    if hasattr(value, "to_local"):
        local = value.to_local()
        # Same layout (the usual case, e.g. after DCP loaded in place): no communication.
        value = local if local.shape == table.weight.shape else value.full_tensor()
    if value.ndim == 2 and value.shape[0] == table.num_rows and table.weight.shape[0] != table.num_rows:
        value = value[table.row_start : table.row_start + table.weight.shape[0]]
    return value


def all_reduce_table_grads(model: nn.Module, replicate_group) -> None:
    """Sum table grads over ranks that hold the SAME shard (never across shards)."""
    group = _as_group(replicate_group)
    for p in engram_table_params(model):
        if p.grad is not None:
            all_reduce_sum(p.grad, group)
