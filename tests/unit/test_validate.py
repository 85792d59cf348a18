"""flcomm.validate, the numeric checks every layer shares: each checked against Python's own
comparison of the value with its bounds, and the message naming the setting, what it must be
and what came."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flcomm.validate import integer, number

INTS = [-3, 0, 1, 2, 7, 10**20]
BOUNDS = [(None, None), (1, None), (0, None), (None, 5), (1, 7)]


@pytest.mark.parametrize("lo,hi", BOUNDS)
@pytest.mark.parametrize("v", INTS)
def test_integer_bounds_are_closed(v, lo, hi):
    ok = (lo is None or lo <= v) and (hi is None or v <= hi)
    if ok:
        assert integer("n", v, lo, hi) == v
    else:
        with pytest.raises(ValueError, match=rf"^n must be an integer .*, got {v}$"):
            integer("n", v, lo, hi)


@pytest.mark.parametrize("v", [True, False, 1.0, 2.5, "3", None, np.int64(3), np.int32(1)])
def test_integer_refuses_bool_float_str_and_numpy_ints(v):
    # NOTE: as the checks it replaces (isinstance(v, int) and not a bool): numpy ints were refused
    with pytest.raises(ValueError, match=r"^steps must be an integer >= 1, got "):
        integer("steps", v, 1)


@pytest.mark.parametrize("lo,hi,lo_open,hi_open,want", [
    (1, None, False, False, "an integer >= 1"),
    (None, 5, False, False, "an integer <= 5"),
    (1, 1048576, False, False, r"an integer in \[1, 1048576\]"),
])
def test_integer_message(lo, hi, lo_open, hi_open, want):
    with pytest.raises(ValueError, match=rf"^block_size \(per scale\) must be {want} or None, got 0.5$"):
        integer("block_size (per scale)", 0.5, lo, hi, also=" or None")


FLOATS = [-1.0, 0, 0.0, 0.5, 1, 1.0, 3.0, 1e300]
FBOUNDS = [(None, None, False, False), (0, None, False, False), (0, None, True, False), (0, 1, False, False),
           (0, 1, True, True), (0, 1, True, False), (None, 1, False, True)]


@pytest.mark.parametrize("lo,hi,lo_open,hi_open", FBOUNDS)
@pytest.mark.parametrize("v", FLOATS)
def test_number_bounds_open_and_closed(v, lo, hi, lo_open, hi_open):
    above = lo is None or (v > lo if lo_open else v >= lo)
    below = hi is None or (v < hi if hi_open else v <= hi)
    if above and below:
        got = number("x", v, lo, hi, lo_open=lo_open, hi_open=hi_open)
        assert got == v and type(got) is float
    else:
        with pytest.raises(ValueError, match=r"^x must be a finite number .*, got "):
            number("x", v, lo, hi, lo_open=lo_open, hi_open=hi_open)


@pytest.mark.parametrize("v", [math.nan, math.inf, -math.inf, np.float64("nan"), True, False, "1.0", None,
                               np.float32(1.0)])
def test_number_refuses_non_finite_bool_str(v):
    # NOTE: np.float32 is no Python float (refused before as well); np.float64 is one
    with pytest.raises(ValueError, match=r"^lr must be a finite number > 0, got "):
        number("lr", v, 0, lo_open=True)


def test_number_accepts_numpy_float64_and_ints():
    assert number("x", np.float64(0.25), 0, 1) == 0.25
    assert number("x", 3) == 3.0


@pytest.mark.parametrize("lo,hi,lo_open,hi_open,want", [
    (0, None, True, False, "> 0"), (0, None, False, False, ">= 0"), (None, 1, False, True, "< 1"),
    (0, 1, True, True, r"in \(0, 1\)"), (0, 1, False, True, r"in \[0, 1\)"), (0, 1, False, False, r"in \[0, 1\]"),
])
def test_number_message(lo, hi, lo_open, hi_open, want):
    with pytest.raises(ValueError, match=rf"^x must be a finite number {want}, got nan$"):
        number("x", math.nan, lo, hi, lo_open=lo_open, hi_open=hi_open)
