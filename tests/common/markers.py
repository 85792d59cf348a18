"""Marker rules of the suite, applied by tests/conftest.py."""

from __future__ import annotations

import os


def deselect_slow(config, items):
    """``slow`` tests run only when asked: ``-m`` names the marker (``-m slow``) or FLCOMM_SLOW=1."""
    if os.environ.get("FLCOMM_SLOW") == "1" or "slow" in (config.getoption("markexpr") or ""):
        return
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "slow" not in item.keywords]
