"""Lazy package exports: ``from flcomm.x import Name`` loads the module that defines ``Name``
only when it is asked for, so importing a light module of a package (a description, a
formula) does not import the heavy ones beside it (torch.distributed, FSDP)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, table: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``table[name]`` on first use."""

    def __getattr__(name: str) -> Any:
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
