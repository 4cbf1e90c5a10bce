"""The training entry point: ``python -m trainer.train --job.config_file X.toml [--section.key value ...]``.

``main`` loads the config and starts what it asks for: a run (the ``Trainer``, trainer/trainer.py,
built and trained by trainer/outcome.py's ``build_and_train``) or, with ``--job.dry_run``, the dry
run's rehearsal of one rank (trainer/dry_run.py). It sits above both, which import neither it nor
each other's entry; a user mistake is one line instead of a traceback.
"""

from __future__ import annotations

import signal

if __name__ == "__main__":
    # `python -m trainer.train` spends its first seconds importing torch, before `main` installs
    # the stop handlers. Python's own SIGINT handler would raise KeyboardInterrupt inside
    # whichever import runs, and print its traceback; with the default action a Ctrl-C ends the
    # process quietly, as SIGTERM does, and run_train.sh (or the shell) reports the stop.
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import os

from trainer.config import ConfigError, load_config
from trainer.distributed import exit_process
from trainer.fault_tolerance import StopRequest
from trainer.launch_files import record_fault_stacks, report_user_error, write_launch_file
from trainer.outcome import build_and_train
from trainer.parent_death import die_with_launcher
from trainer.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()
    record_fault_stacks()
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        return report_user_error(f"config error: {e}")
    if cfg.job.dry_run:
        # Imported here: a training run never loads the dry run's measuring tools.
        from trainer import dry_run

        return dry_run.main(cfg)
    # Before the build, which can take minutes: a stop signal meanwhile is a request too.
    stop = StopRequest(cfg.training.time_limit_minutes).install()
    write_launch_file("pid", str(os.getpid()))
    try:
        return build_and_train(Trainer, cfg, stop)
    finally:
        stop.uninstall()


if __name__ == "__main__":
    code = main()
    write_launch_file("exit", str(code))
    # Not sys.exit: a finished distributed run must not abort in the interpreter teardown
    # (exit_process explains).
    exit_process(code)
