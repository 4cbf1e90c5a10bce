"""Embedding parallelism for Engram tables, and CPU-resident optimizer state for them.

Sharding (FlagScale PR 1147's scheme). Each Engram table's rows are split contiguously over a
1-D process group ("engram" mesh): `rows_per_rank = ceil(num_rows / W)`, rank r owns rows
`[r * rows_per_rank, min((r + 1) * rows_per_rank, num_rows))` (the last shard is shorter, and
may be empty for tiny tables). A lookup of global row `i` goes to `owner = i // rows_per_rank`:

    count ids per (owner, layer) (bincount)  -> all_to_all_single of the counts
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
`table_grad_sq_norm` sums the local squares over the engram group only.

Trainer wiring (`trainer/parallel/parallelize.py`, `Trainer.train_step`): `apply_engram_parallel`
over the "engram" mesh of `ParallelDims` (degree > 1), or `replicate_engram_tables` (degree 1 in a
multi-process run: whole tables on every rank, grads summed over the "loss" mesh). Either way the
tables must not be sharded by FSDP (that would all-gather them every step): FSDP is applied
inside `tables_hidden_from_fsdp(model)`. In the training step `reduce_table_grads` runs after the
last backward and `clip_grad_norm_with_tables` clips with each shard counted once.

Checkpoints: the tables' `state_dict()` entries and their optimizer state (also the CPU-resident
state of `offload_engram_group`) are `DTensor`s with `Shard(0)` placement over the engram mesh,
so DCP reshards them to any other degree (`register_table_state_hooks`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim.adamw import adamw as adamw_update

from models.engram import EngramLookup, EngramTable, LocalEngramLookup, engram_modules, engram_table_params


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
        owners, locals_, keys = [], [], []
        for layer, (table, layer_ids) in enumerate(zip(tables, ids)):
            rows_per_rank = math.ceil(table.num_rows / world)
            flat = layer_ids.reshape(-1)
            owner = flat // rows_per_rank
            owners.append(owner)
            locals_.append(flat - owner * rows_per_rank)
            keys.append(owner * n_layers + layer)
        key = torch.cat(keys)
        # Sender side: ids grouped by destination rank, then by layer.
        order = torch.argsort(key, stable=True)
        send_ids = torch.cat(locals_)[order]
        send_counts = torch.bincount(key, minlength=world * n_layers)  # [W * L], (dest, layer)
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
        # _inverse(order)[j]: where the j-th id of `torch.cat(ids)` sits in the sender order.
        return _PendingRows(back, _inverse(order), shapes, pending)


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


@torch.no_grad()
def clip_grad_norm_with_tables(params: Sequence[torch.Tensor], max_norm: float, model: nn.Module) -> torch.Tensor:
    """`trainer.parallel.fsdp.clip_grad_norm_` for a model whose Engram tables may be row-sharded:
    plain tensors whose placement DTensor cannot show, so their squares are summed over the
    engram group here (each shard once, replicas not again) and added to the other parameters'
    global squared norm. Returns the total norm before clipping."""
    from trainer.parallel.fsdp import clip_grad_norm_, grad_norm

    lookup = sharded_lookup(model)
    if lookup is None:
        return clip_grad_norm_(params, max_norm)
    params = [p for p in params if p.grad is not None]
    table_ids = {id(p) for p in engram_table_params(model)}
    tables_sq = table_grad_sq_norm(model, lookup.group) if lookup.group is not None else _table_sq(model)
    others_sq = grad_norm([p for p in params if id(p) not in table_ids]).to(tables_sq.device).square()
    norm = (tables_sq + others_sq).sqrt()
    if math.isfinite(max_norm) and params:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([_local(p.grad) for p in params], coef)
    return norm


def table_row_ranges(model: nn.Module, clean=lambda name: name) -> dict[str, tuple[int, int]]:
    """Table weight name (after `clean`) -> [start, stop) global rows held here."""
    return {
        clean(f"{name}.weight"): (m.row_start, m.row_start + m.weight.shape[0])
        for name, m in model.named_modules()
        if isinstance(m, EngramTable)
    }


class _ShardedTableStateDict:
    """state_dict hook: the local rows as a `DTensor` view (shares storage: DCP loads in place)."""

    def __init__(self, mesh):
        self.mesh = mesh

    def __call__(self, table: EngramTable, state_dict, prefix, local_metadata):
        key = prefix + "weight"
        state_dict[key] = _row_sharded(state_dict[key], table, self.mesh)
        return state_dict


def _row_sharded(local: torch.Tensor, table: EngramTable, mesh) -> DTensor:
    """The local rows of `table` as a view of the whole table (`Shard(0)` over the engram mesh)."""
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False,
        shape=torch.Size((table.num_rows, table.head_dim)), stride=(table.head_dim, 1),
    )


def _load_table_rows(table: EngramTable, state_dict, prefix, *args) -> None:
    """load_state_dict pre-hook: keep this shard's rows of a full tensor or a DTensor."""
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = _local_rows(state_dict[key], table)


def _local_rows(value: torch.Tensor, table: EngramTable) -> torch.Tensor:
    """This shard's rows of a table-shaped full tensor or DTensor (other values unchanged)."""
    if hasattr(value, "to_local"):
        local = value.to_local()
        # Same layout (the usual case, e.g. after DCP loaded in place): no communication.
        value = local if local.shape == table.weight.shape else value.full_tensor()
    if value.ndim == 2 and value.shape[0] == table.num_rows and table.weight.shape[0] != table.num_rows:
        value = value[table.row_start : table.row_start + table.weight.shape[0]]
    return value


def all_reduce_table_grads(model: nn.Module, replicate_group, average: bool = False) -> None:
    """Sum (or average) table grads over ranks that hold the SAME shard (never across shards)."""
    group = _as_group(replicate_group)
    if dist.get_world_size(group) == 1:
        return
    for p in engram_table_params(model):
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG if average else dist.ReduceOp.SUM, group=group)


def table_grad_sq_norm(model: nn.Module, engram_group) -> torch.Tensor:
    """Squared L2 norm of all table grads with each shard counted once (sum over the engram
    group only); add it to the other parameters' squared norm before clipping."""
    sq = _table_sq(model, torch.float64)
    group = _as_group(engram_group)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    return sq.float()


def _table_sq(model: nn.Module, cpu_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This rank's sum of squared table grads; `cpu_dtype` float64 on CPU, whose fp32 sums of
    large tables lose ~1e-4 (relative); CUDA's tree sums do not."""
    grads = [p.grad for p in engram_table_params(model) if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    dtype = cpu_dtype if device.type == "cpu" else torch.float32
    sq = torch.zeros((), dtype=dtype, device=device)
    for g in grads:
        sq += g.to(dtype).pow(2).sum()
    return sq


class OffloadedAdam(torch.optim.Optimizer):
    """Adam(W) whose state lives in CPU memory and whose update runs on the CPU.

    Holds the device parameters in `param_groups` (schedulers, hooks and checkpoints see a normal
    optimizer); `state[p]` keeps `step`, `exp_avg`, `exp_avg_sq` and an fp32 CPU `master` copy of
    `p` (pinned when `p` is on CUDA). A step copies `p.grad` to the CPU, runs `torch.optim.AdamW`'s
    functional update there, and copies the master back into `p` in place: the parameter tensor
    (identity, storage) never changes.
    """

    def __init__(
        self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8, weight_decay: float = 0.0,
    ):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _state_for(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            pin = p.device.type == "cuda"
            local = _local(p.detach())
            master = torch.empty(local.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
            master.copy_(local)
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(master)
            state["exp_avg_sq"] = torch.zeros_like(master)
            state["master"] = master
            state["grad_buffer"] = torch.empty_like(master, pin_memory=pin)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state_for(p) for p in params]
            for p, s in zip(params, states):
                s["grad_buffer"].copy_(_local(p.grad), non_blocking=True)
            if params[0].device.type == "cuda":
                torch.cuda.current_stream(params[0].device).synchronize()
            beta1, beta2 = group["betas"]
            adamw_update(
                [s["master"] for s in states], [s["grad_buffer"] for s in states],
                [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
                [s["step"] for s in states], fused=True, amsgrad=False, beta1=beta1, beta2=beta2,
                lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
            )
            for p, s in zip(params, states):
                _local(p).copy_(s["master"], non_blocking=True)
        return loss

    @torch.no_grad()
    def load_param_state(self, p: torch.Tensor, entry: dict) -> None:
        """Set `p`'s state from `entry` (`step`, `exp_avg`, `exp_avg_sq`, local shapes); the
        master copy is taken from `p` itself, which must hold its loaded value already."""
        state = self._state_for(p)
        state["master"].copy_(_local(p.detach()))
        state["step"] = entry["step"].detach().float().cpu().clone()
        for name in ("exp_avg", "exp_avg_sq"):
            state[name].copy_(entry[name])

    def state_dict(self):
        # The grad staging buffer is scratch space, not state.
        sd = super().state_dict()
        sd["state"] = {k: {n: v for n, v in s.items() if n != "grad_buffer"} for k, s in sd["state"].items()}
        return sd

    def step_group(self, optimizer: torch.optim.Optimizer) -> None:
        """Updates `optimizer`'s `"engram"` group here (state on the CPU), then drops those grads
        so that `optimizer.step()` skips the group; `trainer.optim.optimizer_step` calls it."""
        # Looked up at every step: `optimizer.load_state_dict` replaces the group dicts.
        (group,) = [g for g in optimizer.param_groups if g.get("engram")]
        target = self.param_groups[0]
        for key in ("lr", "betas", "eps", "weight_decay"):
            target[key] = group[key]  # follows the LR schedule of the device optimizer
        self.step()
        for p in group["params"]:
            p.grad = None

    def load_state_dict(self, state_dict) -> None:
        # torch.optim moves loaded state onto each parameter's device; bring it back to the CPU.
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            pin = p.device.type == "cuda"
            for name in ("exp_avg", "exp_avg_sq", "master"):
                if name in state:
                    cpu = torch.empty(state[name].shape, dtype=torch.float32, device="cpu", pin_memory=pin)
                    state[name] = cpu.copy_(state[name])
            if "master" in state:
                state["step"] = state["step"].float().cpu()
                state["grad_buffer"] = torch.empty_like(state["master"], pin_memory=pin)


def offload_engram_group(optimizer: torch.optim.Optimizer) -> OffloadedAdam:
    """Keep the Adam state of `optimizer`'s `"engram"` param group in CPU memory.

    The group stays in `optimizer` (LR schedule, `zero_grad`, grad clipping see it as before) but
    owns no device state: `trainer.optim.optimizer_step` runs `OffloadedAdam.step_group` on it
    first. The `OffloadedAdam` is returned and kept as `optimizer.engram_offloaded`
    (`register_table_state_hooks` checkpoints it).
    Weight decay is decoupled (AdamW); with the default `engram.weight_decay = 0` it is plain Adam.
    """
    (group,) = [g for g in optimizer.param_groups if g.get("engram")]
    offloaded = OffloadedAdam(
        group["params"], lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"]
    )
    optimizer.engram_offloaded = offloaded
    return offloaded


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _TableOptimizerState:
    """Optimizer `state_dict` post-hook and `load_state_dict` pre-hook for the `"engram"` group.

    Saving: the CPU-resident state of `offload_engram_group` (step, exp_avg, exp_avg_sq; its fp32
    master equals the parameter) goes where the device optimizer keeps its own, so a checkpoint
    holds the same entries with offload on or off; table-shaped state of row-sharded tables
    becomes a `DTensor` (`Shard(0)` over the engram mesh, like the weight), so DCP reshards it to
    another embedding-parallel degree. Loading undoes both (new dicts: the live state is never
    replaced by the checkpoint's views).
    """

    def __init__(self, model: nn.Module):
        self.tables = {id(m.table.weight): m.table for m in engram_modules(model)}
        lookup = sharded_lookup(model)
        self.mesh = lookup.mesh if lookup is not None else None

    @staticmethod
    def _entries(optimizer, state_dict) -> list[tuple[int, torch.Tensor]]:
        for saved, group in zip(state_dict["param_groups"], optimizer.param_groups):
            if group.get("engram"):
                return list(zip(saved["params"], group["params"]))
        return []

    def save(self, optimizer, state_dict):
        offloaded = getattr(optimizer, "engram_offloaded", None)
        state = dict(state_dict["state"])
        for idx, p in self._entries(optimizer, state_dict):
            entry = state.get(idx)
            if offloaded is not None and offloaded.state.get(p):
                s = offloaded.state[p]
                entry = {"step": s["step"], "exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"]}
            if entry:
                state[idx] = {k: self._global(v, p) for k, v in entry.items()}
        state_dict["state"] = state
        return state_dict

    def _global(self, value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if value.ndim == 0 or isinstance(value, DTensor):
            return value
        if isinstance(p, DTensor):  # offloaded local shard of an FSDP-sharded table
            return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        if self.mesh is not None:
            return _row_sharded(value, self.tables[id(p)], self.mesh)
        return value

    def load(self, optimizer, state_dict):
        offloaded = getattr(optimizer, "engram_offloaded", None)
        state = dict(state_dict["state"])
        for idx, p in self._entries(optimizer, state_dict):
            entry = state.get(idx)
            if not entry:
                continue
            if offloaded is not None:
                offloaded.load_param_state(p, {k: self._local(v, p) for k, v in entry.items()})
                del state[idx]  # no device-side state for the offloaded group
            elif self.mesh is not None:
                state[idx] = {k: self._local(v, p) for k, v in entry.items()}
        state_dict["state"] = state
        return state_dict

    def _local(self, value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if isinstance(p, DTensor):
            return value.redistribute(p.device_mesh, p.placements).to_local() if isinstance(value, DTensor) else value
        return _local_rows(value, self.tables[id(p)])


def register_table_state_hooks(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Make `optimizer.state_dict()` / `load_state_dict()` carry the `"engram"` group's state
    (CPU-resident or row-sharded) in checkpointable form; see `_TableOptimizerState`."""
    hooks = _TableOptimizerState(model)
    optimizer.register_state_dict_post_hook(hooks.save)
    optimizer.register_load_state_dict_pre_hook(hooks.load)
