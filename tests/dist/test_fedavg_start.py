"""FedAvg's start (``sync_init``): every rank leaves the constructor only after every group has
its copy of group 0's model, so an uneven broadcast is paid at start-up and not by the first
sync's step. Group 0 is held back after its broadcast here; the reference is the order of the
wall-clock events on one machine."""

from __future__ import annotations

import time

from tests.common.dist import run_distributed

HOLD_S = 1.0


def _worker(rank: int, world: int) -> dict:
    import flcomm.federated.fedavg as fedavg_mod
    from flcomm.federated.fedavg import FedAvg
    from tests.common.fedavg_harness import build

    real, done = fedavg_mod.broadcast, {}

    def slow_group0(transport, tensors, src):
        real(transport, tensors, src)
        if rank < world // 2:  # NOTE: group 0 (the broadcast's source) is still busy for a while
            time.sleep(HOLD_S)
        done["t"] = time.time()

    fedavg_mod.broadcast = slow_group0
    fm, model, opt = build(world, 2, None, "fsdp2")
    FedAvg(model, fm, sync_every=2, optimizer=opt)
    return {"group": fm.coords.group, "broadcast_done": done["t"], "left": time.time()}


def test_no_rank_leaves_before_every_group_has_the_model():
    res = run_distributed(_worker, 4, timeout=120)
    last_done = max(r["broadcast_done"] for r in res)
    for rank, r in enumerate(res):
        assert r["left"] >= last_done, (rank, r, last_done)
