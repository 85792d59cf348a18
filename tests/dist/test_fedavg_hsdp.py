"""FedAvg on 8 gloo ranks: FL+HSDP with real replica and shard dims (F, R, S) = (2, 2, 2) for
FSDP2 and FSDP1 HYBRID_SHARD, and FL+FSDP with F = 4, against the single-process simulation of
tests/common/fedavg_sim.py (the 4-rank cases are in tests/dist/test_fedavg.py)."""

from __future__ import annotations

import pytest

from tests.common.dist import run_distributed
from tests.common.fedavg_harness import ATOL, cases_worker

pytestmark = pytest.mark.timeout(600)  # a hang guard; the machine may be heavily shared

W8_CASES = [
    dict(kind="fsdp2", F=2, S=2, E=2, T=5),                             # FL+HSDP (2, 2, 2)
    dict(kind="fsdp2", F=2, S=2, E=3, T=6, fed={"overlap": True, "outer": "nesterov"}),
    dict(kind="fsdp2", F=4, E=3, T=6),                                  # FL+FSDP, G = 2
    dict(kind="fsdp1", F=2, S=2, E=2, T=4),                             # FSDP1 HYBRID_SHARD
]


def test_fl_hsdp_matches_simulation_8_ranks():
    worst = run_distributed(cases_worker, 8, W8_CASES, timeout=400)
    assert max(max(w) for w in worst) < ATOL * 10
