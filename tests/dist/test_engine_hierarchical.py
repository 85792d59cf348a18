"""The progress engine under a hierarchical all-gather on 4 gloo ranks as 2 nodes x 2: the second
stage (intra-node) runs after the first on the engine's thread, without the caller's wait()."""

from __future__ import annotations

import time

import pytest
import torch

from flcomm.federated.mesh import init_fed_mesh
from tests.common.dist import run_distributed

pytestmark = pytest.mark.timeout(240)  # NOTE: a hang guard above run_distributed's own (120 s + start-up)


def _hier_advances(rank: int, world: int) -> dict:
    from flcomm.federated.topology import Topology

    mesh = init_fed_mesh(Topology(world, 2))
    h = mesh.hierarchy("shard")
    mine = torch.full((1000,), float(rank))
    full = torch.empty(world * 1000)
    job = h.all_gather(full, mine, async_op=True)  # stage 2 (intra-node) needs stage 1's result
    t0 = time.monotonic()
    while not job.is_completed() and time.monotonic() - t0 < 60:
        time.sleep(0.01)
    done = job.is_completed()
    job.wait(60)
    want = torch.arange(world, dtype=torch.float32).repeat_interleave(1000)
    return {"done_without_wait": done, "equal": bool(torch.equal(full, want))}


def test_hierarchical_all_gather_second_stage_runs_without_wait():
    for r in run_distributed(_hier_advances, 4, timeout=120):
        assert r["done_without_wait"] and r["equal"], r
