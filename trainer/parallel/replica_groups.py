"""Fault-tolerant replica groups on torchft (``[fault_tolerance]``, docs/fault_tolerance.md).

Not trainer/fault_tolerance.py, which stops one run cleanly (signals, the non-finite guard): here
a job is ``parallelism.dp_replicate`` replica groups, each launched on its own (one run_train.sh
per group), each holding one dp_replicate slice of the layout with everything inside it (FSDP,
EP, CP, TP) unchanged. torchft's ``Manager`` (one per rank; rank 0 of a group talks to the
lighthouse) replaces the replicate dimension:

- ``start_step``: a quorum of the live groups before each step (``Manager.start_quorum``, not
  asynchronous, so a group that must heal loads the live state before its forward and then
  takes a full part in the step);
- ``sum_`` / ``sum_grads_``: the sums over the groups, after each group's own reductions: the
  global valid-token counts, the losses and router counts (``ParallelStep.global_sum``) and the
  gradients (``ParallelStep.finish_grads``, before the clip). Sums, not means: each group divides
  its loss by the live groups' token count, as HSDP divides by the whole batch's, so the step is
  the mean over the tokens the live groups read;
- ``should_commit``: the groups' vote before the optimizer step; a step in which a group failed is
  not committed by anyone (the trainer rewinds its data position and counter and repeats it);
- healing: a group whose step is behind the quorum's fetches ``LiveState`` from a live peer, rank
  by rank (rank i of one group holds the same shards as rank i of another), over torchft's HTTP
  checkpoint transport: model, optimizer (Muon's momentum included), LR schedule, data position,
  step and the non-finite guard's count.

Rank r of group g is rank ``g * group_world + r`` of the HSDP layout it stands for, so its data
rows, initial weights and sums are that layout's (tests/e2e/test_replica_groups.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from trainer.config import ConfigError
from trainer.config.replica_groups import lighthouse_address
from trainer.distributed import local_tensor

logger = logging.getLogger("trainer")

# The checkpoint manager's options (trainer/checkpoint/manager.py): optimizer state by parameter name.
_BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)


class LiveState:
    """What a healing group fetches from a live one, as this rank's plain local tensors (a DTensor's
    mesh means nothing in another process) and Python values; loaded into the healing rank's own
    DTensors, which have the same layout by construction."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler,
        loader,
        train_state: Callable[[], dict],
        load_train_state: Callable[[dict], None],
    ):
        self.model, self.optimizer, self.lr_scheduler, self.loader = model, optimizer, lr_scheduler, loader
        self.train_state, self.load_train_state = train_state, load_train_state

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_BY_NAME)
        return {
            "model": {k: _local(v) for k, v in model_sd.items()},
            "optimizer": {k: _local(v) for k, v in optim_sd.items()},
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "data": self.loader.state_dict(),
            "train": self.train_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The local state as a template: DCP creates a fresh optimizer's state (a step at LR 0).
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_BY_NAME)
        for mine, theirs in ((model_sd, state["model"]), (optim_sd, state["optimizer"])):
            missing = sorted(set(mine) ^ set(theirs))
            if missing:
                raise RuntimeError(f"healing: the live group's state differs in its entries, e.g. {missing[:3]}")
            for key, value in theirs.items():
                if isinstance(mine[key], torch.Tensor):
                    local_tensor(mine[key]).copy_(value)
                else:
                    mine[key] = value
        set_state_dict(
            self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=_BY_NAME
        )
        self.lr_scheduler.load_state_dict({**self.lr_scheduler.state_dict(), **state["lr_scheduler"]})
        self.loader.load_state_dict(state["data"])
        self.load_train_state(state["train"])


def _local(value: Any) -> Any:
    return local_tensor(value).detach() if isinstance(value, torch.Tensor) else value


class OneReplicaGroup:
    """Without ``[fault_tolerance]``: the job is one group, and every step commits."""

    committed = True
    live = 1
    quorum_seconds = 0.0

    def run_folder(self, dump_folder: str) -> str:
        return dump_folder

    def track(self, state: LiveState, step: int) -> None:
        pass

    def start_step(self, step: int) -> None:
        pass

    def should_commit(self) -> bool:
        return True

    def close(self) -> None:
        pass


class ReplicaGroups(OneReplicaGroup):
    """This rank's torchft ``Manager`` and what the step asks of it (see the module docstring).

    Args:
        ft: the ``[fault_tolerance]`` section.
        groups: the number of replica groups (``parallelism.dp_replicate``).
        device: this rank's device (gloo on CPU, NCCL on CUDA for the cross-group sums).
    """

    def __init__(self, ft, groups: int, device: torch.device):
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        self.replica_id, self.groups = ft.replica_id, groups
        self.address = lighthouse_address(ft)
        timeout = timedelta(seconds=ft.timeout_seconds)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self._store = None
        store = {}
        if "MASTER_ADDR" not in os.environ:
            # One process started without torchrun: the manager's group store is ours.
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            store = {"store_addr": "127.0.0.1", "store_port": self._store.port}
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        try:
            self.manager = Manager(
                pg=pg,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=ft.min_replicas,
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=timedelta(seconds=ft.quorum_timeout_seconds),
                connect_timeout=timeout,
                rank=rank,
                world_size=world,
                lighthouse_addr=self.address,
                # The digits name the group: torchft numbers its ranks (flight-recorder dumps) by them.
                replica_id=f"replica_group_{ft.replica_id}",
                # Every group builds the same initial weights from the seed (trainer/parallel/weight_init.py).
                init_sync=False,
                **store,
            )
        except Exception as e:  # the Rust client's errors are plain RuntimeErrors
            raise ConfigError(f"fault_tolerance.lighthouse {self.address}: {_one_line(e)}") from None
        self.committed = True
        self.live = groups

    def run_folder(self, dump_folder: str) -> str:
        """Each group writes its own log, metrics and checkpoints: a full restart resumes every group
        from its own newest checkpoint, and one that is behind heals from the others."""
        return str(Path(dump_folder) / f"replica_group_{self.replica_id}")

    def track(self, state: LiveState, step: int) -> None:
        """What a healing group fetches; ``step``: the step this group resumed at (0 when it starts)."""
        self.manager.register_state_dict_fn("trainer", state.load_state_dict, state.state_dict)
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})

    def start_step(self, step: int) -> None:
        """The quorum for the step after ``step``; heals this group first when it is behind."""
        start = time.perf_counter()
        try:
            self.manager.start_quorum()
        except Exception as e:
            raise ConfigError(
                f"fault_tolerance.lighthouse {self.address}: no quorum of replica groups after step {step} "
                f"({_one_line(e)})"
            ) from None
        self.quorum_seconds = time.perf_counter() - start
        live = self.manager.num_participants()
        if live != self.live:
            logger.warning(
                "step %d: %d of %d replica groups live: a step trains on their rows of the global batch (%d/%d of "
                "it), its loss is the mean over their tokens; the LR schedule follows the step count",
                step + 1,
                live,
                self.groups,
                live,
                self.groups,
            )
            self.live = live

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over the live groups (after the group's own reduction)."""
        self.manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM).wait()
        return tensor

    def sum_grads_(self, params: list[torch.Tensor]) -> None:
        """Sums every gradient over the live groups: one flat buffer per dtype, so a step costs one
        cross-group all-reduce per dtype, not one per parameter (elementwise the same sums)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            grad = local_tensor(p.grad)
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.sum_(flat)
            for grad, part in zip(grads, flat.split([g.numel() for g in grads])):
                grad.copy_(part.view_as(grad))

    def should_commit(self) -> bool:
        """The groups' vote on this step (a group that failed in it makes every group skip it)."""
        start = time.perf_counter()
        self.committed = self.manager.should_commit()
        self.quorum_seconds += time.perf_counter() - start
        return self.committed

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def build_replica_groups(ft, groups: int, device: torch.device) -> OneReplicaGroup:
    """torchft's replica groups when ``[fault_tolerance]`` is on, else the one group."""
    return ReplicaGroups(ft, groups, device) if ft.enable else OneReplicaGroup()


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:300]
