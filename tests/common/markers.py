"""Marker rules of the suite, applied by tests/conftest.py."""

from __future__ import annotations

import os
import re

# NOTE: the only reasons a CI run may skip a test for (FLCOMM_STRICT_SKIPS=1, which .ci/run sets):
# hardware the CI machine lacks. Anything else (a missing package, tool or build part) fails
# the run, listed with its test (review F8)
NO_GPU = "needs a CUDA GPU; none visible"  # tests/conftest.py's reasons for the gpu and multigpu marks
NO_SECOND_GPU = "needs 2+ CUDA GPUs; {} visible"
NO_AVX512 = "no AVX-512F+BW"  # tests/unit/test_kernels.py's
SKIP_ALLOWED = (re.escape(NO_GPU), re.escape(NO_SECOND_GPU).replace(r"\{\}", r"\d+"), re.escape(NO_AVX512))
# NOTE: with FLCOMM_NATIVE=0 (CI's no-extension step) the extension is off on purpose: a test of
# flcomm._C itself may skip, and only then
NO_NATIVE = r".*flcomm\._C.*"


def strict_skips() -> bool:
    return os.environ.get("FLCOMM_STRICT_SKIPS") == "1"


def skip_allowed(reason: str) -> bool:
    """Whether a skip's reason (pytest's "Skipped: " prefix or not) is one of :data:`SKIP_ALLOWED`."""
    reason = reason.removeprefix("Skipped: ").strip()
    from flcomm._native import switched_off

    allowed = SKIP_ALLOWED + ((NO_NATIVE,) if switched_off() else ())
    return any(re.fullmatch(p, reason, re.S) for p in allowed)



def skip_reason(report) -> str | None:
    """The reason of a skipped test or collection report, else None."""
    if not report.skipped:
        return None
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def deselect_slow(config, items):
    """``slow`` tests run only when asked: ``-m`` names the marker (``-m slow``) or FLCOMM_SLOW=1."""
    if os.environ.get("FLCOMM_SLOW") == "1" or "slow" in (config.getoption("markexpr") or ""):
        return
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "slow" not in item.keywords]
