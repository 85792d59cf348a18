"""FedAvg's exchange in the progress engine on gloo: a peer killed while an exchange is in the
engine makes every survivor fail within the timeout, with an error naming its rank and the
stage; the exchange advances while the loop computes (it is complete before the apply without
the loop ever calling wait())."""

from __future__ import annotations

import os
import pickle
import time
from datetime import timedelta

import pytest
import torch.multiprocessing as mp

from flcomm.train.launch import bound_store
from tests.dist import _worker
from tests.fedavg_sim import batch, loss_fn, make_model, make_opt

pytestmark = pytest.mark.timeout(240)

TIMEOUT_S = 15.0


def _killed_peer(rank: int, world: int) -> dict:
    from flcomm.federated.fedavg import FedAvg
    from flcomm.federated.topology import Topology

    fm = Topology(world, world, group_size=1, shard_size=1).build(
        timeout=timedelta(seconds=TIMEOUT_S), hierarchical=False)
    model = make_model(0, d=64)
    opt = make_opt(model.parameters(), "adamw", 1e-2)
    fed = FedAvg(model, fm, sync_every=2, overlap=True, bucket_mb=0.01)

    def local_step(t: int) -> None:
        loss_fn(model, *batch(rank, 0, t)).backward()
        opt.step()
        opt.zero_grad()

    for t in (1, 2, 3):  # one exchange started at 2 and applied at 3
        local_step(t)
        fed.step()
    local_step(4)
    if rank == world - 1:
        os._exit(17)  # dies instead of starting the exchange of step 4
    fed.step()  # the survivors' exchange is now in the engine, waiting for the dead peer
    t0 = time.monotonic()
    try:
        for t in (5, 6):
            local_step(t)
            fed.step()
        fed.finish()
        return {"error": None}
    except Exception as e:  # noqa: BLE001 - the test checks the type and the message
        return {"error": f"{type(e).__name__}: {e}", "after_s": time.monotonic() - t0}


def test_killed_peer_ends_survivors_within_the_timeout():
    world = 3
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    store = bound_store("127.0.0.1", world + 1, timedelta(seconds=60 + 2 * TIMEOUT_S))  # noqa: F841 - kept alive
    port = store.port
    procs = [ctx.Process(target=_worker, args=(r, world, port, "gloo", _killed_peer, (), q, TIMEOUT_S),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, dict] = {}
    deadline = time.monotonic() + 60 + 2 * TIMEOUT_S  # start-up (imports) + the bound
    try:
        while len(got) < world - 1 and time.monotonic() < deadline:
            if q.empty():
                time.sleep(0.05)
                continue
            rank, status, payload = q.get()
            assert status == "ok", payload
            got[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    assert sorted(got) == list(range(world - 1)), f"survivors that did not end: {set(range(world - 1)) - set(got)}"
    assert procs[-1].exitcode == 17
    for rank, res in got.items():
        err = res["error"]
        assert err is not None, f"rank {rank} finished although a peer died"
        assert res["after_s"] < 2 * TIMEOUT_S, res
        assert f"rank {rank}: FedAvg exchange of step 4" in err and "stage" in err, err


def _advances(rank: int, world: int) -> dict:
    from flcomm.federated.fedavg import FedAvg
    from flcomm.federated.topology import Topology

    fm = Topology(world, world, group_size=1, shard_size=1).build(hierarchical=False)
    model = make_model(0, d=64)
    # int8 + EF in many buckets: every stage (encode, hop 1, reduce, re-encode, hop 2, decode,
    # outer update) of every bucket has to run for the job to complete
    fed = FedAvg(model, fm, sync_every=1, codec="int8", error_feedback=True, overlap=True,
                 outer="nesterov", bucket_mb=0.002)
    fed.step()  # starts the exchange of step 1
    fr = fed._frags[0]
    buckets = fr.exchange.bar.num_buckets
    t0 = time.monotonic()
    while not fr.job.is_completed() and time.monotonic() - t0 < 60:
        time.sleep(0.01)  # the "compute": the loop never calls wait()
    done = fr.job.is_completed()
    fed.finish()
    return {"done_without_wait": done, "buckets": buckets, "syncs": fed.num_syncs}


def test_exchange_completes_without_the_loop_waiting():
    from tests.dist import run_distributed

    res = run_distributed(_advances, 2, timeout=120)
    for r in res:
        assert r["buckets"] >= 4, r
        assert r["done_without_wait"], r
        assert r["syncs"] == 1
