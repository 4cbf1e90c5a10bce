"""Test-wide environment: offline, no wandb network, and throwaway caches.

Set at import time (before torch/datasets read them) and shared by every test in the
session, so compile tests pay for inductor compilation once per run.
"""

import os
import tempfile

_CACHE_ROOT = tempfile.mkdtemp(prefix="dsv3-tests-")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HOME", os.path.join(_CACHE_ROOT, "hf"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE_ROOT, "inductor"))
