"""flcomm's native path (``init_fed_mesh(topology, transport="native")``) on the CPU stand-in of its NCCL
library (tests/common/fake_nccl.py): every tier is a split of one root communicator, with the
groups of the topology; FedAvg on it gives the bits of ``transport="torch"`` and matches the
single-process simulation."""

import pytest
import torch

from flcomm.federated.mesh import init_fed_mesh
from flcomm.federated.topology import Topology
from tests.common.dist import run_distributed

TOPOLOGIES = {"fl-fsdp": Topology(8, 2, group_size=4), "fl-hsdp": Topology(8, 2, group_size=4, shard_size=2)}
TIERS = ("fed", "replicate", "shard", "group", "shard_intra", "shard_inter", "group_intra", "group_inter")


def _tiers(rank, world):
    from flcomm.comm.base import EXCHANGE_MAX_CTAS
    from flcomm.comm.nccl import NcclTransport
    from tests.common import fake_nccl

    out = {}
    with fake_nccl.installed():
        for kind, topo in TOPOLOGIES.items():
            fm = init_fed_mesh(topo, "cpu", transport="native")
            for name in TIERS:
                t = fm.transport(name)
                x = torch.tensor([float(rank)])
                t.all_reduce(x)
                out[kind, name] = (type(t) is NcclTransport, x.item(), t.size, t.comm.max_ctas, fm.tier(name).value)
            rep = fm.private_transport("replicate_exchange", "replicate")
            out[kind, "replicate_exchange"] = (type(rep) is NcclTransport, rep.size, rep.comm.max_ctas)
            out[kind, "cap"] = EXCHANGE_MAX_CTAS
            # NOTE: FSDP's mesh stays on torch's process groups
            out[kind, "device_mesh"] = fm.device_mesh.get_group("shard") is fm.groups["shard"]
            fm.close()
    return out


def _expected_ranks(topo: Topology, name: str, rank: int) -> list[int]:
    if name in ("fed", "replicate", "shard", "group"):
        lists = topo.dim_groups(name)
    else:
        base, part = name.split("_")
        lists = [g for ranks in topo.dim_groups(base) for g in topo.node_split(ranks)[part == "inter"]]
    return next(g for g in lists if rank in g)


def test_native_mesh_splits_every_tier_from_one_root():
    res = run_distributed(_tiers, 8, timeout=180)
    for rank, out in enumerate(res):
        for kind, topo in TOPOLOGIES.items():
            cap = out[kind, "cap"]
            for name in TIERS:
                native, total, size, max_ctas, _ = out[kind, name]
                ranks = _expected_ranks(topo, name, rank)
                assert native and size == len(ranks) and total == sum(ranks), (rank, kind, name, out[kind, name])
                # NOTE: only the exchange's communicator holds few CTAs; the group's keep NCCL's default
                assert max_ctas == (cap if name == "fed" else 0), (kind, name, max_ctas)
            assert out[kind, "replicate_exchange"] == (True, topo.num_replicas, cap)
            assert out[kind, "device_mesh"]
            assert out[kind, "fed"][4] == "inter_group" and out[kind, "group_inter"][4] == "inter_node"


CASES = [
    dict(kind="fsdp2", F=2, E=2, T=6, fed={"codec": "none", "error_feedback": False}),
    dict(kind="fsdp2", F=2, E=4, T=9, fed={"codec": "none", "error_feedback": False, "overlap": True,
                                          "overlap_steps": 1, "fragments": 2}),
    dict(kind="fsdp2", F=2, E=4, T=9, fed={"codec": "int8", "error_feedback": True, "overlap": True,
                                          "overlap_steps": 1, "fragments": 2}),
    dict(kind="fsdp1", F=2, E=2, T=5, fed={"codec": "none", "error_feedback": False}),
    dict(kind="plain", F=4, E=2, T=5, fed={"codec": "none", "error_feedback": False, "offload": "cpu"}),
    # FL+HSDP with the sharded exchange (its private replicate communicator)
    dict(kind="fsdp2", F=2, S=1, E=2, T=5, fed={"codec": "int8", "error_feedback": True}),
    dict(kind="fsdp2", F=2, E=2, T=6, fed={"codec": "fp8", "error_feedback": True, "outer": "nesterov"}),
    dict(kind="fsdp2", F=2, E=2, T=6, fed={"codec": "bf16", "error_feedback": False, "inner_state": "average"}),
    dict(kind="fsdp2", F=2, E=2, T=5, fed={"codec": "fp16", "error_feedback": True, "residual_dtype": "bf16"}),
    dict(kind="plain", F=4, E=4, T=9, fed={"codec": "int8", "error_feedback": True, "offload": "cpu",
                                          "overlap": True, "overlap_steps": 2, "fragments": 2}),
]


def _native_vs_torch(rank, world, cases):
    from flcomm.comm.base import LinkTier
    from tests.common import fake_nccl
    from tests.common.fedavg_harness import fed_mesh, run_case

    out = []
    with fake_nccl.installed():
        for case in cases:
            got = {}
            for transport in ("torch", "native"):
                st: dict = {}
                fm = fed_mesh(world, case["F"], case.get("S"), transport)
                fm.stats.reset()
                run_case(world, {**case, "transport": transport}, st)
                got[transport] = (st["state"], fm.stats.bytes(LinkTier.INTER_GROUP), type(fm.transport("fed")).__name__)
            same = all(torch.equal(got["torch"][0][n], got["native"][0][n]) for n in got["torch"][0])
            out.append((same, got["torch"][1], got["native"][1], got["native"][2]))
    return out


@pytest.mark.timeout(600)
def test_fedavg_on_the_native_path_gives_torchs_bits():
    """Every case: matches the simulation (run_case), and the native run's parameters are the
    torch run's bit for bit, with the same inter-group bytes."""
    res = run_distributed(_native_vs_torch, 4, CASES, timeout=500)
    for rank, out in enumerate(res):
        for case, (same, torch_bytes, native_bytes, kind) in zip(CASES, out):
            assert kind == "NcclTransport", (case, kind)
            assert same, (rank, case)
            assert native_bytes == torch_bytes > 0, (rank, case, torch_bytes, native_bytes)


def _stand_in_semantics(rank, world):
    """What the native-path tests rely on the stand-in to keep of the real class."""
    from flcomm.comm import nccl
    from tests.common import fake_nccl

    out = {}
    with fake_nccl.installed():
        t = nccl.NcclTransport.from_group(None)
        comm = t.comm
        x, y = torch.full((4,), float(rank + 1)), torch.full((4,), float(10 * (rank + 1)))
        before = comm.launches
        with t.group():
            wx = t.all_reduce(x, async_op=True)
            wy = t.all_reduce(y, op="avg", async_op=True)
            out["depth_inside"] = nccl.open_group_depth()
            out["deferred"] = x.tolist() == [float(rank + 1)] * 4  # NOTE: nothing ran before the group's end
            try:
                t.all_reduce(x)  # blocking inside a group: refused
                out["blocking_refused"] = False
            except RuntimeError:
                out["blocking_refused"] = True
        wx.wait()
        wy.wait()
        out["grouped_launches"] = comm.launches - before
        out["sums"] = (x[0].item(), y[0].item())
        out["depth_after"] = nccl.open_group_depth()
        child = t.split(rank % 2, max_ctas=2)
        out["child"] = (child.size, child.comm.max_ctas, t.comm.max_ctas)
        none = t.split(-1)
        out["no_color"] = none is None
        child.abort()
        try:
            child.all_reduce(torch.ones(1))
            out["after_abort"] = None
        except RuntimeError as e:
            out["after_abort"] = str(e)
        out["parent_ok"] = t.all_reduce(torch.ones(1))[0].item()
    return out


def test_the_stand_in_keeps_the_real_classes_rules():
    res = run_distributed(_stand_in_semantics, 2, timeout=60)
    for out in res:
        assert out["depth_inside"] == 1 and out["depth_after"] == 0
        assert out["deferred"] and out["blocking_refused"]
        assert out["grouped_launches"] == 1  # NOTE: one launch for the group's two collectives
        assert out["sums"] == (1.0 + 2.0, (10.0 + 20.0) / 2)
        assert out["child"] == (1, 2, 0) and out["no_color"]
        assert "was aborted (abort() was called)" in out["after_abort"]
        assert out["parent_ok"] == 2.0


def _cta_policy(rank, world):
    from tests.common import fake_nccl

    out = {}
    with fake_nccl.installed():
        fm = init_fed_mesh(Topology(4, 2, group_size=2, shard_size=1), "cpu", transport="native",
                                                              exchange_cta_policy="efficiency")
        rep = fm.private_transport("replicate_exchange", "replicate")
        out["policies"] = {name: fm.transport(name).comm.cta_policy for name in ("fed", "shard", "replicate", "group")}
        out["policies"]["replicate_exchange"] = rep.comm.cta_policy
        out["value"] = fake_nccl.NCCL_CTA_POLICIES["efficiency"]
        fm.close()
        for kw in ({"transport": "native", "exchange_cta_policy": "fastest"},
                   {"transport": "torch", "exchange_cta_policy": "zero"}):
            try:
                init_fed_mesh(Topology(4, 2, group_size=2), "cpu", **kw)
                out[kw["transport"]] = None
            except ValueError as e:
                out[kw["transport"]] = str(e)
    return out


def test_the_exchange_communicators_take_the_cta_policy_and_the_others_keep_nccls():
    """``exchange_cta_policy``: the exchange's splits (``fed``, ``replicate_exchange``) carry the
    loaded NCCL's value for the name; every other tier keeps NCCL's default (-1); a name the NCCL
    does not have, or the torch transport, is refused naming what was expected."""
    for out in run_distributed(_cta_policy, 4, timeout=120):
        v = out["value"]
        assert out["policies"] == {"fed": v, "replicate_exchange": v, "shard": -1, "replicate": -1, "group": -1}, out
        assert "one of the loaded NCCL's CTA policies (default, efficiency, zero), got 'fastest'" in out["native"]
        assert "exchange_cta_policy needs transport='native'" in out["torch"] and "'zero'" in out["torch"]


def _watched_at_apply(rank, world):
    from flcomm.federated.fedavg import FedAvg
    from tests.common import fake_nccl
    from tests.common.fedavg_harness import build, fed_mesh

    with fake_nccl.installed():
        fm = fed_mesh(world, 2, 1, "native")  # FL+HSDP: R = 2 replicas, the sharded exchange
        _, model, opt = build(world, 2, 1, "fsdp2", mesh=fm)
        fed = FedAvg(model, fm, sync_every=2, codec="int8", error_feedback=True, inner_optimizer=opt)
        rep = fm.exchange_replicate_transport(None)  # NOTE: made by FedAvg, after its own set-up began
        watched = fed._links.natives()
        return {"sharded": fed.sharded_exchange, "rep": any(t is rep for t in watched),
                "agree": any(t is fm.private_transport("flags_agree", "group") for t in watched),
                "all": all(any(t is w for w in watched) for t in fm.native_transports())}


def test_an_apply_reads_the_verdict_of_every_native_transport_the_exchange_uses():
    """The watchdog verdicts an apply reads before trusting the refusal flags (read_refusal) are
    those of every native communicator of the mesh as of the apply: the private ones FedAvg made
    for itself (the replicas' gather, the flags' agreement) included."""
    for out in run_distributed(_watched_at_apply, 4, timeout=120):
        assert out == {"sharded": True, "rep": True, "agree": True, "all": True}, out
