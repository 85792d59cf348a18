"""Loads the native core ``flcomm._C`` and says why, when it cannot.

Importing flcomm never fails for lack of the extension, a GPU or CUDA: ``native()`` returns the
module or raises one clear error that says what is missing and how to get it.

``FLCOMM_NATIVE=0`` switches the extension off as if it were not built (it is not even loaded):
every path then runs on the plain-torch kernels, and the native NCCL transport is unavailable.
CI runs the unit and dist tiers so, to keep the no-extension mode the README promises honest.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

_MODULE: ModuleType | None = None
_ERROR: str | None = None


def _load() -> None:
    global _MODULE, _ERROR
    if _MODULE is not None or _ERROR is not None:
        return
    if switched_off():
        _ERROR = OFF_REASON
        return
    try:
        import torch  # noqa: F401  (the extension links libtorch; load it first)

        _MODULE = importlib.import_module("flcomm._C")
    except ImportError as e:  # not built, or built against another torch
        _ERROR = (
            f"flcomm's native extension flcomm._C could not be loaded ({e}). Build it with "
            "`pip install --no-build-isolation -e .` against the torch you run with."
        )


OFF_REASON = "flcomm._C switched off (FLCOMM_NATIVE=0): running on the plain-torch kernels"


def switched_off() -> bool:
    """Whether ``FLCOMM_NATIVE=0`` asks for the no-extension mode."""
    return os.environ.get("FLCOMM_NATIVE", "").strip() == "0"


def available() -> bool:
    """Whether ``flcomm._C`` is importable (kernels registered as ``torch.ops.flcomm.*``)."""
    _load()
    return _MODULE is not None


def unavailable_reason() -> str | None:
    _load()
    return _ERROR


def native() -> ModuleType:
    """The loaded ``flcomm._C`` module; raises RuntimeError with the reason when it is missing."""
    _load()
    if _MODULE is None:
        raise RuntimeError(_ERROR)
    return _MODULE


def ops():
    """``torch.ops.flcomm``, after making sure the extension that registers it is loaded."""
    native()
    import torch

    return torch.ops.flcomm


def nccl_version_string(code: int) -> str | None:
    """``NCCL_VERSION_CODE`` (major*10000 + minor*100 + patch, since NCCL 2.9) as "2.30.7"; None
    for 0 (no NCCL)."""
    if not code:
        return None
    return f"{code // 10000}.{(code // 100) % 100}.{code % 100}"
