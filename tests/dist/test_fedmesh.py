"""FedMesh on gloo: the groups of every mesh dimension and their link tiers on 8 ranks, and every
DeviceMesh dim gives up after the configured timeout when a peer never joins."""

from flcomm.federated.mesh import init_fed_mesh
from flcomm.federated.strategy import Strategy
from flcomm.federated.topology import Topology
from tests.common.dist import run_distributed


def _build_mesh(rank, world):
    import torch

    topo = Strategy.FL_HSDP.topology(world, 2, group_size=4)
    fm = init_fed_mesh(topo, "cpu")
    out = {}
    for name in ("fed", "replicate", "shard", "group", "shard_intra", "shard_inter", "group_intra", "group_inter"):
        t = torch.tensor([float(rank)])
        fm.transport(name).all_reduce(t)
        out[name] = (t.item(), fm.group_ranks[name], fm.tier(name).value)
    out["mesh_fed"] = fm.device_mesh.get_group("fed") is fm.groups["fed"]
    # observe: every transport the mesh hands out passes through it, by name; private ones do not
    seen = []

    class Wrapped:
        def __init__(self, inner):
            self.inner = inner

    fm.observe = lambda t, name: seen.append(name) or Wrapped(t)
    group, private = fm.transport("group"), fm.private_transport("observe_test", "group")
    out["observed"] = (seen, isinstance(group, Wrapped), isinstance(private, Wrapped))
    return out


def test_fedmesh_groups_on_gloo():
    res = run_distributed(_build_mesh, 8)
    topo = Strategy.FL_HSDP.topology(8, 2, group_size=4)
    for rank, out in enumerate(res):
        for name in ("fed", "replicate", "shard", "group"):
            ranks = next(g for g in topo.dim_groups(name) if rank in g)
            s, got_ranks, _ = out[name]
            assert got_ranks == ranks and s == sum(ranks), (rank, name)
        assert out["fed"][2] == "inter_group"
        assert out["shard"][2] == "intra_node"
        assert out["group_inter"][2] == "inter_node"
        assert out["group_intra"][1] == [rank - rank % 2, rank - rank % 2 + 1]
        assert out["observed"] == (["group"], True, False), out["observed"]


MESHES = {"fl-fsdp": Topology(4, 2, group_size=2), "fl-hsdp": Topology(4, 2, group_size=2, shard_size=1)}


def _frozen_peer(rank, world, timeout_s):
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    meshes = {k: init_fed_mesh(t, "cpu", timeout=timedelta(seconds=timeout_s)) for k, t in MESHES.items()}
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
    from tests.common import dist as tdist

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
