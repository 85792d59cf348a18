"""The native module on a machine without a GPU: build info, NCCL version and unique ids, clear
errors from GPU-only calls, and the NCCL transport's validation before any native call (the
unique-id exchange over gloo is in tests/dist/test_nccl_unique_id.py).

Runs against whichever build is in the tree: with NCCL (the default CUDA build) the NCCL calls
that need no GPU work; in a CPU-only build (``FLCOMM_CUDA=0 tools/dev_build.sh``) every NCCL
entry point exists and says flcomm was built without NCCL.
"""

from __future__ import annotations

import pytest
import torch

import flcomm
from flcomm import _native
from flcomm.comm.base import CommStats, LinkTier, ReduceOp, wire_bytes
from flcomm.comm.nccl import NcclTransport, nccl_available

pytestmark = pytest.mark.skipif(not _native.available(), reason=f"flcomm._C not built: {_native.unavailable_reason()}")


def C():
    return _native.native()


def with_nccl() -> bool:
    return bool(C().compiled_with_nccl())


def has_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def torch_nccl_code() -> int | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - CPU build of torch
        return None
    return v[0] * 10000 + v[1] * 100 + v[2] if isinstance(v, tuple) else int(v)


# ---- build info ----

def test_build_info_fields():
    info = flcomm.build_info()
    for key in ("flcomm", "torch", "torch_cuda", "native", "cpu_kernels", "cuda_compiled", "cuda_archs",
                "nccl_compiled", "nccl_loaded", "cuda_runtime", "gpus", "torch_nccl"):
        assert key in info, f"build_info() lacks {key!r}: {sorted(info)}"
    assert info["native"] is True and info["native_error"] is None
    assert info["flcomm"] == flcomm.__version__
    assert info["torch"] == torch.__version__
    assert info["cuda_compiled"] == bool(C().compiled_with_cuda())
    if info["cuda_compiled"]:
        assert torch.version.cuda is not None, "CUDA compiled in against a CPU build of torch"
        assert info["cuda_archs"] and all(a.startswith("sm_") for a in info["cuda_archs"]), info["cuda_archs"]
        assert isinstance(info["cuda_runtime"], int) and info["cuda_runtime"] > 0
    else:
        assert info["cuda_archs"] == [] and info["cuda_runtime"] is None
        assert not with_nccl(), "NCCL without CUDA"
    if not has_gpu():
        assert info["gpus"] == 0


def test_nccl_versions_agree():
    """NCCL compiled against == NCCL loaded == the NCCL torch loaded (one shared libnccl)."""
    compiled, loaded = C().nccl_version_compiled(), C().nccl_version_loaded()
    info = flcomm.build_info()
    if not with_nccl():
        assert compiled == 0 and loaded == 0
        assert info["nccl_compiled"] is None and info["nccl_loaded"] is None
        return
    assert compiled >= 20000, compiled
    assert loaded == compiled, f"compiled against NCCL {compiled}, loaded {loaded}"
    theirs = torch_nccl_code()
    assert theirs is not None, "flcomm has NCCL but torch reports none"
    assert loaded == theirs, f"flcomm loaded NCCL {loaded}, torch {theirs}: two libnccl in one process"
    major, minor, patch = compiled // 10000, (compiled // 100) % 100, compiled % 100
    assert info["nccl_compiled"] == info["nccl_loaded"] == f"{major}.{minor}.{patch}"


# ---- unique ids and GPU-only calls ----

def test_unique_ids():
    if not with_nccl():
        with pytest.raises(RuntimeError, match="built without NCCL"):
            C().nccl_unique_id()
        return
    a, b = C().nccl_unique_id(), C().nccl_unique_id()
    assert isinstance(a, bytes) and len(a) == 128 == C().NCCL_UNIQUE_ID_BYTES
    assert len(b) == 128 and a != b


@pytest.mark.skipif(has_gpu(), reason="checks the errors of a machine without a GPU")
def test_gpu_only_calls_raise_clearly():
    uid = C().nccl_unique_id() if with_nccl() else bytes(128)
    expected = "needs a CUDA device" if with_nccl() else "built without NCCL"
    with pytest.raises(RuntimeError, match=expected):
        C().NcclComm(uid, 1, 0, 0, 5.0)
    ok, reason = nccl_available()
    assert not ok
    assert ("CUDA device" if with_nccl() else "built without NCCL") in reason, reason
    with pytest.raises(RuntimeError, match="NcclTransport.from_group"):
        NcclTransport.from_group()


def test_comm_argument_errors():
    """Arguments are checked before NCCL or CUDA is touched (so also here, without a GPU)."""
    if not with_nccl():
        pytest.skip("built without NCCL: every call raises the same error (test_gpu_only_calls_raise_clearly)")
    uid = C().nccl_unique_id()
    with pytest.raises(RuntimeError, match="128 bytes.*got 5"):
        C().NcclComm(b"short", 1, 0, 0, 5.0)
    with pytest.raises(RuntimeError, match=r"rank must be in \[0, 2\), got 2"):
        C().NcclComm(uid, 2, 2, 0, 5.0)
    with pytest.raises(RuntimeError, match="nranks must be >= 1, got 0"):
        C().NcclComm(uid, 0, 0, 0, 5.0)
    with pytest.raises(RuntimeError, match="timeout_s must be > 0"):
        C().NcclComm(uid, 1, 0, 0, 0.0)
    assert issubclass(C().NcclTimeoutError, TimeoutError)


# ---- the transport's validation, against a recording stand-in for the native communicator ----

class RecordingComm:
    """Stands in for ``flcomm._C.NcclComm``: records each native call; completes at once."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self.rank, self.size, self.device = rank, size, 0
        self.calls: list[tuple] = []

    def _record(self, *call: object) -> RecordingComm.Done:
        self.calls.append(call)
        return RecordingComm.Done(self.calls)

    class Done:
        def __init__(self, calls: list[tuple]) -> None:
            self.calls = calls

        def wait(self, timeout_s: float = -1.0) -> bool:
            self.calls.append(("wait",))
            return True

        def stream_wait(self) -> None:
            self.calls.append(("stream_wait",))

        def is_completed(self) -> bool:
            return True

    def all_reduce(self, tensor, op):
        return self._record("all_reduce", tuple(tensor.shape), op)

    def reduce_scatter(self, output, input, op):
        return self._record("reduce_scatter", output.numel(), input.numel(), op)

    def all_gather(self, output, input):
        return self._record("all_gather", output.numel(), input.numel())

    def all_to_all(self, output, input):
        return self._record("all_to_all", output.numel(), input.numel())

    def broadcast(self, tensor, root):
        return self._record("broadcast", tensor.numel(), root)


def cpu_transport(size: int = 4) -> tuple[NcclTransport, RecordingComm]:
    comm = RecordingComm(size)
    return NcclTransport(comm, LinkTier.INTER_GROUP, device=torch.device("cpu")), comm


def test_transport_rejects_bad_input_before_native_calls():
    t, comm = cpu_transport(4)
    f32 = torch.zeros(8)
    bad = [
        (lambda: t.reduce_scatter(torch.zeros(3), f32), "expected output of 2 elements"),
        (lambda: t.reduce_scatter(torch.zeros(2), torch.zeros(6)), "does not split into 4 equal chunks"),
        (lambda: t.reduce_scatter(torch.zeros(2, dtype=torch.bfloat16), f32), "one dtype"),
        (lambda: t.all_gather(torch.zeros(8), torch.zeros(3)), "expected output of 12 elements"),
        (lambda: t.all_gather(torch.zeros(8, dtype=torch.int32), torch.zeros(2)), "one dtype"),
        (lambda: t.all_to_all(torch.zeros(4), f32), "expected output of 8 elements"),
        (lambda: t.all_to_all(torch.zeros(6), torch.zeros(6)), "does not split into 4"),
        (lambda: t.all_reduce(torch.zeros(4, 4).t()), "contiguous"),
        (lambda: t.all_reduce(torch.zeros(4, dtype=torch.int32), op="avg"), "avg needs a floating dtype"),
        (lambda: t.all_reduce(f32, op="prod"), "reduce op must be one of sum, avg, max"),
        (lambda: t.broadcast(f32, src=4), r"src must be a group rank in \[0, 4\)"),
    ]
    for call, msg in bad:
        with pytest.raises(ValueError, match=msg):
            call()
    assert comm.calls == [], f"native calls were issued for bad input: {comm.calls}"
    assert t.stats.tiers[LinkTier.INTER_GROUP].calls == 0, "bad input was counted in the stats"


def test_transport_rejects_wrong_device_before_native_calls():
    comm = RecordingComm(2)
    t = NcclTransport(comm)  # device cuda:0: CPU tensors are refused without touching CUDA
    assert t.device == torch.device("cuda", 0)
    for call in (lambda: t.all_reduce(torch.zeros(4)), lambda: t.all_gather(torch.zeros(8), torch.zeros(4)),
                 lambda: t.reduce_scatter(torch.zeros(2), torch.zeros(4)),
                 lambda: t.all_to_all(torch.zeros(4), torch.zeros(4)), lambda: t.broadcast(torch.zeros(4))):
        with pytest.raises(ValueError, match=r"must be on cuda:0 .*got cpu"):
            call()
    assert comm.calls == []


def test_non_blocking_wait_orders_the_stream_instead_of_the_host():
    """Issue 9 item 8: wait() of a blocking transport blocks the host (NcclWork.wait); of a
    non-blocking one it makes the current stream wait (NcclWork.stream_wait), and nothing else.
    Non-blocking is the default, of the constructor and of from_group."""
    import inspect

    for blocking, expect in ((None, "stream_wait"), (True, "wait"), (False, "stream_wait")):
        comm = RecordingComm(2)
        kw = {} if blocking is None else {"blocking_wait": blocking}
        t = NcclTransport(comm, LinkTier.INTER_NODE, device=torch.device("cpu"), **kw)
        t.all_reduce(torch.zeros(4))
        t.all_gather(torch.zeros(8), torch.zeros(4), async_op=True).wait()
        waits = [c[0] for c in comm.calls if c[0] in ("wait", "stream_wait")]
        assert waits == [expect, expect], (blocking, comm.calls)
    assert inspect.signature(NcclTransport.from_group).parameters["blocking_wait"].default is False


def test_barrier_blocks_the_host_even_when_waits_do_not():
    """barrier() is a host barrier whatever blocking_wait says (a stream-ordered wait is none)."""
    comm = RecordingComm(2)
    t = NcclTransport(comm, device=torch.device("cpu"))
    t.barrier()
    assert [c[0] for c in comm.calls] == ["all_reduce", "wait"], comm.calls


def test_default_device_is_local_rank_and_checked(monkeypatch):
    """Issue 9 item 11: without a device, LOCAL_RANK picks it (not the current device, which is
    cuda:0 on every rank without set_device), checked against the visible devices."""
    from flcomm.comm.nccl import default_device

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    monkeypatch.setenv("LOCAL_RANK", "x1")
    with pytest.raises(ValueError, match="LOCAL_RANK must be a non-negative integer, got 'x1'"):
        default_device(None)
    monkeypatch.setenv("LOCAL_RANK", str(count))
    with pytest.raises(ValueError, match=f"from LOCAL_RANK is cuda:{count}, but {count} CUDA device"):
        default_device(None)
    if count:
        monkeypatch.setenv("LOCAL_RANK", str(count - 1))
        assert default_device(None) == count - 1


def test_transport_maps_calls_and_counts_bytes():
    """Each protocol call becomes one native call with the arguments in C order and the op's
    name; the wire bytes follow the ring convention of flcomm.comm.base."""
    stats = CommStats()
    comm = RecordingComm(4)
    t = NcclTransport(comm, "inter_node", stats, device=torch.device("cpu"))
    x = torch.zeros(8)
    assert t.all_reduce(x, op=ReduceOp.AVG) is x
    t.reduce_scatter(torch.zeros(2), x, op="max")
    t.all_gather(torch.zeros(32), x)
    w = t.all_to_all(torch.zeros(8), x, async_op=True)
    assert w.is_completed() and w.wait() is not None
    t.broadcast(x, src=3)
    launches = [c for c in comm.calls if c[0] not in ("wait", "stream_wait")]
    assert launches == [("all_reduce", (8,), "avg"), ("reduce_scatter", 2, 8, "max"), ("all_gather", 32, 8),
                          ("all_to_all", 8, 8), ("broadcast", 8, 3)]
    expected = (wire_bytes("all_reduce", 32, 4) + wire_bytes("reduce_scatter", 32, 4)
                + wire_bytes("all_gather", 128, 4) + wire_bytes("all_to_all", 32, 4) + wire_bytes("broadcast", 32, 4))
    assert stats.bytes("inter_node") == expected == 48 + 24 + 96 + 24 + 32
    assert stats.tiers[LinkTier.INTER_NODE].calls == 5


def test_info_names_the_transports(capsys):
    """``python -m flcomm info`` says which transports ``init_fed_mesh(topology, transport=...)`` can use
    here: torch always; native when flcomm has NCCL and a GPU is visible, else why not."""
    import json

    from flcomm.__main__ import main

    assert main(["info", "--json"]) == 0
    t = json.loads(capsys.readouterr().out)["transports"]
    assert t["torch"].startswith("available")
    native = with_nccl() and torch.cuda.device_count() > 0
    assert t["native"].startswith("available (NCCL " if native else "unavailable: "), t
    assert main(["info"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("transports"))
    assert f"torch: {t['torch']}; native: {t['native']}" in line
