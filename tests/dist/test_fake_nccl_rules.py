"""The NCCL stand-in's rules (tests/common/fake_nccl.py, R1-R11), each checked against what NCCL
and the binding (csrc/nccl_comm.cpp) say, not against the stand-in itself; and the native
transport's watchdog (flcomm/comm/watchdog.py) on it: a silent peer's collective is ended by the
watchdog, within twice the timeout, and only by it.

A "silent" peer is alive and connected but never issues its part (as a frozen rank: gloo's
sockets stay open, nothing arrives). It waits for the others to finish, so the harness's result
collection stays exact."""

from __future__ import annotations

import math
import threading
import time
from datetime import timedelta

import torch

from tests.common.dist import run_distributed

TIMEOUT_S = 1.0  # the communicators' timeout in these tests


def _comm(rank, world, mode="strict"):
    """A stand-in communicator over the world, from an id rank 0 shares."""
    import torch.distributed as dist

    from tests.common import fake_nccl

    fake_nccl._MODE = mode
    obj = [fake_nccl.nccl_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(obj, 0)
    return fake_nccl.NcclComm(obj[0], world, rank, 0, TIMEOUT_S)


def _silent_until_done(rank, key="done"):
    """A silent rank: issues nothing until the others say they are done."""
    from tests.common import dist as tdist

    tdist.STORE.wait([key], timedelta(seconds=60))
    return {"silent": rank}


def _launch_and_wait(rank, world):
    """R1: a launch returns before the peer has launched (it would deadlock otherwise); the
    work is pending until then, completes after. R8 on 2 ranks: avg of floats is the sum of the
    inputs times 1/2 (no overflow where a sum-then-divide overflows), of integers the sum divided
    by 2, truncated toward zero."""
    from tests.common import dist as tdist

    c = _comm(rank, world)
    big = torch.tensor([3.0e38, 1.0, -7.0], dtype=torch.float32)  # NOTE: 2 * 3e38 overflows float32
    ints = torch.tensor([-3, 5, -4], dtype=torch.int32) if rank == 0 else torch.tensor([0, 0, 1], dtype=torch.int32)
    if rank == 0:
        w = c.all_reduce(big, "avg")  # NOTE: returns at once: rank 1 launches only once it sees the key
        pending = w.is_completed()
        tdist.STORE.set("launched", "1")
    else:
        tdist.STORE.wait(["launched"], timedelta(seconds=30))
        pending = None
        w = c.all_reduce(big, "avg")
    assert w.wait(30.0)
    wi = c.all_reduce(ints, "avg")
    wi.wait(30.0)
    return {"pending": pending, "avg": big.tolist(), "iavg": ints.tolist(), "done": w.is_completed()}


def test_launch_returns_at_once_and_avg_reduces_as_nccl():
    res = run_distributed(_launch_and_wait, 2, timeout=60)
    assert res[0]["pending"] is False
    f32 = torch.float32
    for r in res:
        assert r["done"] is True
        # NOTE: ncclDevPreMulSum: x * (1/n) per rank in the dtype, then the sum (2 ranks: 2 * x/2)
        want = [float(torch.tensor(x, dtype=f32) * 0.5 * 2) for x in (3.0e38, 1.0, -7.0)]
        assert r["avg"] == want and math.isfinite(r["avg"][0])
        # NOTE: ncclDevSumPostDiv: C integer division, toward zero
        assert r["iavg"] == [int((-3 + 0) / 2), int((5 + 0) / 2), int((-4 + 1) / 2)] == [-1, 2, -1]


def _silent_peer(rank, world):
    """R2-R5 and R9 with a silent peer: rank 0's stream_wait neither returns nor raises at the
    timeout; a bounded wait aborts at its bound and raises NcclTimeoutError; the abort releases the
    stream_wait without an error, leaves the output undefined (NaN), and every later poll raises."""
    from tests.common import dist as tdist
    from tests.common import fake_nccl

    c = _comm(rank, world)
    if rank == 1:
        return _silent_until_done(rank)
    x = torch.ones(4)
    w = c.all_reduce(x, "sum")
    out: dict = {}

    def stream_wait():
        try:
            w.stream_wait()
            out["stream_wait"] = "returned"
        except BaseException as e:  # noqa: BLE001
            out["stream_wait"] = f"raised {type(e).__name__}"

    t = threading.Thread(target=stream_wait, daemon=True)
    t.start()
    t.join(3 * TIMEOUT_S)  # NOTE: past the communicator's timeout: no bound of its own (R2, R3)
    out["alive_after_3_timeouts"] = t.is_alive()
    out["completed"] = w.is_completed()
    try:
        w.wait(0.2)
    except fake_nccl.NcclTimeoutError as e:
        out["wait"] = f"NcclTimeoutError: {e}"
    t.join(5.0)
    out["alive_after_abort"] = t.is_alive()
    out["aborted"] = c.is_aborted
    out["nan"] = bool(torch.isnan(x).all())
    for name, call in (("poll", w.is_completed), ("launch", lambda: c.all_reduce(torch.ones(1), "sum"))):
        try:
            call()
            out[name] = "no error"
        except RuntimeError as e:
            out[name] = str(e)
    tdist.STORE.set("done", "1")
    return out


def test_a_silent_peers_collective_stays_pending_until_abort():
    res = run_distributed(_silent_peer, 2, timeout=60)
    out = res[0]
    assert out["alive_after_3_timeouts"] is True, "stream_wait ended by itself: NCCL's never does"
    assert out["completed"] is False
    assert out["wait"].startswith("NcclTimeoutError") and "0.2 s" in out["wait"]
    assert out["aborted"] is True
    assert out["alive_after_abort"] is False and out["stream_wait"] == "returned"
    assert out["nan"] is True
    assert "aborted" in out["poll"] and "aborted" in out["launch"]


def _finalize_and_split(rank, world):
    """R9: destroy with an operation pending on a silent peer raises NcclTimeoutError within
    its bound and aborts. R10: a split that a member never calls times out and aborts the parent."""
    from tests.common import dist as tdist
    from tests.common import fake_nccl

    a, b = _comm(rank, world), _comm(rank, world)
    if rank == 1:
        return _silent_until_done(rank)
    out = {}
    a.all_reduce(torch.ones(2), "sum")
    t0 = time.monotonic()
    try:
        a.destroy()
        out["destroy"] = "returned"
    except fake_nccl.NcclTimeoutError:
        out["destroy"] = "NcclTimeoutError"
    out["destroy_s"] = time.monotonic() - t0
    out["a_aborted"] = a.is_aborted
    try:
        b.split(0, rank, 0.5)
        out["split"] = "returned"
    except fake_nccl.NcclTimeoutError:
        out["split"] = "NcclTimeoutError"
    out["b_aborted"] = b.is_aborted
    tdist.STORE.set("done", "1")
    return out


def test_finalize_and_split_are_bounded_and_abort():
    out = run_distributed(_finalize_and_split, 2, timeout=60)[0]
    assert out["destroy"] == "NcclTimeoutError" and out["a_aborted"] is True
    assert out["destroy_s"] < 10 * TIMEOUT_S
    assert out["split"] == "NcclTimeoutError" and out["b_aborted"] is True


def _refusals(rank, world):
    """R7: tensors not on the communicator's device are refused before anything is issued."""
    c = _comm(rank, world)
    got = {}
    for name, t in (("meta", torch.empty(4, device="meta")), ("strided", torch.ones(4, 4).t())):
        try:
            c.all_reduce(t, "sum")
            got[name] = "accepted"
        except RuntimeError as e:
            got[name] = str(e)
    got["launches"] = c.launches
    c.destroy()
    return got


def test_tensors_off_the_device_or_strided_are_refused():
    for got in run_distributed(_refusals, 2, timeout=60):
        assert "must be on the communicator's device" in got["meta"]
        assert "contiguous" in got["strided"]
        assert got["launches"] == 0


def _lenient(rank, world):
    """The explicit old mode: stream_wait is the bounded wait (what the strict mode must not do)."""
    from tests.common import dist as tdist
    from tests.common import fake_nccl

    c = _comm(rank, world, mode="lenient")
    if rank == 1:
        return _silent_until_done(rank)
    w = c.all_reduce(torch.ones(2), "sum")
    try:
        w.stream_wait()
        got = "returned"
    except fake_nccl.NcclTimeoutError:
        got = "NcclTimeoutError"
    tdist.STORE.set("done", "1")
    return got


def test_the_lenient_mode_bounds_stream_wait():
    assert run_distributed(_lenient, 2, timeout=60)[0] == "NcclTimeoutError"


# ---------------------------------------------------------------- the watchdog
def _watched(rank, world, enabled):
    """A native transport whose peer stays silent: with the watchdog, the stream-ordered wait
    returns once the watchdog aborted the communicator (within 2x the timeout), ``failure``
    names the tier, the rank, the peers and the op, and the next launch raises it; without it,
    the wait is still blocked after 4x the timeout."""
    import os

    from flcomm.comm.base import LinkTier
    from flcomm.comm.nccl import NcclTransport
    from flcomm.comm.watchdog import CommFailure
    from tests.common import dist as tdist
    from tests.common import fake_nccl

    fake_nccl.install()
    os.environ["FLCOMM_NCCL_WATCHDOG"] = "1" if enabled else "0"
    t = NcclTransport(_comm(rank, world), LinkTier.INTER_GROUP, timeout=timedelta(seconds=TIMEOUT_S))
    t.ranks = [0, 1]
    if rank == 1:
        return _silent_until_done(rank)
    x = torch.ones(3)
    work = t.all_reduce(x, async_op=True)
    t0 = time.monotonic()
    th = threading.Thread(target=work.wait, daemon=True)
    th.start()
    th.join(4 * TIMEOUT_S if not enabled else 30.0)
    out = {"blocked": th.is_alive(), "seconds": time.monotonic() - t0, "aborted": t.comm.is_aborted}
    f = t.failure
    out["failure"] = None if f is None else (type(f) is CommFailure, f.tier, f.rank, f.peers, f.op, str(f))
    try:
        t.all_reduce(torch.ones(1), async_op=True)
        out["next"] = "no error"
    except RuntimeError as e:
        out["next"] = str(e)
    if not enabled:
        t.comm.abort()  # NOTE: end the hang here, so the rank can report
    tdist.STORE.set("done", "1")
    return out


def test_the_watchdog_ends_a_silent_peers_collective_and_names_it():
    out = run_distributed(_watched, 2, True, timeout=60)[0]
    assert out["blocked"] is False and out["aborted"] is True
    assert out["seconds"] <= 2 * TIMEOUT_S
    ok, tier, rank, peers, op, msg = out["failure"]
    assert ok and (tier, rank, peers, op) == ("inter_group", 0, [0, 1], "all_reduce")
    assert "did not complete within 1 s" in msg and "communicator of global ranks [0, 1] (here its rank 0)" in msg
    assert "inter_group NCCL communicator" in out["next"] and "watchdog aborted" in out["next"]


def test_without_the_watchdog_a_silent_peer_hangs_the_native_transport():
    out = run_distributed(_watched, 2, False, timeout=60)[0]
    assert out["blocked"] is True and out["failure"] is None and out["aborted"] is False
    assert out["next"] == "no error"  # NOTE: nothing tells: NCCL's kernels would spin on


def test_rules_table_names_every_rule():
    """The module's rules are what these tests check: R1-R11, each written with its source."""
    from tests.common import fake_nccl

    doc = fake_nccl.__doc__
    for i in range(1, 12):
        assert f"R{i}." in doc, f"rule R{i} is missing from the stand-in's docstring"
    assert fake_nccl._MODE in fake_nccl.MODES and fake_nccl.MODES[0] == "strict"


def _init_waits_for_every_rank(rank, world):
    """R11, with gloo's own connect taken out (a stand-in group that returns at once): rank 1
    creates its communicator 0.5 s after rank 0, and then a second one that rank 0 never does."""
    import torch.distributed as dist

    from flcomm.comm import torch_pg
    from tests.common import fake_nccl

    obj = [fake_nccl.nccl_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(obj, 0)
    keep = torch_pg.store_group
    torch_pg.store_group = lambda *a, **k: None
    try:
        if rank == 1:
            time.sleep(0.5)
        t0 = time.monotonic()
        fake_nccl.NcclComm(obj[0], world, rank, 0, TIMEOUT_S)
        waited = time.monotonic() - t0
        err = ""
        if rank == 1:
            obj2 = fake_nccl.nccl_unique_id()
            try:
                fake_nccl.NcclComm(obj2, world, rank, 0, TIMEOUT_S)
            except fake_nccl.NcclTimeoutError as e:
                err = str(e)
    finally:
        torch_pg.store_group = keep
    dist.barrier()
    return {"waited": waited, "err": err}


def test_a_communicator_is_created_on_no_rank_before_every_rank_has_it():
    r0, r1 = run_distributed(_init_waits_for_every_rank, 2, timeout=60)
    assert r0["waited"] >= 0.4, r0  # NOTE: rank 0 waited for rank 1, who came 0.5 s later
    assert "NcclComm init: rank 1 of 2 (stand-in): the peers did not all join within 1 s" in r1["err"], r1
