"""The process groups flcomm makes for the FedAvg exchange on NCCL, checked on CPU: their
options (CTA cap, non-blocking init, timeout), the error handling that keeps a survivor alive
(an elastic federation's groups), and the abort of a generation's group before the next is
built. ProcessGroupNCCL itself needs a GPU, so it is replaced by a recorder here."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch.distributed as dist

from flcomm.comm import torch_pg


def test_nccl_options_carry_the_cap_the_timeout_and_nonblocking_init():
    t = timedelta(seconds=7)
    opts = torch_pg.nccl_options(t, max_ctas=3, nonblocking=True)
    assert opts._timeout == t
    assert opts.config.max_ctas == 3
    assert opts.config.blocking == 0
    plain = torch_pg.nccl_options(t)
    fresh = dist.ProcessGroupNCCL.Options()
    assert (plain.config.max_ctas, plain.config.blocking) == (fresh.config.max_ctas, fresh.config.blocking)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_nccl_options_refuse_a_bad_cap(bad):
    with pytest.raises(ValueError, match="max_ctas must be an integer >= 1 or None, got"):
        torch_pg.nccl_options(timedelta(seconds=1), max_ctas=bad)


class _RecordingNCCL:
    """Stands in for ProcessGroupNCCL: records what its constructor saw."""

    seen: list[dict] = []

    def __init__(self, store, rank, size, opts):
        _RecordingNCCL.seen.append({"error_handling": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
                                    "opts": opts, "rank": rank, "size": size})


@pytest.mark.parametrize("user", [None, "3"])
def test_store_group_on_nccl_keeps_the_process_alive_and_restores_the_environment(monkeypatch, user):
    if user is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", user)
    recording = type("PG", (_RecordingNCCL,), {"Options": dist.ProcessGroupNCCL.Options})
    monkeypatch.setattr(dist, "ProcessGroupNCCL", recording)
    _RecordingNCCL.seen.clear()
    torch_pg.store_group(dist.HashStore(), "gen0/", 1, 2, "nccl", timedelta(seconds=9))
    (seen,) = _RecordingNCCL.seen
    assert seen["error_handling"] == "2"  # CleanUpOnly: abort the communicator, keep the process
    assert seen["opts"].config.blocking == 0 and seen["opts"].config.max_ctas == torch_pg.EXCHANGE_MAX_CTAS
    assert seen["opts"]._timeout == timedelta(seconds=9)
    assert os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == user


def test_a_generation_is_aborted_before_the_next_is_built(monkeypatch):
    """Federation._build: the old generation's group is aborted (its hung collectives end)
    before the new one is created, and kept, not destroyed."""
    from flcomm.federated import elastic
    from flcomm.federated.topology import Topology

    log: list[str] = []

    class _Group:
        def __init__(self, name):
            self.name = name

        def size(self):
            return 1

        def rank(self):
            return 0

        def abort(self):
            log.append(f"abort {self.name}")

    def fake_store_group(store, prefix, rank, size, backend, timeout):
        log.append(f"build {prefix}")
        return _Group(prefix)

    monkeypatch.setattr(elastic, "store_group", fake_store_group)
    monkeypatch.setattr(elastic.Federation, "members", lambda self, groups: [self.rank])
    fed = elastic.Federation(dist.HashStore(), Topology(2, ranks_per_node=1, group_size=1), rank=0)
    first = fed.transport
    fed._build()
    fed._build()
    assert log == ["build gen0/fed0/", "abort gen0/fed0/", "build gen0/fed0/", "abort gen0/fed0/", "build gen0/fed0/"]
    assert fed._retired[0] is first and len(fed._retired) == 2
    assert fed.transport is not first


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_only_the_exchange_groups_get_the_cap_on_nccl(monkeypatch, backend):
    from flcomm.federated.mesh import EXCHANGE_GROUPS, FedMesh, MeshConfig

    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    mesh = object.__new__(FedMesh)  # NOTE: only the options' choice, no process groups
    mesh.config = MeshConfig(timeout=timedelta(seconds=5), exchange_max_ctas=2)
    # NOTE: the rule, written out: every group a FedAvg job uses from the engine thread (beside
    # FSDP's collectives) is capped, and no group FSDP or the trainer uses is
    engine_groups = {"fed", "replicate_exchange", "flags_agree"}
    assert set(EXCHANGE_GROUPS) == engine_groups
    for name in (*engine_groups, "shard", "replicate", "group", "shard_intra", "shard_inter"):
        opts = mesh._pg_options(name)
        if backend == "nccl" and name in engine_groups:
            assert opts.config.max_ctas == 2 and opts._timeout == timedelta(seconds=5), name
        else:
            assert opts is None, name
    mesh.config = MeshConfig(timeout=timedelta(seconds=5), exchange_max_ctas=None)
    assert mesh._pg_options("fed") is None
