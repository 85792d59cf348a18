"""Transport over flcomm's native NCCL communicator (``flcomm._C.NcclComm``, csrc/nccl_comm.h).

NCCL is called directly, on the caller's current CUDA stream. What bounds a wait for peers:
  - init, split and destroy, and a blocking ``wait``: their own timeout; past it the communicator
    is aborted (``ncclCommAbort``) and ``flcomm._C.NcclTimeoutError`` (a TimeoutError) raised;
  - a stream-ordered wait (the default) has no bound of its own, as NCCL's: the watchdog
    (:mod:`flcomm.comm.watchdog`) gives every launch a deadline (the timeout), aborts a
    communicator whose work is late or failed, and sets the transport's ``failure``, which its
    users check (``raise_if_failed``) before trusting a result.

Creating one is collective over a torch.distributed group::

    transport = NcclTransport.from_group(group, tier="inter_group")
    transport.all_reduce(t, op="avg")

Steps of :meth:`NcclTransport.from_group`:
  1. each rank checks locally that NCCL can run here (built with NCCL, a CUDA device) and picks
     its device (:func:`default_device`: the group's bound device, else ``LOCAL_RANK``);
  2. rank 0 of the group makes a unique id (``ncclGetUniqueId``) and shares it through the c10d
     store (:func:`exchange_unique_id`: no GPU collective, so no device is touched before init);
  3. every rank builds ``NcclComm(id, size, rank, device, timeout)``: non-blocking NCCL init,
     polled until every rank has joined or the timeout has passed.

Streams (as torch's ProcessGroupNCCL): every launch goes on the caller's current stream and
records its tensors with the caching allocator. By default ``wait()`` makes the *current* stream
wait on the launch's event and returns without blocking the host (``Work.wait()`` of torch's NCCL
backend); ``blocking_wait=True`` blocks the host instead, bounded by the timeout.

Groups (:meth:`NcclTransport.group`): NCCL's group state belongs to the calling thread and is
shared by every NCCL user in the process, torch's ProcessGroupNCCL included. A torch.distributed
NCCL collective issued on the thread inside an open flcomm group joins that group
(``ncclGroupCommJoin``): it is launched only when the group ends, and its ``Work`` completes before
anything ran. flcomm refuses what it can tell: init, split and destroy inside a group, a collective
of another communicator, and (:func:`check_no_open_group`) any caller that asks before it issues.
"""

from __future__ import annotations

import itertools
import os
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from flcomm import _native
from flcomm.comm import watchdog
from flcomm.comm.base import DEFAULT_TIMEOUT, CommStats, LinkTier, ReduceOp, Transport, Work

if TYPE_CHECKING:
    import torch.distributed as dist


# NOTE: the library the communicators come from: flcomm._C, or (tests only) a stand-in with the
# same interface, set here the way a test double is injected (tests/common/fake_nccl.py). No user
# path sets it.
_LIBRARY: Any = None


def library() -> Any:
    """The module whose ``NcclComm``, ``nccl_unique_id`` and ``nccl_group_depth`` flcomm calls:
    ``flcomm._C`` (raises if it does not load)."""
    return _LIBRARY if _LIBRARY is not None else _native.native()


def device_type() -> str:
    """The device type the library's communicators run on ("cuda"; a CPU stand-in says "cpu")."""
    return str(getattr(library(), "DEVICE_TYPE", "cuda"))


def nccl_available() -> tuple[bool, str]:
    """Whether a native NCCL communicator can be created on this machine, and why not.

    Returns ``(True, "NCCL <version>")`` or ``(False, reason)``; the reason names what is
    missing (the extension, NCCL at build time, a CUDA device) and how to get it.
    """
    if _LIBRARY is not None:
        return True, str(getattr(_LIBRARY, "DESCRIPTION", type(_LIBRARY).__name__))
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
    return True, f"NCCL {_native.nccl_version_string(C.nccl_version_loaded())}"


def _seconds(timeout: timedelta | float) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


def open_group_depth() -> int:
    """How many flcomm NCCL groups (``NcclComm.group_start()``) are open on the calling thread;
    0 where flcomm has no NCCL. Needs no GPU."""
    if _LIBRARY is None and not _native.available():
        return 0
    return int(library().nccl_group_depth())


def check_no_open_group(what: str) -> None:
    """RuntimeError when a flcomm NCCL group is open on this thread.

    For callers about to issue an NCCL operation flcomm does not own (a torch.distributed
    collective): NCCL would fold it into the open group (``ncclGroupCommJoin``), launch it only at
    the group's end, and its ``Work`` would complete before anything ran.
    """
    depth = open_group_depth()
    if depth:
        raise RuntimeError(f"{what}: {depth} flcomm NCCL group(s) are open on this thread; an NCCL operation "
                           "issued now would join the group and run only at its end. Issue it before the "
                           "group starts or after it ends")


class _NativeHandle:
    """Adapts a native ``NcclWork`` to the handle protocol of :class:`flcomm.comm.base.Work`.

    ``blocking_wait=False``: ``wait`` makes the caller's current stream wait on the launch's
    event and returns without blocking the host (torch's NCCL ``Work.wait()``); it raises at once
    if the communicator has already reported an error. ``True``: it blocks the host until the GPU
    has finished, bounded by ``timeout``.
    """

    def __init__(self, work: Any, blocking_wait: bool, transport: Transport | None = None) -> None:
        self._work = work
        self._blocking = blocking_wait
        self._transport = transport

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        if not self._blocking:
            self._work.stream_wait()
            if self._transport is not None:  # NOTE: where the stream's wait ended by an abort (a CPU's)
                self._transport.raise_if_failed(f"{type(self._transport).__name__}.wait")
            return True
        return bool(self._work.wait(-1.0 if timeout is None else _seconds(timeout)))


class NcclTransport(Transport):
    """A :class:`Transport` over one native NCCL communicator.

    Args:
        comm: a ``flcomm._C.NcclComm`` (or an object with its methods and ``rank``, ``size``,
            ``device``).
        tier: the links this communicator crosses (for the statistics).
        stats: shared statistics (default: a new :class:`CommStats`).
        timeout: bound of every blocking ``wait`` and of the communicator's own waits (init,
            split, destroy; default 300 s).
        blocking_wait: False (default): ``wait()`` makes the current CUDA stream wait on the work
            and returns at once, as torch's NCCL ``Work.wait()``; kernels queued after it run
            after the collective, the host never blocks. Time statistics then measure the issue
            only, and a peer that never comes is detected only by a bounded wait
            (``blocking_wait=True``, or the native work's ``wait(timeout)``). True: ``wait()``
            blocks the host until the GPU has finished, bounded by ``timeout``; on timeout the
            communicator is aborted and ``flcomm._C.NcclTimeoutError`` raised.
        device: the device tensors must be on (default ``cuda:<comm.device>``).
    """

    name = "nccl"

    def __init__(self, comm: Any, tier: LinkTier | str = LinkTier.INTRA_NODE, stats: CommStats | None = None,
                 timeout: timedelta = DEFAULT_TIMEOUT, blocking_wait: bool = False,
                 device: torch.device | None = None) -> None:
        super().__init__(int(comm.rank), int(comm.size), LinkTier(tier), stats, timeout)
        self.comm = comm
        self.blocking_wait = blocking_wait
        #: the members' torch.distributed ranks, in communicator-rank order, where the maker knows
        #: them (a FedMesh's splits); None otherwise
        self.ranks: list[int] | None = None
        self._device = device if device is not None else _comm_device(comm)
        # NOTE: stream-ordered waits leave the host free, so the hierarchy runs inline (N3)
        self._stream_wait = not blocking_wait
        self.failure: Exception | None = None
        self._watched = watchdog.enabled()
        self._deliberate = False  # aborted or closed by its owner: not a failure

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None, tier: LinkTier | str = LinkTier.INTRA_NODE,
                   stats: CommStats | None = None, timeout: timedelta = DEFAULT_TIMEOUT,
                   device: int | torch.device | None = None, blocking_wait: bool = False) -> NcclTransport:
        """Create one communicator over ``group`` (None: the default group); collective.

        ``device``: this rank's CUDA device (default: :func:`default_device`); ``blocking_wait``:
        see the class.
        """
        import torch.distributed as dist

        ok, reason = nccl_available()
        if not ok:
            raise RuntimeError(f"NcclTransport.from_group: {reason}")
        group = group if group is not None else dist.group.WORLD
        if device_type() != "cuda":  # NOTE: a CPU stand-in has one device
            index = 0
        else:
            index = default_device(group) if device is None else _device_index(device)
        uid = exchange_unique_id(group, timeout)
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        return cls(new_comm(uid, size, rank, index, timeout), tier, stats, timeout, blocking_wait)

    def split(self, color: int, key: int | None = None, tier: LinkTier | str | None = None, *,
              max_ctas: int | None = None, cta_policy: int | None = None) -> NcclTransport | None:
        """Sub-communicator of the ranks passing ``color`` (ordered by ``key``, default the rank);
        ``color < 0`` joins none and gets None. Collective over this transport; shares its stats.

        ``max_ctas``: the most CTAs (SMs) each collective of the new communicator may hold
        (ncclConfig_t.maxCTAs); ``cta_policy``: ncclConfig_t.CTAPolicy, a value of the library's
        ``NCCL_CTA_POLICIES`` (NCCL >= 2.27). None keeps NCCL's default."""
        args = (color, self.rank if key is None else key, _seconds(self.timeout))
        config = {k: v for k, v in (("max_ctas", max_ctas), ("cta_policy", cta_policy)) if v is not None}
        child = self.comm.split(*args, **config)
        if child is None:
            return None
        return NcclTransport(child, self.tier if tier is None else tier, self.stats, self.timeout,
                             self.blocking_wait, self._device)

    @property
    def device(self) -> torch.device:
        return self._device

    def close(self) -> None:
        """Flush and free the communicator (ncclCommFinalize + ncclCommDestroy)."""
        self._deliberate = True
        watchdog.get_watchdog().forget(self)
        self.comm.destroy()

    def abort(self) -> None:
        """Drop outstanding work and free the communicator (ncclCommAbort). Returns once NCCL has
        freed it, after the work queued ahead of its kernels; releases the GIL meanwhile."""
        self._deliberate = True
        watchdog.get_watchdog().forget(self)
        self.comm.abort()

    @contextmanager
    def group(self) -> Iterator[None]:
        """Fuse the collectives issued inside the block into one NCCL launch (ncclGroupStart /
        ncclGroupEnd), e.g. the sends and receives of several all_to_all.

        Steps: 1. ``group_start()`` on this thread; 2. the block issues collectives of this
        transport with ``async_op=True`` (a blocking call inside is refused: it would wait for a
        launch that happens only at the block's end); 3. ``group_end()`` launches them, also when
        the block raised; wait on the handles after the block.

        NOTE: NCCL's group is the calling thread's, shared with torch: a torch.distributed NCCL
        collective issued on this thread inside the block joins the group (``ncclGroupCommJoin``),
        runs only at its end, and its ``Work`` reports completion before anything ran. flcomm
        refuses the collectives of another communicator, init, split and destroy inside the
        block; :func:`check_no_open_group` lets other callers refuse theirs.
        """
        self.comm.group_start()
        try:
            yield
        except BaseException:
            try:
                self.comm.group_end()
            except Exception:  # noqa: BLE001 - NOTE: the block's error is the one to report; the
                pass           # thread has left NCCL's group either way (group_end always ends it)
            raise
        end = self.comm.group_end()
        if end is not None and self._watched:
            watchdog.get_watchdog().watch(self, end, "grouped launch")

    def barrier(self) -> None:
        """Blocks the host until every rank has reached it (bounded by the timeout), whatever
        ``blocking_wait`` says: a stream-ordered wait would not make it a barrier."""
        t = torch.zeros(1, device=self.device)
        self._run("all_reduce", 0, lambda: _NativeHandle(self.comm.all_reduce(t, "sum"), True), t, False)

    # ---- the protocol: device checks first, so nothing is issued or counted for bad input ----
    def _check_device(self, async_op: bool = True, **tensors: Tensor) -> None:
        self.raise_if_failed(f"{type(self).__name__} ({self.tier.value})")  # NOTE: nothing on an aborted comm
        if not async_op and open_group_depth():
            raise RuntimeError(f"{type(self).__name__}: a blocking collective inside an open NCCL group would "
                               "wait for a launch that happens only at the group's end; issue it with "
                               "async_op=True and wait after the group")
        for name, t in tensors.items():
            if isinstance(t, Tensor) and t.device != self._device:
                raise ValueError(f"{type(self).__name__}: {name} must be on {self._device} (the "
                                 f"communicator's device), got {t.device}")

    def all_reduce(self, tensor: Tensor, op: Any = ReduceOp.SUM, async_op: bool = False) -> Work | Tensor:
        self._check_device(async_op, tensor=tensor)
        return super().all_reduce(tensor, op, async_op)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: Any = ReduceOp.SUM,
                       async_op: bool = False) -> Work | Tensor:
        self._check_device(async_op, output=output, input=input)
        return super().reduce_scatter(output, input, op, async_op)

    def all_gather(self, output: Tensor, input: Tensor, async_op: bool = False) -> Work | Tensor:
        self._check_device(async_op, output=output, input=input)
        return super().all_gather(output, input, async_op)

    def all_to_all(self, output: Tensor, input: Tensor, async_op: bool = False) -> Work | Tensor:
        self._check_device(async_op, output=output, input=input)
        return super().all_to_all(output, input, async_op)

    def broadcast(self, tensor: Tensor, src: int = 0, async_op: bool = False) -> Work | Tensor:
        self._check_device(async_op, tensor=tensor)
        return super().broadcast(tensor, src, async_op)

    # ---- implementations: one native call each ----
    def _handle(self, work: Any, op: str) -> _NativeHandle:
        if self._watched and not open_group_depth():  # NOTE: a group's works: its end's (group())
            watchdog.get_watchdog().watch(self, work, op)
        return _NativeHandle(work, self.blocking_wait, self)

    def _all_reduce(self, tensor: Tensor, op: ReduceOp) -> Any:
        return self._handle(self.comm.all_reduce(tensor, op.value), "all_reduce")

    def _reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp) -> Any:
        return self._handle(self.comm.reduce_scatter(output, input, op.value), "reduce_scatter")

    def _all_gather(self, output: Tensor, input: Tensor) -> Any:
        return self._handle(self.comm.all_gather(output, input), "all_gather")

    def _all_to_all(self, output: Tensor, input: Tensor) -> Any:
        return self._handle(self.comm.all_to_all(output, input), "all_to_all")

    def _broadcast(self, tensor: Tensor, src: int) -> Any:
        return self._handle(self.comm.broadcast(tensor, src), "broadcast")


def check_environment() -> None:
    """ValueError when the environment overrides what flcomm's communicators rely on:
    ``NCCL_COMM_BLOCKING=1`` makes init and split block with no bound (it overrides
    ``ncclConfig_t.blocking``), so a peer that never joins would hang them (N9)."""
    raw = os.environ.get("NCCL_COMM_BLOCKING", "").strip()
    if raw not in ("", "0"):
        raise ValueError(f"NCCL_COMM_BLOCKING={raw} makes NCCL's init and split block with no bound; flcomm's "
                         "communicators need it unset (or 0): they bound every wait by the mesh's timeout")


def new_comm(unique_id: bytes, size: int, rank: int, device: int, timeout: timedelta | float) -> Any:
    """``NcclComm(unique_id, size, rank, device, timeout)`` of the library, after
    :func:`check_environment`: every native root communicator is made here."""
    check_environment()
    return library().NcclComm(unique_id, size, rank, device, _seconds(timeout))


def _comm_device(comm: Any) -> torch.device:
    kind = device_type()
    return torch.device(kind, int(comm.device)) if kind == "cuda" else torch.device(kind)


def _device_index(device: int | torch.device | str) -> int:
    d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if d.type != "cuda" or d.index is None:
        raise ValueError(f"device must be a CUDA device index or 'cuda:<i>', got {device!r}")
    return d.index


def default_device(group: dist.ProcessGroup | None = None) -> int:
    """This rank's CUDA device index when none is given, checked against the visible devices.

    1. the device the process group is bound to (``init_process_group(device_id=...)``);
    2. else ``LOCAL_RANK`` (torchrun and most launchers set it);
    3. else ``torch.cuda.current_device()`` (what ``torch.cuda.set_device`` chose).

    NOTE: not simply the current device: without ``set_device`` every local rank would pick
    cuda:0 and NCCL's init fails with "Duplicate GPU".
    """
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    bound = getattr(group, "bound_device_id", None) if group is not None else None
    count = torch.cuda.device_count()
    if bound is not None and bound.type == "cuda":
        index, source = (bound.index if bound.index is not None else torch.cuda.current_device()), "bound device"
    elif os.environ.get("LOCAL_RANK", "").strip():
        raw = os.environ["LOCAL_RANK"].strip()
        if not raw.isdigit():
            raise ValueError(f"LOCAL_RANK must be a non-negative integer, got {raw!r}")
        index, source = int(raw), "LOCAL_RANK"
    else:
        index, source = torch.cuda.current_device(), "torch.cuda.current_device()"
    if not 0 <= index < count:
        raise ValueError(f"NcclTransport: this rank's device from {source} is cuda:{index}, but "
                         f"{count} CUDA device(s) are visible; pass device= or set CUDA_VISIBLE_DEVICES")
    return index


# NOTE: per-group call counters: every rank of a group calls exchange_unique_id in the same order
# (it is collective), so (group name, count) names the same store key on every rank.
_EXCHANGES: defaultdict[str, itertools.count] = defaultdict(itertools.count)


def exchange_unique_id(group: dist.ProcessGroup | None = None,
                       timeout: timedelta | float = DEFAULT_TIMEOUT) -> bytes:
    """Rank 0 of ``group`` makes an NCCL unique id; every rank of the group returns it. Collective.

    Steps: 1. the key ``flcomm/nccl_unique_id/<group name>/<n>`` (the n-th exchange of the
    group); 2. rank 0 sets it in the default c10d store; 3. the others wait for it (bounded by
    ``timeout``) and read it.

    NOTE: the c10d store, not a collective: a broadcast over an NCCL group would stage the bytes
    through a CUDA device before this rank's NCCL device is even chosen.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    group = group if group is not None else dist.group.WORLD
    C = library()
    name = str(group.group_name)
    key = f"flcomm/nccl_unique_id/{name}/{next(_EXCHANGES[name])}"
    store = c10d._get_default_store()
    if dist.get_rank(group) == 0:
        uid = C.nccl_unique_id()
        store.set(key, uid)
    else:
        try:
            store.wait([key], timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout))
        except RuntimeError as e:  # the store's timeout error
            raise TimeoutError(f"exchange_unique_id: rank 0 of group {name!r} did not publish the NCCL "
                               f"unique id {key!r} within {timeout}: {e}") from e
        uid = store.get(key)
    if not isinstance(uid, bytes) or len(uid) != C.NCCL_UNIQUE_ID_BYTES:
        raise RuntimeError(f"exchange_unique_id: expected {C.NCCL_UNIQUE_ID_BYTES} bytes from rank 0, "
                           f"got {type(uid).__name__} of length {len(uid) if uid is not None else 0}")
    return uid
