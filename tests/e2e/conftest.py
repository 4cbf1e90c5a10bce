"""Every test in tests/e2e runs the trainer as a user does (minutes on a CPU): all are `slow`,
so the fast tier (`pytest -m "not slow"`) leaves the folder out without a mark on each test."""

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items):
    for item in items:
        if _HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.slow)
