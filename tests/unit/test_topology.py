"""Topology: every mesh dimension partitions the world, coordinates are consistent, bad input
is refused with the numbers named (FedMesh on gloo is in tests/dist/test_fedmesh.py)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flcomm.comm.base import LinkTier
from flcomm.federated.strategy import Strategy
from flcomm.federated.topology import Topology


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
    fsdp = Strategy.FSDP.topology(8, 2)
    assert fsdp.mesh_shape == (1, 1, 8) and not fsdp.federated and not fsdp.hybrid
    hsdp = Strategy.HSDP.topology(8, 2)
    assert hsdp.mesh_shape == (1, 4, 2) and hsdp.hybrid
    flf = Strategy.FL_FSDP.topology(8, 2, group_size=4)
    assert flf.mesh_shape == (2, 1, 4)
    assert flf.dim_groups("fed") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    flh = Strategy.FL_HSDP.topology(8, 2, group_size=4)
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
    (dict(world_size=0, ranks_per_node=1), "world_size must be an integer >= 1, got 0"),
    (dict(world_size=4, ranks_per_node=2.0), "ranks_per_node must be an integer >= 1, got 2.0"),
])
def test_bad_topologies(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        Topology(**kwargs)
