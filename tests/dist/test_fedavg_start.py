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
    FedAvg(model, fm, sync_every=2, inner_optimizer=opt)
    return {"group": fm.coords.group, "broadcast_done": done["t"], "left": time.time()}


def test_no_rank_leaves_before_every_group_has_the_model():
    res = run_distributed(_worker, 4, timeout=120)
    last_done = max(r["broadcast_done"] for r in res)
    for rank, r in enumerate(res):
        assert r["left"] >= last_done, (rank, r, last_done)


def _warm_worker(rank: int, world: int) -> dict:
    import torch

    from flcomm.federated.fedavg import FedAvg
    from tests.common.fedavg_harness import build

    fm, model, opt = build(world, 2, None, "fsdp2")
    before = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    sent0 = fm.stats.bytes("inter_group")
    fed = FedAvg(model, fm, sync_every=2, codec="int8", error_feedback=True, outer="nesterov", overlap_steps=1,
                 inner_optimizer=opt)
    after = {n: p.detach().to_local() for n, p in model.named_parameters()}
    residuals = [r for fr in fed._frags for r in fr.exchange.state_dict()["residuals"] if r is not None]
    return {"same": all(torch.equal(before[n], after[n]) for n in before),
            "anchor_is_local": all(torch.equal(a, s.local) for a, s in zip(fed._anchor, fed.slots)),
            "zero_state": all(not t.any() for t in [*residuals, *fed._outer.buffers]),
            "sent": fm.stats.bytes("inter_group") - sent0, "num_syncs": fed.num_syncs, "exposed": fed.exposed_comm_s}


def test_the_warm_up_exchange_runs_at_construction_and_changes_nothing():
    """A lossy, nesterov, overlapped FedAvg exchanges once at construction (inter-group bytes are
    sent) and leaves the model, the anchors, the residuals, the momentum and the counters as a
    FedAvg that never synced."""
    for rank, r in enumerate(run_distributed(_warm_worker, 4, timeout=120)):
        assert r["same"] and r["anchor_is_local"] and r["zero_state"], (rank, r)
        assert r["sent"] > 0 and r["num_syncs"] == 0 and r["exposed"] == 0.0, (rank, r)


def _first_step_worker(rank: int, world: int) -> dict:
    import torch

    from flcomm.federated.fedavg import FedAvg
    from tests.common.fedavg_harness import build

    fm, model, opt = build(world, 2, None, "fsdp2")
    fed = FedAvg(model, fm, sync_every=4, codec="int8", error_feedback=True, overlap_steps=1, inner_optimizer=opt)
    model(torch.randn(5, 4)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    if fm.coords.group == 1:  # NOTE: group 1's first step had more to do (a lazy init, say)
        time.sleep(HOLD_S)
    entered = time.time()
    fed.step()
    return {"group": fm.coords.group, "entered": entered, "left": time.time(), "syncs": fed.num_syncs}


def test_the_groups_leave_the_first_step_together():
    """The first step's one-time costs differ between groups: FedAvg's first ``step()`` is a
    barrier over the group and the shard peers, so the first sync's step does not wait for them.
    Every rank leaves that call after the late group entered it (no sync has run)."""
    res = run_distributed(_first_step_worker, 4, timeout=120)
    late = max(r["entered"] for r in res if r["group"] == 1)
    for rank, r in enumerate(res):
        assert r["left"] >= late and r["syncs"] == 0, (rank, r, late)
