"""Two ranks on one GPU: the multi-rank native NCCL paths, on real NCCL (tools/gpu_check.sh's
pytest_two_ranks step, capped at 60 s; one GPU gives no other multi-rank coverage).

NCCL refuses two ranks of one communicator on one GPU of one host ("Duplicate GPU", init.cc).
Each rank here sets its own ``NCCL_HOSTID`` before its first NCCL call (utils.cc getHostHash), so
NCCL takes the two processes for two hosts and connects them by its socket transport, over ``lo``
(:data:`NCCL_ENV`). The two CUDA contexts time-slice the GPU: slow, but every NCCL rule holds.
Every wait is bounded: blocking waits (``blocking_wait=True``) with :data:`TIMEOUT_S`, and in the
dead-peer part the watchdog, the only bound a stream-ordered wait has.

Parts, one test each (so the summary says which passed: tools/gpu_summary.py MULTI_RANK_PATHS),
in order of value within the cap:
  1. a native 2-rank root communicator over a gloo world of 2 (``NcclTransport.from_group``) and
     its splits (both ranks, reversed; one each; one rank and no color; a CTA cap; a split of a
     split): all_reduce (sum, avg), all_gather, reduce_scatter, all_to_all against exact formulas;
  2. a dead peer: rank 1 freezes (SIGSTOP) while rank 0 issues an all_reduce with a stream-ordered
     wait; within 2x the timeout the watchdog has set rank 0's ``failure``, aborted the
     communicator (``is_aborted``), and ``raise_if_failed`` raises its CommFailure;
  3. a 2-rank FedAvg sync (2 groups of 1), int8 + error feedback, on ``init_fed_mesh(topology, "cuda",
     transport="native")`` against the same sync on ``transport="torch"`` over gloo on the CPU:
     the same bits (the kernels are the CPU's bit for bit), lossy against the exact average;
  4. the replicate all-reduce hook (flcomm/fsdp/fsdp2.py), called as FSDP2 calls it, on a 2-rank
     NcclTransport against the same hook on gloo: exact (codec none, the average's formula) and
     int8 + error feedback (fp32 and bf16 gradients).

When NCCL does not set up the two ranks (the root's init fails: a GPU in an exclusive compute
mode, no socket, ...), the parts are skipped with "NCCL refused two ranks on one GPU: <why>", and
the summary lists them as unverified. The same parts run on the CPU on the strict NCCL stand-in
(tests/common/fake_nccl.py): the probe's own checks, tested where CI runs them.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch

from flcomm import _native
from flcomm.federated.mesh import init_fed_mesh
from tests.common.dist import run_distributed

TIMEOUT_S = 15.0  # init, split and every blocking wait of parts 1, 3 and 4 (an init that hangs is a
# refusal, reported before part 1's own limit: the forkserver's start and this, with room)
DEAD_TIMEOUT_S = 3.0  # part 2's communicator: the watchdog's deadline
N = 4099  # elements per rank (odd: no chunk is aligned by luck)
ROUNDS = 3  # FedAvg syncs and hook calls (error feedback carries over from the first)
#: NCCL's environment in each rank (setdefault: the caller's own settings win). lo: the two
#: "hosts" are one; IB off: the socket transport, which two processes on one GPU can use
NCCL_ENV = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_DEBUG": "WARN"}
REFUSED = "NCCL refused two ranks on one GPU"  # NOTE: tools/gpu_summary.py REFUSED reads it
#: int8's stated tolerance for one exchange, of the largest magnitude (tests/common/fedavg_harness.py)
INT8_TOL = 0.02

# NOTE: what part 1 found, for the later parts: a setup NCCL refused, or one that hung, is not
# tried again (each try would spend the step's cap on the same init)
_SETUP: dict[str, str] = {}

needs_nccl = pytest.mark.skipif(not (_native.available() and _native.native().compiled_with_nccl()),
                                reason="flcomm built without NCCL")


# ---------------------------------------------------------------- the ranks
def _setup(rank: int, stand_in: bool) -> str:
    """This rank's NCCL environment and device, before its first NCCL call; the device type."""
    if stand_in:
        from tests.common import fake_nccl

        fake_nccl.install()
        return "cpu"
    os.environ["NCCL_HOSTID"] = f"flcomm-two-ranks-{rank}"
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)
    os.environ.pop("LOCAL_RANK", None)  # NOTE: both ranks on cuda:0 (default_device: the current one)
    torch.cuda.set_device(0)
    return "cuda"


def _refusal(e: BaseException, t0: float) -> str:
    return f"{type(e).__name__} after {time.monotonic() - t0:.1f} s: {str(e)[:600]}"


def _ramp(rank: int, device: str) -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32, device=device) + 1000.0 * rank


def _blocking_root(rank: int, stand_in: bool):
    """(this rank's device, a blocking native root transport over the world, bounded by TIMEOUT_S)."""
    from flcomm.comm.base import LinkTier
    from flcomm.comm.nccl import NcclTransport

    device = _setup(rank, stand_in)
    return device, NcclTransport.from_group(None, LinkTier.INTER_NODE, timeout=timedelta(seconds=TIMEOUT_S),
                                            blocking_wait=True)


def _root_and_splits(rank: int, world: int, stand_in: bool) -> dict:

    t0 = time.monotonic()
    try:
        device, root = _blocking_root(rank, stand_in)
    except Exception as e:  # noqa: BLE001 - NCCL's refusal of the setup is the result
        return {"refused": _refusal(e, t0)}
    out: dict = {"refused": None, "init_s": time.monotonic() - t0, "root": (root.rank, root.size)}
    x = _ramp(rank, device)
    root.all_reduce(x, "sum")
    out["sum"] = x.cpu()
    y = torch.full((N,), 3.0 * (rank + 1), device=device)
    root.all_reduce(y, "avg")
    out["avg"] = y.cpu()
    g = torch.empty(2 * N, device=device)
    root.all_gather(g, _ramp(rank, device))
    out["gather"] = g.cpu()
    rs = torch.empty(N, device=device)
    root.reduce_scatter(rs, torch.arange(2 * N, dtype=torch.float32, device=device) * (rank + 1), "sum")
    out["reduce_scatter"] = rs.cpu()
    a2a = torch.empty(2 * N, device=device)
    root.all_to_all(a2a, torch.cat([torch.full((N,), 100.0 * rank + j, device=device) for j in range(2)]))
    out["all_to_all"] = a2a.cpu()

    both = root.split(0, key=1 - rank)  # NOTE: reversed: global rank 1 is the child's rank 0
    z = torch.full((N,), float(rank + 1), device=device)
    both.all_reduce(z, "sum")
    order = torch.empty(2, device=device)
    both.all_gather(order, torch.full((1,), float(rank), device=device))
    out["both"] = (both.rank, both.size, z.cpu(), order.cpu())
    alone = root.split(rank)
    w = torch.full((N,), float(rank + 5), device=device)
    alone.all_reduce(w, "sum")
    out["alone"] = (alone.rank, alone.size, w.cpu())
    only0 = root.split(0 if rank == 0 else -1)
    out["only0"] = None if only0 is None else (only0.rank, only0.size)
    capped = root.split(0, max_ctas=2)
    c = torch.full((N,), float(rank + 1), device=device)
    capped.all_reduce(c, "sum")
    out["capped"] = (int(capped.comm.max_ctas), c.cpu())
    nested = both.split(0)  # NOTE: a split of a split; key: the rank in ``both``
    ng = torch.empty(2 * N, device=device)
    nested.all_gather(ng, _ramp(rank, device))
    out["nested"] = (nested.rank, nested.size, ng.cpu())
    for t in (nested, capped, only0, alone, both, root):
        if t is not None:
            t.close()
    out["seconds"] = time.monotonic() - t0
    return out


def _dead_peer(rank: int, world: int, stand_in: bool) -> dict:
    import torch.distributed as dist

    from flcomm.comm.base import LinkTier
    from flcomm.comm.nccl import NcclTransport
    from flcomm.comm.watchdog import CommFailure
    from tests.common import dist as tdist

    t0 = time.monotonic()
    try:
        device = _setup(rank, stand_in)
        # NOTE: stream-ordered waits (the default): nothing but the watchdog bounds a lost peer
        t = NcclTransport.from_group(None, LinkTier.INTER_GROUP, timeout=timedelta(seconds=DEAD_TIMEOUT_S))
    except Exception as e:  # noqa: BLE001 - NCCL's refusal of the setup is the result
        return {"refused": _refusal(e, t0)}
    x = torch.ones(N, device=device)
    t.all_reduce(x, "sum")
    out: dict = {"refused": None, "before": float(x.sum().item())}  # NOTE: both alive: 2 N
    if rank == 1:
        tdist.STORE.set("two_ranks/pid1", str(os.getpid()))
        dist.barrier()
        os.kill(os.getpid(), signal.SIGSTOP)  # NOTE: frozen: alive, connected, issuing nothing
        return out  # NOTE: never reached: rank 0 kills it once it has its verdict
    dist.barrier()
    pid = int(tdist.STORE.get("two_ranks/pid1"))
    out["frozen_seen"] = _wait_stopped(pid, 10.0)
    t1 = time.monotonic()
    y = torch.ones(N, device=device)
    try:
        t.all_reduce(y, "sum")  # NOTE: on a GPU it returns once the stream waits on it; the host is free
        out["issue_error"] = None
    except RuntimeError as e:  # NOTE: the stand-in's stream is the host: its wait ends with the abort
        out["issue_error"] = str(e)
    out["issue_s"] = time.monotonic() - t1
    while t.failure is None and time.monotonic() - t1 < 3 * DEAD_TIMEOUT_S:
        time.sleep(0.02)
    out["detect_s"] = time.monotonic() - t1
    f = t.failure
    out["failure"] = None if f is None else {"type": type(f).__name__, "is_comm_failure": isinstance(f, CommFailure),
                                             "tier": getattr(f, "tier", None), "rank": getattr(f, "rank", None),
                                             "op": getattr(f, "op", None), "reason": getattr(f, "reason", None),
                                             "seconds": getattr(f, "seconds", None), "text": str(f)}
    # NOTE: the watchdog sets the failure, then aborts (which may take a while to drain)
    while f is not None and not t.comm.is_aborted and time.monotonic() - t1 < out["detect_s"] + DEAD_TIMEOUT_S:
        time.sleep(0.02)
    out["aborted"], out["aborted_s"] = bool(t.comm.is_aborted), time.monotonic() - t1
    try:
        t.raise_if_failed("probe")
        out["raised"] = None
    except Exception as e:  # noqa: BLE001 - what it raises is the result
        out["raised"] = {"type": type(e).__name__, "is_comm_failure": isinstance(e, CommFailure),
                         "caused_by_failure": e is f or e.__cause__ is f, "text": str(e)}
    t2 = time.monotonic()
    if device == "cuda":
        torch.cuda.synchronize()  # NOTE: the aborted kernel exited: the stream runs on
    out["stream_drained_s"] = time.monotonic() - t2
    os.kill(pid, signal.SIGKILL)
    return out


def _wait_stopped(pid: int, limit_s: float) -> bool:
    """Whether process ``pid`` is stopped (``T`` in /proc/<pid>/stat) within ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    return True
        except (OSError, IndexError):
            return False
        time.sleep(0.01)
    return False


def _model() -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 64))


def _delta(rank: int, rnd: int, i: int, shape: torch.Size) -> torch.Tensor:
    """Rank ``rank``'s local change of parameter ``i`` in round ``rnd``: magnitudes differ per
    parameter, with an outlier every 97 elements so that int8's blocks lose precision."""
    g = torch.Generator().manual_seed(1000 * rank + 10 * rnd + i)
    d = torch.randn(shape, generator=g) * 0.01 * (i + 1)
    d.view(-1)[::97] *= 8.0
    return d


def _fedavg_native_and_gloo(rank: int, world: int, stand_in: bool) -> dict:
    from flcomm.comm.base import LinkTier
    from flcomm.federated.fedavg import FedAvg
    from flcomm.federated.topology import Topology

    t0 = time.monotonic()
    device = _setup(rank, stand_in)
    topo = Topology(2, 2, group_size=1)  # NOTE: 2 federation groups of 1 rank: the fed dim is both ranks
    out: dict = {"refused": None}
    for transport, dev in (("torch", "cpu"), ("native", device)):
        try:
            fm = init_fed_mesh(topo, dev, node_tiers=False, transport=transport, timeout=timedelta(seconds=TIMEOUT_S))
        except Exception as e:  # noqa: BLE001 - NCCL's refusal of the setup is the result
            if transport == "torch":
                raise
            return {"refused": _refusal(e, t0)}
        model = _model().to(dev)
        fed = FedAvg(model, fm, sync_every=1, codec="int8", error_feedback=True)
        fm.stats.reset()
        synced = []
        for rnd in range(ROUNDS):
            with torch.no_grad():
                for i, p in enumerate(model.parameters()):
                    p.add_(_delta(rank, rnd, i, p.shape).to(dev))
            synced.append(fed.step())
        fed.finish()
        out[transport] = {"params": [p.detach().cpu().clone() for p in model.parameters()], "synced": synced,
                          "bytes": fm.stats.bytes(LinkTier.INTER_GROUP), "fed": type(fm.transport("fed")).__name__}
        fm.close()
    out["seconds"] = time.monotonic() - t0
    return out


#: the replicate hook's cases: codec, error feedback, the gradient's dtype
HOOK_CASES = (("none", False, torch.float32), ("int8", True, torch.float32), ("int8", True, torch.bfloat16))


def _grad(rank: int, rnd: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5000 + 1000 * rank + 10 * rnd + k)
    x = torch.randn(N, generator=g) * (k + 1)
    x[::101] *= 10.0
    return x


def _hook_native_and_gloo(rank: int, world: int, stand_in: bool) -> dict:
    import torch.distributed as dist

    from flcomm.comm.base import LinkTier
    from flcomm.comm.torch_pg import TorchTransport
    from flcomm.fsdp.fsdp2 import ReplicateAllReduceHook

    t0 = time.monotonic()
    try:
        device, native = _blocking_root(rank, stand_in)
    except Exception as e:  # noqa: BLE001 - NCCL's refusal of the setup is the result
        return {"refused": _refusal(e, t0)}
    gloo = TorchTransport(dist.group.WORLD, LinkTier.INTER_NODE, timeout=timedelta(seconds=TIMEOUT_S))
    out: dict = {"refused": None}
    for name, transport, dev in (("gloo", gloo, "cpu"), ("native", native, device)):
        hooks = [ReplicateAllReduceHook(transport, codec, "avg", ef) for codec, ef, _ in HOOK_CASES]
        got = []
        for rnd in range(ROUNDS):
            for k, (_, _, dtype) in enumerate(HOOK_CASES):
                g = _grad(rank, rnd, k).to(dtype).to(dev)
                hooks[k](g)  # NOTE: in place, as FSDP2 calls it on the reduce-scatter output
                got.append(g.cpu())
        out[name] = got
    native.close()
    out["seconds"] = time.monotonic() - t0
    return out


# ---------------------------------------------------------------- the checks (both backends)
def _refused(res: list[dict]) -> str | None:
    why = [f"rank {r}: {x['refused']}" for r, x in enumerate(res) if x and x.get("refused")]
    return "; ".join(why) or None


def _run_part(fn, stand_in: bool, timeout: float, **kw) -> list[dict]:
    """``fn`` on two ranks; on the GPU, a refusal of the setup (this part's or an earlier one's)
    skips with :data:`REFUSED`, and a run that did not end is remembered for the later parts."""
    if not stand_in:
        if "refused" in _SETUP:
            pytest.skip(f"{REFUSED}: {_SETUP['refused']} (found by an earlier part; not tried again)")
        if "stuck" in _SETUP:
            pytest.skip(f"not run: the root communicator's part did not end ({_SETUP['stuck']}); the same "
                        "two-rank setup would hang here")
    try:
        res = run_distributed(fn, 2, stand_in, timeout=timeout, **kw)
    except (TimeoutError, pytest.fail.Exception) as e:  # NOTE: the harness's limit, or pytest-timeout's
        if not stand_in and fn is _root_and_splits:
            _SETUP["stuck"] = f"{type(e).__name__}: {str(e)[:200]}"
        raise
    why = _refused(res)
    if why is not None:
        assert not stand_in, f"the stand-in refused two ranks: {why}"
        _SETUP["refused"] = why
        pytest.skip(f"{REFUSED}: {why}")
    return res


def _check_root_and_splits(res: list[dict]) -> None:
    ramp = torch.arange(N, dtype=torch.float32)
    full = torch.arange(2 * N, dtype=torch.float32)
    for rank, out in enumerate(res):
        assert out["root"] == (rank, 2), out["root"]
        assert torch.equal(out["sum"], 2 * ramp + 1000.0), ("all_reduce sum", rank)
        assert torch.equal(out["avg"], torch.full((N,), (3.0 + 6.0) / 2)), ("all_reduce avg", rank)
        assert torch.equal(out["gather"], torch.cat([ramp, ramp + 1000.0])), ("all_gather", rank)
        # NOTE: chunk r of the reduce-scatter is the sum of both ranks' chunk r: (1 + 2) x
        assert torch.equal(out["reduce_scatter"], 3 * full[rank * N:(rank + 1) * N]), ("reduce_scatter", rank)
        want = torch.cat([torch.full((N,), 100.0 * j + rank) for j in range(2)])  # chunk j: rank j's chunk r
        assert torch.equal(out["all_to_all"], want), ("all_to_all", rank)
        child_rank, size, z, order = out["both"]
        assert (child_rank, size) == (1 - rank, 2), out["both"][:2]
        assert torch.equal(z, torch.full((N,), 3.0)) and order.tolist() == [1.0, 0.0], ("split, reversed", rank)
        assert out["alone"][:2] == (0, 1) and torch.equal(out["alone"][2], torch.full((N,), rank + 5.0))
        assert out["only0"] == ((0, 1) if rank == 0 else None), (rank, out["only0"])
        assert out["capped"][0] == 2 and torch.equal(out["capped"][1], torch.full((N,), 3.0)), ("capped split", rank)
        nrank, nsize, ng = out["nested"]
        # NOTE: the nested split keeps ``both``'s order: its rank 0 is global rank 1
        assert (nrank, nsize) == (1 - rank, 2) and torch.equal(ng, torch.cat([ramp + 1000.0, ramp])), ("nested", rank)


def _check_dead_peer(res: list[dict], on_gpu: bool) -> None:
    out = res[0]
    assert out["before"] == 2.0 * N, out
    assert out["frozen_seen"], "rank 1 did not stop (SIGSTOP)"
    if on_gpu:
        assert out["issue_error"] is None and out["issue_s"] < DEAD_TIMEOUT_S, \
            f"the stream-ordered all_reduce blocked the host: {out}"
    else:  # NOTE: the stand-in's host is its stream: it waits until the abort, which it reports
        assert out["issue_error"] is None or "the watchdog aborted the communicator" in out["issue_error"], out
    f = out["failure"]
    assert f is not None, f"no failure within {3 * DEAD_TIMEOUT_S} s of a frozen peer: {out}"
    assert out["detect_s"] <= 2 * DEAD_TIMEOUT_S, f"the watchdog took {out['detect_s']:.1f} s: {out}"
    assert f["is_comm_failure"] and f["tier"] == "inter_group" and f["rank"] == 0 and f["op"] == "all_reduce", f
    assert f"did not complete within {DEAD_TIMEOUT_S:g} s" in f["reason"], f
    assert out["aborted"], f"the watchdog set the failure but did not abort the communicator: {out}"
    r = out["raised"]
    assert r is not None, "raise_if_failed raised nothing on a failed transport"
    # NOTE: the failure itself, or an error naming what was waited for, raised from it
    assert r["is_comm_failure"] or r["caused_by_failure"], r
    assert out["stream_drained_s"] < DEAD_TIMEOUT_S, f"the stream did not run on after the abort: {out}"


def _exact_fedavg() -> list[torch.Tensor]:
    """The uncompressed FedAvg of both ranks' deltas: the start plus the mean change of each round."""
    params = [p.detach().clone() for p in _model().parameters()]
    for rnd in range(ROUNDS):
        for i, p in enumerate(params):
            p += (_delta(0, rnd, i, p.shape) + _delta(1, rnd, i, p.shape)) / 2
    return params


def _check_fedavg(res: list[dict]) -> None:
    exact = _exact_fedavg()
    start = [p.detach() for p in _model().parameters()]
    scale = max((e - s).abs().max().item() for e, s in zip(exact, start))
    for rank, out in enumerate(res):
        assert out["native"]["fed"] == "NcclTransport", out["native"]["fed"]
        for kind in ("torch", "native"):
            assert out[kind]["synced"] == [True] * ROUNDS, (kind, out[kind]["synced"])
        assert out["native"]["bytes"] == out["torch"]["bytes"] > 0, (out["native"]["bytes"], out["torch"]["bytes"])
        diff = [i for i, (a, b) in enumerate(zip(out["native"]["params"], out["torch"]["params"]))
                if not torch.equal(a, b)]
        assert diff == [], f"rank {rank}: parameters {diff} differ between the native and the gloo sync"
        err = max((a - e).abs().max().item() for a, e in zip(out["native"]["params"], exact))
        # NOTE: lossy (int8 ran) and within int8's stated tolerance of the exact average
        assert 0 < err <= INT8_TOL * scale, (rank, err, scale)
    for a, b in zip(res[0]["native"]["params"], res[1]["native"]["params"]):
        assert torch.equal(a, b), "the two groups hold different models after the sync"


def _check_hook(res: list[dict]) -> None:
    for rank, out in enumerate(res):
        for j, (a, b) in enumerate(zip(out["native"], out["gloo"])):
            assert a.dtype == b.dtype and torch.equal(a, b), f"rank {rank}, call {j}: native and gloo differ"
    for rnd in range(ROUNDS):
        for k, (codec, _, dtype) in enumerate(HOOK_CASES):
            j = rnd * len(HOOK_CASES) + k
            g0, g1 = _grad(0, rnd, k).to(dtype).float(), _grad(1, rnd, k).to(dtype).float()
            mean = (g0 + g1) / 2
            got = res[0]["native"][j]
            assert torch.equal(got, res[1]["native"][j]), f"call {j}: the ranks differ"
            if codec == "none":
                assert torch.equal(got, mean), f"call {j}: the exact hook is not the average"
            else:
                err = (got.float() - mean).abs().max().item()
                # NOTE: error feedback carries a round's loss into the next: two rounds' bound; a
                # bf16 gradient is rounded back to bf16 (8 bits of mantissa) after the exchange
                rel = 2 * INT8_TOL + (0.0 if dtype == torch.float32 else 2.0 ** -8)
                bound = rel * mean.abs().max().item()
                assert 0 < err <= bound, (j, codec, dtype, err, bound)


# ---------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@needs_nccl
@pytest.mark.timeout(35)
def test_root_communicator_and_splits():
    _check_root_and_splits(_run_part(_root_and_splits, False, timeout=30))


@pytest.mark.gpu
@needs_nccl
@pytest.mark.timeout(20)
def test_dead_peer_aborted_by_the_watchdog():
    _check_dead_peer(_run_part(_dead_peer, False, timeout=15, may_die=frozenset({1})), on_gpu=True)


@pytest.mark.gpu
@needs_nccl
@pytest.mark.timeout(25)
def test_fedavg_int8_error_feedback_native_matches_gloo():
    _check_fedavg(_run_part(_fedavg_native_and_gloo, False, timeout=20))


@pytest.mark.gpu
@needs_nccl
@pytest.mark.timeout(15)
def test_replicate_hook_native_matches_gloo():
    _check_hook(_run_part(_hook_native_and_gloo, False, timeout=12))


# ---------------------------------------------------------------- the same on the stand-in
def test_root_communicator_and_splits_on_the_stand_in():
    _check_root_and_splits(_run_part(_root_and_splits, True, timeout=60))


def test_dead_peer_aborted_by_the_watchdog_on_the_stand_in():
    _check_dead_peer(_run_part(_dead_peer, True, timeout=60, may_die=frozenset({1})), on_gpu=False)


def test_fedavg_int8_error_feedback_native_matches_gloo_on_the_stand_in():
    _check_fedavg(_run_part(_fedavg_native_and_gloo, True, timeout=90))


def test_replicate_hook_native_matches_gloo_on_the_stand_in():
    _check_hook(_run_part(_hook_native_and_gloo, True, timeout=60))
