"""FedAvg's checks against training wrongly without a word (flcomm/federated/sharding.py,
verify.py, nonfinite.py), on 4 gloo ranks: FL+FSDP (F = 2, G = S = 2), FL+HSDP (F = 2, G = 2, S = 1,
R = 2) and one-rank groups.

* The model's sharding must match the topology: a plain module in a group of 2 ranks, FSDP2 on
  the blocks only (the root's parameters plain), FL+HSDP sharded on ``device_mesh["shard"]``
  only (the replicas would never all-reduce their gradients), FSDP1 over the wrong groups and
  DDP over the world are refused, naming what was expected and the fix; ``replicated=True``,
  DDP over the group, a DeviceMesh of one's own over the right ranks and one-rank groups pass.
* The step order: ``fed.step()`` before ``optimizer.step()``, or by hand besides ``attach``,
  raises; ``skipped=True`` passes; without ``optimizer=`` (the README's loop) the right order
  passes and the wrong one stops at its second step; an optimizer over other parameters, or
  none, is not counted.
* ``verify=True`` passes on every mode (codec none / int8 + error feedback, overlap, fragments,
  nesterov, offload, FL+HSDP with the sharded exchange, FSDP1, DDP) and leaves the training
  bit for bit as without it; the blocking runs' shard peers really are equal (all_gather of the
  full weights). Planted drifts are caught on every rank, naming the group, its ranks and the
  step: a replica perturbed after a sync (which the sharded exchange would make equal again),
  an anchor perturbed in one group, one rank's average changed in the exchange, plain modules
  that ``replicated=True`` wrongly promised equal.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.common.dist import run_distributed, run_parts
from tests.common.fedavg_harness import build, fed_mesh, full_state, train
from tests.common.fedavg_sim import batch, loss_fn, make_model, make_opt

pytestmark = pytest.mark.timeout(600)


def _meshes(world: int):
    """FL+FSDP (G = S = 2), FL+HSDP (G = 2, S = 1, R = 2), one-rank groups."""
    return fed_mesh(world, 2), fed_mesh(world, 2, 1), fed_mesh(world, 4)


def _fsdp2(model, dm):
    from torch.distributed.fsdp import fully_shard

    for b in model.blocks:
        fully_shard(b, mesh=dm)
    fully_shard(model, mesh=dm)
    return model


# ------------------------------------------------------------------ the model's sharding
def _sharding(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from flcomm.federated.fedavg import FedAvg

    fm2, hs, fm4 = _meshes(world)
    g2 = re.escape(str(fm2.group_ranks["group"]))
    out = {}
    # a plain module in a group of 2 ranks: refused; said replicated, in DDP over the group, or
    # in a one-rank group: accepted
    with pytest.raises(ValueError, match=r"parameter 'inp.weight' \(and \d+ more\) is a plain tensor .* federation "
                                         rf"group of 2 ranks \({g2}\).*replicated=True") as ei:
        FedAvg(make_model(0), fm2, sync_every=1)
    out["plain"] = str(ei.value)
    FedAvg(make_model(0), fm2, sync_every=1, replicated=True)
    FedAvg(DDP(make_model(0), process_group=fm2.groups["group"]), fm2, sync_every=1)
    FedAvg(make_model(0), fm4, sync_every=1)
    FedAvg(make_model(0).requires_grad_(False), fm2, sync_every=1)  # NOTE: frozen: nothing can drift
    with pytest.raises(ValueError, match=rf"DistributedDataParallel replicates over ranks \[0, 1, 2, 3\].*"
                                         rf"federation group is ranks {g2}.*fed_mesh.groups\['group'\]"):
        FedAvg(DDP(make_model(0)), fm2, sync_every=1)
    # FSDP2 on the blocks only: the root's own parameters (inp, head) stay plain
    m = make_model(0)
    for b in m.blocks:
        fully_shard(b, mesh=fm2.device_mesh["shard"])
    with pytest.raises(ValueError, match=r"parameter 'inp.weight' \(and 3 more\) is a plain tensor.*"
                                         r"for every unit and the root"):
        FedAvg(m, fm2, sync_every=1)
    # a DeviceMesh of one's own over the same ranks: compared by ranks, accepted
    own = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("fed", "shard"))["shard"]
    FedAvg(_fsdp2(make_model(0), own), fm2, sync_every=1)
    # FL+HSDP sharded on device_mesh["shard"] only: the replicate dim left out
    hg = re.escape(str(hs.group_ranks["group"]))
    with pytest.raises(ValueError, match=rf"parameter '[\w.]+' is sharded over ranks \[{rank}\] and replicated over "
                                         rf"ranks \[{rank}\], but the topology \(G=2, S=1, R=2\) expects it sharded "
                                         rf"over the FedMesh's 'shard' dim, ranks \[{rank}\], and replicated over its "
                                         rf"'replicate' dim, ranks {hg} .*drift apart.*\['replicate', 'shard'\]") as ei:
        FedAvg(_fsdp2(make_model(0), hs.device_mesh["shard"]), hs, sync_every=1)
    out["hsdp_shard_only"] = str(ei.value)
    # ... or sharded over the whole group (FSDP where the topology says HSDP)
    with pytest.raises(ValueError, match=rf"sharded over ranks {hg} and replicated over ranks \[{rank}\]"):
        FedAvg(_fsdp2(make_model(0), hs.device_mesh["replicate"]), hs, sync_every=1)
    FedAvg(_fsdp2(make_model(0), hs.device_mesh["replicate", "shard"]), hs, sync_every=1)
    # FSDP1: HYBRID_SHARD over a one-rank shard group, which FSDP1 turns into NO_SHARD on that
    # group: the replicate group is dropped; NO_SHARD over the replicate group replicates
    with warnings.catch_warnings():  # NOTE: FSDP1 says it switches to NO_SHARD
        warnings.simplefilter("ignore")
        m1 = FSDP(make_model(0), process_group=(hs.groups["shard"], hs.groups["replicate"]),
                  sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=torch.device("cpu"))
        m2 = FSDP(make_model(0), process_group=hs.groups["replicate"], sharding_strategy=ShardingStrategy.NO_SHARD,
                  device_id=torch.device("cpu"))
    with pytest.raises(ValueError, match=rf"FSDP1 unit 0 \(Net, NO_SHARD\) is sharded over ranks \[{rank}\] and "
                                         rf"replicated over ranks \[{rank}\].*ranks {hg}.*HYBRID_SHARD over a one-rank "
                                         r"shard group into NO_SHARD"):
        FedAvg(m1, hs, sync_every=1)
    FedAvg(m2, hs, sync_every=1)
    with pytest.raises(ValueError, match=rf"FSDP1 unit 0 \(Net, FULL_SHARD\) is sharded over ranks {hg} and "
                                         rf"replicated over ranks \[{rank}\]"):
        FedAvg(FSDP(make_model(0), process_group=hs.groups["group"], device_id=torch.device("cpu")), hs, sync_every=1)
    FedAvg(FSDP(make_model(0), process_group=fm2.groups["shard"], device_id=torch.device("cpu")), fm2, sync_every=1)
    return out


# ------------------------------------------------------------------ the step order
def _step_order(rank: int, world: int) -> dict:
    from flcomm.federated.fedavg import FedAvg

    fm2 = fed_mesh(world, 2)
    c = fm2.coords
    fm, model, opt = build(world, 2, None, "fsdp2", mesh=fm2)
    fed = FedAvg(model, fm, sync_every=2, inner_optimizer=opt)
    loss_fn(model, *batch(c.group, c.index, 1)).backward()
    with pytest.raises(RuntimeError, match=r"FedAvg.step\(\) for local step 1 came with no optimizer.step\(\) "
                                           r"since the previous FedAvg.step\(\): call fed.step\(\) once after "
                                           r"optimizer.step\(\)"):
        fed.step()  # the mistake: before optimizer.step()
    assert fed.steps == 0
    opt.step()
    assert fed.step() is False and fed.steps == 1
    assert fed.step(skipped=True) is True and fed.steps == 2  # NOTE: step 2 syncs
    with pytest.raises(RuntimeError, match="local step 3 came with no optimizer.step"):
        fed.step()
    # attach() watches its optimizer; a fed.step() by hand besides it is the mistake
    _, model2, opt2 = build(world, 2, None, "fsdp2", mesh=fm2)
    fed2 = FedAvg(model2, fm2, sync_every=2)
    fed2.attach(opt2)
    train(fm2, model2, opt2, None, range(1, 4))
    assert fed2.steps == 3 and fed2.num_syncs == 1
    with pytest.raises(RuntimeError, match="local step 4 came with no optimizer.step"):
        fed2.step()
    # no torch optimizer over the model's parameters: nothing to check against
    fed3 = FedAvg(model2, fm2, sync_every=3)
    assert fed3.step() is False and fed3.steps == 1
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    other.step()  # NOTE: an optimizer over other parameters is not the model's
    assert fed3.step() is False and fed3.steps == 2
    # the README's loop, which gives FedAvg no optimizer: the right order passes...
    _, model4, opt4 = build(world, 2, None, "fsdp2", mesh=fm2)
    fed4 = FedAvg(model4, fm2, sync_every=2)
    assert train(fm2, model4, opt4, fed4, range(1, 5)) == [False, True, False, True]
    # ...and fed.step() before optimizer.step() stops at the second step, naming the first
    _, model5, opt5 = build(world, 2, None, "fsdp2", mesh=fm2)
    fed5 = FedAvg(model5, fm2, sync_every=2)
    loss_fn(model5, *batch(c.group, c.index, 1)).backward()
    assert fed5.step() is False  # NOTE: no optimizer has stepped yet: none is known
    opt5.step()
    opt5.zero_grad()
    loss_fn(model5, *batch(c.group, c.index, 2)).backward()
    with pytest.raises(RuntimeError, match=r"FedAvg.step\(\) for local step 1 came before any optimizer.step\(\) of "
                                           r"an optimizer holding the model's parameters \(one has stepped since\): "
                                           r"call fed.step\(\) once after optimizer.step\(\)"):
        fed5.step()
    assert fed5.steps == 1 and fed5.num_syncs == 0
    return {}


# ------------------------------------------------------------------ verify: passes on every mode
PASS_CASES = [
    ("fsdp2", "fl-fsdp", 2, {}),
    ("fsdp2", "fl-fsdp", 2, {"codec": "int8", "error_feedback": True}),
    ("fsdp2", "fl-fsdp", 2, {"codec": "int8", "error_feedback": True, "overlap_steps": 1}),
    ("fsdp2", "fl-fsdp", 4, {"fragments": 2, "outer": "nesterov"}),
    ("fsdp2", "fl-fsdp", 4, {"fragments": 2, "overlap_steps": 3, "outer": "nesterov"}),
    ("fsdp2", "fl-fsdp", 2, {"codec": "int8", "error_feedback": True, "overlap_steps": 1, "offload": "cpu"}),
    ("fsdp2", "fl-hsdp", 2, {"codec": "int8", "error_feedback": True}),  # the sharded exchange
    ("fsdp2", "fl-hsdp", 2, {"overlap_steps": 1, "outer": "nesterov"}),
    ("fsdp2", "fl-hsdp", 2, {"sharded_exchange": False}),
    ("fsdp1", "fl-fsdp", 2, {"codec": "int8", "error_feedback": True}),
    ("ddp", "fl-fsdp", 2, {"codec": "int8", "error_feedback": True}),
    ("plain", "one-rank", 2, {"codec": "int8", "error_feedback": True}),
]


def _model(world: int, kind: str, topo: str, seed: int = 0):
    fm2, hs, fm4 = _meshes(world)
    fm = {"fl-fsdp": fm2, "fl-hsdp": hs, "one-rank": fm4}[topo]
    if kind != "ddp":
        return build(world, 2, None, kind, mesh=fm, seed=seed)
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model(seed), process_group=fm.groups["group"])
    return fm, model, make_opt(model.parameters(), "adamw", 1e-2)


def _flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[n].reshape(-1).double() for n in sorted(state)])


def _verify_passes(rank: int, world: int) -> dict:
    from flcomm.federated.fedavg import FedAvg

    out = {}
    for kind, topo, E, kw in PASS_CASES:
        states = []
        for verify in (True, False):
            fm, model, opt = _model(world, kind, topo)
            fed = FedAvg(model, fm, sync_every=E, inner_optimizer=opt, verify=verify, **kw)
            train(fm, model, opt, fed, range(1, 2 * E + 1))
            fed.finish()
            assert fed.num_syncs == 2 * kw.get("fragments", 1)
            states.append(full_state(model.module if kind == "ddp" else model, "plain" if kind == "ddp" else kind))
        name = f"{kind} {topo} E={E} {kw}"
        for n in states[1]:
            assert torch.equal(states[0][n], states[1][n]), (name, n, "verify changed the training")
        if not kw.get("overlap_steps") and kw.get("fragments", 1) == 1:
            # NOTE: the condition verify checks, independently: after a blocking sync at the
            # last step every group holds the same weights
            got = [torch.zeros_like(_flat(states[0])) for _ in range(world)]
            dist.all_gather(got, _flat(states[0]))
            assert all(torch.equal(g, got[0]) for g in got), (name, "the groups differ after a blocking sync")
        out[name] = True
    return out


# ------------------------------------------------------------------ verify: planted drifts
def _expect_mismatch(fn, group: str, ranks: list[int], step: int) -> str:
    from flcomm.federated.verify import ReplicaMismatchError

    with pytest.raises(ReplicaMismatchError) as ei:
        fn()
    e = ei.value
    assert (e.group, e.ranks, e.step) == (group, ranks, step), (str(e), e.group, e.ranks, e.step)
    return str(e)


def _drifts(rank: int, world: int) -> dict:
    from flcomm.federated.fedavg import FedAvg

    fm2, hs, _ = _meshes(world)
    out = {}
    # 1. FL+HSDP: replica 1 of group 0 (rank 1) perturbed after the sync of step 2; the sharded
    # exchange of step 4 would make the replicas equal again: caught at that sync
    fm, model, opt = _model(world, "fsdp2", "fl-hsdp")
    fed = FedAvg(model, fm, sync_every=2, inner_optimizer=opt, verify=True, codec="int8", error_feedback=True)
    train(fm, model, opt, fed, range(1, 3))
    if rank == 1:
        with torch.no_grad():
            next(model.parameters()).to_local().view(-1)[0] += 1e-3
    train(fm, model, opt, fed, range(3, 4))
    g0 = list(hs.topology.group_ranks(0))
    out["replica"] = _expect_mismatch(lambda: train(fm, model, opt, fed, range(4, 5)),
                                      "replicate" if rank in g0 else "group", g0, 4)
    if rank in g0:
        assert "the replicas of shard 0 in federation group 0, replicate group [0, 1]" in out["replica"]

    # 2. overlap: group 1's anchor perturbed on rank 2 (shard peers [0, 2]) after the first apply;
    # the anchors of the next sync (step 4, applied at step 5) differ
    fm, model, opt = _model(world, "fsdp2", "fl-fsdp")
    fed = FedAvg(model, fm, sync_every=2, inner_optimizer=opt, verify=True, codec="int8", error_feedback=True,
                 overlap_steps=1)
    train(fm, model, opt, fed, range(1, 4))
    if rank == 2:
        with torch.no_grad():
            fed._anchor[0].view(-1)[0] += 1e-3
    train(fm, model, opt, fed, range(4, 5))
    out["anchor"] = _expect_mismatch(lambda: train(fm, model, opt, fed, range(5, 6)), "fed", [0, 2], 4)
    if rank in (0, 2):
        assert "shard peers [0, 2] hold different anchors (the sync-step averages) (rank 0: " in out["anchor"]

    # 3. the paper's in-place mode: rank 2's exchange writes another average than its peer's
    fm, model, opt = _model(world, "fsdp2", "fl-fsdp")
    fed = FedAvg(model, fm, sync_every=2, inner_optimizer=opt, verify=True)
    assert fed.config.in_place
    if rank == 2:
        ex = fed._exchange
        unpack = ex._unpack

        def wrong(segs, flat, locals_, ok):
            unpack(segs, flat, locals_, ok)
            locals_[segs[0].index].view(-1)[0] += 1e-3

        ex._unpack = wrong
    train(fm, model, opt, fed, range(1, 2))
    out["in_place"] = _expect_mismatch(lambda: train(fm, model, opt, fed, range(2, 3)), "fed", [0, 2], 2)
    if rank in (0, 2):
        assert "hold different local shards" in out["in_place"]

    # 4. replicated=True promised, but nothing keeps the plain module equal in its group
    fm, model, opt = build(world, 2, None, "plain", mesh=fm2)
    fed = FedAvg(model, fm, sync_every=2, inner_optimizer=opt, verify=True, replicated=True)
    train(fm, model, opt, fed, range(1, 2))
    mine = list(fm2.group_ranks["group"])
    out["plain"] = _expect_mismatch(lambda: train(fm, model, opt, fed, range(2, 3)), "group", mine, 2)
    assert "different plain (unsharded) parameters" in out["plain"]
    return out


def _worker(rank: int, world: int) -> dict:
    return run_parts(rank, world, (("sharding", _sharding, ()), ("step_order", _step_order, ()),
                                   ("verify_passes", _verify_passes, ()), ("drifts", _drifts, ())))


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 4, timeout=500)


def test_sharding_that_does_not_match_the_topology_is_refused(results):
    for r in results:
        assert "fully_shard(module, mesh=fed_mesh.device_mesh['shard'])" in r["sharding"]["plain"]
        assert "fully_shard(module, mesh=fed_mesh.device_mesh['replicate', 'shard'])" in \
            r["sharding"]["hsdp_shard_only"]


def test_step_order_is_checked(results):
    assert all("step_order" in r for r in results)


def test_verify_passes_on_every_mode(results):
    for r in results:
        assert sorted(r["verify_passes"]) == sorted(f"{k} {t} E={e} {kw}" for k, t, e, kw in PASS_CASES)


def test_verify_catches_planted_drifts_on_every_rank(results):
    for r in results:
        assert set(r["drifts"]) == {"replica", "anchor", "in_place", "plain"}
