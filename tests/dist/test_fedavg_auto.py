"""``overlap_steps="auto"`` on 4 gloo ranks (2 federation groups of 2): the k each group settles
on, when it is applied, and that a checkpoint keeps it.

Time is staged: each step lasts exactly STEP_S on a fake clock and rank r's exchanges "take"
EXCHANGE_S[r] (``Job.seconds``), so the reference is exact: the rule written out here (the
smallest k with k * step >= MARGIN * exchange, in [1, E]), the largest of a group's ranks, and
the schedule a fixed k gives (applies k steps after each sync)."""

from __future__ import annotations

import math

import pytest

from tests.common.dist import run_distributed

E, T, STEP_S = 8, 40, 1.0
EXCHANGE_S = [0.5, 1.5, 2.5, 3.5]  # rank r's staged exchange time


def _staged(rank: int):
    """Patch the clock FedAvg's measurement reads and the exchange's measured time."""
    import flcomm.federated.autotune as autotune
    from flcomm.comm.engine import Job

    clock = {"t": 0.0}

    class Clock:
        @staticmethod
        def perf_counter() -> float:
            return clock["t"]

    autotune.time = Clock
    Job.seconds = lambda self: EXCHANGE_S[rank]
    return clock


def _worker(rank: int, world: int) -> dict:
    from flcomm.federated.fedavg import FedAvg
    from tests.common.fedavg_harness import batch, build, loss_fn

    clock = _staged(rank)
    fm, model, opt = build(world, 2, None, "fsdp2")
    fed = FedAvg(model, fm, sync_every=E, overlap_steps="auto", inner_optimizer=opt)
    flags, ks = [], []
    for t in range(1, T + 1):
        loss_fn(model, *batch(fm.coords.group, fm.coords.index, t)).backward()
        opt.step()
        opt.zero_grad()
        clock["t"] += STEP_S
        flags.append(fed.step())
        ks.append(fed.overlap_steps)
    fed.finish()
    sd = fed.state_dict()
    again = FedAvg(model, fm, sync_every=E, overlap_steps="auto", inner_optimizer=opt, sync_module_states=False)
    before = again.overlap_steps
    again.load_state_dict(sd)
    return {"flags": flags, "ks": ks, "saved": sd.get("overlap_steps"), "loaded": (before, again.overlap_steps),
            "group": fm.coords.group}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 4, timeout=240)


def _rule(exchange_s: float) -> int:
    from flcomm.federated.autotune import MARGIN

    return max(1, min(E, math.ceil(MARGIN * exchange_s / STEP_S)))


def test_each_group_settles_on_its_slowest_ranks_k(results):
    for rank, r in enumerate(results):
        g = r["group"]
        want = max(_rule(EXCHANGE_S[q]) for q in (2 * g, 2 * g + 1))
        decided = 3 * E + E  # NOTE: measured with k = E; the 1st exchange is left out, the 2nd and 3rd count
        assert r["ks"][:decided - 1] == [E] * (decided - 1), (rank, r["ks"])
        assert r["ks"][decided - 1:] == [want] * (T - decided + 1), (rank, r["ks"])
        assert r["saved"] == want and r["loaded"] == (E, want), (rank, r)
    assert {r["ks"][-1] for r in results[:2]} != {r["ks"][-1] for r in results[2:]}  # the groups differ here


def test_applies_follow_the_chosen_k(results):
    for rank, r in enumerate(results):
        k = r["ks"][-1]
        syncs = list(range(E, T + 1, E))
        applies = {s + E for s in syncs if s + E <= 4 * E} | {s + k for s in syncs if s > 3 * E and s + k <= T}
        want = [t in syncs or t in applies for t in range(1, T + 1)]
        assert r["flags"] == want, (rank, r["flags"], want)
