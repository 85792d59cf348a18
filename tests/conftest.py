import os

import pytest
import torch

from tests.common.markers import NO_GPU, NO_SECOND_GPU, deselect_slow, skip_allowed, skip_reason, strict_skips

_SKIPS_REFUSED: list[str] = []


def pytest_configure(config):
    """``FLCOMM_REQUIRE=native,cuda,nccl`` (CI sets it per job): a build without one of them
    fails the run at once, instead of passing with the modules that need it skipped."""
    required = os.environ.get("FLCOMM_REQUIRE", "")
    if not required.strip():
        return
    from flcomm.info import missing_features

    missing = missing_features(required)
    if missing:
        raise pytest.UsageError("FLCOMM_REQUIRE=" + required + ", but this flcomm lacks: " + "; ".join(missing))


def pytest_collection_modifyitems(config, items):
    deselect_slow(config, items)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        # NOTE: by marker, not keyword: item.keywords also holds the names of the test's folders,
        # so "gpu" in them would skip the CPU twins that tests/gpu/ keeps beside their GPU tests
        if item.get_closest_marker("gpu") is not None and gpus < 1:
            item.add_marker(pytest.mark.skip(reason=NO_GPU))
        if item.get_closest_marker("multigpu") is not None and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=NO_SECOND_GPU.format(gpus)))


def _note_skip(report) -> None:
    reason = skip_reason(report)
    if reason is not None and not skip_allowed(reason):
        _SKIPS_REFUSED.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report):
    _note_skip(report)


def pytest_collectreport(report):
    _note_skip(report)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _SKIPS_REFUSED and strict_skips():
        terminalreporter.section("skips outside the allow-list (tests/common/markers.py SKIP_ALLOWED)", red=True)
        for line in _SKIPS_REFUSED:
            terminalreporter.line(line)


def pytest_sessionfinish(session, exitstatus):
    """FLCOMM_STRICT_SKIPS=1 (CI): a skip for a reason outside the allow-list fails the run."""
    if _SKIPS_REFUSED and strict_skips() and exitstatus == 0:
        session.exitstatus = 1
