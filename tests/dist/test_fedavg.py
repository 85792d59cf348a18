"""FedAvg synchronizer on gloo against independent references.

* FL+FSDP / FL+HSDP (FSDP2 per block, FSDP1 flat parameters) and plain replicated modules match
  the single-process simulation of tests/common/fedavg_sim.py (F model copies, each with its own AdamW
  on its own data, averaged every E steps) to fp32 tolerance, for several F, G, E (the 8-rank
  FL+HSDP cases are in tests/dist/test_fedavg_hsdp.py).
* E = 1 with plain SGD and no compression equals synchronous data-parallel training.
* Plain replicated modules: the plain average equals torch's PeriodicModelAverager.
* Overlap follows the documented one-step-delay semantics (simulated); outer Nesterov equals
  torch.optim.SGD(nesterov=True) on the pseudo-gradient; inner state average / reset.
* Compressed exchanges (bf16, int8, fp8, with/without error feedback) stay within a stated
  tolerance of the uncompressed run and put fewer bytes on the inter-group tier.
* state_dict round trip (also through torch.distributed.checkpoint), NaN refusal, bad input.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.common.dist import run_distributed, run_parts
from tests.common.fedavg_harness import (
    ATOL,
    CODEC_TOL,
    build,
    cases_worker,
    compare,
    fed_mesh,
    full_state,
    resume_from,
    run_case,
    train,
)
from tests.common.fedavg_sim import averaged_names, batch, loss_fn, make_model, make_opt, simulate

pytestmark = pytest.mark.timeout(600)  # a hang guard; the machine may be heavily shared


# ------------------------------------------------------------------ matches the simulation
W4_CASES = [
    dict(kind="fsdp2", F=2, E=2, T=6),                                  # FL+FSDP, G = 2
    dict(kind="fsdp2", F=2, E=3, T=7),
    dict(kind="fsdp2", F=4, E=1, T=3, model_kw={"bn": True}),           # G = 1, BatchNorm buffers
    dict(kind="fsdp2", F=2, S=1, E=2, T=5),                             # FL+HSDP, R = 2, S = 1
    dict(kind="fsdp1", F=2, E=2, T=5),                                  # flat parameters
    dict(kind="fsdp1_orig", F=2, E=3, T=6),                             # use_orig_params=True
    dict(kind="plain", F=4, E=2, T=5, model_kw={"bn": True}),           # replicated modules
    dict(kind="fsdp2", F=1, E=2, T=4),                                  # not federated: no-op
]


def test_fl_fsdp_matches_simulation_4_ranks():
    worst = run_distributed(cases_worker, 4, W4_CASES, timeout=400)
    assert max(max(w) for w in worst) < ATOL * 10


# ------------------------------------------------------------------ semantics
SEMANTIC_CASES = [
    dict(kind="fsdp2", F=2, E=2, T=7, fed={"overlap": True}),           # last sync applied at 7
    dict(kind="fsdp2", F=2, E=1, T=4, fed={"overlap": True}),
    dict(kind="plain", F=4, E=3, T=6, fed={"overlap": True}),          # applied by finish()
    dict(kind="fsdp2", F=2, E=2, T=6, fed={"outer": "nesterov"}),
    dict(kind="fsdp2", F=2, E=2, T=7, fed={"outer": "nesterov", "overlap": True}),
    dict(kind="fsdp2", F=2, E=2, T=6, fed={"inner_state": "average"}),
    dict(kind="plain", F=4, E=2, T=5, fed={"inner_state": "reset"}),
    # overlap_steps = k: the average applied k steps after its sync (Streaming DiLoCo's tau)
    dict(kind="fsdp2", F=2, E=3, T=8, fed={"overlap": True, "overlap_steps": 2}),   # applied at 5, 8
    dict(kind="plain", F=4, E=2, T=6, fed={"overlap": True, "overlap_steps": 2}),  # k = E
    dict(kind="fsdp2", F=2, E=4, T=9, fed={"overlap": True, "overlap_steps": 2, "outer": "nesterov"}),
    dict(kind="plain", F=4, E=2, T=5, fed={"bucket_cap_mb": 1e-4}),                    # many buckets, in place
    dict(kind="fsdp2", F=2, E=2, T=5, fed={"overlap": True, "bucket_cap_mb": 1e-4, "outer": "nesterov"}),
    # streaming fragments (K = 2, 4 with E = 8): fragment j syncs at (t - j E / K) % E == 0
    dict(kind="fsdp2", F=2, E=8, T=12, fed={"fragments": 2}),
    dict(kind="fsdp2", F=2, E=8, T=13, fed={"fragments": 4, "overlap": True, "outer": "nesterov"}),
    dict(kind="plain", F=4, E=8, T=11, fed={"fragments": 4, "codec": "none", "error_feedback": False}),
    dict(kind="plain", F=4, E=8, T=12, fed={"fragments": 2, "overlap": True, "overlap_steps": 2}),
    # offload="cpu": the same algorithm with the full-size state in host memory
    dict(kind="fsdp2", F=2, E=2, T=5, fed={"overlap": True, "outer": "nesterov", "offload": "cpu",
                                            "bucket_cap_mb": 1e-4}),
]


def _semantics_worker(rank: int, world: int) -> dict:
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    from flcomm.federated.fedavg import FedAvg

    out: dict = {"worst": [run_case(world, c) for c in SEMANTIC_CASES]}

    # E = 1, SGD, no compression == synchronous data parallel (gradients averaged over the world)
    fm, model, opt = build(world, 2, None, "fsdp2", opt="sgd", lr=0.1)
    fed = FedAvg(model, fm, sync_every=1)
    fed.attach(opt)  # the step hook instead of explicit fed.step() calls
    train(fm, model, opt, None, range(1, 5))
    assert fed.num_syncs == 4
    ref = make_model(0)
    ref_opt = make_opt(ref.parameters(), "sgd", 0.1)
    c = fm.coords
    for t in range(1, 5):
        loss_fn(ref, *batch(c.group, c.index, t)).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        ref_opt.step()
        ref_opt.zero_grad()
    pn, bn = averaged_names(ref)
    want = {n: t.detach() for n, t in list(ref.named_parameters()) + list(ref.named_buffers()) if n in pn + bn}
    out["ddp"] = compare(full_state(model, "fsdp2"), want, "E=1 SGD vs synchronous DP")

    # replicated modules: plain average == PeriodicModelAverager (it averages at calls
    # warmup, warmup + E, ...; warmup = E - 1 makes that after local steps E, 2E, ...)
    E, T = 3, 8
    fm4 = fed_mesh(world, world)
    _, model, opt = build(world, world, None, "plain", mesh=fm4)
    fed = FedAvg(model, fm4, sync_every=E)
    train(fm4, model, opt, fed, range(1, T + 1))
    ref = make_model(0)
    ref_opt = make_opt(ref.parameters(), "adamw", 1e-2)
    avg = PeriodicModelAverager(period=E, warmup_steps=E - 1, process_group=dist.group.WORLD)
    for t in range(1, T + 1):
        loss_fn(ref, *batch(rank, 0, t)).backward()
        ref_opt.step()
        # NOTE: before zero_grad: the averager skips parameters whose .grad is None
        avg.average_parameters(list(ref.parameters()))
        ref_opt.zero_grad()
    want = {n: p.detach() for n, p in ref.named_parameters()}
    got = {n: p.detach() for n, p in model.named_parameters()}
    out["averager"] = compare(got, want, "plain average vs PeriodicModelAverager")

    # the overlap case is not the synchronous one: the delay is observable (the test can fail)
    _, model, opt = build(world, world, None, "plain", mesh=fm4)
    fed = FedAvg(model, fm4, sync_every=2, overlap_steps=1)
    train(fm4, model, opt, fed, range(1, 6))
    fed.finish()
    sync = simulate(world, 1, 2, 5)[fm4.coords.group]
    out["overlap_vs_sync"] = max((p.detach() - sync[n]).abs().max().item() for n, p in model.named_parameters())
    return out


def test_semantics_ddp_averager_overlap_outer_inner():
    res = run_distributed(_semantics_worker, 4, timeout=400)
    assert res[0]["overlap_vs_sync"] > 1e-4, res[0]  # the one-step delay really changes the result


# ------------------------------------------------------------------ compression, state, errors
# NOTE: the three checks below share one run of the ranks (starting 4 ranks costs more than the
# checks); each test reads its own part; the first part that fails ends the run (tests.dist.run_parts)
def _combined_worker(rank: int, world: int, ckpt_dir: str) -> dict:
    return run_parts(rank, world, (("compressed", _compressed_worker, ()),
                                   ("roundtrip", _roundtrip_worker, (ckpt_dir,)), ("errors", _errors_worker, ())))


@pytest.fixture(scope="module")
def combined() -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        return run_distributed(_combined_worker, 4, d, timeout=400)


def _part(results: list[dict], name: str) -> list:
    return [res[name] for res in results]


COMPRESSED = [("bf16", False), ("int8", False), ("int8", True), ("fp8", True), ("int8", "bf16")]


def _compressed_worker(rank: int, world: int) -> dict:
    from flcomm.comm.base import LinkTier
    from flcomm.federated.fedavg import FedAvg

    fm = fed_mesh(world, 2)
    init = make_model(0, d=32)
    res: dict = {}
    for codec, ef in [("none", False)] + COMPRESSED:
        _, model, opt = build(world, 2, None, "fsdp2", mesh=fm, model_kw={"d": 32})
        # NOTE: ~4k-element shards in buckets of 0.02 MB (5k elements): several buckets per
        # exchange, large enough that the codecs' block padding is small
        fed = FedAvg(model, fm, sync_every=2, codec=codec, error_feedback=bool(ef), bucket_cap_mb=0.01,
                     residual_dtype=ef if isinstance(ef, str) else "fp32")
        fm.stats.reset()
        train(fm, model, opt, fed, range(1, 7))
        res[(codec, ef)] = (full_state(model, "fsdp2"), fm.stats.bytes(LinkTier.INTER_GROUP), fed.num_syncs)
    base, base_bytes, _ = res[("none", False)]
    w0 = {n: p.detach() for n, p in init.named_parameters()}
    moved = max((base[n] - w0[n]).abs().max().item() for n in w0)
    out = {}
    for codec, ef in COMPRESSED:
        got, nbytes, syncs = res[(codec, ef)]
        assert syncs == 3
        err = max((got[n] - base[n]).abs().max().item() for n in w0) / moved
        out[f"{codec}{'+ef' if ef else ''}{'-' + ef if isinstance(ef, str) else ''}"] = (err, nbytes / base_bytes)
    return out


# NOTE: 2x what this run gives (measured 2026-12-07, torch 2.14.1, CPU; deterministic): bf16
# 1.86e-3, int8 3.57e-3, int8+ef 1.94e-3, fp8+ef 1.11e-2, int8+ef with a bf16 residual 1.94e-3.
# A codec path twice as lossy fails here; CODEC_TOL (the harness's stated bound) stays looser.
MEASURED_X2 = {"bf16": 3.7e-3, "int8": 7.2e-3, "int8+ef": 3.9e-3, "fp8+ef": 2.2e-2, "int8+ef-bf16": 3.9e-3}


def test_compressed_within_tolerance_of_uncompressed(combined):
    res = _part(combined, "compressed")
    assert set(res[0]) == set(MEASURED_X2), sorted(res[0])
    for name, (err, byte_ratio) in res[0].items():
        codec = name.split("+")[0]
        assert 0 < err < min(MEASURED_X2[name], CODEC_TOL[codec]), (name, err)  # lossy, within 2x of what ran
        assert byte_ratio < (0.6 if codec in ("bf16", "fp16") else 0.35), (name, byte_ratio)
    # a bf16 residual keeps what error feedback gains (measured: 1.94e-3 for both)
    assert res[0]["int8+ef-bf16"][0] <= 1.2 * res[0]["int8+ef"][0], res[0]
    print({k: (f"err {e:.2e}", f"bytes x{b:.3f}") for k, (e, b) in res[0].items()})


# ------------------------------------------------------------------ state, NaN, bad input
def _roundtrip_worker(rank: int, world: int, ckpt_dir: str) -> dict:
    import os

    base = dict(sync_every=2, outer="nesterov", codec="int8", error_feedback=True, overlap_steps=1,
                bucket_cap_mb=0.0005)
    # the second holds per-fragment state (fragments synced at odd and even steps)
    out = {}
    # the third: the sparse codec's residuals (its own bucket layout: whole blocks, no chunks)
    sparse = {**base, "codec": "topk:k=4:bits=2:block=128"}
    for name, kw in (("single", base), ("fragments", {**base, "fragments": 2}), ("topk", sparse)):
        d = os.path.join(ckpt_dir, name)
        out[name] = _roundtrip_one(rank, world, d, kw)
    return out


def _roundtrip_one(rank: int, world: int, ckpt_dir: str, kw: dict) -> dict:
    import torch.distributed.checkpoint as dcp

    from flcomm.federated.fedavg import FedAvg

    fm = fed_mesh(world, 2)

    def fresh():
        _, model, opt = build(world, 2, None, "fsdp2", mesh=fm)
        return model, opt, FedAvg(model, fm, **kw)

    model, opt, fed = fresh()
    train(fm, model, opt, fed, range(1, 6))
    fed.finish()
    shards = [p.to_local().detach().clone() for p in model.parameters()]
    opt_sd = copy.deepcopy(opt.state_dict())
    fed_sd = copy.deepcopy(fed.state_dict())
    K = kw.get("fragments", 1)
    assert fed_sd["steps"] == 5 and fed_sd["num_syncs"] == (2 if K == 1 else 5)
    if K > 1:
        assert len(fed_sd[f"rank{rank}"]["exchange"]["fragments"]) == K
    dcp.save({"fed": fed.state_dict()}, checkpoint_id=ckpt_dir)
    train(fm, model, opt, fed, range(6, 10))
    fed.finish()
    want = full_state(model, "fsdp2")

    def resume(load_fed) -> dict:
        return resume_from(fm, fresh, shards, opt_sd, load_fed, range(6, 10))

    def via_dcp(fed) -> None:
        template = {"fed": fed.state_dict()}
        dcp.load(template, checkpoint_id=ckpt_dir)
        fed.load_state_dict(template["fed"])

    out = {}
    for how, load in (("in_memory", lambda f: f.load_state_dict(copy.deepcopy(fed_sd))), ("dcp", via_dcp)):
        got = resume(load)
        for n in want:
            assert torch.equal(got[n], want[n]), f"{how}: {n} differs after resume"
    got = resume(lambda f: None)  # without the FedAvg state the continuation differs
    out["without_state_diff"] = max((got[n] - want[n]).abs().max().item() for n in want)
    return out


def test_state_dict_round_trip(combined):
    res = _part(combined, "roundtrip")
    for name in ("single", "fragments", "topk"):
        assert res[0][name]["without_state_diff"] > 1e-6, name


def _errors_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from flcomm.federated.fedavg import FedAvg
    from flcomm.federated.nonfinite import NonFiniteAverageError

    fm2, fm4 = fed_mesh(world, 2), fed_mesh(world, 4)
    model = make_model(0)
    bad_args = [
        (dict(sync_every=0), ValueError, "sync_every .* >= 1, got 0"),
        (dict(sync_every=1.5), ValueError, "sync_every"),
        (dict(sync_every=2, codec="zip"), ValueError, "zip"),
        (dict(sync_every=2, outer="adam"), ValueError, r"outer must be one of avg, nesterov, got 'adam'"),
        (dict(sync_every=2, inner_state="x"), ValueError, "inner_state must be one of"),
        (dict(sync_every=2, inner_state="average"), ValueError, "needs the inner optimizer"),
        (dict(sync_every=2, bucket_cap_mb=0), ValueError, "bucket_cap_mb"),
        (dict(sync_every=2, outer="nesterov", outer_momentum=1.0), ValueError, "outer_momentum"),
        (dict(sync_every=2, overlap_steps=3), ValueError,
         r"overlap_steps .* in \[0, 2\] \(at most sync_every\) or 'auto', got 3"),
        (dict(sync_every=2, overlap=True), TypeError, r"unknown FedAvg setting\(s\) \['overlap'\].*overlap_steps"),
        (dict(sync_every=4, fragments=3), ValueError, "fragments .* must divide sync_every=4, got 3"),
        (dict(sync_every=4, fragments=2, inner_state="reset"), ValueError, "not supported with fragments > 1"),
        (dict(sync_every=2, offload="gpu"), ValueError, "offload must be None or 'cpu', got 'gpu'"),
        (dict(sync_every=2, residual_dtype="fp8"), ValueError, "residual_dtype must be one of fp32, bf16, got 'fp8'"),
    ]
    for kw, exc, pattern in bad_args:
        with pytest.raises(exc, match=pattern):
            FedAvg(model, fm2, **kw)
    with pytest.raises(TypeError, match="FedMesh"):
        FedAvg(model, object(), sync_every=1)
    with pytest.raises(ValueError, match="codec must be a name"):
        FedAvg(model, fm2, sync_every=1, codec=3)

    # model sharded over the whole world, but 2 federation groups: refused
    world_mesh = init_device_mesh("cpu", (world,))
    m = make_model(0)
    fully_shard(m, mesh=world_mesh)
    with pytest.raises(ValueError, match=r"ranks \[0, 1, 2, 3\], which leave the federation group"):
        FedAvg(m, fm2, sync_every=1)

    # groups that built different models: refused on all shard peers
    other = make_model(0, d=8 if fm2.coords.group == 0 else 6)
    with pytest.raises(ValueError, match="do not hold the same shards"):
        FedAvg(other, fm2, sync_every=1, replicated=True)

    # a state from another topology or configuration
    _, model, opt = build(world, 2, None, "plain", mesh=fm2)
    sd2 = FedAvg(model, fm2, sync_every=2, replicated=True).state_dict()
    fed4 = FedAvg(model, fm4, sync_every=2)
    with pytest.raises(ValueError, match=r"another topology: saved .*\[2, 1, 2\].* has .*\[4, 1, 1\]"):
        fed4.load_state_dict(sd2)
    with pytest.raises(ValueError, match="outer='avg', this run has outer='nesterov'"):
        FedAvg(model, fm2, sync_every=2, outer="nesterov", replicated=True).load_state_dict(sd2)

    # NaN/Inf from one group: refused on all its shard peers, local weights kept
    for kw in ({}, {"codec": "int8", "error_feedback": True}):
        _, model, opt = build(world, 4, None, "plain", mesh=fm4)
        fed = FedAvg(model, fm4, sync_every=2, **kw)
        train(fm4, model, opt, fed, range(1, 2))
        loss_fn(model, *batch(rank, 0, 2)).backward()
        opt.step()
        if rank == 2:
            with torch.no_grad():
                model.inp.weight[0, 0] = float("nan")
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(NonFiniteAverageError,
                           match=r"sync of step 2.*from ranks \[2\] \(federation groups \[2\]\)") as ei:
            fed.step()
        assert ei.value.bad_ranks == [2] and ei.value.fed_ranks == [0, 1, 2, 3]
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]) or (n == "inp.weight" and rank == 2), (kw, n)
        assert fed.num_syncs == 0
        for r in fed._exchange.state_dict().get("residuals", []):
            assert r is None or bool(torch.isfinite(r).all()), (kw, "residuals keep NaN")

    # a NaN among one set of shard peers reaches every rank of every federation group, with one message
    _, model, opt = build(world, 2, None, "fsdp2", mesh=fm2)
    fed = FedAvg(model, fm2, sync_every=1, overlap_steps=1)
    loss_fn(model, *batch(fm2.coords.group, fm2.coords.index, 1)).backward()
    opt.step()
    if rank == 3:
        with torch.no_grad():
            next(model.parameters()).to_local().view(-1)[0] = float("nan")
    fed.step()  # starts the exchange (overlap): the refusal comes at the apply
    with pytest.raises(NonFiniteAverageError) as ei:
        fed.step(skipped=True)  # NOTE: no optimizer step of its own: the apply is what is tested
    out = {"refusal": str(ei.value), "bad": ei.value.bad_ranks}
    return out


def _precision_worker(rank: int, world: int) -> dict:
    """fp64 stays fp64 (or is refused); a codec object reaches the exchange as given."""
    from flcomm.codecs import Int8Codec
    from flcomm.comm.base import LinkTier
    from flcomm.federated.fedavg import FedAvg

    fm4 = fed_mesh(world, 4)
    out: dict = {}
    model = make_model(0).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-12 * (rank + 1) * torch.ones_like(p))  # below fp32 resolution
    want = {}
    for n, p in model.named_parameters():
        t = p.detach().clone()
        dist.all_reduce(t)
        want[n] = t / world
    fed = FedAvg(model, fm4, sync_every=1, sync_module_states=False)  # the paper's mode: in place, fp64
    fed.step()
    out["fp64_err"] = max((p.detach() - want[n]).abs().max().item() for n, p in model.named_parameters())
    out["fp64_delta_anchor"] = str(FedAvg(model, fm4, sync_every=1, overlap_steps=1)._anchor[0].dtype)
    try:
        FedAvg(model, fm4, sync_every=1, codec="int8")
        out["fp64_int8"] = "no error"
    except ValueError as e:
        out["fp64_int8"] = str(e)
    got = {}
    for name, codec in (("default", "int8"), ("b64", Int8Codec(block_size=64))):
        model = make_model(0, d=32)
        fed = FedAvg(model, fm4, sync_every=1, codec=codec)
        fm4.stats.reset()
        fed.step()
        got[name] = (fed._exchange.bar.codec, fm4.stats.bytes(LinkTier.INTER_GROUP))
    out["b64_is_given"] = got["b64"][0].block_size == 64 and got["default"][0].block_size != 64
    out["bytes"] = (got["default"][1], got["b64"][1])
    return out


def test_fp64_kept_or_refused_and_codec_object_passed_down():
    res = run_distributed(_precision_worker, 4, timeout=200)
    r = res[0]
    assert r["fp64_err"] < 1e-15, r  # an fp32 average would be off by ~1e-8 at magnitude ~0.5
    assert r["fp64_delta_anchor"] == "torch.float64"
    assert "would cut the precision of the fp64 tensors" in r["fp64_int8"], r
    assert r["b64_is_given"]
    # block 64 carries 4x the scales of block 256: more bytes on the wire, measured
    assert r["bytes"][1] > r["bytes"][0], r["bytes"]


def test_nan_refusal_reaches_every_federation_group(combined):
    res = _part(combined, "errors")
    msgs = {r["refusal"] for r in res}
    assert len(msgs) == 1, msgs  # every rank of every group: the same message
    assert all(r["bad"] == [3] for r in res)
    assert "sync of step 1" in msgs.pop()


def test_errors_nan_refusal(combined):
    """The worker's own raises are checked there; here what reached every rank of the world: a
    NaN planted on rank 3 alone (one set of shard peers, of 2 groups) is refused on all 4 ranks, naming
    rank 3, with one message."""
    res = _part(combined, "errors")
    assert len(res) == 4 and all(o["bad"] == [3] for o in res), res
    assert len({o["refusal"] for o in res}) == 1 and "[3]" in res[0]["refusal"], res
