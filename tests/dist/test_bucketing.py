"""BucketedAllReduce on gloo: codec ``none`` round-trips every parameter exactly (against a
per-tensor torch.distributed all-reduce), tensors spanning buckets, mixed dtypes, int8 buckets
against the single-process two-hop simulation (with fp32 and with bf16 residuals), error-feedback
state save/restore, bad input."""

from __future__ import annotations

import pytest
import torch

from tests.common.dist import run_distributed
from tests.common.two_hop import simulate_two_hop

SHAPES = [(7, 5), (1000,), (), (0,), (3, 4, 33), (257,)]
DTYPES = [torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.float16, torch.float32]
WORLD = 3
BUCKET_MB = 600 * 4 / 2**20  # 600 fp32 elements: tensors span buckets
OFFLOAD_MB = 2**14 * 4 / 2**20  # 16384 fp32 elements


def _tensors(rank: int, round_: int, integer: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + round_)
    out = []
    for shape, dt in zip(SHAPES, DTYPES):
        t = torch.randn(shape, generator=g) * 4
        if integer:
            t = t.round()  # integer values: every summation order gives the exact sum
        out.append(t.to(dt))
    return out


def _body(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from flcomm.collectives.bucketing import BucketedAllReduce
    from flcomm.comm import TorchTransport

    tr = TorchTransport()
    res: dict = {}

    # 1. codec none, sum and avg: exact against per-tensor all-reduce
    for op in ("sum", "avg"):
        ts = _tensors(rank, 0, integer=True)
        ref = [t.clone().float() for t in ts]
        for r in ref:
            dist.all_reduce(r)
            if op == "avg":
                r /= world
        bar = BucketedAllReduce(tr, ts, codec="none", bucket_mb=BUCKET_MB, op=op)
        ptrs = [t.data_ptr() for t in ts]
        work = bar.start()
        _ = torch.randn(200, 200) @ torch.randn(200, 200)  # compute meanwhile
        out = work.wait(timeout=60)
        res[("none", op)] = {
            "ok": [torch.equal(t, r.to(t.dtype)) for t, r in zip(ts, ref)],
            "same": [t.data_ptr() == p for t, p in zip(ts, ptrs)] + [out[0] is ts[0]],
            "completed": work.is_completed(),
            "buckets": bar.num_buckets,
            "numels": bar.bucket_numels,
            "layout": bar.layout(),
        }

    # 2. int8 with error feedback, 2 rounds via start(tensors), then save / restore the state;
    # offload: the same, single-buffered, the residuals in host memory staged through the scratch
    for key, offload in (("int8", False), ("int8 offload", True)):
        ts0 = [t.float() for t in _tensors(rank, 1, integer=False)]
        kw = dict(codec="int8", bucket_mb=BUCKET_MB, error_feedback=True, op="avg", offload=offload)
        bar = BucketedAllReduce(tr, ts0, **kw)
        outs = []
        for rnd in range(2):
            ts = [t.float() for t in _tensors(rank, 1 + rnd, integer=False)]
            bar.start(ts).wait()
            outs.append(ts)
        sd = bar.state_dict()
        bar2 = BucketedAllReduce(tr, ts0, **kw)
        bar2.load_state_dict(sd)
        t_a = [t.float() for t in _tensors(rank, 3, integer=False)]
        t_b = [t.clone() for t in t_a]
        bar.start(t_a).wait()
        bar2.start(t_b).wait()
        res[key] = {"outs": outs, "restored_equal": all(torch.equal(a, b) for a, b in zip(t_a, t_b)),
                    "residuals": sd["residuals"], "numels": bar.bucket_numels, "layout": bar.layout()}

    # 2a. the same with bf16 residuals (review P4: one never written back passed all but a ratio)
    for key, offload in (("int8 bf16", False), ("int8 bf16 offload", True)):
        ts0 = [t.float() for t in _tensors(rank, 1, integer=False)]
        bar = BucketedAllReduce(tr, ts0, codec="int8", bucket_mb=BUCKET_MB, error_feedback=True, op="avg",
                                offload=offload, residual_dtype=torch.bfloat16)
        outs, sds = [], []
        for rnd in range(2):
            ts = [t.float() for t in _tensors(rank, 1 + rnd, integer=False)]
            bar.start(ts).wait()
            outs.append(ts)
            sds.append(bar.state_dict()["residuals"])
        res[key] = {"outs": outs, "residuals": sds, "layout": bar.layout()}

    # 2b. offload keeps at most two buckets on the device, whatever the codec
    big = [torch.randn(70_000, generator=torch.Generator().manual_seed(rank)), torch.randn(30_001)]
    res["offload memory"] = {}
    for codec in ("none", "int8", "fp8", "bf16", "fp16"):
        for offload in (False, True):
            bar = BucketedAllReduce(tr, [t.clone() for t in big], codec=codec, bucket_mb=OFFLOAD_MB,
                                    error_feedback=codec != "none", offload=offload)
            bar.start().wait()
            res["offload memory"][(codec, offload)] = {**bar.memory_bytes(), "numels": bar.bucket_numels}

    # 3. errors
    msgs = []
    for fn in (lambda: bar.start([t.float() for t in _tensors(rank, 0, False)][:-1]),
               lambda: BucketedAllReduce(tr, [torch.zeros(3, dtype=torch.int64)]),
               lambda: BucketedAllReduce(tr, [torch.zeros(4, 4)[:, 1]]),
               lambda: BucketedAllReduce(tr, [torch.zeros(4)], bucket_mb=0),
               lambda: BucketedAllReduce(tr, [torch.zeros(4)], codec="zip"),
               lambda: bar2.load_state_dict({**sd, "bucket_numels": [1]})):
        try:
            fn()
            msgs.append("no error")
        except (TypeError, ValueError, RuntimeError) as e:
            msgs.append(str(e))
    w = bar.start()
    try:
        bar.start()
        msgs.append("no error")
    except RuntimeError as e:
        msgs.append(str(e))
    w.wait()
    res["errors"] = msgs
    return res


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_body, WORLD, timeout=180)


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_none_codec_round_trips_every_parameter_exactly(results, op):
    for r in results:
        d = r[("none", op)]
        assert all(d["ok"]), d["ok"]
        assert all(d["same"]) and d["completed"]
    d = results[0][("none", op)]
    total = sum(int(torch.Size(s).numel()) for s in SHAPES)
    assert sum(d["numels"]) == total and d["buckets"] == -(-total // 600)
    # every element of every tensor appears exactly once in the layout
    seen = {i: [] for i in range(len(SHAPES))}
    for segs in d["layout"]:
        for s in segs:
            seen[s.index].append((s.tensor_offset, s.length))
    for i, shape in enumerate(SHAPES):
        spans = sorted(seen[i])
        assert sum(n for _, n in spans) == torch.Size(shape).numel()
        pos = 0
        for off, n in spans:
            assert off == pos
            pos += n


def _flatten_bucket(ts: list[torch.Tensor], segs) -> torch.Tensor:
    n = max(s.bucket_offset + s.length for s in segs)
    flat = torch.zeros(n)
    for s in segs:
        src = ts[s.index].reshape(-1)[s.tensor_offset:s.tensor_offset + s.length]
        flat[s.bucket_offset:s.bucket_offset + s.length] = src
    return flat


def _check_rounds(results: list[dict], key: str, kept) -> list[list[list[torch.Tensor]]]:
    """The two rounds of ``results[key]`` (int8, avg, error feedback) against the two-hop
    simulation: every rank's result equals it bit for bit. ``kept(residual)``: what a rank keeps
    of its new residual (its dtype's rounding), fed to the next round. Returns the kept residuals
    after each round, ``[round][rank][bucket]``."""
    layout = results[0][key]["layout"]
    residuals = [[torch.zeros(sum(s.length for s in segs)) for segs in layout] for _ in range(WORLD)]
    after = []
    for rnd in range(2):
        inputs = [[t.float() for t in _tensors(r, 1 + rnd, integer=False)] for r in range(WORLD)]
        for b, segs in enumerate(layout):
            xs = [_flatten_bucket(inputs[r], segs) for r in range(WORLD)]
            out, _, new_res = simulate_two_hop(xs, "int8", "avg", residuals=[residuals[r][b] for r in range(WORLD)])
            for r in range(WORLD):
                residuals[r][b] = kept(new_res[r])
                got = _flatten_bucket(results[r][key]["outs"][rnd], segs)
                assert torch.equal(got, out), (rnd, b, r, float((got - out).abs().max()))
        after.append([list(rs) for rs in residuals])
    return after


@pytest.mark.parametrize("key", ["int8", "int8 offload"])
def test_int8_buckets_match_the_two_hop_simulation_with_error_feedback(results, key):
    residuals = _check_rounds(results, key, lambda res: res)[-1]
    for r in range(WORLD):
        saved = results[r][key]["residuals"]
        for b in range(len(results[0][key]["layout"])):
            n = residuals[r][b].numel()
            assert torch.equal(saved[b][:n], residuals[r][b])
            assert not bool(saved[b][n:].any())  # the padding never carries error
    assert all(r[key]["restored_equal"] for r in results)


@pytest.mark.parametrize("key", ["int8 bf16", "int8 bf16 offload"])
def test_bf16_residuals_are_the_simulation_rounded_to_bf16(results, key):
    """``residual_dtype=bf16``: after each round every rank's residual is the two-hop
    simulation's, fed the previous round's bf16 residual, rounded to bf16 (torch's
    round-to-nearest-even), and the result is the simulation's, bit for bit."""
    after = _check_rounds(results, key, lambda res: res.to(torch.bfloat16).float())
    for rnd, residuals in enumerate(after):
        for r in range(WORLD):
            for b, want in enumerate(residuals[r]):
                saved = results[r][key]["residuals"][rnd][b]
                assert saved.dtype == torch.bfloat16 and bool(want.any()), (rnd, b, r)
                assert torch.equal(saved[:want.numel()].float(), want), (rnd, b, r)


@pytest.mark.parametrize("codec", ["none", "int8", "fp8", "bf16", "fp16"])
def test_offload_keeps_at_most_two_buckets_on_the_device(results, codec):
    """Staging (buffer, scratch, plan) plus hop 2's temporary <= 2 buckets with offload; without
    it the layout is bucket_mb's, with it the largest buckets that fit (codec none: less the
    padding; a lossy codec: between a third and two thirds)."""
    bucket = OFFLOAD_MB * 2**20
    for r in results:
        dev, off = r["offload memory"][(codec, False)], r["offload memory"][(codec, True)]
        assert off["staging"] + off["transient"] <= 2 * bucket, (off, (off["staging"] + off["transient"]) / bucket)
        assert dev["numels"][0] == bucket // 4 and sum(dev["numels"]) == sum(off["numels"]) == 100_001
        n, cap = off["numels"][0], dev["numels"][0]
        if codec == "none":  # one alignment's padding less
            assert cap - WORLD * 4 <= n < cap, (n, cap)
        else:  # cut to fit the codec's plan
            assert cap // 3 <= n <= 2 * cap // 3, (n, cap)
        assert off["residual"] >= (0 if codec == "none" else 4 * 100_001)  # in host memory (padded)


def test_bad_input_errors(results):
    m = results[0]["errors"]
    assert "must have the layout's shapes" in m[0]
    assert "floating dtype, got torch.int64" in m[1]
    assert "contiguous" in m[2]
    assert "bucket_mb must be a positive number, got 0" in m[3]
    assert "known codecs" in m[4]
    assert "state dict is for buckets [1]" in m[5]
    assert "still in flight" in m[6]
