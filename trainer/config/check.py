"""The pre-launch check: `python -m trainer.config.check --world-size N [options as for trainer.train]`.

`run_train.sh` runs it before starting any process, so a config that cannot run (a typo, a layout
whose degrees do not fit NNODES x NGPU or the model's blocks, heads and experts, a sequence the
TP/CP splits do not divide, a dump folder that cannot be created, a local dataset path (of
`training.dataset_path` or a `training.dataset_mix` source) that names no file or an empty one,
with `--free-port` a single-node MASTER_PORT that is taken, with `--rendezvous-host-port` the port
node 0 of a multi-node job is to host the rendezvous on, taken, with `--restarts N` torchrun
restarts that could not resume, with `[fault_tolerance]` a lighthouse address nothing answers at)
fails in a second with one `config error: ...` line and exit code 2, instead of in every rank's
traceback. A dry run (`--job.dry_run`) is checked against the world it rehearses
(`dry_run.world_size`), not N: it runs in one process. With `[fault_tolerance]` N is one replica
group's and the layout is checked as the job's, N x dp_replicate ranks. `--print-launch` prints how
run_train.sh is to launch the job (`train` or `dry_run`) on stdout.
The workers run the same checks again (`Layout.from_job`, `trainer.run_folder.open_run_folder`,
the data loader).
Torch-free.
"""

from __future__ import annotations

import signal

if __name__ == "__main__":
    # A Ctrl-C while this check imports the config modules ends it quietly (the default action),
    # not with a KeyboardInterrupt traceback; run_train.sh stops with it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import errno
import socket
import sys

from models.flavors.deepseek_v3 import flavor_fields
from trainer.config.combinations import LOCAL_FORMATS
from trainer.config.data_files import resolve_local_files
from trainer.config.data_mix import parse_mixture
from trainer.config.dump_folder import check_dump_folder
from trainer.config.fields import ConfigError
from trainer.config.layout import Layout
from trainer.config.loader import load_config
from trainer.config.replica_groups import check_lighthouse, job_world_size

USAGE = (
    "usage: python -m trainer.config.check --world-size N [--restarts N] "
    "[--free-port ADDR:PORT | --rendezvous-host-port PORT] [--print-launch] [--section.key VALUE ...]"
)


def check_job(argv: list[str], world_size: int, restarts: int = 0) -> str:
    """Check the job; returns how run_train.sh is to launch it: "dry_run" (one process, whatever
    NNODES x NGPU: it rehearses `dry_run.world_size` ranks, against which its layout is checked)
    or "train"."""
    cfg = load_config(argv)
    if cfg.job.dry_run:
        check_model_fit(cfg, Layout.from_job(cfg, cfg.dry_run.world_size))
        return "dry_run"
    check_model_fit(cfg, Layout.from_job(cfg, job_world_size(cfg, world_size)))
    check_dump_folder(cfg.job.dump_folder)
    if cfg.fault_tolerance.enable:
        check_lighthouse(cfg.fault_tolerance)
    check_data_files(cfg)
    check_restarts(cfg, restarts)
    return "train"


def check_restarts(cfg, restarts: int) -> None:
    """torchrun restarts every worker with the same command after one fails (run_train.sh's
    RESTARTS): the restart resumes, like a rerun, from the newest complete checkpoint, so it needs
    checkpoints, and a pinned `load_step` would take it back to that step instead."""
    if restarts == 0:
        return
    if not cfg.checkpoint.enable:
        raise ConfigError(
            f"RESTARTS={restarts}: a restarted worker resumes from the run's newest checkpoint, and "
            "checkpoint.enable is off (a restart would train again from step 0); pass --checkpoint.enable "
            "(checkpoint.interval bounds what a restart redoes) or unset RESTARTS"
        )
    if cfg.checkpoint.load_step != -1:
        step = cfg.checkpoint.load_step
        raise ConfigError(
            f"RESTARTS={restarts} with checkpoint.load_step = {step}: every restart would load step {step} again, "
            f"losing what the run trained since; drop --checkpoint.load_step (a run resumes from the newest "
            f"complete checkpoint: move the ones after step-{step} out of the checkpoint folder) or unset RESTARTS"
        )


def check_model_fit(cfg, layout: Layout) -> None:
    """The layout against the flavor's shape, read from its plain-data table (no torch): the
    pipeline's stages against its blocks, TP against its heads, EP against its experts."""
    try:
        shape = flavor_fields(cfg.model.flavor)
    except ValueError as e:
        raise ConfigError(f"model.flavor: {e}") from None
    layout.check_shapes(cfg.training.seq_len, n_heads=shape["n_heads"], num_experts=shape["moe"]["num_experts"])
    layout.check_stages(shape["n_layers"], cfg.model.mtp_depth_for(shape["mtp_depth"]))


def check_data_files(cfg) -> None:
    """Local dataset paths must name files that hold data (relative paths from the working
    directory, as the workers read them)."""
    if cfg.training.dataset_mix:
        sources = [
            (f"training.dataset_mix source {s.name!r}", s.dataset, s.path)
            for s in parse_mixture(cfg.training.dataset_mix)
        ]
    else:
        sources = [("training.dataset_path", cfg.training.dataset, cfg.training.dataset_path)]
    if cfg.validation.enable:
        sources.append(("validation.dataset_path", cfg.validation.dataset, cfg.validation.dataset_path))
    for what, dataset, path in sources:
        if dataset in LOCAL_FORMATS:
            try:
                resolve_local_files(dataset, path)
            except (OSError, ValueError) as e:
                raise ConfigError(f"{what}: {e}") from None


def _bind_error(family: socket.AddressFamily, host: str, port: int) -> OSError | None:
    """Why this node could not listen on host:port as torchrun's rendezvous store would, or None.
    SO_REUSEADDR as the store sets it: a port left in TIME_WAIT by an earlier run is free. On the
    IPv6 wildcard the socket takes both stacks, also where the system default is IPv6 only."""
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host == "::":
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def check_free_port(address: str) -> None:
    """A single-node run's rendezvous listens on MASTER_ADDR:MASTER_PORT: refuse a port that is
    taken: torchrun would join whatever listens there and wait in silence for minutes."""
    host, _, port = address.rpartition(":")
    fix = "unset MASTER_PORT to let run_train.sh pick a free port, or set another one"
    e = _bind_error(socket.AF_INET6 if ":" in host else socket.AF_INET, host, int(port))
    if e is None:
        return
    if e.errno == errno.EADDRINUSE:
        raise ConfigError(
            f"MASTER_PORT={port} is in use on MASTER_ADDR={host} (another job or program listens there); {fix}"
        )
    raise ConfigError(
        f"MASTER_ADDR={host} MASTER_PORT={port}: a single-node run cannot listen there ({e.strerror or e}); "
        f"{fix}, and leave MASTER_ADDR unset (127.0.0.1) or give an address of this machine"
    )


def check_rendezvous_host_port(port: int) -> None:
    """Node 0 of a multi-node job hosts the rendezvous store, which listens on MASTER_PORT on every
    address of the node: refuse a port that another program holds, which torchrun would join and
    wait on in silence for minutes."""
    # The store binds the IPv6 wildcard (dual-stack) where there is one, else the IPv4 one.
    try:
        e = _bind_error(socket.AF_INET6, "::", port) if socket.has_ipv6 else _bind_error(socket.AF_INET, "0.0.0.0", port)
    except OSError:  # IPv6 compiled in but off on this machine: no socket of that family
        e = _bind_error(socket.AF_INET, "0.0.0.0", port)
    if e is None:
        return
    problem = (
        "is in use on this node (another job or program listens there)" if e.errno == errno.EADDRINUSE
        else f"cannot be listened on here ({e.strerror or e})"
    )
    raise ConfigError(
        f"MASTER_PORT={port} {problem}, and this node hosts the multi-node rendezvous (NODE_RANK=0); "
        "set a free MASTER_PORT, the same on every node"
    )


def _take_option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """The value of `--name VALUE` / `--name=VALUE` in argv, and argv without it."""
    rest, value = [], None
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == name and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        elif token.startswith(name + "="):
            value, i = token.partition("=")[2], i + 1
        else:
            rest.append(token)
            i += 1
    return value, rest


def _take_flag(argv: list[str], name: str) -> tuple[bool, list[str]]:
    """Whether the bare flag `name` is in argv, and argv without it."""
    return name in argv, [token for token in argv if token != name]


def main(argv: list[str] | None = None) -> int:
    world, rest = _take_option(sys.argv[1:] if argv is None else list(argv), "--world-size")
    if world is None or not world.isdigit() or int(world) < 1:
        raise SystemExit(f"{USAGE}\n--world-size must be a positive integer (NNODES x NGPU), got {world!r}")
    free_port, rest = _take_option(rest, "--free-port")
    host_port, rest = _take_option(rest, "--rendezvous-host-port")
    restarts, rest = _take_option(rest, "--restarts")
    if host_port is not None and not host_port.isdigit():
        raise SystemExit(f"{USAGE}\n--rendezvous-host-port must be a port number, got {host_port!r}")
    if restarts is not None and not restarts.isdigit():
        raise SystemExit(f"{USAGE}\n--restarts must be a non-negative integer, got {restarts!r}")
    print_launch, rest = _take_flag(rest, "--print-launch")
    try:
        launch = check_job(rest, int(world), int(restarts or 0))
        if launch == "train" and free_port is not None:
            check_free_port(free_port)
        if launch == "train" and host_port is not None:
            check_rendezvous_host_port(int(host_port))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if print_launch:
        print(launch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
