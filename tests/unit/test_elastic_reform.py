"""The membership round (Federation.reform) on an in-memory store, rank 0 of two groups of one
rank: it waits ``grace_s`` for a silent rank, unless the silent rank's group has restarted (all
of its ranks asked to rejoin), whose previous incarnation cannot answer any more."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist


@pytest.fixture
def federation(monkeypatch):
    from flcomm.federated import elastic
    from flcomm.federated.topology import Topology

    class _Group:
        def size(self):
            return 1

        def rank(self):
            return 0

        def abort(self):
            pass

    monkeypatch.setattr(elastic, "store_group", lambda *a, **k: _Group())
    monkeypatch.setattr(elastic.Federation, "members", lambda self, groups: [self.rank])

    def make(grace_s: float, topology: Topology | None = None):
        store = dist.HashStore()
        topology = topology or Topology(2, ranks_per_node=1, group_size=1)
        return store, elastic.Federation(store, topology, rank=0, grace_s=grace_s)

    return make


def test_a_silent_group_is_dropped_after_the_grace(federation):
    _, fed = federation(0.3)
    t0 = time.monotonic()
    new = fed.reform(step=4)
    assert time.monotonic() - t0 >= 0.3
    assert new.groups == (0,) and new.lost == (1,) and new.missing_ranks == (1,) and new.step == 4


@pytest.mark.timeout(120)
def test_a_restarted_group_ends_the_wait_at_once(federation):
    """Grace 600 s (the test's own timeout is 120 s): the round ends once group 1's restarted
    rank asks to rejoin (here 0.2 s in), not at the grace; its group is out of this generation,
    to be admitted at a committed round."""
    store, fed = federation(600.0)
    asked = threading.Timer(0.2, lambda: fed.kv.set("rejoin/1/1", "1"))
    asked.start()
    t0 = time.monotonic()
    new = fed.reform(step=8)
    asked.join()
    assert time.monotonic() - t0 < 60.0, "reform waited for the grace"
    assert new.groups == (0,) and new.lost == (1,)
    assert fed._pending_rejoins() == [1]  # the next committed round admits it


def test_a_group_not_all_of_whose_ranks_asked_is_waited_for(federation):
    """Two groups of two ranks: one restarted rank of group 1 asking is not the group: rank 0 of
    group 0 waits the grace for rank 1 (its own group) and for group 1's silent ranks."""
    from flcomm.federated.topology import Topology

    _, fed = federation(0.3, Topology(4, ranks_per_node=2, group_size=2))
    fed.kv.set("g0/alive/1", "1")
    fed.kv.add("g0/alive_n", 1)
    fed.kv.set("rejoin/1/2", "1")
    t0 = time.monotonic()
    new = fed.reform(step=4)
    assert time.monotonic() - t0 >= 0.3
    assert new.groups == (0,) and new.lost == (1,) and new.missing_ranks == (2, 3)
