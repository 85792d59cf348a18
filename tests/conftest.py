import os

import pytest
import torch


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


def _deselect_slow(config, items):
    """``slow`` tests run only when asked: ``-m`` names the marker (``-m slow``) or FLCOMM_SLOW=1."""
    if os.environ.get("FLCOMM_SLOW") == "1" or "slow" in (config.getoption("markexpr") or ""):
        return
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "slow" not in item.keywords]


def pytest_collection_modifyitems(config, items):
    _deselect_slow(config, items)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none visible"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2+ CUDA GPUs; {gpus} visible"))
