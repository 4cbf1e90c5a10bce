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

Gradients: table grads need no reduction within the engram group; ranks holding the *same*
shard in different engram groups (e.g. engram degree 2 in a world of 4) sum theirs with
`all_reduce_table_grads` over the replicate group. In the gradient norm each shard counts once:
`table_grad_sq_norm` sums the local squares over the engram group only.

Tables must not be sharded by FSDP as well (that would all-gather them back): the FSDP wrapping
has to leave `engram.table.weight` out (e.g. `fully_shard(..., ignored_params=...)`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.adamw import adamw as adamw_update

from models.engram import EngramLookup, EngramTable, engram_modules, engram_table_params


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
    """all_to_all_single whose backward is the reverse all-to-all (grads return to the sender)."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        grad_in = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return grad_in, None, None, None


class ShardedEngramLookup(EngramLookup):
    """`EngramLookup` over row-sharded tables (see the module docstring).

    Args:
        group: the engram process group (or a 1-D DeviceMesh).
        precompute: exchange all layers at once (one count exchange + one all-to-all pair per
            forward) instead of one exchange per layer.
    """

    def __init__(self, group, precompute: bool = True):
        self.group = _as_group(group)
        self.world = dist.get_world_size(self.group)
        self.precompute = precompute

    def __call__(self, tables: Sequence[EngramTable], ids: torch.Tensor) -> Sequence[torch.Tensor]:
        if self.precompute:
            return self.exchange(tables, [ids[:, :, i] for i in range(len(tables))])
        return _LazyRows(self, tables, ids)

    @torch.compiler.disable
    def exchange(self, tables: Sequence[EngramTable], ids: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """ids[l]: `[..., H]` global rows of `tables[l]` -> rows `[..., H, D_h]` per layer."""
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
        back = _AllToAll.apply(rows, input_splits, output_splits, self.group)  # sender order
        back = back.index_select(0, _inverse(order))  # the order of `torch.cat(ids)`
        out, start = [], 0
        for table, layer_ids in zip(tables, ids):
            n = layer_ids.numel()
            out.append(back[start : start + n].view(*layer_ids.shape, table.weight.shape[1]))
            start += n
        return out


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


def apply_engram_parallel(model: nn.Module, mesh_or_group, precompute: bool = True) -> None:
    """Shard every Engram table of `model` over the 1-D engram group and swap in the sharded
    lookup. Run before the optimizer is built: on a meta-device model (then `init_weights`
    fills each shard with exactly the unsharded values) or on a built one (rows are copied).

    Given a DeviceMesh, the tables' `state_dict()` entries become `DTensor`s sharded on dim 0
    (the row layout above is DTensor's `Shard(0)` layout), so a DCP checkpoint saved at one
    degree loads at another; `load_state_dict` accepts such DTensors or full tensors."""
    group = _as_group(mesh_or_group)
    mesh = mesh_or_group if hasattr(mesh_or_group, "get_group") else None
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    for module in engram_modules(model):
        _, start, n_rows = shard_rows(module.table.num_rows, world, rank)
        module.table.shard_(start, n_rows)
        if mesh is not None:
            module.table._register_state_dict_hook(_ShardedTableStateDict(mesh))
            module.table._register_load_state_dict_pre_hook(_load_table_rows, with_module=True)
    model.engram_lookup = ShardedEngramLookup(group, precompute=precompute)


class _ShardedTableStateDict:
    """state_dict hook: the local rows as a `DTensor` view (shares storage: DCP loads in place)."""

    def __init__(self, mesh):
        self.mesh = mesh

    def __call__(self, table: EngramTable, state_dict, prefix, local_metadata):
        from torch.distributed.tensor import DTensor, Shard

        key = prefix + "weight"
        local = state_dict[key]
        state_dict[key] = DTensor.from_local(
            local, self.mesh, [Shard(0)], run_check=False,
            shape=torch.Size((table.num_rows, table.head_dim)), stride=(table.head_dim, 1),
        )
        return state_dict


def _load_table_rows(table: EngramTable, state_dict, prefix, *args) -> None:
    """load_state_dict pre-hook: keep this shard's rows of a full tensor or a DTensor."""
    key = prefix + "weight"
    value = state_dict.get(key)
    if value is None:
        return
    if hasattr(value, "to_local"):
        local = value.to_local()
        # Same layout (the usual case, e.g. after DCP loaded in place): no communication.
        value = local if local.shape == table.weight.shape else value.full_tensor()
        state_dict[key] = value
    if value.shape[0] == table.num_rows and table.weight.shape[0] != table.num_rows:
        state_dict[key] = value[table.row_start : table.row_start + table.weight.shape[0]]


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
    grads = [p.grad for p in engram_table_params(model) if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        sq += g.float().pow(2).sum()
    group = _as_group(engram_group)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
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
            master = torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
            master.copy_(p.detach())
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
                s["grad_buffer"].copy_(p.grad, non_blocking=True)
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
                p.copy_(s["master"], non_blocking=True)
        return loss

    def state_dict(self):
        # The grad staging buffer is scratch space, not state.
        sd = super().state_dict()
        sd["state"] = {k: {n: v for n, v in s.items() if n != "grad_buffer"} for k, s in sd["state"].items()}
        return sd

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


class _OffloadedGroupStep:
    """Optimizer step pre-hook: updates the `"engram"` group with `offloaded` (state on the CPU),
    then drops those grads so the device optimizer skips the group. If the trainer skips a step
    (non-finite loss) the hook does not run and `zero_grad` clears the grads as usual."""

    def __init__(self, group: dict, offloaded: OffloadedAdam):
        self.group = group
        self.offloaded = offloaded

    def __call__(self, optimizer, args, kwargs) -> None:
        target = self.offloaded.param_groups[0]
        for key in ("lr", "betas", "eps", "weight_decay"):
            target[key] = self.group[key]  # follows the LR schedule of the device optimizer
        self.offloaded.step()
        for p in self.group["params"]:
            p.grad = None


def offload_engram_group(optimizer: torch.optim.Optimizer) -> OffloadedAdam:
    """Keep the Adam state of `optimizer`'s `"engram"` param group in CPU memory.

    The group stays in `optimizer` (LR schedule, `zero_grad`, grad clipping see it as before) but
    owns no device state: a step pre-hook runs `OffloadedAdam` on it first. The `OffloadedAdam` is
    returned and kept as `optimizer.engram_offloaded` (its state must be checkpointed with it).
    Weight decay is decoupled (AdamW); with the default `engram.weight_decay = 0` it is plain Adam.
    """
    (group,) = [g for g in optimizer.param_groups if g.get("engram")]
    offloaded = OffloadedAdam(
        group["params"], lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"]
    )
    optimizer.register_step_pre_hook(_OffloadedGroupStep(group, offloaded))
    optimizer.engram_offloaded = offloaded
    return offloaded
