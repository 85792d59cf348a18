"""Topology: every mesh dimension partitions the world, coordinates are consistent, bad input
is refused with the numbers named; FedMesh builds the groups on gloo."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flcomm.comm.base import LinkTier
from flcomm.federated.topology import Topology
from tests.dist import run_distributed


@st.composite
def topologies(draw):
    L = draw(st.sampled_from([1, 2, 4, 8]))
    nodes = draw(st.integers(1, 8))
    P = L * nodes
    G = draw(st.sampled_from([d for d in range(1, P + 1) if P % d == 0 and (d % L == 0 or L % d == 0)]))
    S = draw(st.sampled_from([d for d in range(1, G + 1) if G % d == 0 and (d % L == 0 or L % d == 0)]))
    return Topology(P, L, G, S)


@settings(max_examples=200, deadline=None)
@given(topologies())
def test_each_dim_partitions_the_world(topo):
    for dim in ("fed", "replicate", "shard", "group"):
        groups = topo.dim_groups(dim)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(topo.world_size)), dim
    F, R, S = topo.mesh_shape
    assert F * R * S == topo.world_size
    assert all(len(g) == F for g in topo.dim_groups("fed"))
    assert all(len(g) == S for g in topo.dim_groups("shard"))
    assert all(len(g) == R for g in topo.dim_groups("replicate"))


@settings(max_examples=200, deadline=None)
@given(topologies())
def test_coords_match_mesh(topo):
    m = topo.mesh()
    for rank in range(topo.world_size):
        c = topo.coords(rank)
        assert m[c.group][c.replica][c.shard] == rank
        assert c.node == rank // topo.ranks_per_node
        assert c.group == rank // topo.group_size  # contiguous blocks, as in the paper's code
        # same shard coordinates across groups: the fed dim
        fed = next(g for g in topo.dim_groups("fed") if rank in g)
        assert [topo.coords(r).shard for r in fed] == [c.shard] * topo.num_groups
        assert [topo.coords(r).replica for r in fed] == [c.replica] * topo.num_groups


def test_strategies_and_tiers():
    fsdp = Topology.fsdp(8, 2)
    assert fsdp.mesh_shape == (1, 1, 8) and not fsdp.federated and not fsdp.hybrid
    hsdp = Topology.hsdp(8, 2)
    assert hsdp.mesh_shape == (1, 4, 2) and hsdp.hybrid
    flf = Topology.fl_fsdp(8, 2, group_size=4)
    assert flf.mesh_shape == (2, 1, 4)
    assert flf.dim_groups("fed") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    flh = Topology.fl_hsdp(8, 2, group_size=4)
    assert flh.mesh_shape == (2, 2, 2)
    assert flh.tier([0, 1]) == LinkTier.INTRA_NODE
    assert flh.tier([0, 2]) == LinkTier.INTER_NODE
    assert flh.tier([0, 4], "fed") == LinkTier.INTER_GROUP


def test_node_split():
    t = Topology(8, 2, group_size=8)
    intra, inter = t.node_split(list(range(8)))
    assert intra == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert inter == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ValueError, match="same number of ranks"):
        t.node_split([0, 1, 2])
    with pytest.raises(ValueError, match="ordered node by node"):
        t.node_split([0, 2, 1, 3])


def test_explicit_node_groups():
    t = Topology(8, 2, group_size=4, node_groups=((0, 2), (1, 3)))
    assert t.group_ranks(0) == (0, 1, 4, 5)
    assert t.group_ranks(1) == (2, 3, 6, 7)
    assert t.coords(4).group == 0 and t.coords(2).group == 1
    with pytest.raises(ValueError, match="exactly once"):
        Topology(8, 2, group_size=4, node_groups=((0, 1), (1, 3)))
    with pytest.raises(ValueError, match="must list 2 nodes"):
        Topology(8, 2, group_size=4, node_groups=((0,), (1, 2, 3)))


@pytest.mark.parametrize("kwargs, msg", [
    (dict(world_size=8, ranks_per_node=3), "whole number of nodes"),
    (dict(world_size=8, ranks_per_node=2, group_size=3), "group_size 3 does not divide world_size 8"),
    (dict(world_size=8, ranks_per_node=2, group_size=4, shard_size=3), "shard_size 3 does not divide group_size 4"),
    (dict(world_size=12, ranks_per_node=4, group_size=6), "multiple or a divisor of ranks_per_node 4"),
    (dict(world_size=0, ranks_per_node=1), "world_size must be a positive integer, got 0"),
    (dict(world_size=4, ranks_per_node=2.0), "ranks_per_node must be a positive integer"),
])
def test_bad_topologies(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        Topology(**kwargs)


def _build_mesh(rank, world):
    import torch

    topo = Topology.fl_hsdp(world, 2, group_size=4)
    fm = topo.build("cpu")
    out = {}
    for name in ("fed", "replicate", "shard", "group", "shard_intra", "shard_inter", "group_intra", "group_inter"):
        t = torch.tensor([float(rank)])
        fm.transport(name).all_reduce(t)
        out[name] = (t.item(), fm.group_ranks[name], fm.tier(name).value)
    out["mesh_fed"] = fm.device_mesh.get_group("fed") is fm.groups["fed"]
    return out


def test_fedmesh_groups_on_gloo():
    res = run_distributed(_build_mesh, 8)
    topo = Topology.fl_hsdp(8, 2, group_size=4)
    for rank, out in enumerate(res):
        for name in ("fed", "replicate", "shard", "group"):
            ranks = next(g for g in topo.dim_groups(name) if rank in g)
            s, got_ranks, _ = out[name]
            assert got_ranks == ranks and s == sum(ranks), (rank, name)
        assert out["fed"][2] == "inter_group"
        assert out["shard"][2] == "intra_node"
        assert out["group_inter"][2] == "inter_node"
        assert out["group_intra"][1] == [rank - rank % 2, rank - rank % 2 + 1]


MESHES = {"fl-fsdp": Topology(4, 2, group_size=2), "fl-hsdp": Topology(4, 2, group_size=2, shard_size=1)}


def _frozen_peer(rank, world, timeout_s):
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    meshes = {k: t.build("cpu", timeout=timedelta(seconds=timeout_s)) for k, t in MESHES.items()}
    out = {}
    for k, fm in meshes.items():
        for dim in ("shard", "replicate", "fed"):
            if rank == 0 or len(fm.group_ranks[dim]) == 1 or 0 not in fm.group_ranks[dim]:
                continue  # NOTE: rank 0 never joins: its peers must give up within the timeout
            t0 = time.monotonic()
            try:
                dist.all_reduce(torch.ones(1), group=fm.device_mesh.get_group(dim))
                out[k, dim] = ("completed", time.monotonic() - t0)
            except RuntimeError:
                out[k, dim] = ("timed out", time.monotonic() - t0)
    # NOTE: rank 0 stays (its groups open) until every peer has given up
    from tests import dist as tdist

    tdist.STORE.add("peers_done", int(rank != 0))
    while rank == 0 and tdist.STORE.add("peers_done", 0) < world - 1:
        time.sleep(0.05)
    return out


def test_mesh_dims_carry_the_timeout():
    """Every DeviceMesh dim (what FSDP and FedAvg use) gives up after the configured timeout,
    not torch's default 30 minutes: rank 0 never joins, its peers time out."""
    timeout_s = 2.0
    res = run_distributed(_frozen_peer, 4, timeout_s, timeout=90)
    seen = {key for out in res for key in out}
    assert seen == {("fl-fsdp", "shard"), ("fl-fsdp", "fed"), ("fl-hsdp", "replicate"), ("fl-hsdp", "fed")}
    for rank in (1, 2, 3):
        for key, (status, secs) in res[rank].items():
            # NOTE: 5 x the timeout (a loaded machine); torch's default would be 30 min
            assert status == "timed out" and secs < 5 * timeout_s, (rank, key, secs)
