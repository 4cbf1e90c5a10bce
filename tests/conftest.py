"""Test-wide environment: offline, no wandb network, and throwaway caches.

Set at import time (before torch/datasets read them) and shared by every test in the
session, so compile tests pay for inductor compilation once per run.
"""

import atexit
import os
import shutil
import tempfile

_CACHE_ROOT = tempfile.mkdtemp(prefix="dsv3-tests-")
# Removed when the session ends: a compiling session leaves tens of MB of kernels behind.
atexit.register(shutil.rmtree, _CACHE_ROOT, ignore_errors=True)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HOME", os.path.join(_CACHE_ROOT, "hf"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE_ROOT, "inductor"))


import logging  # noqa: E402  (after the environment above, which must precede every other import)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _trainer_logger_as_found():
    """A Trainer built in this process points the "trainer" logger at its run's stdout and log file
    and stops it propagating (trainer/runtime.py's setup_logging): put it back after each test, so a
    later test's ``caplog`` sees its records and no handler writes to a stream pytest has closed."""
    yield
    log = logging.getLogger("trainer")
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    log.propagate = True
    log.setLevel(logging.NOTSET)
