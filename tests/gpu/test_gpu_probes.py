"""Probes for a lent GPU (tools/gpu_check.sh runs this file in its own step, after the GPU tests).

Each probe states its pass rule in its docstring and writes its figures with :func:`figure`
(FLCOMM_GPU_FIGURES), so a failed or a passed run says how far it was from the rule; where a
probe could pass blind, a positive control shows it can fail. In order of value:

1. real NCCL kernels: a one-rank ``all_to_all`` plans a self send/recv and launches a kernel (a
   one-rank all-reduce may launch none), for the group event, cross-stream ordering,
   SM-sharing (both streams behind one device-side gate, so host launch cost is out) and
   exchange-in-flight probes;
2. overlap end to end: an int8 + error-feedback FedAvg exchange over a stub two-rank "slow wire"
   transport on the communication stream, against a matmul loop on the main stream; and late
   exchanges, where a double count of exposed time (W3) would show, with the pre-fix count as
   the control;
3. the FSDP2 all-reduce hook race with bf16 parameters and a bf16 reduce, with a positive control;
4. kernel GB/s at 256 MiB and 1 GiB: the ``bench_kernels`` step of gpu_check (no test here);
5. FedAvg offload with bf16 parameters and fragments at k > E / K (the apply's own scratch, W2),
   bit for bit against no offload (codec none: offload changes a lossy codec's buckets), with a
   shared scratch as the control, peak memory;
6. the hook's error-feedback residual after an Inf gradient.

The slow-wire stub (tests/common/gpu_figures.py), the one-process mesh, the late-exchange
accounting, the offload comparison and the plain-torch reference of probe 6 also run on CPU (no
delay), so CI checks their plumbing.
"""

from __future__ import annotations

import time
import warnings
from datetime import timedelta

import pytest
import torch
from torch import Tensor, nn

from flcomm import _native
from flcomm.comm.base import CommStats, LinkTier, Transport
from flcomm.federated.exposure import ExposedTime, cuda_event
from tests.common.dist import run_distributed
from tests.common.gpu_figures import CYCLES_PER_S, SlowWire, figure

needs_nccl = pytest.mark.skipif(not (_native.available() and _native.native().compiled_with_nccl()),
                                reason="flcomm built without NCCL")


def C():
    return _native.native()


@pytest.fixture(scope="module")
def comm():
    c = C().NcclComm(C().nccl_unique_id(), 1, 0, 0, 60.0)
    yield c
    c.destroy()


def _ms(e0: torch.cuda.Event, e1: torch.cuda.Event) -> float:
    return e0.elapsed_time(e1)


def _event() -> torch.cuda.Event:
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


# ---------------------------------------------------------------- 1. real NCCL kernels

@needs_nccl
@pytest.mark.gpu
def test_all_to_all_group_end_records_on_the_ops_stream(comm):
    """Pass rule: a group holding one all_to_all issued on a side stream that first sleeps
    ~100 ms, closed with the idle default stream current, is NOT complete at once (its event is
    on the ops' stream, behind the sleep), and its output equals its input once waited."""
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    out = torch.zeros_like(x)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    comm.group_start()
    with torch.cuda.stream(side):
        torch.cuda._sleep(CYCLES_PER_S // 10)
        comm.all_to_all(out, x)
    w = comm.group_end()
    early = w.is_completed()
    t0 = time.monotonic()
    assert w.wait(30.0)
    waited = time.monotonic() - t0
    equal = bool(torch.equal(out, x))
    figure("test_all_to_all_group_end_records_on_the_ops_stream", completed_at_once=early, wait_s=waited, equal=equal)
    assert not early, "group_end recorded its event on the current (idle) stream, not the ops' stream"
    assert equal, "the one-rank all_to_all did not copy its input"


@needs_nccl
@pytest.mark.gpu
def test_all_to_all_cross_stream_order_and_allocator(comm):
    """Pass rule: on a side stream, ~200 ms of sleep, a fill, then the all_to_all: the output is
    the fill (the kernel ran after it on that stream), and the input, dropped with its work handle
    while the side stream still sleeps, is not handed to the next allocation of its size on the
    default stream (the launch recorded it with the caching allocator). Control: on one stream a
    freed block is handed out again."""
    n = 1 << 22
    c = torch.empty(n, device="cuda")
    cptr = c.data_ptr()
    del c
    assert torch.empty(n, device="cuda").data_ptr() == cptr, "the allocator does not reuse blocks here"
    x = torch.zeros(n, device="cuda")
    out = torch.zeros(n, device="cuda")
    ptr = x.data_ptr()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(CYCLES_PER_S // 5)
        x.fill_(3.0)
        w = comm.all_to_all(out, x)
    del x, w
    y = torch.empty(n, device="cuda")
    reused = y.data_ptr() == ptr
    torch.cuda.synchronize()
    filled = bool(torch.all(out == 3.0).item())
    figure("test_all_to_all_cross_stream_order_and_allocator", block_reused_while_in_use=reused, output_is_fill=filled)
    assert filled, "the all_to_all did not run after the fill on its stream"
    assert not reused, "the input of an all_to_all still queued on another stream was handed out again"


def _matmul_loop(a: Tensor, n: int) -> None:
    for _ in range(n):
        torch.mm(a, a)


class _Gate:
    """A device-side gate (review N11): ``gate_s`` of GPU sleep on the current stream, then the
    event ``open``. Work queued behind it (on this stream, or on a stream that :meth:`hold` made
    wait for it) starts when the sleep ends, whatever the host's launch cost, provided the host
    had issued all of it by then: :meth:`slack_ms` says by how much (call :meth:`issued` once the
    host has queued everything, and read it after a synchronize). The current stream must be
    idle when the gate is made.

    NOTE: the sleep kernel cannot start before the host launched it, so the gate opens no earlier
    than ``t0`` (host clock, just before ``start`` was recorded) plus the sleep's own time (the
    events ``start`` -> ``open``): a host done issuing within that time issued before the gate
    opened. Conservative, and it needs no third stream, which could share a hardware queue with
    the gated ones and be held behind them."""

    def __init__(self, gate_s: float) -> None:
        self.t0 = time.perf_counter()
        self.start = _event()
        torch.cuda._sleep(int(gate_s * CYCLES_PER_S))
        self.open = _event()
        self.issued_s = float("inf")

    def hold(self, stream: torch.cuda.Stream) -> None:
        stream.wait_event(self.open)

    def issued(self) -> None:
        self.issued_s = time.perf_counter() - self.t0

    def slack_ms(self) -> float:
        return _ms(self.start, self.open) - self.issued_s * 1e3


@needs_nccl
@pytest.mark.gpu
def test_all_to_all_kernels_share_the_gpu_with_compute(comm):
    """SM sharing. A run of one-rank all_to_all kernels (256 MiB each) on a communication stream
    against a bf16 matmul loop on the main stream, timed with events, each also alone. Every run
    is queued behind one device-side gate (:class:`_Gate`; review N11), so both streams start
    together when it opens and the host's launch cost (a pthread per native launch, P2) is out of
    the timings; the host's issue time per op is a figure.
    Pass rule: each gate opened after the host had issued everything behind it (else the run
    measured host launches, not the GPU); together, the two overlap in time (the overlap covers at
    least half of the shorter one), and the matmul loop takes at most 3x its time alone (NCCL's
    kernels take a few SMs, not the GPU)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    x = torch.ones(64 << 20, device="cuda")
    out = torch.empty_like(x)
    comm_stream = torch.cuda.Stream()

    def comms(k: int) -> float:
        """Queue k all_to_alls on the communication stream; the host seconds per op."""
        t0 = time.perf_counter()
        with torch.cuda.stream(comm_stream):
            for _ in range(k):
                comm.all_to_all(out, x)
        return (time.perf_counter() - t0) / k

    def matmuls(n: int) -> float:
        t0 = time.perf_counter()
        _matmul_loop(a, n)
        return (time.perf_counter() - t0) / n

    _matmul_loop(a, 3)
    comms(2)
    torch.cuda.synchronize()
    e = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    slack = {}
    gate = _Gate(0.05)  # NOTE: the matmul loop alone
    e[0].record()
    mm_issue_s = matmuls(20)
    e[1].record()
    gate.issued()
    torch.cuda.synchronize()
    mm_solo, slack["matmul_solo"] = _ms(e[0], e[1]), gate.slack_ms()
    gate = _Gate(0.05)  # NOTE: the all_to_alls alone
    gate.hold(comm_stream)
    with torch.cuda.stream(comm_stream):
        e[0].record()
    a2a_issue_s = comms(10)
    with torch.cuda.stream(comm_stream):
        e[1].record()
    gate.issued()
    torch.cuda.synchronize()
    per_a2a, slack["a2a_solo"] = _ms(e[0], e[1]) / 10, gate.slack_ms()
    # NOTE: the comms outlast the matmuls; at most 500 queued (CUDA's launch queue per stream
    # holds ~1000 launches: a full queue would block the host behind the closed gate)
    k = max(10, min(500, int(2 * mm_solo / max(per_a2a, 1e-3))))
    gate_s = 2 * (k * a2a_issue_s + 20 * mm_issue_s) + 0.05
    gate = _Gate(gate_s)
    gate.hold(comm_stream)
    with torch.cuda.stream(comm_stream):
        e[0].record()
    during_a2a_issue_s = comms(k)
    with torch.cuda.stream(comm_stream):
        e[1].record()
    e[2].record()
    _matmul_loop(a, 20)
    e[3].record()
    gate.issued()
    torch.cuda.synchronize()
    slack["together"] = gate.slack_ms()
    c0, c1, m0, m1 = (_ms(gate.open, ev) for ev in e)
    overlap = max(0.0, min(c1, m1) - max(c0, m0))
    shorter = min(c1 - c0, m1 - m0)
    mm_during = m1 - m0
    figure("test_all_to_all_kernels_share_the_gpu_with_compute", matmul_solo_ms=mm_solo, matmul_during_ms=mm_during,
           a2a_ms=per_a2a, a2a_count=k, a2a_bytes=x.numel() * 4, a2a_gbps=x.numel() * 8 / per_a2a / 1e6,
           a2a_issue_us=a2a_issue_s * 1e6, a2a_issue_during_us=during_a2a_issue_s * 1e6,
           matmul_issue_us=mm_issue_s * 1e6, gate_s=gate_s, gate_slack_ms=slack, comm_start_ms=c0,
           matmul_start_ms=m0, comm_span_ms=c1 - c0, overlap_ms=overlap, inflation=mm_during / mm_solo)
    late = {name: ms for name, ms in slack.items() if not ms > 0}
    assert not late, f"the host was still issuing when the gate opened (slack in ms {late}): the timings " \
                     f"hold host launch cost, not only the GPU's"
    assert overlap >= 0.5 * shorter, f"the NCCL kernels and the matmuls did not run together ({overlap:.1f} ms " \
                                     f"of {shorter:.1f} ms)"
    assert mm_during <= 3 * mm_solo, (mm_solo, mm_during)


@needs_nccl
@pytest.mark.gpu
def test_exchange_in_flight_does_not_block_compute():
    """Items 8/9 (transport side), on an op that moves data on one rank: a one-rank all_to_all
    (256 MiB, a self send/recv: a kernel that copies; a one-rank in-place all_reduce launches
    nothing, so the "exchange" would be no work at all). Pass rule: while the all_to_all is
    queued on a communication stream behind ~300 ms of GPU sleep, issuing it returns in < 50 ms,
    a marker matmul timed on the main stream finishes before the exchange and within 3x its time
    on an idle GPU, and once waited the output is the input (the kernel ran and moved the data)."""
    from flcomm.comm.nccl import NcclTransport

    t = NcclTransport(C().NcclComm(C().nccl_unique_id(), 1, 0, 0, 60.0), blocking_wait=False)
    a = torch.randn(4096, 4096, device="cuda")
    x = torch.arange(64 << 20, dtype=torch.float32, device="cuda")
    out = torch.zeros_like(x)

    def marker() -> float:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(5):
            a @ a
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1)

    marker()  # warm up cuBLAS
    solo_ms = marker()
    t.all_to_all(torch.empty_like(x), x)  # NOTE: warm up NCCL's self send/recv (its first launch)
    torch.cuda.synchronize()
    comm_stream = torch.cuda.Stream()
    comm_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(comm_stream):
        torch.cuda._sleep(CYCLES_PER_S * 3 // 10)
        t0 = time.monotonic()
        h = t.all_to_all(out, x, async_op=True)
        issue_s = time.monotonic() - t0
    during_ms = marker()
    exchange_done_first = h.is_completed()
    h.wait()
    torch.cuda.synchronize()
    moved = bool(torch.equal(out, x))
    t.close()
    figure("test_exchange_in_flight_does_not_block_compute", issue_s=issue_s, marker_solo_ms=solo_ms,
           marker_during_ms=during_ms, exchange_done_before_marker=exchange_done_first, output_is_input=moved)
    assert issue_s < 0.05, f"issuing the all_to_all blocked the host {issue_s:.3f} s"
    assert not exchange_done_first, "the marker waited for the exchange"
    assert during_ms < 3 * solo_ms, (solo_ms, during_ms)
    assert moved, "the one-rank all_to_all did not copy its input: the exchange in flight was no work"


# ---------------------------------------------------------------- the slow wire and a one-process mesh

class OneRank(Transport):
    """A one-rank transport: every collective leaves its result as it is (copies where the
    output is another tensor)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(0, 1, LinkTier.INTRA_NODE, CommStats(), timedelta(seconds=60))
        self._device = device

    @property
    def device(self) -> torch.device:
        return self._device

    def _all_reduce(self, t, op): return None
    def _reduce_scatter(self, o, i, op): o.copy_(i)
    def _all_gather(self, o, i): o.copy_(i)
    def _all_to_all(self, o, i): o.copy_(i)
    def _broadcast(self, t, s): return None


class OneProcessMesh:
    """Rank 0 of a federation of two one-rank groups, in one process: what FedAvg reads of a
    FedMesh, with the fed dim on ``wire`` and the (one-rank) group on :class:`OneRank`."""

    def __init__(self, wire: Transport) -> None:
        from flcomm.federated.topology import Topology

        self.topology = Topology(2, 1, group_size=1)
        self.rank = 0
        self.coords = self.topology.coords(0)
        self.timeout = timedelta(seconds=60)
        self.stats = wire.stats
        self.group_ranks = {"fed": [0, 1], "group": [0]}
        self._t = {"fed": wire, "group": OneRank(wire.device)}

    def transport(self, name: str) -> Transport:
        return self._t[name]

    def private_transport(self, name: str, dim: str) -> Transport:
        return self._t[dim]  # NOTE: the one-rank group has nothing to interleave with

    def global_ranks(self, ranks):
        return list(ranks)

    def exchange_replicate_transport(self, sharded, elastic=False):
        return None  # NOTE: one-rank groups: one replica, nothing to shard the exchange over

    def native_transports(self) -> list[Transport]:
        return []  # NOTE: no native communicator, as a torch mesh: nothing a watchdog aborts


class Params(nn.Module):
    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(s, generator=g).to(device, dtype)) for s in shapes)


def _train_step(model: Params, step: int) -> None:
    """A deterministic local update (the same on every run): p += 1e-2 * noise(step)."""
    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in model.ps:
            p.add_((torch.randn(p.shape, generator=g) * 1e-2).to(p.device, p.dtype))


def test_slow_wire_fedavg_plumbing_on_cpu():
    """The probes' stub on CPU: FedAvg (int8, error feedback, overlap) runs over SlowWire and the
    one-process mesh, in >= 8 buckets, and the exact exchange of two mirrors leaves the model as
    plain local training would (avg of identical deltas = own delta)."""
    from flcomm.federated.fedavg import FedAvg

    dev = torch.device("cpu")
    shapes = [(1 << 14,)] * 8 + [(3, 1001)]
    model = Params(shapes, torch.float32, dev)
    fed = FedAvg(model, OneProcessMesh(SlowWire(dev)), sync_every=2, codec="int8", error_feedback=True,
                 overlap_steps=2, bucket_cap_mb=0.0625)
    assert fed._exchange.bar.num_buckets >= 8
    for t in range(1, 7):
        _train_step(model, t)
        fed.step()
    fed.finish()
    assert fed.num_syncs == 3
    exact = Params(shapes, torch.float32, dev)
    ref = Params(shapes, torch.float32, dev)
    fe = FedAvg(exact, OneProcessMesh(SlowWire(dev)), sync_every=2, overlap_steps=2, bucket_cap_mb=0.0625)
    for t in range(1, 7):
        _train_step(exact, t)
        _train_step(ref, t)
        fe.step()
    fe.finish()
    for a, b in zip(exact.ps, ref.ps):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


class HostAndEvents(ExposedTime):
    """FedAvg's accounting of exposed time (:class:`~flcomm.federated.exposure.ExposedTime`, put
    in as ``fed._exposure`` and its fragments' links) that also sums each window's host seconds in ``host_s``: with them
    added to the events (CUDA), it is the count before the fix of W3, which counted a late
    exchange that the host waited for twice (the probes' positive control)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(events=device.type == "cuda", new_event=lambda: cuda_event(device))
        self.host_s = 0.0

    def end(self, token: tuple) -> None:
        self.host_s += time.perf_counter() - token[0]
        super().end(token)


def _late_exchanges(dev: torch.device) -> dict:
    """FedAvg (codec none, overlap k = 1, E = 2, 8 buckets) over a slow wire that blocks the host
    (10 ms per collective, ``host_wait``: the job ends on the host when its collectives end),
    against ~10 ms compute steps (CUDA), so each apply waits most of an exchange on the host.
    Events time each fed.step() / finish() on the main stream (the stall). Step 1 (its barriers,
    inside the stall but no exchange) runs before the count is reset."""
    from flcomm.federated.fedavg import FedAvg

    cuda = dev.type == "cuda"
    wire = SlowWire(dev, delay_s=0.01 if cuda else 0.0, host_wait=True)
    model = Params([(1 << 18,)] * 8, torch.float32, dev)
    fed = FedAvg(model, OneProcessMesh(wire), sync_every=2, overlap_steps=1, bucket_cap_mb=1.0)
    exposure = fed._exposure = fed._links.exposure = HostAndEvents(dev)
    n_mm, a = 0, None
    if cuda:
        a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
        _matmul_loop(a, 10)
        e0 = _event()
        _matmul_loop(a, 20)
        e1 = _event()
        torch.cuda.synchronize()
        n_mm = max(1, int(10.0 / (_ms(e0, e1) / 20)))

    def compute() -> None:
        if cuda:
            _matmul_loop(a, n_mm)
            _event().synchronize()  # NOTE: as a loop that reads its loss
        _train_step_gpu(model)

    compute()
    fed.step()  # NOTE: step 1: the first step's barriers; no sync
    if cuda:
        torch.cuda.synchronize()
    fed.exposed_comm_s = 0.0
    exposure.host_s = 0.0
    wire.intervals.clear()
    stalls = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2, 10):  # NOTE: syncs start at 2, 4, 6, 8 and are applied one step later
            compute()
            s = _event() if cuda else time.perf_counter()
            fed.step()
            stalls.append((s, _event() if cuda else time.perf_counter()))
        s = _event() if cuda else time.perf_counter()
        fed.finish()
        stalls.append((s, _event() if cuda else time.perf_counter()))
    if cuda:
        torch.cuda.synchronize()
        stall_s = sum(_ms(*p) for p in stalls) / 1e3
    else:
        stall_s = sum(t1 - t0 for t0, t1 in stalls)
    exposed = fed.exposed_comm_s
    busy_s = sum(_ms(*iv) for g in wire.intervals for iv in g) / 1e3 if cuda else 0.0
    return {"buckets": fed._exchange.bar.num_buckets, "num_syncs": fed.num_syncs, "wire_busy_s": busy_s,
            "stall_events_s": stall_s, "fedavg_exposed_comm_s": exposed, "host_window_s": exposure.host_s,
            "pre_fix_count_s": exposed + exposure.host_s,
            "late_warning": any("still running" in str(w.message) for w in caught)}


def test_late_exchange_accounting_plumbing_on_cpu():
    """The CPU twin of :func:`test_exposed_time_counts_a_late_exchange_once`: FedAvg counts its
    windows through the recorder put in (host seconds on CPU, so both counts agree), 4 syncs."""
    res = _late_exchanges(torch.device("cpu"))
    assert res["num_syncs"] == 4 and res["buckets"] == 8, res
    assert res["host_window_s"] > 0, f"FedAvg did not count through the recorder: {res}"
    assert res["fedavg_exposed_comm_s"] == pytest.approx(res["host_window_s"], rel=0.05, abs=1e-4), res
    assert res["fedavg_exposed_comm_s"] <= res["stall_events_s"], res


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_exposed_time_counts_a_late_exchange_once():
    """W3, the case that tells a double count apart: exchanges that are late (:func:`_late_exchanges`:
    the host waits for each inside FedAvg's apply window, and the idle compute stream shows the
    same wait), so the pre-fix count (host seconds + events) is about twice the stall and a count
    once about the stall.
    Pass rule: 4 syncs; the exchanges were late (the stall >= half the wire's busy time); the
    positive control: the pre-fix count > 1.2 stall + 1 ms (this run tells the counts apart);
    FedAvg's exposed_comm_s within [0.8 stall - 2 ms, 1.2 stall + 1 ms] (FedAvg's windows lie
    inside the stall's on one stream: what they leave out is host work of a few launches)."""
    res = _late_exchanges(torch.device("cuda", torch.cuda.current_device()))
    figure("test_exposed_time_counts_a_late_exchange_once", **res)
    stall, exposed = res["stall_events_s"], res["fedavg_exposed_comm_s"]
    assert res["num_syncs"] == 4, res
    assert stall >= 0.5 * res["wire_busy_s"] > 0, f"the exchanges were not late: the probe tests nothing {res}"
    assert res["pre_fix_count_s"] > 1.2 * stall + 0.001, f"the control: a double count passes the bound {res}"
    assert 0.8 * stall - 0.002 <= exposed <= 1.2 * stall + 0.001, res


# ---------------------------------------------------------------- 2. overlap end to end

@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_fedavg_overlap_end_to_end_on_the_comm_stream():
    """An int8 + error-feedback FedAvg exchange (overlap, k = E = 4 steps, >= 8 buckets) over the
    slow wire (3 ms of GPU sleep per collective on the engine's communication stream) while the
    main stream runs a bf16 matmul loop of ~40 ms per step, the host waiting for each step's end.
    Events time: each compute step, each fed.step() on the main stream (the stall), each
    collective on the wire. Closest to a two-rank run: the peer is this rank's mirror (SlowWire).

    Figures: compute-step inflation (steps with exchanges in flight / steps alone), the wire's
    idle fraction between buckets (per exchange, 1 - wire busy / wire span; the first exchange,
    which allocates, left out), FedAvg's exposed_comm_s against the stall the events measured,
    and the count before W3's fix (each window's host seconds added to its events).
    Pass rule: all 4 exchanges applied; inflation <= 1.5; the stall <= half the wire's busy time
    (the exchange is mostly hidden); exposed_comm_s within [stall / 2 - 5 ms, 1.2 stall + 1 ms]
    (FedAvg's windows lie inside the stall's, on the same stream, so a count once is at most the
    stall; :func:`test_exposed_time_counts_a_late_exchange_once` is the case that tells a double
    count apart)."""
    from flcomm.federated.fedavg import FedAvg

    dev = torch.device("cuda", torch.cuda.current_device())
    wire = SlowWire(dev, delay_s=0.003)
    model = Params([(1 << 20,)] * 12, torch.float32, dev)
    fed = FedAvg(model, OneProcessMesh(wire), sync_every=4, codec="int8", error_feedback=True,
                 overlap_steps=4, bucket_cap_mb=4.0)
    buckets = fed._exchange.bar.num_buckets
    exposure = fed._exposure = fed._links.exposure = HostAndEvents(dev)
    wire.intervals.clear()  # NOTE: the construction's peer check and broadcast are no exchange
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    _matmul_loop(a, 10)
    e0 = _event()
    _matmul_loop(a, 20)
    e1 = _event()
    torch.cuda.synchronize()
    n_mm = max(1, int(40.0 / (_ms(e0, e1) / 20)))

    def compute() -> tuple:
        s = _event()
        _matmul_loop(a, n_mm)
        e = _event()
        e.synchronize()  # NOTE: as a loop that reads its loss: host time in fed.step() is a GPU stall
        return s, e

    solo = [compute() for _ in range(6)][2:]
    fed.exposed_comm_s = 0.0
    exposure.host_s = 0.0
    steps, stalls = [], []
    for _ in range(1, 20):  # NOTE: syncs at 4, 8, 12, 16; the last one has 3 steps before finish()
        steps.append(compute())
        _train_step_gpu(model)
        s = _event()
        fed.step()
        stalls.append((s, _event()))
    s = _event()
    fed.finish()
    stalls.append((s, _event()))
    torch.cuda.synchronize()
    exposed = fed.exposed_comm_s
    solo_ms = sum(_ms(*p) for p in solo) / len(solo)
    step_ms = sum(_ms(*p) for p in steps[4:]) / len(steps[4:])  # NOTE: from the first exchange on
    stall_s = sum(_ms(*p) for p in stalls) / 1e3
    exchanges = [g for g in wire.intervals if g]
    busy_s = sum(_ms(*iv) for g in exchanges for iv in g) / 1e3
    idle = []
    for g in exchanges[1:]:
        span = _ms(g[0][0], g[-1][1])
        idle.append(1 - sum(_ms(*iv) for iv in g) / span if span > 0 else 0.0)
    res = {"buckets": buckets, "exchanges": len(exchanges), "collectives_per_exchange": [len(g) for g in exchanges],
           "num_syncs": fed.num_syncs, "matmuls_per_step": n_mm, "step_solo_ms": solo_ms, "step_during_ms": step_ms,
           "inflation": step_ms / solo_ms, "wire_busy_s": busy_s, "wire_idle_fraction": idle,
           "stall_events_s": stall_s, "fedavg_exposed_comm_s": exposed,
           "pre_fix_count_s": exposed + exposure.host_s}
    figure("test_fedavg_overlap_end_to_end_on_the_comm_stream", **res)
    assert buckets >= 8, res
    assert fed.num_syncs == 4, res
    assert res["inflation"] <= 1.5, res
    assert stall_s <= 0.5 * busy_s, res
    assert stall_s / 2 - 0.005 <= exposed <= 1.2 * stall_s + 0.001, res


def _train_step_gpu(model: Params) -> None:
    with torch.no_grad():
        for p in model.ps:
            p.add_(1e-3)


# ---------------------------------------------------------------- 3. the FSDP2 hook race, bf16

def _fsdp_bf16_race(rank: int, world: int) -> dict:
    """Child process (1-rank NCCL group): FSDP2 with param_dtype=bf16 and reduce_dtype=bf16 (the
    reduce output is then cast to the fp32 gradient and freed, so the next reduce-scatter can get
    its block), a ReplicateAllReduceHook per module that also halves the buffer after a ~50 ms GPU
    sleep on the hook's stream; three runs: no sleep (reference), sleep, and sleep with
    Tensor.record_stream turned off inside the hook (the positive control)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from flcomm.comm.torch_pg import TorchTransport
    from flcomm.fsdp.fsdp2 import ReplicateAllReduceHook

    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (1,))
    transport = TorchTransport(tier="inter_node")

    class ScaleHook(ReplicateAllReduceHook):
        sleep_cycles = 0

        def __call__(self, reduce_output):
            super().__call__(reduce_output)
            if self.sleep_cycles:
                torch.cuda._sleep(self.sleep_cycles)
            reduce_output.mul_(0.5)

    class SleepyHook(ScaleHook):
        sleep_cycles = CYCLES_PER_S // 20

    class NoRecordHook(SleepyHook):
        def __call__(self, reduce_output):
            keep = torch.Tensor.record_stream
            torch.Tensor.record_stream = lambda *a, **k: None  # NOTE: the hook's own call off
            try:
                super().__call__(reduce_output)
            finally:
                torch.Tensor.record_stream = keep

    def grads(hook_cls) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for layer in model:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_all_reduce_hook(hook_cls(transport))
        x = torch.randn(256, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        for _ in range(3):
            model.zero_grad()
            model(x).float().pow(2).mean().backward()
        torch.cuda.synchronize()
        return [p.grad.full_tensor().cpu() for p in model.parameters()]

    ref, got, ctl = grads(ScaleHook), grads(SleepyHook), grads(NoRecordHook)

    def differ(xs):
        return [i for i, (a, b) in enumerate(zip(ref, xs)) if not torch.equal(a, b)]

    return {"params": len(ref), "differ": differ(got), "control_differ": differ(ctl),
            "grad_dtype": str(ref[0].dtype)}


@needs_nccl
@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_fsdp2_hook_race_with_a_bf16_reduce():
    """Pass rule: with the hook's record_stream every gradient equals the reference run (same
    hook, no sleep) bit for bit; the positive control (record_stream off) differs in at least one
    gradient, so the probe can see the race it guards against."""
    (res,) = run_distributed(_fsdp_bf16_race, 1, timeout=150, backend="nccl")
    figure("test_fsdp2_hook_race_with_a_bf16_reduce", **res)
    assert res["params"] == 16 and res["differ"] == [], res
    assert res["control_differ"], f"the control without record_stream did not race: the probe is blind here {res}"


def _fsdp_hook_race(rank: int, world: int) -> dict:
    """Child process (1-rank NCCL group): FSDP2 with param_dtype=bf16, reduce_dtype=fp32 and a
    ReplicateAllReduceHook per module that also halves the buffer, with and without a ~20 ms GPU
    sleep inside each hook call (on the hook's stream): the gradients must be identical."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from flcomm.comm.torch_pg import TorchTransport
    from flcomm.fsdp.fsdp2 import ReplicateAllReduceHook

    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (1,))
    transport = TorchTransport(tier="inter_node")

    # NOTE: on one rank the all-reduce changes nothing, so each hook then scales the buffer in
    # place: a buffer reused by the next reduce-scatter while the (slow) hook still runs would
    # show in the gradients.
    calls = {"n": 0}

    class ScaleHook(ReplicateAllReduceHook):
        sleep_cycles = 0

        def __call__(self, reduce_output):
            calls["n"] += 1
            super().__call__(reduce_output)
            if self.sleep_cycles:
                torch.cuda._sleep(self.sleep_cycles)
            reduce_output.mul_(0.5)

    class SleepyHook(ScaleHook):
        sleep_cycles = CYCLES_PER_S // 50

    def grads(hook_cls) -> list[torch.Tensor]:
        """The gradients after 3 steps with ``hook_cls`` on every FSDP module (None: no hook)."""
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)]).cuda()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        for m in model.modules():
            if isinstance(m, FSDPModule) and hook_cls is not None:
                m.set_all_reduce_hook(hook_cls(transport))
        x = torch.randn(64, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        for _ in range(3):
            model.zero_grad()
            model(x).float().pow(2).mean().backward()
        torch.cuda.synchronize()
        return [p.grad.full_tensor().cpu() for p in model.parameters()]

    # NOTE: the positive control (review D16): without a hook every gradient is twice the
    # hooked one (x0.5 is exact in fp32), so a hook that FSDP skipped cannot pass as equal
    plain = grads(None)
    ref = grads(ScaleHook)
    ref_calls = calls["n"]
    got = grads(SleepyHook)
    diff = [i for i, (a, b) in enumerate(zip(ref, got)) if not torch.equal(a, b)]
    unhooked = [i for i, (a, b) in enumerate(zip(ref, plain)) if not torch.equal(a * 2, b)]
    return {"params": len(ref), "differ": diff, "not_halved": unhooked,
            "hook_calls": [ref_calls, calls["n"] - ref_calls]}


@needs_nccl
@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_fsdp2_hook_with_mixed_precision_and_a_slow_hook():
    """Item 5. Pass rule: every gradient equals the reference run (same hook, no sleep), the hook
    ran on every layer at every step, as often in both runs, and the
    reference's gradients are half the hook-less run's (the hook's effect seen)."""
    (res,) = run_distributed(_fsdp_hook_race, 1, timeout=150, backend="nccl")
    figure("test_fsdp2_hook_with_mixed_precision_and_a_slow_hook", **res)
    assert res["params"] == 16 and res["differ"] == [] and res["not_halved"] == [], res
    # NOTE: 8 layers with parameters x 3 steps at least (the root holds none of its own)
    assert res["hook_calls"][0] == res["hook_calls"][1] >= 24, res


# ---------------------------------------------------------------- 5. offload, bf16, fragments

STAGE_SLEEP_S = 0.002  # offload probe: GPU sleep after each piece staged into the exchange's scratch


def _slow_staging(exchange, cycles: int) -> None:
    """Hold each piece an offloaded exchange stages into its scratch there for ``cycles`` of GPU
    sleep (on the job's stream) before it is used: the scratch is then in use for most of the
    job, so an apply that wrote it from the main stream meanwhile (W2) corrupts the job's
    pieces for certain, not by the luck of the timing. Changes no value; no-op on CPU."""
    stage = exchange._stage

    def slow(home, s, flat):
        dev = stage(home, s, flat)
        if dev.is_cuda and exchange.offload:
            torch.cuda._sleep(cycles)
        return dev

    exchange._stage = slow


def _offload_run(offload: str | None, dev: torch.device, shared_apply_scratch: bool = False) -> dict:
    """FedAvg over the slow wire (no delay) with bf16 parameters, two fragments, Nesterov and
    overlap k = 2 > E / K = 1, 8 steps; codec none (see :func:`test_offload_bf16_fragments_bit_for_bit`).
    With k > E / K each fragment's apply meets the other fragment's exchange in flight, so an
    offloaded apply stages through a scratch of its own (``apply_scratch``; review W2);
    ``shared_apply_scratch`` turns that off (the positive control: the apply then writes the
    scratch the other fragment's job stages through)."""
    from flcomm.federated.fedavg import FedAvg

    shapes = [(1 << 18,)] * 6 + [(3, 100_001), (257,)]
    model = Params(shapes, torch.bfloat16, dev)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev) if cuda else 0
    fed = FedAvg(model, OneProcessMesh(SlowWire(dev)), sync_every=2, fragments=2, codec="none", outer="nesterov",
                 overlap_steps=2, bucket_cap_mb=1.0, offload=offload)
    exchanges = [fr.exchange for fr in fed._frags]
    apply_scratch = [ex.apply_scratch for ex in exchanges]
    for ex in exchanges:
        if shared_apply_scratch:
            ex.apply_scratch = False
        _slow_staging(ex, int(STAGE_SLEEP_S * CYCLES_PER_S))
    for t in range(1, 9):
        _train_step(model, t)
        fed.step()
    fed.finish()
    if cuda:
        torch.cuda.synchronize()
    return {"params": [p.detach().cpu() for p in model.ps], "anchors": [a.cpu() for a in fed._anchor],
            "momentum": [b.cpu() for b in fed._outer.buffers], "syncs": fed.num_syncs, "mem": fed.memory_stats(),
            "apply_scratch": apply_scratch,
            "peak": torch.cuda.max_memory_allocated(dev) - base if cuda else None}


def _same(a: dict, b: dict) -> dict[str, bool]:
    return {k: len(a[k]) > 0 and all(torch.equal(x, y) for x, y in zip(a[k], b[k]))
            for k in ("params", "anchors", "momentum")}


def _offload_equal(dev: torch.device) -> tuple[dict, dict, dict]:
    on_dev, off = _offload_run(None, dev), _offload_run("cpu", dev)
    return _same(on_dev, off), on_dev, off


def test_offload_bf16_fragments_bit_for_bit_on_cpu():
    """The CPU twin of the probe below (host and device are one memory; the same staged path),
    also at k = 2 > E / K, where the offloaded apply takes its own scratch."""
    equal, on_dev, off = _offload_equal(torch.device("cpu"))
    assert off["syncs"] == on_dev["syncs"] == 8
    assert off["apply_scratch"] == [True, True], off["apply_scratch"]
    assert all(equal.values()), equal


@pytest.mark.gpu
@pytest.mark.timeout(150)
def test_offload_bf16_fragments_bit_for_bit():
    """FedAvg with bf16 parameters, two fragments, Nesterov, overlap k = 2 > E / K = 1 (each
    apply meets the other fragment's exchange in flight: W2), over the slow wire (no delay), 8
    steps, with offload="cpu" (anchors, local-at-sync copies, momentum in pinned host memory) and
    without; each staged piece held in the scratch ~2 ms (:func:`_slow_staging`). Codec none,
    not int8 + error feedback as first asked: offload shrinks the buckets so that a bucket's
    device buffers fit in two buckets, which moves the int8 blocks and chunk boundaries, so lossy
    runs differ by their quantization error by design.
    Pass rule: the offloaded apply takes its own scratch; parameters, anchors and momentum bit
    for bit equal; the positive control (offloaded, the apply through the exchanges' shared
    scratch) differs in one of them, so the probe can see the race; the offloaded run's peak
    device memory above the model (torch.cuda.max_memory_allocated) is below the device run's."""
    dev = torch.device("cuda", torch.cuda.current_device())
    equal, on_dev, off = _offload_equal(dev)
    ctl = _same(on_dev, _offload_run("cpu", dev, shared_apply_scratch=True))
    figure("test_offload_bf16_fragments_bit_for_bit", equal=equal, control_equal=ctl,
           apply_scratch=off["apply_scratch"], peak_device_bytes=on_dev["peak"], peak_offload_bytes=off["peak"],
           syncs=off["syncs"], mem_offload=off["mem"], mem_device=on_dev["mem"])
    assert off["syncs"] == on_dev["syncs"] == 8, (off["syncs"], on_dev["syncs"])
    assert off["apply_scratch"] == [True, True], f"k > E / K but the apply shares the scratch: {off['apply_scratch']}"
    assert all(equal.values()), equal
    assert not all(ctl.values()), f"the control (a shared scratch) did not race: the probe is blind here {ctl}"
    assert off["peak"] < on_dev["peak"], (off["peak"], on_dev["peak"])


# ---------------------------------------------------------------- 6. the residual after an Inf gradient

def _mirror_ref(x: Tensor, residual: Tensor, fmt: str, block: int) -> tuple[Tensor, Tensor]:
    """Plain torch (flcomm.ops.quant's *_ref twins): compressed_all_reduce's avg with error feedback
    as rank 0 of two ranks whose peer is its mirror (SlowWire). On two ranks it is one all-gather
    (flcomm.collectives.compressed.gathers): the whole tensor is encoded once with the residual,
    both ranks' encodings (the same) are gathered, and the result is the first decoded, the
    second added, divided by 2. Returns (result, new residual)."""
    from flcomm.ops import quant

    r = residual.clone()
    q = torch.empty(quant.encoded_nbytes(x.numel(), fmt, block), dtype=torch.uint8)
    quant.quantize_error_feedback_ref(x, r, q, fmt=fmt, block_size=block)
    out = torch.empty(x.numel())
    quant.dequantize_ref(q, out, fmt=fmt, block_size=block)
    quant.dequantize_ref(q, out, fmt=fmt, block_size=block, accumulate=True)
    return out.div_(2), r


def test_mirror_reference_is_the_hook_on_cpu():
    """The plain-torch reference of the probe below against the hook on CPU, finite gradients
    only (the Inf case is the lead's CPU test): result and residual bit for bit, three rounds."""
    from flcomm.codecs import get_codec
    from flcomm.fsdp.fsdp2 import ReplicateAllReduceHook

    codec = get_codec("int8")
    hook = ReplicateAllReduceHook(SlowWire(torch.device("cpu")), codec="int8", error_feedback=True)
    g = torch.Generator().manual_seed(0)
    r = torch.zeros(64 * codec.block_size)
    for _ in range(3):
        x = torch.randn(r.numel(), generator=g)
        want, r = _mirror_ref(x, r, codec.fmt, codec.block_size)
        got = x.clone()
        hook(got)
        assert torch.equal(got, want) and torch.equal(hook.residual, r)


@pytest.mark.gpu
def test_hook_residual_is_finite_again_after_an_inf_gradient():
    """The FSDP2 all-reduce hook (int8, error feedback) called directly on CUDA reduce outputs,
    over the two-rank slow wire without delay (closest to FSDP2 calling it that needs no second
    GPU; a one-rank transport would skip the codec and the residual): a gradient with an Inf,
    then two finite ones.
    Pass rule: the residual is finite after the first finite gradient, and after the second the
    hook's result and residual equal a plain-torch computation from the residual it started from
    (:func:`_mirror_ref`), bit for bit."""
    from flcomm.codecs import get_codec
    from flcomm.fsdp.fsdp2 import ReplicateAllReduceHook

    dev = torch.device("cuda", torch.cuda.current_device())
    codec = get_codec("int8")
    hook = ReplicateAllReduceHook(SlowWire(dev), codec="int8", error_feedback=True)
    g = torch.Generator().manual_seed(0)
    n = 64 * codec.block_size  # NOTE: two chunks of whole blocks: no padding
    grads = [torch.randn(n, generator=g).to(dev) for _ in range(3)]
    grads[0][5] = float("inf")
    finite_after = []
    for x in grads[:2]:
        hook(x.clone())
        finite_after.append(bool(torch.isfinite(hook.residual).all()))
    r_before = hook.residual.clone()
    out = grads[2].clone()
    hook(out)
    # NOTE: on CPU: the torch ops the CPU kernels are checked against bit for bit
    ref_out, ref_r = _mirror_ref(grads[2].cpu(), r_before.cpu(), codec.fmt, codec.block_size)
    got_r, got_out = hook.residual.cpu(), out.cpu()
    figure("test_hook_residual_is_finite_again_after_an_inf_gradient", finite_after_inf=finite_after[0],
           finite_after_next=finite_after[1], residual_max_diff=float((got_r - ref_r).abs().max()),
           out_max_diff=float((got_out - ref_out).abs().max()))
    assert finite_after[1], "the error-feedback residual stayed non-finite after a finite gradient"
    assert torch.equal(got_r, ref_r), "the residual after a finite step differs from plain torch"
    assert torch.equal(got_out, ref_out), "the hook's result differs from plain torch"


@pytest.mark.gpu
def test_elastic_snapshot_does_not_block_the_host_and_restores_the_round_inputs():
    """P7: an elastic round's snapshot of CUDA tensors is queued on the current stream (pinned
    host copies), not a host sync per round; restore() waits for it and writes the inputs back."""
    from flcomm.federated.elastic import snapshot

    a = torch.randn(1 << 20, device="cuda")
    b = torch.randn(1 << 16, device="cuda").to(torch.bfloat16)
    want = [a.clone(), b.clone()]
    torch.cuda.synchronize()
    torch.cuda._sleep(int(CYCLES_PER_S))  # ~1 s of a busy stream ahead of the copies
    restore = snapshot([a, b])
    still_busy = not torch.cuda.current_stream().query()
    a.mul_(-2)  # the round changes its inputs after the snapshot, on the same stream
    b.add_(3)
    restore()
    torch.cuda.synchronize()
    assert still_busy, "snapshot() waited for the stream: a host sync per elastic round"
    assert torch.equal(a, want[0]) and torch.equal(b, want[1])
