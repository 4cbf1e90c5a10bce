"""A run's outcome as the launcher and the user see it: the exit code and the last words of a
Trainer's build and run. One line for a user mistake, a collective that timed out or a peer that
died (exit 2 or 1), 3 for a diverged run, 130 for an interrupt; a traceback only for what is
nobody's mistake but ours. `python -m trainer.train` (trainer/train.py's ``main``) ends here.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

from trainer.config import ConfigError, JobConfig
from trainer.distributed import collective_timeout_message, destroy_distributed, is_collective_timeout, is_peer_lost
from trainer.fault_tolerance import StopRequest, TrainingDiverged
from trainer.launch_files import report_user_error

if TYPE_CHECKING:  # a type only: the entry (trainer/train.py) passes the class
    from trainer.trainer import Trainer

logger = logging.getLogger("trainer")


def build_and_train(trainer_class: type[Trainer], cfg: JobConfig, stop: StopRequest) -> int:
    """Builds ``trainer_class(cfg)`` and runs it (`run`); a user mistake or a timeout found while
    building is one line and its exit code, as in `run`."""
    try:
        trainer = trainer_class(cfg)
    except ConfigError as e:
        destroy_distributed()  # a process group made before the mistake was found
        return report_user_error(f"config error: {e}")
    except (OSError, ValueError) as e:
        # Bad paths, files or data options found while building the run: one line, no traceback.
        destroy_distributed()
        return report_user_error("error: " + " ".join(str(e).split()))
    except RuntimeError as e:
        if not is_collective_timeout(e):
            raise
        destroy_distributed()
        return report_user_error(
            collective_timeout_message(e, "init_timeout_seconds", cfg.comm.init_timeout_seconds, "while starting")
        )
    except KeyboardInterrupt:  # a second Ctrl-C while starting
        destroy_distributed()
        print("interrupted while starting; nothing was trained", file=sys.stderr)
        return 130
    return run(trainer, stop)


def run(trainer: Trainer, stop: StopRequest | None = None) -> int:
    """Trains a built Trainer (until `stop`, see `Trainer.train`) and closes it; returns the
    process exit code (0 done or stopped, 2 a setting only the run could find wrong or a collective
    that timed out, 3 diverged, 130 interrupted)."""
    try:
        trainer.train(stop)
    except ConfigError as e:
        # A setting that only the run itself can find wrong (e.g. a validation split smaller
        # than one global batch): one line, as at startup.
        return report_user_error(f"config error: {e}")
    except TrainingDiverged as e:  # a RuntimeError: before the timeout clause
        logger.error("%s; %s. Lower the learning rate for the rerun, or check the data near this step.",
                     e, trainer.checkpointer.newest_good())
        return 3
    except RuntimeError as e:
        if is_peer_lost(e):
            logger.error("error: at step %d a collective lost its connection to another rank, which died or was "
                         "killed (the launcher names it); torch: %s", trainer.step, " ".join(str(e).split())[:200])
            return 1
        if not is_collective_timeout(e):
            raise
        key = trainer.collective_timeout_key
        return report_user_error(
            collective_timeout_message(e, key, getattr(trainer.cfg.comm, key), f"at step {trainer.step}")
        )
    except KeyboardInterrupt:
        logger.warning("interrupted at step %d; exiting", trainer.step)
        return 130
    finally:
        trainer.close()
    return 0
