"""The sharded FedAvg exchange of FL+HSDP on 8 gloo ranks, (F, R, S) = (2, 2, 2): replica r
averages only slice r of every bucket over the shard peers and the slices are all-gathered over a
private replicate group.

* The exchange alone (DeltaExchange): the average equals the mean of every rank's regenerated
  inputs and the unsharded exchange; inter-group bytes per rank are exactly 2(F-1)/(F R) of the
  shard's encoded bytes (unsharded: 2(F-1)/F, so R times more), and the replicate all-gather
  adds exactly (R-1)/R of the shard's encoded bytes (fp32 for codec none) on the intra-group
  tier; the error-feedback residual
  is the slice's, and its state refuses to load into an unsharded layout.
* FedAvg (FSDP2 on the ("replicate", "shard") mesh) matches the single-process simulation of
  tests/common/fedavg_sim.py for codec none in the paper's mode, with many buckets, error feedback,
  outer Nesterov, overlap (k = 1, 2), fragments and offload.
* Every lossy codec (with and without error feedback) stays within the stated codec tolerance
  of the unsharded exchange, with R times fewer inter-group bytes.
* state_dict / load_state_dict of the sharded residuals resumes bit for bit.
* A non-finite shard in one group is refused on every rank of every group.
"""

from __future__ import annotations

import copy

import pytest
import torch

from flcomm.federated.config import FedAvgConfig
from tests.common.dist import run_distributed, run_parts
from tests.common.fedavg_harness import ATOL, CODEC_TOL, build, fed_mesh, full_state, resume_from, run_case, train
from tests.common.fedavg_sim import make_model

pytestmark = pytest.mark.timeout(900)  # a hang guard; the machine may be heavily shared

WORLD, F, S = 8, 2, 2
R = WORLD // (F * S)
# NOTE: 4096 elements per rank, a multiple of F * R * 256 (int8/fp8 block): no padding, so the
# byte formulas are exact
SHAPES = [(3, 1024), (1024,)]
N = sum(torch.Size(s).numel() for s in SHAPES)


# ------------------------------------------------------------------ the exchange alone
def _data(group: int, shard: int, what: str) -> list[torch.Tensor]:
    """A rank's tensors: the same on the R replicas of a shard (HSDP), per group and shard."""
    g = torch.Generator().manual_seed(1000 * group + 10 * shard + len(what))
    return [torch.randn(s, generator=g) * 4 for s in SHAPES]


def _exchange(fm, codec: str, ef: bool, sharded: bool, replicate):
    from flcomm.codecs import get_codec
    from flcomm.comm.engine import get_engine
    from flcomm.federated.exchange import DeltaExchange, ExchangeBuffers

    c = fm.coords
    loc = _data(c.group, c.shard, "local")
    anchors = _data(0, c.shard, "anchor")
    ex = DeltaExchange(fm.transport("fed"), loc,
                       FedAvgConfig(codec=get_codec(codec), bucket_cap_mb=1.0, error_feedback=ef),
                       ExchangeBuffers(anchors=anchors),
                       replicate=replicate if sharded else None)
    fm.stats.reset()
    get_engine("cpu").submit(lambda j: ex.run(j, loc), "test sharded exchange").wait(120)
    return ex, loc, fm.stats.snapshot()


def _exchange_worker(rank: int, world: int) -> dict:
    from flcomm.comm.base import wire_bytes

    fm = fed_mesh(world, F, S)
    assert fm.topology.num_replicas == R and fm.topology.mesh_shape == (F, R, S)
    assert fm.exchange_replicate_transport(False) is None
    with pytest.raises(ValueError, match="sharded_exchange must be None, True or False, got 'yes'"):
        FedAvgConfig(sync_every=2, sharded_exchange="yes")
    rep = fm.exchange_replicate_transport(None)
    assert rep.size == R and rep.tier.value == "intra_node"
    # a private transport is made once per name: the engine's jobs share it, in their order
    assert fm.exchange_replicate_transport(True) is rep
    assert fm.private_transport("replicate_exchange", "replicate") is rep
    with pytest.raises(ValueError, match="'replicate_exchange' is over dim 'replicate', not 'group'"):
        fm.private_transport("replicate_exchange", "group")
    # an elastic federation never shards: the replicas' gather would not survive an aborted round
    assert fm.exchange_replicate_transport(None, elastic=True) is None
    with pytest.raises(ValueError, match="sharded_exchange=True cannot run in an elastic federation"):
        fm.exchange_replicate_transport(True, elastic=True)
    out: dict = {}
    for codec, ef in (("none", False), ("int8", True), ("fp8", False)):
        plain, plain_loc, plain_bytes = _exchange(fm, codec, ef, False, rep)
        shard, shard_loc, shard_bytes = _exchange(fm, codec, ef, True, rep)
        enc = 4 * N if codec == "none" else plain.codec.encoded_nbytes(N)
        out[codec] = {
            "inter": (plain_bytes["inter_group"]["bytes"], shard_bytes["inter_group"]["bytes"]),
            "intra": (plain_bytes["intra_node"]["bytes"], shard_bytes["intra_node"]["bytes"]),
            # the formulas of the issue, independent of the bucket layout
            "want_inter": (2 * (F - 1) * enc // F, 2 * (F - 1) * enc // (F * R)),
            # the replicas gather the averaged slices as encoded (fp32 for codec none)
            "want_intra": (0, (R - 1) * enc // R),
            "loc": (plain_loc, shard_loc),
            "wire": [r.numel() if r is not None else 0 for r in shard.bar.residuals()],
        }
        if ef:
            sd = shard.state_dict()
            assert sd["replicas"] == R
            with pytest.raises(ValueError, match="replicas"):
                plain.load_state_dict(sd)
            out[codec]["residual_nonzero"] = all(bool(r.abs().sum() > 0) for r in shard.bar.residuals())
    # the paper's mode, in place in bf16, many buckets (tensors span buckets and slices)
    from flcomm.codecs import get_codec
    from flcomm.comm.engine import get_engine
    from flcomm.federated.exchange import DeltaExchange

    c = fm.coords
    loc = [t.round().to(torch.bfloat16) for t in _data(c.group, c.shard, "inplace")]
    ex = DeltaExchange(fm.transport("fed"), loc,
                       FedAvgConfig(codec=get_codec("none"), bucket_cap_mb=300 * 4 / 2**20, error_feedback=False),
                       replicate=rep)
    get_engine("cpu").submit(lambda j: ex.run(j, loc), "test in place").wait(120)
    out["inplace_bf16"] = (loc, ex.bar.num_buckets)
    # the generic bucketed all-reduce gathers the slices as reduced (fp32), the exchange's in the
    # codec's encoding (its gather_slices hook)
    from flcomm.collectives.bucketing import BucketedAllReduce
    from flcomm.federated.exchange import SlicedAllReduce

    out["generic_gather"] = {}
    for cls in (BucketedAllReduce, SlicedAllReduce):
        ts = _data(c.group, c.shard, "generic")
        bar = cls(fm.transport("fed"), ts, codec="int8", bucket_mb=1.0, replicate=rep)
        fm.stats.reset()
        bar.start().wait(120)
        out["generic_gather"][cls.__name__] = (ts, fm.stats.snapshot()["intra_node"]["bytes"])
    # the bookkeeping helper agrees with the formula (one home for wire bytes)
    assert wire_bytes("all_gather", 4 * N, R) == (R - 1) * 4 * N // R
    out["coords"] = (fm.coords.group, fm.coords.replica, fm.coords.shard)
    return out


# ------------------------------------------------------------------ FedAvg against the simulation
SIM_CASES = [
    dict(kind="fsdp2", F=F, S=S, E=2, T=5),                                             # in place
    dict(kind="fsdp2", F=F, S=S, E=2, T=5, fed={"bucket_cap_mb": 1e-4}),                    # many buckets
    dict(kind="fsdp2", F=F, S=S, E=2, T=5, fed={"error_feedback": True, "bucket_cap_mb": 1e-4}),
    dict(kind="fsdp2", F=F, S=S, E=3, T=7, fed={"overlap": True, "outer": "nesterov", "bucket_cap_mb": 1e-4}),
    dict(kind="fsdp2", F=F, S=S, E=3, T=8, fed={"overlap": True, "overlap_steps": 2}),
    dict(kind="fsdp2", F=F, S=S, E=4, T=9, fed={"fragments": 2, "overlap": True, "outer": "nesterov"}),
    dict(kind="fsdp2", F=F, S=S, E=2, T=5, fed={"overlap": True, "offload": "cpu", "bucket_cap_mb": 1e-4}),
]


def _sim_worker(rank: int, world: int) -> dict:
    from flcomm.federated.fedavg import FedAvg

    fm, model, _ = build(world, F, S, "fsdp2")
    assert FedAvg(model, fm, sync_every=2).sharded_exchange  # on by default when R > 1
    assert FedAvg(model, fm, sync_every=2, sharded_exchange=False).sharded_exchange is False
    return {"worst": [run_case(world, c) for c in SIM_CASES]}


# ------------------------------------------------------------------ codecs, bytes, checkpoints
LOSSY = [("bf16", False), ("int8", False), ("int8", True), ("fp8", True), ("int8", "bf16")]


def _codecs_worker(rank: int, world: int) -> dict:
    from flcomm.comm.base import LinkTier
    from flcomm.federated.fedavg import FedAvg

    fm = fed_mesh(world, F, S)
    init = {n: p.detach() for n, p in make_model(0, d=32).named_parameters()}
    res: dict = {}
    for codec, ef in [("none", False)] + LOSSY:
        for sharded in (False, True):
            _, model, opt = build(world, F, S, "fsdp2", mesh=fm, model_kw={"d": 32})
            fed = FedAvg(model, fm, sync_every=2, codec=codec, error_feedback=bool(ef), bucket_cap_mb=0.01,
                         residual_dtype=ef if isinstance(ef, str) else "fp32", sharded_exchange=sharded)
            fm.stats.reset()
            train(fm, model, opt, fed, range(1, 7))
            assert fed.num_syncs == 3
            res[(codec, ef, sharded)] = (full_state(model, "fsdp2"), fm.stats.bytes(LinkTier.INTER_GROUP))
    moved = max((res[("none", False, False)][0][n] - init[n]).abs().max().item() for n in init)
    out = {}
    for codec, ef in [("none", False)] + LOSSY:
        (plain, pb), (shard, sb) = res[(codec, ef, False)], res[(codec, ef, True)]
        err = max((shard[n] - plain[n]).abs().max().item() for n in init) / moved
        out[f"{codec}{'+ef' if ef else ''}{'-' + ef if isinstance(ef, str) else ''}"] = (err, pb / sb)
    return out


def _roundtrip_worker(rank: int, world: int) -> dict:
    from flcomm.federated.fedavg import FedAvg

    fm = fed_mesh(world, F, S)
    kw = dict(sync_every=2, outer="nesterov", codec="int8", error_feedback=True, overlap_steps=1, bucket_cap_mb=0.0005)

    def fresh():
        _, model, opt = build(world, F, S, "fsdp2", mesh=fm)
        return model, opt, FedAvg(model, fm, **kw)

    model, opt, fed = fresh()
    train(fm, model, opt, fed, range(1, 6))
    fed.finish()
    shards = [p.to_local().detach().clone() for p in model.parameters()]
    opt_sd, fed_sd = copy.deepcopy(opt.state_dict()), copy.deepcopy(fed.state_dict())
    ex = fed_sd[f"rank{rank}"]["exchange"]
    # the residual is the slice's: 1/R of each (padded) bucket
    assert ex["replicas"] == R
    assert [r.numel() * R for r in ex["residuals"]] == [b.padded for b in fed._exchange.bar._buckets]
    train(fm, model, opt, fed, range(6, 10))
    fed.finish()
    want = full_state(model, "fsdp2")

    got = resume_from(fm, fresh, shards, opt_sd, lambda f: f.load_state_dict(copy.deepcopy(fed_sd)), range(6, 10))
    for n in want:
        assert torch.equal(got[n], want[n]), f"{n} differs after resume"
    # without the FedAvg state (residuals, momentum, anchor) it differs
    got = resume_from(fm, fresh, shards, opt_sd, lambda f: None, range(6, 10))
    _, model, _ = build(world, F, S, "fsdp2", mesh=fm)
    with pytest.raises(ValueError, match="replicas"):
        FedAvg(model, fm, **kw, sharded_exchange=False).load_state_dict(copy.deepcopy(fed_sd))
    return {"without_state_diff": max((got[n] - want[n]).abs().max().item() for n in want)}


def _nan_worker(rank: int, world: int) -> dict:
    """Group 1's shards (both replicas, as HSDP keeps them) turn NaN: every rank refuses."""
    from flcomm.federated.fedavg import FedAvg
    from flcomm.federated.nonfinite import NonFiniteAverageError

    fm, model, opt = build(world, F, S, "fsdp2", mesh=fed_mesh(world, F, S))
    fed = FedAvg(model, fm, sync_every=1, codec="int8", error_feedback=True)
    train(fm, model, opt, None, range(1, 2))
    planted = False
    if fm.coords.group == 1:
        with torch.no_grad():
            for p in model.parameters():
                if p.to_local().numel():
                    p.to_local().view(-1)[0] = float("nan")
                    planted = True
    try:
        fed.step()
    except NonFiniteAverageError as e:
        return {"bad_ranks": e.bad_ranks, "message": str(e), "planted": planted}
    return {"bad_ranks": None, "planted": planted}


# NOTE: one run of the ranks for every part (starting 8 ranks costs more than most checks); each
# test reads its own part; the first part that fails ends the run (tests.dist.run_parts)
PARTS = (("exchange", _exchange_worker, ()), ("sim", _sim_worker, ()), ("codecs", _codecs_worker, ()),
         ("roundtrip", _roundtrip_worker, ()), ("nan", _nan_worker, ()))


def _all_worker(rank: int, world: int) -> dict:
    return run_parts(rank, world, PARTS)


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_all_worker, WORLD, timeout=800)


def _part(results: list[dict], name: str) -> list:
    return [res[name] for res in results]


def test_exchange_average_and_bytes_drop_by_R(results):
    res = _part(results, "exchange")
    for r, out in enumerate(res):
        g, _, s = out["coords"]
        for codec in ("none", "int8", "fp8"):
            o = out[codec]
            assert o["inter"] == o["want_inter"], (r, codec, o["inter"], o["want_inter"])
            assert o["inter"][0] == R * o["inter"][1], (r, codec)
            assert o["intra"] == o["want_intra"], (r, codec, o["intra"], o["want_intra"])
            # the residual is the slice's: 1/R of the shard
            if codec == "int8":
                assert o["wire"] == [N // R] and o["residual_nonzero"], (r, o["wire"])
            plain, shard = o["loc"]
            # the average of every group's regenerated inputs (no collective in the reference)
            want = [sum(ts[i].double() for ts in (_data(f, s, "local") for f in range(F))) / F
                    for i in range(len(SHAPES))]
            # lossy: no worse than twice the unsharded exchange's own worst error
            plain_err = max((p.double() - w).abs().max().item() for p, w in zip(plain, want))
            tol = 1e-5 if codec == "none" else 2 * plain_err
            for p, q, w in zip(plain, shard, want):
                torch.testing.assert_close(q.double(), w, rtol=0, atol=tol)
                if codec == "none":
                    torch.testing.assert_close(q, p, rtol=0, atol=1e-6)


def test_in_place_bf16_many_buckets(results):
    for out in _part(results, "exchange"):
        g, _, s = out["coords"]
        got, buckets = out["inplace_bf16"]
        assert buckets > 10
        want = [sum(ts[i].round().double() for ts in (_data(f, s, "inplace") for f in range(F))) / F
                for i in range(len(SHAPES))]
        for t, w in zip(got, want):
            assert t.dtype == torch.bfloat16
            assert torch.equal(t, w.to(torch.bfloat16))  # integer halves: exact in bf16


def test_generic_bucketing_gathers_the_slices_decoded(results):
    """BucketedAllReduce gathers the replicas' reduced slices in fp32, the exchange's
    SlicedAllReduce in the codec's encoding and decodes them: the same bits, (R-1)/R of the fp32
    bytes against (R-1)/R of the encoded bytes."""
    from flcomm.codecs import get_codec

    for r, out in enumerate(_part(results, "exchange")):
        g, _, s = out["coords"]
        (plain, plain_bytes), (sliced, sliced_bytes) = (out["generic_gather"][k] for k in
                                                        ("BucketedAllReduce", "SlicedAllReduce"))
        assert plain_bytes == (R - 1) * 4 * N // R, (r, plain_bytes)
        assert sliced_bytes == (R - 1) * get_codec("int8").encoded_nbytes(N) // R, (r, sliced_bytes)
        want = [sum(ts[i].double() for ts in (_data(f, s, "generic") for f in range(F))) / F
                for i in range(len(SHAPES))]
        for p, q, w in zip(plain, sliced, want):
            assert torch.equal(p, q), r
            torch.testing.assert_close(p.double(), w, rtol=0, atol=CODEC_TOL["int8"] * w.abs().max().item())


def test_fedavg_sharded_matches_simulation(results):
    res = _part(results, "sim")
    assert max(max(o["worst"]) for o in res) < ATOL * 10


def test_codecs_within_tolerance_of_unsharded_with_R_times_fewer_inter_group_bytes(results):
    res = _part(results, "codecs")
    for name, (err, ratio) in res[0].items():
        codec = name.split("+")[0].split("-")[0]
        tol = ATOL if codec == "none" else CODEC_TOL[codec]
        assert err < tol, (name, err)
        # the flags all-reduce (8 bytes a sync) and the codec's block padding stay below 5%
        assert abs(ratio - R) < 0.05 * R, (name, ratio)
    print({k: (f"err {e:.2e}", f"inter-group bytes plain/sharded {b:.3f}") for k, (e, b) in res[0].items()})


def test_state_dict_round_trip_of_the_sharded_residuals(results):
    res = _part(results, "roundtrip")
    assert all(o["without_state_diff"] > 1e-6 for o in res)


def test_non_finite_shard_is_refused_on_every_rank(results):
    res = _part(results, "nan")
    group1 = list(range(WORLD // F, WORLD))  # contiguous groups: ranks 4..7
    planted = [r for r, o in enumerate(res) if o["planted"]]  # NOTE: the ranks that hold a NaN
    assert planted and set(planted) <= set(group1)
    for o in res:
        assert o["bad_ranks"] is not None and sorted(o["bad_ranks"]) == planted, (o, planted)
