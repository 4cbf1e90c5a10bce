"""The optimizer of the Engram tables: CPU-resident Adam, and their state in checkpoints.

`offload_engram_group` moves the Adam state of the optimizer's `"engram"` param group to CPU
memory (`engram.offload_optimizer_state`): the tables are large and sparse-updated, and their two fp32
moments would otherwise double or triple their device memory. `register_table_state_hooks`
makes the group's state checkpointable whatever holds it: the CPU-resident state is saved where
the device optimizer keeps its own, and state of row-sharded tables
(`trainer/parallel/engram_parallel.py`) becomes a `DTensor` that DCP reshards to any degree.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as adamw_update

from models.engram import engram_modules
from trainer.distributed import local_tensor
from trainer.parallel.engram_parallel import local_rows, row_sharded, sharded_lookup
from trainer.step_hooks import StepHook


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
            local = local_tensor(p.detach())
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
                s["grad_buffer"].copy_(local_tensor(p.grad), non_blocking=True)
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
                local_tensor(p).copy_(s["master"], non_blocking=True)
        return loss

    @torch.no_grad()
    def load_param_state(self, p: torch.Tensor, entry: dict) -> None:
        """Set `p`'s state from `entry` (`step`, `exp_avg`, `exp_avg_sq`, local shapes); the
        master copy is taken from `p` itself, which must hold its loaded value already."""
        state = self._state_for(p)
        state["master"].copy_(local_tensor(p.detach()))
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
        so that `optimizer.step()` skips the group; `EngramOffloadStep` calls it."""
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
    owns no device state: `EngramOffloadStep` runs `OffloadedAdam.step_group` on it before the
    optimizer's own step. The `OffloadedAdam` is returned (`register_table_state_hooks` checkpoints it).
    Weight decay is decoupled (AdamW); with the default `engram.weight_decay = 0` it is plain Adam.
    """
    (group,) = [g for g in optimizer.param_groups if g.get("engram")]
    offloaded = OffloadedAdam(
        group["params"], lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"]
    )
    return offloaded


class EngramOffloadStep(StepHook):
    """The step hook of `offload_engram_group`: the tables' CPU-resident Adam step, before the
    optimizer steps the device groups (skipped with them on a non-finite step)."""

    def __init__(self, optimizer: torch.optim.Optimizer, offloaded: OffloadedAdam):
        self.optimizer, self.offloaded = optimizer, offloaded

    def before_optimizer(self, skip: bool) -> None:
        if not skip:
            self.offloaded.step_group(self.optimizer)


class _TableOptimizerState:
    """Optimizer `state_dict` post-hook and `load_state_dict` pre-hook for the `"engram"` group.

    Saving: the CPU-resident state of `offload_engram_group` (step, exp_avg, exp_avg_sq; its fp32
    master equals the parameter) goes where the device optimizer keeps its own, so a checkpoint
    holds the same entries with offload on or off; table-shaped state of row-sharded tables
    becomes a `DTensor` (`Shard(0)` over the engram mesh, like the weight), so DCP reshards it to
    another embedding-parallel degree. Loading undoes both (new dicts: the live state is never
    replaced by the checkpoint's views).
    """

    def __init__(self, model: nn.Module, offloaded: OffloadedAdam | None):
        self.offloaded = offloaded
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
        offloaded = self.offloaded
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
            return row_sharded(value, self.tables[id(p)], self.mesh)
        return value

    def load(self, optimizer, state_dict):
        offloaded = self.offloaded
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
        return local_rows(value, self.tables[id(p)])


def register_table_state_hooks(
    optimizer: torch.optim.Optimizer, model: nn.Module, offloaded: OffloadedAdam | None = None
) -> None:
    """Make `optimizer.state_dict()` / `load_state_dict()` carry the `"engram"` group's state
    (CPU-resident in ``offloaded``, or row-sharded) in checkpointable form; see `_TableOptimizerState`."""
    hooks = _TableOptimizerState(model, offloaded)
    optimizer.register_state_dict_post_hook(hooks.save)
    optimizer.register_load_state_dict_pre_hook(hooks.load)
