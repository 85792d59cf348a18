"""The cost model's ``--measure`` (measure_tiers) on 4 gloo ranks as 2 nodes x 2: every tier's
bandwidth and latency, bus bandwidth = wire bytes / time, and a Cluster built from it."""

from __future__ import annotations

import pytest

from flcomm import costmodel as cm
from flcomm.costmodel import Cluster
from tests.common.dist import run_distributed


def _measure(rank: int, world: int) -> dict:
    return cm.measure_tiers(ranks_per_node=2, nbytes=1 << 16, iters=2, latency_iters=3)


def test_measure_tiers_on_gloo():
    res = run_distributed(_measure, 4, timeout=90)
    r0 = res[0]
    assert (r0["nodes"], r0["ranks_per_node"], r0["group_size"], r0["backend"]) == (2, 2, 2, "gloo")
    assert r0["intra_node"]["ranks"] == 2 and r0["intra_node"]["per"] == "rank"
    assert r0["inter_node"]["ranks"] == 2 and r0["inter_node"]["per"] == "node"
    assert r0["inter_group"]["ranks"] == 2
    for tier in ("intra_node", "inter_node", "inter_group"):
        assert r0[tier]["bandwidth_Bps"] > 0 and r0[tier]["latency_s"] >= 0
        # bus bandwidth = wire bytes / time (2 ranks: wire = the buffer)
        assert r0[tier]["bus_Bps_per_rank"] == pytest.approx(r0[tier]["nbytes"] / r0[tier]["time_s"])
    # inter tiers count both ranks of a node crossing at once
    assert r0["inter_node"]["bandwidth_Bps"] == pytest.approx(2 * r0["inter_node"]["bus_Bps_per_rank"])
    assert all(r["inter_node"]["time_s"] == r0["inter_node"]["time_s"] for r in res)  # the slowest rank's
    c = Cluster.from_measurement(r0, nodes=16)
    assert c.world_size == 32 and c.intra.bandwidth == r0["intra_node"]["bandwidth_Bps"]
