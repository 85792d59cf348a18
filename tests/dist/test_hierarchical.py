"""Hierarchical reduce-scatter / all-gather on gloo against the flat torch.distributed collective
and an exact local formula, for several node shapes, sizes, dtypes and ops; on a GPU, with
stream-ordered transports, issued on the caller's stream (the native shard reorder is in
tests/unit/test_shard_transpose.py)."""

from __future__ import annotations

import pytest
import torch

from flcomm.federated.mesh import init_fed_mesh
from tests.common.dist import run_distributed

# ---------------------------------------------------------------- distributed (gloo)

def _rank_input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-50, 50, (numel,), generator=g, dtype=torch.int64).to(dtype)


def _expected_reduce(world: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """The exact reduction of every rank's input, computed locally in float64 / int64."""
    xs = torch.stack([_rank_input(r, numel, dtype).to(torch.float64 if dtype.is_floating_point else torch.int64)
                      for r in range(world)])
    if op == "max":
        return xs.max(0).values
    s = xs.sum(0)
    return s / world if op == "avg" else s


TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    if not dtype.is_floating_point:
        return torch.equal(got.to(torch.int64), want)
    tol = TOL[dtype]
    return torch.allclose(got.to(torch.float64), want.to(torch.float64), rtol=tol, atol=tol * 4)


def _check_collectives(rank: int, world: int, local: int, sizes: list[int], dtypes: list[torch.dtype]) -> dict:
    import torch.distributed as dist

    from flcomm.comm.base import LinkTier
    from flcomm.federated.topology import Topology

    mesh = init_fed_mesh(Topology(world, local))
    h = mesh.hierarchy("shard")
    assert (h.nodes, h.local, h.size, h.rank) == (world // local, local, world, rank)
    checked = 0
    for dtype in dtypes:
        ops = ["sum", "max"] + (["avg"] if dtype.is_floating_point else [])
        for c in sizes:
            for op in ops:
                x = _rank_input(rank, world * c, dtype)
                want = _expected_reduce(world, world * c, dtype, op)[rank * c:(rank + 1) * c]
                out = torch.full((c,), 7, dtype=dtype)
                h.reduce_scatter(out, x.clone(), op)
                assert _close(out, want, dtype), (dtype, c, op, (out.double() - want.double()).abs().max())
                # the flat torch.distributed collective: same result within summation order
                flat = torch.empty(c, dtype=dtype)
                dist.reduce_scatter_tensor(flat, x.clone(), op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                                               "avg": dist.ReduceOp.SUM}[op])
                if op == "avg":
                    flat = flat / world
                assert _close(out, flat.to(torch.float64) if dtype.is_floating_point else flat.to(torch.int64),
                              dtype), (dtype, c, op)
                if op == "max" or not dtype.is_floating_point:
                    assert torch.equal(out, flat.to(dtype)), (dtype, c, op)
                # async: same bits as the synchronous call
                out2 = torch.empty(c, dtype=dtype)
                w = h.reduce_scatter(out2, x.clone(), op, async_op=True)
                assert w.wait() is out2 and w.is_completed()
                assert torch.equal(out2, out), (dtype, c, op)
                checked += 1
            # all-gather: bit-exact against the flat one
            mine = _rank_input(rank, c, dtype)
            full = torch.empty(world * c, dtype=dtype)
            h.all_gather(full, mine)
            want = torch.cat([_rank_input(r, c, dtype) for r in range(world)])
            assert torch.equal(full, want), (dtype, c)
            full2 = torch.empty(world * c, dtype=dtype)
            w = h.all_gather(full2, mine, async_op=True)
            w.wait()
            assert torch.equal(full2, want)
            checked += 1

    # wire bytes per tier: only 1/L of the reduce-scatter crosses the inter-node links
    N, L = world // local, local
    mesh.stats.reset()
    B = world * 64 * 4
    h.reduce_scatter(torch.empty(64), torch.ones(world * 64))
    assert mesh.stats.bytes(LinkTier.INTRA_NODE) == (L - 1) * B // L
    assert mesh.stats.bytes(LinkTier.INTER_NODE) == (N - 1) * (B // L) // N
    mesh.stats.reset()
    h.all_gather(torch.empty(world * 64), torch.ones(64))
    assert mesh.stats.bytes(LinkTier.INTER_NODE) == (N - 1) * (B // L) // N

    # refusals name the numbers
    errors = []
    for call in (lambda: h.reduce_scatter(torch.empty(3), torch.empty(world * 3 + 1)),
                 lambda: h.all_gather(torch.empty(world * 3 - 1), torch.empty(3)),
                 lambda: h.reduce_scatter(torch.empty(3, dtype=torch.float64), torch.empty(world * 3)),
                 lambda: h.reduce_scatter(torch.empty(3, dtype=torch.int64),
                                          torch.zeros(world * 3, dtype=torch.int64), "avg"),
                 lambda: h.reduce_scatter(torch.empty(3), torch.empty(world * 3), "prod")):
        try:
            call()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    dist.barrier()
    return {"checked": checked, "errors": errors}


def test_hierarchical_2x2_matches_flat():
    sizes = [1, 3, 64, 1000, 4099]
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
    res = run_distributed(_check_collectives, 4, 2, sizes, dtypes, timeout=120)
    assert all(r["checked"] == res[0]["checked"] for r in res) and res[0]["checked"] > 100
    errs = res[0]["errors"]
    assert all(e is not None for e in errs), errs
    assert "input must have 4 x output elements (4 x 3 = 12), got 13" in errs[0]
    assert "output must have 4 x input elements (4 x 3 = 12), got 11" in errs[1]
    assert "one dtype" in errs[2]
    assert "avg needs a floating dtype" in errs[3]
    assert "sum, avg, max" in errs[4]


def _check_two_shapes(rank: int, world: int, sizes: list[int], dtypes: list[torch.dtype]) -> list[dict]:
    return [_check_collectives(rank, world, local, sizes, dtypes) for local in (4, 2)]


@pytest.mark.timeout(600)
def test_hierarchical_2x4_and_4x2_match_flat():
    # NOTE: one spawn of 8 ranks for both shapes (2 nodes x 4 and 4 nodes x 2): start-up dominates.
    sizes = [1, 5, 257]
    dtypes = [torch.float32, torch.int64]
    res = run_distributed(_check_two_shapes, 8, sizes, dtypes, timeout=500)
    for shape in range(2):
        # float32: 3 ops + all-gather, int64: 2 ops + all-gather, per size
        assert [r[shape]["checked"] for r in res] == [len(sizes) * (4 + 3)] * 8
        assert all(e is not None for e in res[0][shape]["errors"])


class _Mirror:
    """A stream-ordered transport of ``size`` ranks that all hold this rank's input (one GPU
    plays every rank): reduce-scatter sums ``size`` copies of this rank's chunk, all-gather
    repeats the input. Its kernels run on the caller's stream."""

    def __new__(cls, size: int, rank: int):
        from flcomm.comm.base import CommStats, LinkTier, Transport

        class Mirror(Transport):
            _stream_wait = True

            def __init__(self):
                super().__init__(rank, size, LinkTier.INTRA_NODE, CommStats())

            def _all_reduce(self, t, op):
                t.mul_(size)

            def _reduce_scatter(self, o, i, op):
                o.copy_(i.view(size, -1)[rank] * size)

            def _all_gather(self, o, i):
                o.view(size, -1).copy_(i.view(1, -1).expand(size, -1))

            def _all_to_all(self, o, i):
                o.copy_(i)

            def _broadcast(self, t, s):
                return None

            @property
            def device(self):
                return torch.device("cuda")

        return Mirror()


@pytest.mark.gpu
def test_cuda_two_stage_collectives_issue_inline_on_the_callers_stream():
    """With stream-ordered transports, a hierarchical reduce-scatter / all-gather is issued on
    the caller's stream (no engine job, no host wait) and gives the flat result."""
    from flcomm.collectives.hierarchical import hierarchical_all_gather, hierarchical_reduce_scatter
    from flcomm.comm import engine

    N, L, c = 2, 2, 1024
    intra, inter = _Mirror(L, 1), _Mirror(N, 1)  # group rank n L + l = 1 * 2 + 1 = 3
    x = torch.randn(N * L * c, device="cuda")
    out = torch.empty(c, device="cuda")
    before = set(engine._ENGINES)
    h = hierarchical_reduce_scatter(out, x, intra, inter, async_op=True)
    assert h.is_completed()  # nothing left for a host thread: the stream holds the work
    h.wait()
    assert torch.equal(out, x.view(N * L, c)[3] * (N * L))  # every rank held x: P copies of chunk 3
    full = torch.empty(N * L * c, device="cuda")
    hierarchical_all_gather(full, out, intra, inter)
    assert torch.equal(full, out.repeat(N * L))
    assert set(engine._ENGINES) == before, "a hierarchical engine lane was started"
