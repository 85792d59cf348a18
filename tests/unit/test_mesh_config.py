"""MeshConfig (the FedMesh's settings), init_fed_mesh's keywords and the deprecated
Topology.build alias, without building a mesh (no process group)."""

from __future__ import annotations

import warnings
from datetime import timedelta

import pytest

from flcomm.comm.base import DEFAULT_TIMEOUT, EXCHANGE_MAX_CTAS
from flcomm.federated import mesh as mesh_module
from flcomm.federated.mesh import MeshConfig, TransportKind
from flcomm.federated.topology import Topology


def test_defaults_are_the_transports_defaults():
    c = MeshConfig()
    assert (c.transport, c.node_tiers, c.timeout, c.exchange_max_ctas, c.exchange_cta_policy) == \
        ("torch", True, DEFAULT_TIMEOUT, EXCHANGE_MAX_CTAS, None)
    assert c.transport_kind is TransportKind.TORCH


def test_values_are_normalized():
    c = MeshConfig(transport=" Native ", timeout=12.5)
    assert c.transport == "native" and c.transport_kind is TransportKind.NATIVE
    assert c.timeout == timedelta(seconds=12.5)


@pytest.mark.parametrize("kw, message", [
    ({"transport": "mpi"}, "transport"),
    ({"node_tiers": "yes"}, "node_tiers must be True or False, got 'yes'"),
    ({"timeout": 0}, "timeout must be a positive timedelta"),
    ({"timeout": timedelta(seconds=-1)}, "timeout must be a positive timedelta"),
    ({"timeout": True}, "timeout must be a positive timedelta"),
    ({"exchange_max_ctas": 0}, "exchange_max_ctas must be an integer >= 1 or None"),
    ({"exchange_cta_policy": 3, "transport": "native"}, "exchange_cta_policy must be a policy name or None, got 3"),
    ({"exchange_cta_policy": "zero"}, "exchange_cta_policy needs transport='native'"),
])
def test_bad_values_name_the_field(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MeshConfig(**kw)


def test_make_replaces_fields_and_names_unknown_ones():
    base = MeshConfig(transport="native", timeout=5)
    c = MeshConfig.make(base, exchange_max_ctas=None)
    assert (c.transport, c.timeout, c.exchange_max_ctas) == ("native", timedelta(seconds=5), None)
    assert MeshConfig.make(None) == MeshConfig()
    with pytest.raises(TypeError, match=r"unknown mesh setting\(s\) \['hierarchical'\] \(hierarchical is node_tiers\)"):
        MeshConfig.make(hierarchical=False)
    with pytest.raises(TypeError, match="config must be a MeshConfig, got dict"):
        MeshConfig.make({"transport": "torch"})


def test_topology_build_is_a_deprecated_alias_of_init_fed_mesh(monkeypatch):
    """Topology.build warns and hands every setting to init_fed_mesh (hierarchical as node_tiers)."""
    got = {}

    def fake(topology, device_type="cpu", config=None, *, stats=None, group_rank=None, **settings):
        got.update(topology=topology, device_type=device_type, stats=stats, group_rank=group_rank,
                   config=MeshConfig.make(config, **settings))
        return "mesh"

    monkeypatch.setattr(mesh_module, "init_fed_mesh", fake)
    topo = Topology(4, 2, group_size=2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = topo.build("cuda", timeout=timedelta(seconds=7), hierarchical=False, group_rank=3, transport="native",
                         exchange_max_ctas=2, exchange_cta_policy="zero")
    assert out == "mesh"
    assert [x.category for x in w] == [DeprecationWarning] and "flcomm.init_fed_mesh" in str(w[0].message)
    assert w[0].filename == __file__  # NOTE: the caller's line
    assert got == {"topology": topo, "device_type": "cuda", "stats": None, "group_rank": 3,
                   "config": MeshConfig(transport="native", node_tiers=False, timeout=timedelta(seconds=7),
                                        exchange_max_ctas=2, exchange_cta_policy="zero")}


def test_federation_takes_the_transport_from_the_mesh_config():
    import torch.distributed as dist

    from flcomm.federated.elastic import Federation

    with pytest.raises(ValueError, match=r"backend must be 'gloo' or 'nccl'.*mesh=MeshConfig\(transport='native'\)"):
        Federation(dist.HashStore(), Topology(2, ranks_per_node=1, group_size=1), rank=0, backend="native")
    with pytest.raises(TypeError, match="mesh must be a MeshConfig"):
        Federation(dist.HashStore(), Topology(2, ranks_per_node=1, group_size=1), rank=0, mesh="native")
