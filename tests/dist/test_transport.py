"""TorchTransport against direct torch.distributed calls, its byte counts against the ring
formulas, and its input validation (which must raise before any collective is issued); the
formulas themselves are in tests/unit/test_transport_checks.py."""

import torch

from flcomm.comm.base import CommStats, LinkTier, wire_bytes
from tests.common.dist import run_distributed


def _transport_vs_torch(rank, world):
    import torch.distributed as dist

    from flcomm.comm.torch_pg import TorchTransport

    stats = CommStats()
    tr = TorchTransport(None, LinkTier.INTER_NODE, stats)
    g = torch.Generator().manual_seed(1234 + rank)
    out = {"mismatch": []}
    expected_bytes = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int32):
        for n in (1, 7, 64):
            x = (torch.randn(world * n, generator=g) * 10).to(dtype)
            # all_reduce, every op
            for op, top in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("avg", None)):
                if op == "avg" and not dtype.is_floating_point:
                    continue
                a, ref = x.clone(), x.clone()
                tr.all_reduce(a, op=op)
                if top is None:
                    dist.all_reduce(ref, op=dist.ReduceOp.SUM)
                    ref = ref / world
                else:
                    dist.all_reduce(ref, op=top)
                if not torch.equal(a, ref.to(dtype)):
                    out["mismatch"].append(("all_reduce", op, dtype, n))
                expected_bytes += wire_bytes("all_reduce", x.numel() * x.element_size(), world)
            # reduce_scatter (async)
            o, ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            w = tr.reduce_scatter(o, x.clone(), op="sum", async_op=True)
            w.wait()
            dist.reduce_scatter_tensor(ref, x.clone())
            if not torch.equal(o, ref):
                out["mismatch"].append(("reduce_scatter", dtype, n))
            expected_bytes += wire_bytes("reduce_scatter", x.numel() * x.element_size(), world)
            # all_gather
            xi = x[:n].contiguous()
            o, ref = torch.empty(world * n, dtype=dtype), torch.empty(world * n, dtype=dtype)
            tr.all_gather(o, xi)
            dist.all_gather_into_tensor(ref, xi)
            if not torch.equal(o, ref):
                out["mismatch"].append(("all_gather", dtype, n))
            expected_bytes += wire_bytes("all_gather", o.numel() * o.element_size(), world)
            # all_to_all
            o, ref = torch.empty_like(x), torch.empty_like(x)
            tr.all_to_all(o, x)
            dist.all_to_all_single(ref, x)
            if not torch.equal(o, ref):
                out["mismatch"].append(("all_to_all", dtype, n))
            expected_bytes += wire_bytes("all_to_all", x.numel() * x.element_size(), world)
            # broadcast from the last rank
            b, ref = x.clone(), x.clone()
            tr.broadcast(b, src=world - 1)
            dist.broadcast(ref, src=world - 1)
            if not torch.equal(b, ref):
                out["mismatch"].append(("broadcast", dtype, n))
            expected_bytes += wire_bytes("broadcast", x.numel() * x.element_size(), world)
    out["bytes"] = stats.bytes(LinkTier.INTER_NODE)
    out["expected_bytes"] = expected_bytes
    out["other_tiers"] = stats.bytes("intra_node") + stats.bytes("inter_group")
    out["calls"] = stats.tiers[LinkTier.INTER_NODE].calls
    out["time"] = stats.tiers[LinkTier.INTER_NODE].time_s

    # validation raises before anything is issued: the stats do not move
    before = stats.snapshot()
    errors = []
    for fn in (
        lambda: tr.reduce_scatter(torch.empty(3), torch.empty(world * 3 + 1)),
        lambda: tr.reduce_scatter(torch.empty(2), torch.empty(world * 3)),
        lambda: tr.all_gather(torch.empty(world * 3, dtype=torch.float64), torch.empty(3)),
        lambda: tr.all_to_all(torch.empty(world * 2), torch.empty(world * 3)),
        lambda: tr.all_reduce(torch.empty(4, 4).t()),
        lambda: tr.all_reduce(torch.zeros(4, dtype=torch.int32), op="avg"),
        lambda: tr.all_reduce(torch.zeros(4), op="prod"),
        lambda: tr.broadcast(torch.zeros(4), src=world),
    ):
        try:
            fn()
            errors.append(None)
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    out["errors"] = errors
    out["stats_unchanged"] = stats.snapshot() == before
    return out


def test_torch_transport_matches_torch_distributed():
    world = 4
    for rank, out in enumerate(run_distributed(_transport_vs_torch, world)):
        assert out["mismatch"] == [], (rank, out["mismatch"])
        assert out["bytes"] == out["expected_bytes"] and out["bytes"] > 0
        assert out["other_tiers"] == 0
        assert out["calls"] == 4 * 3 * 7 - 3 * 1  # 4 dtypes x 3 sizes x 7 calls, int32 has no avg
        assert out["time"] > 0
        assert out["stats_unchanged"]
        errs = out["errors"]
        assert all(e is not None for e in errs), errs
        assert "does not split into 4 equal chunks" in errs[0]
        assert "expected output of" in errs[1] and "got 2" in errs[1]
        assert "one dtype" in errs[2]
        assert "contiguous" in errs[4]
        assert "floating dtype" in errs[5]
        assert "sum, avg, max" in errs[6]
        assert "src must be a group rank in [0, 4)" in errs[7]
