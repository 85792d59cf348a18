"""Lazy package exports: ``from flcomm.x import Name`` loads the module that defines ``Name``
only when it is asked for, so importing a light module of a package (a description, a
formula) does not import the heavy ones beside it (torch.distributed, FSDP). Also the deprecated
names kept for one release: a renamed module attribute, a moved module."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, table: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``table[name]`` on first use."""

    def __getattr__(name: str) -> Any:
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def renamed_attributes(module: str, renames: dict[str, str],
                       then: Callable[[str], Any] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module``: its attribute ``old`` is ``renames[old]`` now,
    given with a DeprecationWarning (for one release); any other name goes to ``then``."""

    def __getattr__(name: str) -> Any:
        if name in renames:
            new = renames[name]
            warnings.warn(f"{module}.{name} is deprecated: use {module}.{new}", DeprecationWarning, stacklevel=2)
            return getattr(sys.modules[module], new)
        if then is not None:
            return then(name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def moved_module(old: str, new: str) -> None:
    """Warn (DeprecationWarning) that the module ``old``, imported now, is ``new``: the shim that
    keeps ``old`` importable for one release re-exports ``new``'s names."""
    warnings.warn(f"{old} is deprecated: it moved to {new}", DeprecationWarning, stacklevel=3)
