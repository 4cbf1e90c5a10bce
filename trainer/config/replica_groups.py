"""The checks and the arithmetic of fault-tolerant replica groups (``[fault_tolerance]``), torch-free
so that run_train.sh's pre-launch check (trainer/config/check.py) runs them before any process starts.

A replica group is one ``dp_replicate`` slice of the layout, launched on its own (one run_train.sh
per group): its torchrun world is ``world / dp_replicate`` ranks that hold everything else of the
layout (FSDP, EP, CP, TP) unchanged, and torchft's manager (trainer/parallel/replica_groups.py)
replaces the replicate dimension's gradient all-reduce. So the layout is checked as the whole job's,
``launched world x dp_replicate`` ranks, and the run's data and batch arithmetic are the HSDP
layout's: group ``replica_id`` reads the rows its dp_replicate index would read.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from typing import Any
from urllib.parse import urlsplit

from trainer.config.fields import ConfigError

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
LIGHTHOUSE_COMMAND = "torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000"


def replica_group_problems(cfg: Any) -> list[str]:
    """What ``[fault_tolerance]`` cannot run with the rest of the config: one message each."""
    ft, p = cfg.fault_tolerance, cfg.parallelism
    if not ft.enable:
        return []
    if p.dp_replicate < 2:
        return [
            f"fault_tolerance.enable needs parallelism.dp_replicate >= 2, the number of replica groups (each group is "
            f"one dp_replicate slice, launched on its own), got {p.dp_replicate}; add --parallelism.dp_replicate 2 "
            "or drop --fault_tolerance.enable."
        ]
    refusals = [
        (
            ft.replica_id >= p.dp_replicate,
            f"fault_tolerance.replica_id = {ft.replica_id} is not one of the parallelism.dp_replicate = "
            f"{p.dp_replicate} replica groups; pick 0 .. {p.dp_replicate - 1}",
        ),
        (
            ft.min_replicas > p.dp_replicate,
            f"fault_tolerance.min_replicas = {ft.min_replicas} is more than the parallelism.dp_replicate = "
            f"{p.dp_replicate} replica groups, so no step could commit; pick 1 .. {p.dp_replicate}",
        ),
        (
            p.pp > 1,
            f"fault_tolerance with parallelism.pp = {p.pp}: the pipeline's stage-to-stage groups are not torchft's "
            "and a restarted stage could not heal alone; use --parallelism.pp 1",
        ),
        (
            cfg.job.dry_run,
            "job.dry_run with fault_tolerance: the dry run rehearses the whole layout (dry_run.world_size ranks, the "
            "groups' replicate dimension as HSDP's, which a group's ranks match in memory and collectives); drop "
            "--fault_tolerance.enable for it",
        ),
        (
            cfg.ema.enable,
            "fault_tolerance with ema.enable: the parameter EMA is not part of the live state a healing group "
            "fetches, so the groups' EMAs would part; drop --ema.enable",
        ),
        (
            cfg.optimizer.qk_clip,
            "fault_tolerance with optimizer.qk_clip: the clip's logit maximum is taken inside one replica group, "
            "not across the groups; drop --optimizer.qk_clip",
        ),
    ]
    return [message + "." for bad, message in refusals if bad]


def job_world_size(cfg: Any, launched_world: int) -> int:
    """The whole layout's world size: the launch's, times the replica groups when each launch is one."""
    if cfg.fault_tolerance.enable:
        return launched_world * cfg.parallelism.dp_replicate
    return launched_world


def lighthouse_address(ft: Any) -> str:
    """``fault_tolerance.lighthouse``, else $TORCHFT_LIGHTHOUSE; refused in one line when neither is set."""
    address = ft.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise ConfigError(
            f"fault_tolerance.enable needs the torchft lighthouse's address: set --fault_tolerance.lighthouse "
            f"http://HOST:29510 (or {LIGHTHOUSE_ENV}) and start it there with `{LIGHTHOUSE_COMMAND}`"
        )
    return address


def check_lighthouse(ft: Any, timeout: float = 5.0) -> None:
    """Whether something answers at the lighthouse's address: a group that cannot reach it fails here,
    in one line naming the address, instead of after its model is built."""
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(
            "fault_tolerance.enable needs torchft: pip install torchft==0.2.0 (the [ft] extra of this package)"
        )
    address = lighthouse_address(ft)
    parts = urlsplit(address if "://" in address else f"http://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError as e:  # a port that is no number
        raise ConfigError(f"fault_tolerance.lighthouse = {address!r}: {e}; use http://HOST:PORT") from None
    if not host or port is None:
        raise ConfigError(f"fault_tolerance.lighthouse = {address!r} names no host and port; use http://HOST:PORT")
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise ConfigError(
            f"fault_tolerance.lighthouse {address}: no lighthouse answers there ({e.strerror or e}); start it with "
            f"`{LIGHTHOUSE_COMMAND}` on that host, or fix the address"
        ) from None
