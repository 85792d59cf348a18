"""Checks of numeric settings, shared by every layer (this module imports nothing from flcomm).

Each check returns the value when it is acceptable and otherwise raises ValueError naming the
setting, what it must be and what came::

    integer("steps", 0, lo=1)           # steps must be an integer >= 1, got 0
    number("lr", float("nan"), lo=0, lo_open=True)  # lr must be a finite number > 0, got nan

A bool is never a number here (``True`` would pass as 1); numpy scalars count as what Python
says they are (``np.float64`` is a float, ``np.int64`` is no int).
"""

from __future__ import annotations

import math
from typing import Any


def _bounds(lo: Any, hi: Any, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f" {'<' if hi_open else '<='} {hi}"
    return ""


def _within(v: Any, lo: Any, hi: Any, lo_open: bool, hi_open: bool) -> bool:
    above = lo is None or (v > lo if lo_open else v >= lo)
    below = hi is None or (v < hi if hi_open else v <= hi)
    return above and below


def integer(name: str, v: Any, lo: int | None = None, hi: int | None = None, *, also: str = "") -> int:
    """``v`` when it is an int (not a bool) in [lo, hi] (a bound left None is open-ended); else
    ValueError "``name`` must be an integer <bounds>``also``, got ``v!r``"."""
    if isinstance(v, bool) or not isinstance(v, int) or not _within(v, lo, hi, False, False):
        raise ValueError(f"{name} must be an integer{_bounds(lo, hi, False, False)}{also}, got {v!r}")
    return v


def number(name: str, v: Any, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
           hi_open: bool = False, also: str = "") -> float:
    """``float(v)`` when ``v`` is a finite int or float (not a bool) within the bounds (open
    ones with ``lo_open`` / ``hi_open``; None: open-ended); else ValueError "``name`` must be a
    finite number <bounds>``also``, got ``v!r``"."""
    ok = (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
          and _within(v, lo, hi, lo_open, hi_open))
    if not ok:
        raise ValueError(f"{name} must be a finite number{_bounds(lo, hi, lo_open, hi_open)}{also}, got {v!r}")
    return float(v)
