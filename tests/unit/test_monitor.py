"""Who failed first, as a rank decides alone (flcomm.train.monitor): the blame rule over
records of other hosts (liveness by the ``alive`` time) and of this host (the process), the
order silent > reported > terminated, the store path (a peer's record read back from a real
TCPStore), a store that is gone, and the collective named by a noted transport."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from flcomm.train import monitor as mon_mod
from flcomm.train.monitor import STORE_KEY, Monitor, blame, first_failure

NOW = 1_000_000.0


def _rec(rank: int, state: str = "run", alive: float | None = NOW, t: float = NOW - 20, host: str = "elsewhere",
         pid: int = 1, step: int = 4, phase: str = "fedavg") -> dict:
    r = {"pid": pid, "host": host, "rank": rank, "step": step, "phase": phase, "t": t, "state": state}
    if alive is not None:
        r["alive"] = alive
    return r


def test_a_peer_whose_beat_stopped_is_blamed_before_the_ranks_that_reported():
    stale = NOW - mon_mod.STALE_S - 1
    recs = {1: _rec(1, alive=stale), 2: _rec(2), 3: _rec(3, "error", t=NOW - 30)}
    rank, rec, how = blame(recs, NOW, "here")
    assert (rank, how) == (1, "stopped answering") and rec is recs[1]


def test_fresh_peers_are_not_blamed_and_reports_come_before_terminations():
    fresh = {1: _rec(1, alive=NOW - mon_mod.STALE_S + 0.5), 2: _rec(2)}
    assert blame(fresh, NOW, "here") is None
    recs = {**fresh, 0: _rec(0, "exited", t=NOW - 9), 3: _rec(3, "error", t=NOW - 5), 4: _rec(4, "error", t=NOW - 7)}
    assert blame(recs, NOW, "here")[0::2] == (4, "failed first")
    assert blame({0: recs[0], 1: recs[1]}, NOW, "here")[0::2] == (0, "was terminated")


def test_an_unwatched_record_of_another_host_is_never_stale():
    """Launched by flcomm's launcher, ranks do not beat: their phase time says nothing."""
    assert blame({1: _rec(1, alive=None, t=NOW - 1000)}, NOW, "here") is None


def test_settled_ranks_the_launcher_rule(tmp_path):
    """``now`` None (the launcher, every rank settled): every "run" is silent, the oldest first."""
    recs = {0: _rec(0, "error", t=NOW - 50), 1: _rec(1, alive=None, t=NOW - 10), 2: _rec(2, alive=None, t=NOW - 12)}
    assert blame(recs)[0] == 2
    for r, rec in recs.items():
        with open(mon_mod.heartbeat_path(str(tmp_path), r), "w") as f:
            f.write(json.dumps(rec))
    assert first_failure(str(tmp_path), [0, 1, 2]) == (2, recs[2])


def test_a_dead_or_stopped_process_of_this_host_is_silent_at_once():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stopped.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        recs = {1: _rec(1, host="here", pid=dead.pid, alive=NOW - 0.5),
                2: _rec(2, host="here", pid=stopped.pid, alive=NOW)}
        assert blame(recs, NOW, "here")[0::2] == (1, "exited")
        assert blame({2: recs[2]}, NOW, "here")[0::2] == (2, "stopped answering")
    finally:
        stopped.kill()
        stopped.wait()


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))


def test_a_rank_names_the_peer_whose_record_in_the_store_went_stale(tmp_path, monkeypatch):
    monkeypatch.setattr(mon_mod, "STALE_S", 1.0)
    store = _store()
    t = time.time() - 5
    store.set(STORE_KEY.format(0), json.dumps(_rec(0, alive=t, t=t, step=3, phase="forward")))
    m = Monitor(str(tmp_path), 1, 2)
    m.watch("127.0.0.1", store.port, "hosted by rank 0")
    try:
        msg = m.fail(RuntimeError("Connection reset by peer"))
        assert "culprit: rank 0 (step 3, phase forward (FSDP all-gather)) stopped answering" in msg, msg
        assert json.loads(store.get(STORE_KEY.format(1)))["state"] == "error"  # what the others read
    finally:
        m.close()


def test_a_store_that_is_gone_is_named_within_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(mon_mod, "STALE_S", 0.5)
    monkeypatch.setattr(mon_mod, "HEARTBEAT_S", 0.2)
    store = _store()
    port = store.port
    m = Monitor(str(tmp_path), 2, 4)
    m.watch("127.0.0.1", port, "hosted by rank 0", owner=0)
    del store  # NOTE: the server goes with its last reference, as with rank 0's process
    t0 = time.monotonic()
    try:
        msg = m.fail(RuntimeError("Connection closed by peer"))
    finally:
        m.close()
    # NOTE: the wait (0.9 s here) and one bounded access per rank: 10 x that at most
    assert time.monotonic() - t0 < 10 * (0.9 + mon_mod.STORE_TIMEOUT_S), msg
    assert f"the culprit could not be determined: the store at 127.0.0.1:{port} (hosted by rank 0) is unreachable" \
        in msg and "rank 0 serves it, so it exited or stopped answering" in msg, msg


def test_a_noted_transport_names_the_collective_and_its_group(tmp_path):
    class Fake:
        ranks = [0, 1]

        def all_reduce(self, t, op="sum"):
            raise RuntimeError("Connection reset by peer")

    m = Monitor(None, 0, 4)
    m.set_groups({"group": [0, 1], "fed": [0, 2]})
    m.enter(4, "fedavg")
    noted = m.noting(Fake(), "in-group all-reduce", "group")
    assert noted.ranks == [0, 1]
    with pytest.raises(RuntimeError) as e:
        noted.all_reduce(None, op="max")
    msg = m.fail(e.value)
    assert msg.startswith("rank 0: step 4, phase FedAvg exchange (in-group all-reduce), group 'group' "
                          "(ranks [0, 1]): RuntimeError"), msg
    m.enter(5, "forward")
    assert m.detail is None


def test_a_failed_job_stage_names_the_group_it_talks_over():
    """FedAvg's exchange job ORs the refusal flags over the federation group: a job that fails in
    a stage that says its group (``job.stage_group``) names that group, not the phase's fed
    group; another stage keeps the phase's."""
    from flcomm.comm.engine import ProgressEngine
    from flcomm.federated.fragment import AGREE_STAGE

    def failing(stage: str, group: str | None):
        def fn(job):
            job.stage, job.stage_group = stage, group
            raise ConnectionError("peer gone")

        return fn

    m = Monitor(None, 0, 4)
    m.set_groups({"group": [0, 1], "fed": [0, 2]})
    m.enter(4, "fedavg")
    errors = []
    for stage, group in ((AGREE_STAGE, "group"), ("bucket 2", None)):
        engine = ProgressEngine("cpu", lane=f"monitor-test-{len(errors)}")
        with pytest.raises(Exception) as info:
            engine.submit(failing(stage, group), "FedAvg exchange of step 4").wait(30)
        engine.close(30)
        errors.append(info.value)
    assert (errors[0].stage, errors[0].group) == (AGREE_STAGE, "group")
    msg = m.fail(errors[0])
    assert msg.startswith(f"rank 0: step 4, phase FedAvg exchange ({AGREE_STAGE}), group 'group' (ranks [0, 1])"), msg
    other = m.fail(errors[1])
    assert other.startswith("rank 0: step 4, phase FedAvg exchange, group 'fed' (ranks [0, 2])"), other


def test_a_peer_whose_clock_lags_is_not_stale_while_it_beats(tmp_path, monkeypatch):
    """Staleness is judged by this rank's clock (how long a peer's ``alive`` stayed unchanged),
    not by comparing two hosts' clocks: a peer 100 s behind that beats is answering."""
    monkeypatch.setattr(mon_mod, "STALE_S", 0.6)
    monkeypatch.setattr(mon_mod, "HEARTBEAT_S", 0.2)
    store = _store()
    stop = threading.Event()

    def peer() -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
        while not stop.wait(0.1):
            client.set(STORE_KEY.format(0), json.dumps(_rec(0, alive=time.time() - 100)))

    beating = threading.Thread(target=peer, daemon=True)
    beating.start()
    time.sleep(0.3)
    m = Monitor(str(tmp_path), 1, 2)
    m.watch("127.0.0.1", store.port, "hosted by rank 0")
    try:
        msg = m.fail(RuntimeError("Connection reset by peer"))
    finally:
        stop.set()
        beating.join()
        m.close()
    assert "the culprit could not be determined: every peer still answers" in msg, msg


def test_an_elastic_failure_names_why_the_other_groups_ended(tmp_path):
    """``--elastic``: the group mate of the rank that failed first reports its group lost, the
    other groups report their own end; the launcher's message takes the latter from outside
    the culprit's group, whichever of the two was written first."""
    from flcomm.train.launch import _other_groups_report

    cfg = type("Cfg", (), {"log_dir": str(tmp_path)})()
    recs = {0: _rec(0, "error", t=NOW - 4), 1: _rec(1, "error", t=NOW - 4),
            2: _rec(2, "error", t=NOW - 6), 3: _rec(3, alive=None, t=NOW - 10)}
    recs[2]["msg"] = "rank 2: federation group 1 is out of the federation"
    recs[0]["msg"] = recs[1]["msg"] = "fewer than --min-groups 2"
    assert _other_groups_report(cfg, [[0, 1], [2, 3]]) == ""  # no records written yet
    for r, rec in recs.items():
        with open(mon_mod.heartbeat_path(str(tmp_path), r), "w") as f:
            f.write(json.dumps(rec))
    assert first_failure(str(tmp_path), [0, 1, 2, 3])[0] == 3
    got = _other_groups_report(cfg, [[0, 1], [2, 3]])
    assert got == "\nfirst report of the other federation groups: fewer than --min-groups 2", got
    recs[0]["state"] = recs[1]["state"] = "done"
    for r in (0, 1):
        with open(mon_mod.heartbeat_path(str(tmp_path), r), "w") as f:
            f.write(json.dumps(recs[r]))
    assert _other_groups_report(cfg, [[0, 1], [2, 3]]) == ""  # the other group finished
