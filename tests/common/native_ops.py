"""The torch operators flcomm._C declares, read from their schemas in csrc/bindings.cpp (the
source, not the build): what every build must register for the CPU, and a CUDA build for CUDA."""

from __future__ import annotations

import pathlib
import re

BINDINGS = pathlib.Path(__file__).resolve().parents[2] / "csrc" / "bindings.cpp"


def declared_operators() -> set[str]:
    """The names of the ``m.def("name(...`` schemas of ``TORCH_LIBRARY(flcomm, m)``."""
    return set(re.findall(r'm\.def\("(\w+)\(', BINDINGS.read_text()))
