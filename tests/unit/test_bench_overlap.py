"""bench/overlap.py's arithmetic: the exposed fraction of interleaved blocks against the issue's
definition, E * (overlap step - compute step) / exchange, computed by hand."""

from __future__ import annotations

import argparse
import random

import pytest

from bench.overlap import summarize


@pytest.mark.parametrize("E,K,B", [(4, 1, 2), (8, 2, 3)])
def test_exposed_fraction_matches_the_issue_definition(E: int, K: int, B: int):
    a = argparse.Namespace(sync_every=E, fragments=K, overlap_steps=E)
    rng = random.Random(E + K + B)
    compute, exchange, blocking_step = 0.5, 0.48, 0.6
    n = (B + 1) * E
    blocks, extras, cpus = [], [], []
    for _ in range(5):
        extra = rng.uniform(0.0, 0.1)  # exposed seconds per exchange in this block
        cpu, cpu_step = rng.uniform(0.0, 0.05), rng.uniform(0.4, 0.6)  # CPU s per exchange; per compute step
        applied = B * K
        before, after = compute + rng.uniform(-0.05, 0.05), compute + rng.uniform(-0.05, 0.05)
        c = (before + after) / 2
        blocks.append({"time_s": n * c + applied * extra, "applied": applied, "fedavg_s": 0.01 * applied,
                       "compute_step_s": c, "compute_around_s": [before, after], "steps": n,
                       "cpu_s": n * cpu_step + applied * cpu, "compute_cpu_step_s": cpu_step})
        extras.append(extra)
        cpus.append(cpu)
    row = summarize(a, "int8", {"step_s": blocking_step, "exchange_s": exchange}, blocks)
    mean_extra = sum(extras) / len(extras)
    mean_compute = sum(b["compute_step_s"] for b in blocks) / len(blocks)
    # steady training: one exchange (of 1/K) per E/K steps, each adding its exposed time
    overlap_step = mean_compute + mean_extra * K / E
    assert row["overlap_step_s"] == pytest.approx(overlap_step, rel=1e-12)
    assert row["exposed_fraction"] == pytest.approx(E * (overlap_step - mean_compute) / (K * exchange), rel=1e-9)
    assert row["fedavg_exposed_fraction"] == pytest.approx(0.01 / exchange, rel=1e-12)
    assert row["overlap_vs_compute"] == pytest.approx(overlap_step / mean_compute, rel=1e-12)
    assert row["overlap_vs_blocking"] == pytest.approx(overlap_step / blocking_step, rel=1e-12)
    assert row["exposed_fraction_se"] > 0 and len(row["repeats"]) == 5
    # the CPU seconds an exchange adds: the block's CPU time less its steps' compute-only CPU time
    assert row["cpu_per_exchange_s"] == pytest.approx(sum(cpus) / len(cpus), rel=1e-9)
