"""Host-side rules of the native NCCL communicator, checked without a GPU.

NCCL's group calls (ncclGroupStart / ncclGroupEnd with nothing queued) need no device, and
``flcomm._C._testing.unattached_comm`` is a communicator with no ncclComm behind it: the group
bookkeeping, the refusals inside an open group, abort and the reduction flcomm issues all run here.
What needs a live communicator is in tests/gpu/test_nccl_gpu.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

from flcomm import _native
from flcomm.comm.nccl import NcclTransport, check_no_open_group, open_group_depth

pytestmark = pytest.mark.skipif(
    not (_native.available() and _native.native().compiled_with_nccl()),
    reason="flcomm._C " + ("built without NCCL" if _native.available()
                           else f"not built: {_native.unavailable_reason()}"))


def C():
    return _native.native()


def T():
    return _native.native()._testing


@pytest.fixture
def clean_thread():
    """Every test starts and must end outside any NCCL group on this thread."""
    assert open_group_depth() == 0 and not T().nccl_thread_in_group()
    yield
    assert open_group_depth() == 0, "a test left an flcomm group open"
    assert not T().nccl_thread_in_group(), "a test left this thread inside an NCCL group"


def test_avg_on_one_rank_is_issued_as_sum():
    """Item 2: avg over one rank is the input (the mean of one value), so flcomm issues it as sum,
    which NCCL runs as a copy for every dtype; NCCL's own one-rank avg is a PreMulSum kernel
    that NCCL's host code lacks for fp8. On more ranks avg stays NCCL's avg."""
    x = torch.randn(64, dtype=torch.float64)
    assert torch.equal(torch.stack([x]).mean(0), torch.stack([x]).sum(0))  # the identity relied on
    assert T().nccl_reduction("avg", 1) == "sum"
    for n in (2, 3, 8):
        assert T().nccl_reduction("avg", n) == "avg"
    for n in (1, 2):
        for op in ("sum", "max", "min"):
            assert T().nccl_reduction(op, n) == op
    with pytest.raises(RuntimeError, match="op must be one of sum, avg, max, min; got 'prod'"):
        T().nccl_reduction("prod", 1)


def test_group_end_on_an_aborted_communicator_leaves_the_nccl_group(clean_thread):
    """Item 6: a communicator aborted inside a group: group_end() reports the abort, and the
    thread has left NCCL's group (before, it raised before ncclGroupEnd, and every later NCCL call
    on the thread, torch's too, was deferred into a group that never ends)."""
    comm = T().unattached_comm(0, 1)
    comm.group_start()
    comm.group_start()
    assert open_group_depth() == 2 and T().nccl_thread_in_group()
    comm.abort()
    assert comm.is_aborted
    with pytest.raises(RuntimeError, match="was aborted"):
        comm.group_end()  # inner
    assert open_group_depth() == 1 and T().nccl_thread_in_group()
    with pytest.raises(RuntimeError, match=r"was aborted \(abort\(\) was called\)"):
        comm.group_end()  # outermost
    assert open_group_depth() == 0
    assert not T().nccl_thread_in_group(), "group_end left the thread inside NCCL's group"
    with pytest.raises(RuntimeError, match="was aborted"):
        comm.group_start()  # refused before ncclGroupStart: nothing to close
    assert not T().nccl_thread_in_group()


def test_inside_a_group_other_communicators_and_nccl_setup_are_refused(clean_thread):
    """Item 11: inside an open group, another communicator's ops and group, and the calls NCCL
    would fold into the group (init, split, destroy), are refused before anything is issued."""
    a, b = T().unattached_comm(0, 1), T().unattached_comm(0, 2)
    a.group_start()
    try:
        with pytest.raises(RuntimeError, match="another communicator"):
            b.group_start()
        with pytest.raises(RuntimeError, match="another communicator"):
            b.all_reduce(torch.zeros(4), "sum")
        with pytest.raises(RuntimeError, match="another communicator"):
            b.all_to_all(torch.zeros(4), torch.zeros(4))
        for call, what in ((lambda: b.destroy(), "NcclComm.destroy"), (lambda: a.destroy(), "NcclComm.destroy"),
                           (lambda: a.split(0, 0), "NcclComm.split"),
                           (lambda: C().NcclComm(C().nccl_unique_id(), 1, 0, 0, 5.0), "NcclComm init")):
            with pytest.raises(RuntimeError, match=f"{what}: not allowed while a group_start"):
                call()
        assert not b.is_destroyed and not a.is_destroyed
        with pytest.raises(RuntimeError, match="belongs to another communicator"):
            b.group_end()
        assert open_group_depth() == 1
    finally:
        a.abort()
        with pytest.raises(RuntimeError, match="was aborted"):
            a.group_end()
    b.abort()
    b.destroy()  # after an abort: only the flag
    assert b.is_destroyed


def test_open_groups_are_per_thread_and_readable_from_python(clean_thread):
    """Item 11: the open-group depth is the calling thread's; check_no_open_group refuses on the
    thread with the group and passes on another one."""
    comm = T().unattached_comm(0, 1)
    seen: dict = {}

    def other() -> None:
        seen["depth"] = open_group_depth()
        try:
            check_no_open_group("torch all_reduce")
            seen["refused"] = False
        except RuntimeError:
            seen["refused"] = True

    comm.group_start()
    try:
        with pytest.raises(RuntimeError, match="torch all_reduce: 1 flcomm NCCL group"):
            check_no_open_group("torch all_reduce")
        t = threading.Thread(target=other)
        t.start()
        t.join(30)
        assert seen == {"depth": 0, "refused": False}, seen
    finally:
        comm.abort()
        with pytest.raises(RuntimeError, match="was aborted"):
            comm.group_end()
    check_no_open_group("after the group")  # passes


def test_transport_group_refuses_blocking_collectives_and_always_closes(clean_thread):
    """A blocking collective inside NcclTransport.group() would wait for a launch that happens
    only at the group's end: refused before anything is issued; the block's error is the one
    raised, and the group is closed."""
    t = NcclTransport(T().unattached_comm(0, 2), device=torch.device("cpu"))
    x = torch.zeros(4)
    for call in (lambda: t.all_reduce(x), lambda: t.all_gather(torch.zeros(8), x),
                 lambda: t.reduce_scatter(torch.zeros(2), x), lambda: t.all_to_all(torch.zeros(4), x),
                 lambda: t.broadcast(x)):
        with pytest.raises(RuntimeError, match="async_op=True"):
            with t.group():
                assert open_group_depth() == 1
                call()
        assert open_group_depth() == 0 and not T().nccl_thread_in_group()
    assert t.stats.tiers[t.tier].calls == 0, "a refused collective was counted"


def test_torch_nccl_collectives_are_refused_inside_an_open_group(clean_thread):
    """Item 11, torch's side: flcomm's transports over torch's NCCL process groups refuse to
    issue while an flcomm group is open on the thread (the collective would join it). A gloo
    group stands in for NCCL's (``_stream_wait`` is what marks an NCCL transport)."""
    from datetime import timedelta

    import torch.distributed as dist

    from flcomm.comm.torch_pg import ProcessGroupTransport

    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
    t = ProcessGroupTransport(pg, [0], "gloo")
    t._stream_wait = True
    comm = T().unattached_comm(0, 1)
    comm.group_start()
    try:
        with pytest.raises(RuntimeError, match=r"ProcessGroupTransport.all_reduce on torch's NCCL process group: "
                                               r"1 flcomm NCCL group\(s\) are open on this thread"):
            t.all_reduce(torch.ones(4), async_op=True)
        assert t.stats.tiers[t.tier].calls == 0
    finally:
        comm.abort()  # NOTE: no ncclComm behind it: abort, then group_end closes NCCL's group
        with pytest.raises(RuntimeError, match="was aborted"):
            comm.group_end()
    t._stream_wait = False  # NOTE: gloo's work is waited on the host
    assert torch.equal(t.all_reduce(torch.ones(4)), torch.ones(4))


def test_a_stream_ordered_native_transport_takes_the_hierarchys_inline_path():
    """N3 of the GPU review: an NcclTransport whose waits are stream-ordered says so, so a
    two-stage hierarchical collective on CUDA is issued inline on the caller's stream
    (flcomm/collectives/hierarchical.py) instead of a host hand-off per FSDP layer; a blocking
    one goes through the engine lane, whose host wait orders the stages."""
    ordered = NcclTransport(T().unattached_comm(0, 1))
    blocking = NcclTransport(T().unattached_comm(0, 1), blocking_wait=True)
    assert ordered.stream_ordered and ordered._stream_wait
    assert not blocking.stream_ordered and not blocking._stream_wait
