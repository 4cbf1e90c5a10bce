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
