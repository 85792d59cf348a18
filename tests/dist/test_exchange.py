"""federated/exchange.py on gloo, against references computed from every rank's regenerated
inputs (no collective in the reference): the paper's in-place average in the tensors' own dtype,
the delta modes (anchor and local, and the overlap correction with a Nesterov outer step checked
against torch.optim.SGD), a non-finite bucket left unapplied, and the engine's issue order of
the collectives (the same on every rank, the documented pipeline)."""

from __future__ import annotations

import pytest
import torch

from tests.common.dist import run_distributed

pytestmark = pytest.mark.timeout(300)

WORLD = 2
SHAPES = [(7, 5), (1000,), (257,)]
BUCKET_MB = 300 * 4 / 2**20  # 300 fp32 elements: several buckets, tensors spanning them


def _data(rank: int, what: str, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(hash_stable(what) * 10 + rank)
    return [(torch.randn(s, generator=g) * 8).round().to(dtype) for s in SHAPES]


def hash_stable(s: str) -> int:
    return sum(ord(c) * 31 ** i for i, c in enumerate(s)) % 100_003


def _run(ex, locals_):
    from flcomm.comm.engine import get_engine

    return get_engine("cpu").submit(lambda j: ex.run(j, locals_), "test exchange").wait(120)


def _worker(rank: int, world: int) -> dict:
    from flcomm.codecs import get_codec
    from flcomm.comm import TorchTransport
    from flcomm.federated.config import FedAvgConfig
    from flcomm.federated.exchange import DeltaExchange, ExchangeBuffers
    from flcomm.federated.outer import OuterOptimizer

    out: dict = {}
    none = get_codec("none")

    # 1. the paper's mode: in place, in the tensors' own dtype (bf16 stays bf16)
    for dt in (torch.float32, torch.bfloat16):
        loc = _data(rank, "inplace", dt)
        ex = DeltaExchange(TorchTransport(), loc,
                           FedAvgConfig(codec=none, bucket_cap_mb=BUCKET_MB, error_feedback=False))
        assert ex.work_dtypes == [dt] * 3
        _run(ex, loc)
        out[("inplace", dt)] = [t.clone() for t in loc]

    # 2. delta mode, no overlap: anchor += mean(local - anchor); local = anchor
    loc = _data(rank, "local")
    anchors = _data(0, "anchor")  # the same on every rank
    ex = DeltaExchange(TorchTransport(), loc, FedAvgConfig(codec=none, bucket_cap_mb=BUCKET_MB, error_feedback=False),
                       ExchangeBuffers(anchors=anchors))
    _run(ex, loc)
    out["delta"] = ([t.clone() for t in loc], [a.clone() for a in anchors])

    # 3. overlap + nesterov: local_at_sync = local (as of the sync) before; after: anchor += disp,
    # and its buffer holds the correction anchor - local (the new anchor less the local shard as
    # of the sync)
    loc = _data(rank, "local")
    anchors = _data(0, "anchor")
    at_sync = [t.clone() for t in loc]
    outer = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
    outer.allocate(anchors[:2])  # tensors 0, 1 are parameters; tensor 2 a buffer (plain average)
    before = [t.clone() for t in loc]
    ex = DeltaExchange(TorchTransport(), loc, FedAvgConfig(codec=none, bucket_cap_mb=BUCKET_MB, error_feedback=False),
                       ExchangeBuffers(anchors=anchors, local_at_sync=at_sync, outer=outer,
                                       momentum_index=[0, 1, None]))
    _run(ex, loc)
    out["overlap"] = {"local_untouched": all(torch.equal(a, b) for a, b in zip(loc, before)),
                      "correction": [o.clone() for o in at_sync], "anchor": [a.clone() for a in anchors]}

    # 3b. the apply step, local += correction (in the local's dtype), piece by piece: bf16 locals
    # with fp32 anchors and local-at-sync copies, on the device and offloaded (staged through the
    # scratch)
    for offload in (False, True):
        loc = _data(rank, "local", torch.bfloat16)
        anchors = [a.float() for a in _data(0, "anchor")]
        at_sync = [t.float() for t in loc]
        ex = DeltaExchange(TorchTransport(), loc,
                           FedAvgConfig(codec=none, bucket_cap_mb=BUCKET_MB, error_feedback=False,
                                        offload="cpu" if offload else None),
                           ExchangeBuffers(anchors=anchors, local_at_sync=at_sync))
        _run(ex, loc)
        want = [t + o.to(t.dtype) for t, o in zip(loc, at_sync)]  # what FedAvg's apply step does
        ex.add_correction(loc)
        out[("add_correction", offload)] = all(torch.equal(a, b) for a, b in zip(loc, want)) and \
            not all(torch.equal(a, b) for a, b in zip(loc, _data(rank, "local", torch.bfloat16)))

    # 4. a non-finite average is not applied to its bucket
    loc = _data(rank, "local")
    anchors = _data(0, "anchor")
    if rank == 1:
        loc[1][500] = float("inf")
    keep = [a.clone() for a in anchors]
    before = [t.clone() for t in loc]
    ex = DeltaExchange(TorchTransport(), loc, FedAvgConfig(codec=none, bucket_cap_mb=BUCKET_MB, error_feedback=False),
                       ExchangeBuffers(anchors=anchors))
    res = _run(ex, loc)
    out["bad"] = {"bad_buckets": res.bad_buckets, "layout": ex.bar.layout(), "anchors": anchors, "keep": keep,
                  "locals": loc, "before": before}

    # 4b. the same refusal with overlap + nesterov, on the device (the fused apply) and offloaded
    # (staged through the scratch): the refused bucket's anchors, local-at-sync copies and momentum stay
    for offload in (False, True):
        loc = _data(rank, "local")
        anchors = _data(0, "anchor")
        if rank == 1:
            loc[1][500] = float("inf")
        at_sync = [t.clone() for t in loc]
        outer = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
        outer.allocate(anchors[:2])
        for b, m in zip(outer.buffers, _data(0, "momentum")):
            b.copy_(m)  # NOTE: not zero, so a change would show
        keep = {"anchors": [a.clone() for a in anchors], "local_at_sync": [o.clone() for o in at_sync],
                "momentum": [b.clone() for b in outer.buffers]}
        ex = DeltaExchange(TorchTransport(), loc,
                           FedAvgConfig(codec=none, bucket_cap_mb=BUCKET_MB, error_feedback=False,
                                        offload="cpu" if offload else None),
                           ExchangeBuffers(anchors=anchors, local_at_sync=at_sync, outer=outer,
                                           momentum_index=[0, 1, None]))
        res = _run(ex, loc)
        out[("bad overlap", offload)] = {"bad_buckets": res.bad_buckets, "layout": ex.bar.layout(), "keep": keep,
                                         "anchors": anchors, "local_at_sync": at_sync,
                                         "momentum": outer.buffers}

    return out


def _order_worker(rank: int, world: int) -> dict:
    """The engine's issue order of the collectives: int8, 3+ buckets (a gathering plan on 2 ranks,
    two hops on 3: flcomm.collectives.compressed.gathers)."""
    from flcomm.codecs import get_codec
    from flcomm.comm import TorchTransport
    from flcomm.federated.config import FedAvgConfig
    from flcomm.federated.exchange import DeltaExchange, ExchangeBuffers

    out: dict = {}
    class Recording(TorchTransport):
        log: list[str] = []

        def _all_to_all(self, output, input):
            self.log.append("a2a")
            return super()._all_to_all(output, input)

        def _all_gather(self, output, input):
            self.log.append("ag")
            return super()._all_gather(output, input)

        def _all_reduce(self, tensor, op):
            self.log.append("ar")
            return super()._all_reduce(tensor, op)

    for key, offload in (("order", False), ("order offload", True)):
        tr = Recording()
        tr.log = []
        loc = _data(rank, "local")
        ex = DeltaExchange(tr, loc,
                           FedAvgConfig(codec=get_codec("int8"), bucket_cap_mb=BUCKET_MB, error_feedback=True,
                                        offload="cpu" if offload else None),
                           ExchangeBuffers(anchors=_data(0, "anchor")))
        _run(ex, loc)
        out[key] = (list(tr.log), ex.bar.num_buckets)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, WORLD, timeout=240)


@pytest.fixture(scope="module")
def orders() -> dict[int, list[dict]]:
    return {w: run_distributed(_order_worker, w, timeout=240) for w in (2, 3)}


def _mean(what: str, dtype=torch.float32) -> list[torch.Tensor]:
    per_rank = [_data(r, what, dtype) for r in range(WORLD)]
    return [sum(ts[i].double() for ts in per_rank) / WORLD for i in range(len(SHAPES))]


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_in_place_average_in_own_dtype(results, dt):
    want = _mean("inplace", dt)
    for r in results:
        for got, w in zip(r[("inplace", dt)], want):
            assert got.dtype == dt
            assert torch.equal(got, w.to(dt))  # integer-valued halves: exact in bf16 too


def test_delta_mode_sets_anchor_and_local_to_the_average(results):
    want = _mean("local")
    for r in results:
        loc, anchors = r["delta"]
        for t, a, w in zip(loc, anchors, want):
            torch.testing.assert_close(a.double(), w, rtol=0, atol=1e-5)
            assert torch.equal(t, a)


def test_overlap_correction_with_nesterov_matches_torch_sgd(results):
    mean = _mean("local")
    anchor0 = _data(0, "anchor")
    for r, res in enumerate(results):
        o = res["overlap"]
        assert o["local_untouched"]  # the local shard keeps training: only the apply writes it
        delta0 = [t - a for t, a in zip(_data(r, "local"), anchor0)]
        for i in range(len(SHAPES)):
            p = anchor0[i].clone().double().requires_grad_(False)
            if i < 2:
                opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
                p.grad = p - mean[i]  # pseudo-gradient: old minus average
                opt.step()
            else:
                p = mean[i].clone()  # buffers: the plain average
            torch.testing.assert_close(o["anchor"][i].double(), p, rtol=1e-6, atol=1e-5)
            disp = p - anchor0[i].double()
            torch.testing.assert_close(o["correction"][i].double(), disp - delta0[i].double(), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("offload", [False, True])
def test_add_correction_is_the_apply_step(results, offload):
    assert all(r[("add_correction", offload)] for r in results)


def test_non_finite_bucket_is_not_applied(results):
    """The bucket holding rank 1's Inf leaves anchors and local shards as they were; every other
    bucket is applied (anchor and local = the average: the reference from the ranks' inputs)."""
    per_rank = [_data(r, "local") for r in range(WORLD)]
    per_rank[1][1][500] = float("inf")
    anchor0 = _data(0, "anchor")
    want = [anchor0[i].double() + sum(ts[i].double() - anchor0[i].double() for ts in per_rank) / WORLD
            for i in range(len(SHAPES))]
    for r in results:
        b = r["bad"]
        # element 500 of tensor 1: the one bucket holding it
        hit = [k for k, segs in enumerate(b["layout"]) for s in segs
               if s.index == 1 and s.tensor_offset <= 500 < s.tensor_offset + s.length]
        assert b["bad_buckets"] == hit and len(hit) == 1
        assert len(b["layout"]) >= 3
        for k, segs in enumerate(b["layout"]):
            for s in segs:
                def piece(ts, s=s):
                    return ts[s.index].reshape(-1)[s.tensor_offset:s.tensor_offset + s.length]

                if k == hit[0]:
                    assert torch.equal(piece(b["anchors"]), piece(b["keep"])), (k, s)
                    assert torch.equal(piece(b["locals"]), piece(b["before"])), (k, s)
                else:
                    torch.testing.assert_close(piece(b["anchors"]).double(), piece(want), rtol=0, atol=1e-5)
                    assert torch.equal(piece(b["locals"]), piece(b["anchors"])), (k, s)
        assert all(bool(torch.isfinite(a).all()) for a in b["anchors"])


@pytest.mark.parametrize("offload", [False, True])
def test_non_finite_bucket_with_overlap_and_nesterov_is_not_applied(results, offload):
    """The refused bucket leaves the anchor, the local-at-sync copy and the momentum as they
    were; every other bucket moved them (the local-at-sync copy became the correction)."""
    for r in results:
        b = r[("bad overlap", offload)]
        hit = [k for k, segs in enumerate(b["layout"]) for s in segs
               if s.index == 1 and s.tensor_offset <= 500 < s.tensor_offset + s.length]
        assert b["bad_buckets"] == hit and len(hit) == 1
        moved = 0
        for k, segs in enumerate(b["layout"]):
            for s in segs:
                kinds = ["anchors", "local_at_sync"] + (["momentum"] if s.index < 2 else [])
                for kind in kinds:
                    got = b[kind][s.index].reshape(-1)[s.tensor_offset:s.tensor_offset + s.length]
                    was = b["keep"][kind][s.index].reshape(-1)[s.tensor_offset:s.tensor_offset + s.length]
                    if k == hit[0]:
                        assert torch.equal(got, was), (k, s, kind)
                    else:
                        moved += not torch.equal(got, was)
        assert moved > 0


def test_issue_order_is_the_documented_pipeline_on_every_rank(orders):
    # two hops (3 ranks): hop 1 of bucket k is issued before hop 2 (the all-gather) of bucket k-1
    logs = [r["order"][0] for r in orders[3]]
    nb = orders[3][0]["order"][1]
    assert nb >= 3
    want = ["a2a"]
    want += ["a2a", "ag"] * (nb - 1)  # issue bucket k, then the middle (all-gather) of bucket k-1
    want += ["ag"]
    assert logs[0] == want, logs[0]
    assert all(log == logs[0] for log in logs)
    # offload: single-buffered (one bucket on the device at a time)
    logs = [r["order offload"][0] for r in orders[3]]
    nb = orders[3][0]["order offload"][1]
    assert nb >= 3 and logs[0] == ["a2a", "ag"] * nb, logs[0]
    assert all(log == logs[0] for log in logs)
    # a gathering plan (2 ranks): one all-gather per bucket, in bucket order, nothing else
    for key in ("order", "order offload"):
        logs = [r[key][0] for r in orders[2]]
        assert orders[2][0][key][1] >= 3 and logs[0] == ["ag"] * orders[2][0][key][1], (key, logs[0])
        assert all(log == logs[0] for log in logs)
