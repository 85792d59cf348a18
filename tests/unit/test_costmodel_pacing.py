"""The cost model of a slow federation group (flcomm/costmodel/stragglers.py) against a discrete
simulation of the two rules, written here from their definitions: groups whose steps take s_g
(jittered by +-10 %, so the deadline falls anywhere in a step), syncing every E steps (each group
waits for the last) or at absolute deadlines every T seconds (blocking: each waits at the sync for
the last group, then for the exchange; with overlap nobody waits at the start)."""

from __future__ import annotations

import random

import pytest

from flcomm.costmodel.stragglers import expected_lateness, predict_pacing
from flcomm.federated.config import FedAvgConfig


def _simulate_timed(step_s, period, exposed, rounds=4000, overlap=False, seed=0):
    rng = random.Random(seed)
    t = [0.0] * len(step_s)  # each group's clock
    steps = [0] * len(step_s)
    for p in range(1, rounds + 1):
        deadline = p * period
        for g, s in enumerate(step_s):
            while t[g] < deadline:
                t[g] += s * (1 + 0.1 * (2 * rng.random() - 1))
                steps[g] += 1
        if not overlap:
            done = max(t) + exposed  # the last group's arrival, then the exchange
            t = [done] * len(t)
        else:
            t = [x + exposed for x in t]
    return [n / (rounds * period) for n in steps]


@pytest.mark.parametrize("step_s", [[1.0, 1.5], [1.0, 1.0, 1.0, 3.0], [0.7, 1.0]])
@pytest.mark.parametrize("overlap", [False, True])
def test_timed_rates_match_the_simulation(step_s, overlap):
    period, exposed = 12.0, 0.4
    cfg = FedAvgConfig(sync_period_s=period, overlap_steps=1 if overlap else 0)
    got = predict_pacing(cfg, step_s, tokens_per_step=1.0, exposed_s=exposed)
    want = _simulate_timed(step_s, period, exposed, overlap=overlap)
    assert got.round_s == period
    for g, (a, b) in enumerate(zip(got.group_tokens_per_s, want)):
        assert a == pytest.approx(b, rel=0.03), (g, got, want)


def test_by_steps_every_group_runs_at_the_slowest_pace():
    got = predict_pacing(FedAvgConfig(sync_every=8), [1.0, 1.5], tokens_per_step=100.0, exposed_s=2.0)
    assert got.round_s == 8 * 1.5 + 2.0
    assert got.group_tokens_per_s == [800 / 14.0, 800 / 14.0]
    assert got.wait_s == [8 * 0.5 + 2.0, 2.0]


def test_the_lateness_is_the_mean_of_the_largest_uniform():
    assert expected_lateness([2.0]) == pytest.approx(1.0)
    assert expected_lateness([1.0, 1.0]) == pytest.approx(2 / 3)  # E[max of 2 U(0, 1)]
    rng = random.Random(1)
    mc = sum(max(rng.uniform(0, 1.0), rng.uniform(0, 3.0)) for _ in range(200_000)) / 200_000
    assert expected_lateness([1.0, 3.0]) == pytest.approx(mc, rel=0.01)


def test_bad_inputs_name_what_came():
    with pytest.raises(ValueError, match=r"step_s\[1\] .* got 0"):
        predict_pacing(FedAvgConfig(), [1.0, 0], 1.0)
    with pytest.raises(ValueError, match="shorter than the slowest step"):
        predict_pacing(FedAvgConfig(sync_period_s=2.0), [1.0, 3.0], 1.0)
    with pytest.raises(ValueError, match="one step time per federation group, got none"):
        predict_pacing(FedAvgConfig(), [], 1.0)
