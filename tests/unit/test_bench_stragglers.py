"""bench/stragglers.py's pure helpers against independent references: the slow factors' parsing,
the rows' plan, the interpolation at equal wall time (numpy.interp and a value computed by hand),
a row's reduction of its ranks' records, and the by-steps prediction against its closed form."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from bench.stragglers import at_equal, interp, parse_args, parse_slow, plan_rows, predict, reduce_row


def test_slow_factors_parse_from_a_comma_list():
    _, a = parse_args(["--slow", "1.5,3"])
    assert a.slow == [1.5, 3.0]
    assert a.slow_group == a.groups - 1 == 3  # the default: the last of 4 groups
    _, a = parse_args(["--groups", "2", "--slow", "2"])
    assert a.slow == [2.0] and a.slow_group == 1
    for bad in ("0.5", "x", "", "1.5,inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_slow(bad)


def test_rows_come_in_pairs_no_slow_group_first():
    labels = [r["label"] for r in plan_rows([1.5, 3.0])]
    assert labels == ["no slow group, by steps", "no slow group, by time", "slow x1.5, by steps", "slow x1.5, by time",
                      "slow x3, by steps", "slow x3, by time"]
    assert [r["timed"] for r in plan_rows([2.0])] == [False, True, False, True]


def test_interpolation_at_equal_wall_time():
    # a: loss 1.0 -> 0.5 -> 0.2 at 1, 3, 5 s; b: 0.9 -> 0.4 at 2, 4 s. Equal time: min(5, 4) = 4 s.
    a = [{"t": 1.0, "tokens": 10, "loss": 1.0}, {"t": 3.0, "tokens": 20, "loss": 0.5},
         {"t": 5.0, "tokens": 30, "loss": 0.2}]
    b = [{"t": 2.0, "tokens": 15, "loss": 0.9}, {"t": 4.0, "tokens": 40, "loss": 0.4}]
    x, la, lb = at_equal(a, b, "t")
    assert x == 4.0
    assert la == pytest.approx(0.35, abs=1e-12)  # halfway between 0.5 (3 s) and 0.2 (5 s), by hand
    assert lb == pytest.approx(0.4, abs=1e-12)
    # equal tokens: min(30, 40) = 30; b between 15 (0.9) and 40 (0.4): 0.9 - 0.5 * 15 / 25 = 0.6
    n, na, nb = at_equal(a, b, "tokens")
    assert (n, na) == (30, 0.2) and nb == pytest.approx(0.6, abs=1e-12)
    rng = np.random.default_rng(0)
    xs = np.cumsum(rng.uniform(0.1, 1.0, 12))
    ys = rng.uniform(0.0, 2.0, 12)
    for q in rng.uniform(xs[0], xs[-1], 50):
        assert interp(list(xs), list(ys), float(q)) == pytest.approx(float(np.interp(q, xs, ys)), abs=1e-12)
    assert interp(list(xs), list(ys), float(xs[-1]) + 1) is None and interp([], [], 0.0) is None


def _rank(rank: int, group: int, **kw) -> dict:
    base = {"rank": rank, "group": group, "steps": 10, "tokens": 160, "compute_s": 0.5, "fed_step_s": 0.1,
            "exposed_s": 0.05, "fed_bytes": 1000, "sync_events": 2, "records": [], "final_loss": 0.3,
            "start": 100.0, "end": 104.0}
    return {**base, **kw}


def test_a_rows_reduction_of_its_ranks():
    ranks = [_rank(0, 0, start=100.0, fed_step_s=0.2), _rank(1, 0, start=100.5, fed_step_s=0.3),
             _rank(2, 1, steps=5, tokens=80, compute_s=0.75, end=105.0, fed_bytes=3000),
             _rank(3, 1, steps=5, tokens=80, compute_s=0.5, final_loss=0.31)]
    r = reduce_row(ranks, {"label": "x", "slow": 1.5, "timed": True}, groups=2, rounds=2)
    assert r["wall_s"] == 5.0  # the last end (105) less the first start (100)
    assert r["job_tokens_per_s"] == pytest.approx((160 + 160 + 80 + 80) / 5.0)
    assert r["group_tokens_per_s"] == pytest.approx([320 / 5.0, 160 / 5.0])
    assert r["group_step_s"] == pytest.approx([0.05, (0.15 + 0.1) / 2])  # mean over ranks of compute / steps
    assert r["group_wait_s"] == pytest.approx([0.3, 0.1])  # max over the group's ranks
    assert r["fed_bytes_per_round"] == pytest.approx((1000 + 1000 + 3000 + 1000) / 4 / 2)
    assert r["eval_end"] == 0.3 and r["eval_spread"] == pytest.approx(0.01)


def test_the_by_steps_prediction_is_the_slowest_groups_pace():
    a = argparse.Namespace(sync_every=8, step_s=0.05, overlap_steps=0, ranks=8, groups=4, batch_size=16)
    steps = [0.05, 0.05, 0.05, 0.075]
    row = {"timed": False, "group_step_s": steps}
    # by hand: each group trains E steps of G x batch tokens per round of E max(s) + exposed seconds
    want = 4 * 8 * (2 * 16) / (8 * 0.075 + 0.1)
    assert predict(row, a, exposed_s=0.1) == pytest.approx(want, rel=1e-12)
    # by time with overlap: each group trains (T - exposed) / s steps per period T
    a.overlap_steps = 1
    T = 8 * 0.05
    want = sum((T - 0.0) / s * 32 / T for s in steps)
    assert predict({"timed": True, "group_step_s": steps}, a, exposed_s=0.1) == pytest.approx(want, rel=1e-12)
