"""Transport over flcomm's native NCCL communicator (``flcomm._C.NcclComm``, csrc/nccl_comm.h).

NCCL is called directly, on the caller's current CUDA stream, with a timeout on everything that
waits for peers: a peer that never joins an init or a collective makes ``wait`` abort the
communicator (``ncclCommAbort``) and raise ``flcomm._C.NcclTimeoutError`` (a TimeoutError)
instead of hanging.

Creating one is collective over a torch.distributed group::

    transport = NcclTransport.from_group(group, tier="inter_group")
    transport.all_reduce(t, op="avg")

Steps of :meth:`NcclTransport.from_group`:
  1. each rank checks locally that NCCL can run here (built with NCCL, a CUDA device);
  2. rank 0 of the group makes a unique id (``ncclGetUniqueId``) and broadcasts it through the
     group (``broadcast_object_list``: gloo or NCCL groups alike);
  3. every rank builds ``NcclComm(id, size, rank, device, timeout)``: non-blocking NCCL init,
     polled until every rank has joined or the timeout has passed.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from flcomm import _native
from flcomm.comm.base import DEFAULT_TIMEOUT, CommStats, LinkTier, ReduceOp, Transport, Work

if TYPE_CHECKING:
    import torch.distributed as dist


def nccl_available() -> tuple[bool, str]:
    """Whether a native NCCL communicator can be created on this machine, and why not.

    Returns ``(True, "NCCL <version>")`` or ``(False, reason)``; the reason names what is
    missing (the extension, NCCL at build time, a CUDA device) and how to get it.
    """
    if not _native.available():
        return False, str(_native.unavailable_reason())
    C = _native.native()
    if not C.compiled_with_nccl():
        why = "a CPU-only build" if not C.compiled_with_cuda() else "nccl.h was not found at build time"
        return False, (f"flcomm was built without NCCL ({why}); rebuild against a CUDA build of torch "
                       "with CUDA_HOME set and the nvidia-nccl wheel installed: "
                       "`FLCOMM_CUDA=1 pip install --no-build-isolation -e .`")
    try:
        gpus = torch.cuda.device_count()
    except Exception as e:  # noqa: BLE001 - no driver reads as no GPU
        return False, f"no CUDA device: {e}"
    if gpus < 1:
        return False, "no CUDA device is visible (torch.cuda.device_count() == 0)"
    code = C.nccl_version_loaded()
    return True, f"NCCL {code // 10000}.{(code // 100) % 100}.{code % 100}"


def _seconds(timeout: timedelta | float) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class _NativeHandle:
    """Adapts a native ``NcclWork`` to the handle protocol of :class:`flcomm.comm.base.Work`.

    ``blocking_wait=False``: the launch is ordered on the caller's stream, so ``wait`` only
    checks for an NCCL error and returns without blocking the host (like torch's NCCL work).
    """

    def __init__(self, work: Any, blocking_wait: bool) -> None:
        self._work = work
        self._blocking = blocking_wait

    def is_completed(self) -> bool:
        # C: bool NcclWork::is_completed()  (cudaEventQuery + ncclCommGetAsyncError)
        return bool(self._work.is_completed())

    def wait(self, timeout: timedelta | float) -> bool:
        if not self._blocking:
            self._work.is_completed()  # raises on an NCCL error
            return True
        # C: bool NcclWork::wait(double timeout_s)  (polls; aborts + throws on error / timeout)
        return bool(self._work.wait(_seconds(timeout)))


class NcclTransport(Transport):
    """A :class:`Transport` over one native NCCL communicator.

    Args:
        comm: a ``flcomm._C.NcclComm`` (or an object with its methods and ``rank``, ``size``,
            ``device``).
        tier: the links this communicator crosses (for the statistics).
        stats: shared statistics (default: a new :class:`CommStats`).
        timeout: bound of every ``wait`` (default 300 s).
        blocking_wait: ``wait()`` blocks the host until the GPU has finished, with the timeout
            (default). False: ``wait()`` returns at once, the work being ordered on the caller's
            stream; time statistics then measure the issue only, and a hang is not detected.
        device: the device tensors must be on (default ``cuda:<comm.device>``).
    """

    name = "nccl"

    def __init__(self, comm: Any, tier: LinkTier | str = LinkTier.INTRA_NODE, stats: CommStats | None = None,
                 timeout: timedelta = DEFAULT_TIMEOUT, blocking_wait: bool = True,
                 device: torch.device | None = None) -> None:
        super().__init__(int(comm.rank), int(comm.size), LinkTier(tier), stats, timeout)
        self.comm = comm
        self.blocking_wait = blocking_wait
        self._device = device if device is not None else torch.device("cuda", int(comm.device))

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None, tier: LinkTier | str = LinkTier.INTRA_NODE,
                   stats: CommStats | None = None, timeout: timedelta = DEFAULT_TIMEOUT,
                   device: int | torch.device | None = None, blocking_wait: bool = True) -> NcclTransport:
        """Create one communicator over ``group`` (None: the default group); collective.

        ``device``: this rank's CUDA device (default: ``torch.cuda.current_device()``).
        """
        import torch.distributed as dist

        ok, reason = nccl_available()
        if not ok:
            raise RuntimeError(f"NcclTransport.from_group: {reason}")
        group = group if group is not None else dist.group.WORLD
        if device is None:
            index = torch.cuda.current_device()
        else:
            index = torch.device("cuda", device).index if isinstance(device, int) else torch.device(device).index
            if index is None:
                raise ValueError(f"device must be a CUDA device index or 'cuda:<i>', got {device!r}")
        uid = exchange_unique_id(group)
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        C = _native.native()
        # C: NcclComm::NcclComm(const std::string& unique_id, int nranks, int rank, int device,
        #                       double timeout_s)  (ncclCommInitRankConfig, blocking = 0)
        comm = C.NcclComm(uid, size, rank, index, _seconds(timeout))
        return cls(comm, tier, stats, timeout, blocking_wait)

    def split(self, color: int, key: int | None = None, tier: LinkTier | str | None = None) -> NcclTransport | None:
        """Sub-communicator of the ranks passing ``color`` (ordered by ``key``, default the rank);
        ``color < 0`` joins none and gets None. Collective over this transport; shares its stats."""
        # C: std::shared_ptr<NcclComm> NcclComm::split(int color, int key, double timeout_s)
        #    (ncclCommSplit; nullptr for NCCL_SPLIT_NOCOLOR)
        child = self.comm.split(color, self.rank if key is None else key, _seconds(self.timeout))
        if child is None:
            return None
        return NcclTransport(child, self.tier if tier is None else tier, self.stats, self.timeout,
                             self.blocking_wait)

    @property
    def device(self) -> torch.device:
        return self._device

    def close(self) -> None:
        """Flush and free the communicator (ncclCommFinalize + ncclCommDestroy)."""
        # C: void NcclComm::destroy()
        self.comm.destroy()

    def abort(self) -> None:
        """Drop outstanding work and free the communicator at once (ncclCommAbort)."""
        # C: void NcclComm::abort()
        self.comm.abort()

    # ---- the protocol: device checks first, so nothing is issued or counted for bad input ----
    def _check_device(self, **tensors: Tensor) -> None:
        for name, t in tensors.items():
            if isinstance(t, Tensor) and t.device != self._device:
                raise ValueError(f"{type(self).__name__}: {name} must be on {self._device} (the "
                                 f"communicator's device), got {t.device}")

    def all_reduce(self, tensor: Tensor, op: Any = ReduceOp.SUM, async_op: bool = False) -> Work | Tensor:
        self._check_device(tensor=tensor)
        return super().all_reduce(tensor, op, async_op)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: Any = ReduceOp.SUM,
                       async_op: bool = False) -> Work | Tensor:
        self._check_device(output=output, input=input)
        return super().reduce_scatter(output, input, op, async_op)

    def all_gather(self, output: Tensor, input: Tensor, async_op: bool = False) -> Work | Tensor:
        self._check_device(output=output, input=input)
        return super().all_gather(output, input, async_op)

    def all_to_all(self, output: Tensor, input: Tensor, async_op: bool = False) -> Work | Tensor:
        self._check_device(output=output, input=input)
        return super().all_to_all(output, input, async_op)

    def broadcast(self, tensor: Tensor, src: int = 0, async_op: bool = False) -> Work | Tensor:
        self._check_device(tensor=tensor)
        return super().broadcast(tensor, src, async_op)

    # ---- implementations: one native call each ----
    def _handle(self, work: Any) -> _NativeHandle:
        return _NativeHandle(work, self.blocking_wait)

    def _all_reduce(self, tensor: Tensor, op: ReduceOp) -> Any:
        # C: std::shared_ptr<NcclWork> NcclComm::all_reduce(const at::Tensor& tensor,
        #                                                    const std::string& op)  (ncclAllReduce)
        return self._handle(self.comm.all_reduce(tensor, op.value))

    def _reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp) -> Any:
        # C: std::shared_ptr<NcclWork> NcclComm::reduce_scatter(const at::Tensor& output,
        #        const at::Tensor& input, const std::string& op)  (ncclReduceScatter)
        return self._handle(self.comm.reduce_scatter(output, input, op.value))

    def _all_gather(self, output: Tensor, input: Tensor) -> Any:
        # C: std::shared_ptr<NcclWork> NcclComm::all_gather(const at::Tensor& output,
        #        const at::Tensor& input)  (ncclAllGather)
        return self._handle(self.comm.all_gather(output, input))

    def _all_to_all(self, output: Tensor, input: Tensor) -> Any:
        # C: std::shared_ptr<NcclWork> NcclComm::all_to_all(const at::Tensor& output,
        #        const at::Tensor& input)  (ncclGroupStart; ncclSend + ncclRecv per peer; ncclGroupEnd)
        return self._handle(self.comm.all_to_all(output, input))

    def _broadcast(self, tensor: Tensor, src: int) -> Any:
        # C: std::shared_ptr<NcclWork> NcclComm::broadcast(const at::Tensor& tensor, int root)
        #    (ncclBroadcast, in place)
        return self._handle(self.comm.broadcast(tensor, src))


def exchange_unique_id(group: dist.ProcessGroup | None = None) -> bytes:
    """Rank 0 of ``group`` makes an NCCL unique id; every rank of the group returns it. Collective.

    NOTE: ``broadcast_object_list`` works on gloo and NCCL groups alike (on NCCL it stages the
    bytes through the current CUDA device).
    """
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    C = _native.native()
    # C: std::string nccl_unique_id()  (ncclGetUniqueId; 128 bytes)
    obj: list[bytes | None] = [C.nccl_unique_id() if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(obj, src=dist.get_global_rank(group, 0), group=group)
    uid = obj[0]
    if not isinstance(uid, bytes) or len(uid) != C.NCCL_UNIQUE_ID_BYTES:
        raise RuntimeError(f"exchange_unique_id: expected {C.NCCL_UNIQUE_ID_BYTES} bytes from rank 0, "
                           f"got {type(uid).__name__} of length {len(uid) if uid is not None else 0}")
    return uid
