"""A CPU stand-in for flcomm's native NCCL library (``flcomm._C``'s ``NcclComm``, ``NcclWork``,
``nccl_unique_id``, ``nccl_group_depth``), backed by gloo, so that everything above the C++ calls
into NCCL runs in CI: the native mesh, the hooks, FedAvg and the driver on ``transport="native"``.

It is a test double, injected with :func:`installed` (``flcomm.comm.nccl._LIBRARY``), or in
subprocesses through ``tests/common/fake_nccl_site`` on PYTHONPATH; nothing in flcomm ships or
selects it. ``tests/unit/test_fake_nccl.py`` checks its interface against the real binding's
signatures, and each rule below against its written source, so the two cannot drift.

The data moves on gloo. The control follows NCCL, not gloo: a double must be at least as strict
as the real thing. The rules (mode ``"strict"``, the default), each from NCCL's documentation or
the binding's source (csrc/nccl_comm.cpp):

  R1. A launch returns at once; the operation runs later, in launch order, on the communicator's
      own worker thread (its "stream"). NCCL: "NCCL calls are asynchronous ... enqueued on the
      CUDA stream"; the binding's ``launch()`` returns after the enqueue.
  R2. ``stream_wait()`` has no bound and never raises for what happens after it was called: the
      real one is a bare ``cudaStreamWaitEvent``. A CPU has no streams, so the calling thread
      stands in for the stream that waits (its next op reads the result): it waits for the
      operation to complete or the communicator to be aborted, however long that takes.
  R3. An operation whose peer is dead or silent stays pending forever: NCCL's kernels spin on a
      lost peer, and no timeout of gloo's leaks through as an error (the worker stops; every
      later operation of the communicator stays pending behind it, as on one stream).
  R4. Only ``abort()`` ends a pending operation (``ncclCommAbort``: the kernels exit early). Its
      outputs are then undefined (filled with NaN, or the dtype's max for integers); ``wait`` and
      ``is_completed`` raise; a ``stream_wait`` already waiting returns, as the stream would run on.
  R5. Errors show only when polled: ``wait`` (bounded: past the timeout it aborts and raises
      NcclTimeoutError), ``is_completed``, and the next call on the communicator.
  R6. One communicator's launches are serialized under its lock, issue to enqueue (the binding
      holds it across ``ncclInProgress``, N4); groups are per thread, deferred to their end and
      launched there as one; their works cannot be waited on before; the group of another
      communicator, and split inside a group, are refused.
  R7. Tensors must be contiguous, of NCCL's dtypes, on the communicator's device (here the CPU);
      a page-locked host tensor is not device memory and is refused, as the binding refuses it.
  R8. ``avg`` as NCCL reduces it: floating dtypes are multiplied by 1/n (in their dtype) and
      summed (``ncclDevPreMulSum``), integers summed and divided by n, truncating
      (``ncclDevSumPostDiv``); on one rank the input itself.
  R9. ``destroy()`` is ``ncclCommFinalize``: it waits for the pending operations, bounded by the
      timeout, else aborts and raises NcclTimeoutError.
  R10. ``split()`` is collective over the parent (host side, through the bootstrap store), bounded
      by the timeout; a timeout aborts the parent.
  R11. Creating a communicator (init, or a split's child) returns on no rank before every rank
      has it: the binding's init is non-blocking and ``await_ready`` waits for the peers, bounded
      by the timeout (csrc/nccl_comm.cpp). gloo's mesh connects pairwise, so one rank could be
      done, finish and close its pairs while another still connects to them.

Mode ``"lenient"`` (``installed(mode="lenient")``, or ``FLCOMM_FAKE_NCCL_MODE=lenient`` in the
trainer's subprocesses) is the stand-in of before: ``stream_wait`` is the bounded ``wait``, and a
gloo error or timeout raises at once. Only a test that says why may ask for it.

Also: ``launches`` (how many launches the communicator made; a grouped block counts once).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEVICE_TYPE = "cpu"
DESCRIPTION = "a CPU stand-in for NCCL (gloo), for tests"
NCCL_UNIQUE_ID_BYTES = 128
NCCL_CTA_POLICIES = {"default": 0, "efficiency": 1, "zero": 2}  # NOTE: NCCL >= 2.27's, as the binding's
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int32,
           torch.int64)
_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
MODES = ("strict", "lenient")
MODE_ENV = "FLCOMM_FAKE_NCCL_MODE"
# NOTE: the mode of the communicators made from now on (installed(mode=...), or the environment)
_MODE = os.environ.get(MODE_ENV, "strict")


class NcclTimeoutError(TimeoutError):
    """A wait that ran past the communicator's timeout (the communicator was aborted)."""


_SERVERS: list[dist.TCPStore] = []  # NOTE: the bootstrap stores this process serves, alive with it


def nccl_unique_id() -> bytes:
    """ncclGetUniqueId(): 128 bytes rank 0 shares with the other ranks. As NCCL's, it carries
    the address of a bootstrap root this process serves (here a TCPStore on an ephemeral port),
    so the members meet wherever the id is handed, whatever world each one is in."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    _SERVERS.append(server)
    head = f"fake-nccl:127.0.0.1:{server.port}:".encode()
    return head + os.urandom(NCCL_UNIQUE_ID_BYTES - len(head))


def _bootstrap(unique_id: bytes, timeout_s: float) -> dist.Store:
    """A client of the bootstrap store named by ``unique_id``."""
    try:
        _, host, port, _ = unique_id.split(b":", 3)
    except ValueError:
        raise RuntimeError("NcclComm: unique_id is not one of the stand-in's (nccl_unique_id())") from None
    return dist.TCPStore(host.decode(), int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


class _Group(threading.local):
    depth = 0
    comm: NcclComm | None = None
    pending: list[tuple[NcclWork, Callable[[], Any], list[torch.Tensor], Callable[[], None] | None]]


_TL = _Group()


def nccl_group_depth() -> int:
    """How many group_start() blocks are open on the calling thread."""
    return _TL.depth


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"fake_nccl: mode must be one of {MODES}, got {mode!r}")
    return mode


def install(mode: str | None = None) -> None:
    """Make flcomm's native path build its communicators with this stand-in, for the rest of
    the process (tests/common/fake_nccl_site: the trainer's subprocesses)."""
    import sys

    from flcomm.comm import nccl

    global _MODE
    _MODE = _check_mode(mode or os.environ.get(MODE_ENV, "strict"))
    nccl._LIBRARY = sys.modules[__name__]


@contextmanager
def installed(mode: str = "strict") -> Iterator[None]:
    """Make flcomm's native path build its communicators with this stand-in (``mode``: the
    module's rules, ``"strict"``; ``"lenient"`` only for a test that says why)."""
    import sys

    from flcomm.comm import nccl

    global _MODE
    before, before_mode = nccl._LIBRARY, _MODE
    nccl._LIBRARY, _MODE = sys.modules[__name__], _check_mode(mode)
    try:
        yield
    finally:
        nccl._LIBRARY, _MODE = before, before_mode


def _poison(t: torch.Tensor) -> None:
    """R4: what an aborted kernel leaves is undefined; here something no correct result is."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(torch.iinfo(t.dtype).max)


class _Op:
    """One launch (a grouped block is one): gloo issues run by the worker in order, the outputs
    they write, and what runs after them (avg's integer division)."""

    def __init__(self, issues: list[Callable[[], Any]], outputs: list[torch.Tensor],
                 posts: list[Callable[[], None]]) -> None:
        self.issues, self.outputs, self.posts = issues, outputs, posts
        self.finished = False
        self.error: BaseException | None = None  # NOTE: lenient mode only (R3 keeps it pending)


class NcclWork:
    """One launch's completion (shared by the works of one group)."""

    def __init__(self, comm: NcclComm) -> None:
        self._comm = comm
        self._op: _Op | None = None  # NOTE: None until launched (inside a group: its end)

    def _checked(self, what: str) -> _Op:
        if self._op is None:
            raise RuntimeError(f"{what}: the work of an open group completes with group_end(); call it first")
        return self._op

    def wait(self, timeout_s: float = -1.0) -> bool:
        """Blocks until the launch completed, at most ``timeout_s`` (< 0: the communicator's);
        past it aborts the communicator and raises NcclTimeoutError (R5)."""
        op = self._checked("NcclWork.wait")
        if op.finished:
            return True
        c = self._comm
        c._check_alive("NcclWork.wait")
        limit = c.timeout if timeout_s < 0 else timeout_s
        if not c._await(op, limit):
            c._check_alive("NcclWork.wait")  # NOTE: aborted (or destroyed) while waiting
            msg = (f"NcclWork.wait: the collective on the {c._where()} did not complete within {limit:g} s "
                   "(a peer is missing or stuck); the communicator was aborted")
            c._abort(msg)
            raise NcclTimeoutError(msg)
        return True

    def is_completed(self) -> bool:
        """Non-blocking: whether the launch completed; raises once the communicator is aborted."""
        op = self._checked("NcclWork")
        if op.finished:
            return True
        self._comm._check_alive("NcclWork")
        return False

    def stream_wait(self) -> None:
        """The stream-ordered wait (R2): no bound, and no error for what happens after the call."""
        op = self._checked("NcclWork.stream_wait")
        if op.finished:
            return
        c = self._comm
        c._check_alive("NcclWork.stream_wait")
        if c._mode == "lenient":
            self.wait()
            return
        c._await(op, None)


class NcclComm:
    """A communicator of ``nranks`` processes on gloo (see the module)."""

    def __init__(self, unique_id: bytes, nranks: int, rank: int, device: int, timeout_s: float = 300.0) -> None:
        if not isinstance(unique_id, bytes) or len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise RuntimeError(f"NcclComm: unique_id must be {NCCL_UNIQUE_ID_BYTES} bytes, got "
                               f"{len(unique_id) if isinstance(unique_id, bytes) else type(unique_id).__name__}")
        if timeout_s <= 0:
            raise RuntimeError(f"NcclComm: timeout_s must be > 0, got {timeout_s}")
        self._store = _bootstrap(unique_id, timeout_s)
        self._setup("fake_nccl", nranks, rank, device, timeout_s, 0, -1)

    @classmethod
    def _child(cls, prefix: str, nranks: int, rank: int, parent: NcclComm, max_ctas: int,
               cta_policy: int) -> NcclComm:
        comm = cls.__new__(cls)
        comm._store = parent._store
        comm._setup(prefix, nranks, rank, parent.device, parent.timeout, max_ctas, cta_policy)
        return comm

    def _setup(self, prefix: str, nranks: int, rank: int, device: int, timeout_s: float, max_ctas: int,
               cta_policy: int) -> None:
        from flcomm.comm.torch_pg import store_group

        if nranks < 1:
            raise RuntimeError(f"NcclComm: nranks must be >= 1, got {nranks}")
        if not 0 <= rank < nranks:
            raise RuntimeError(f"NcclComm: rank must be in [0, {nranks}), got {rank}")
        if timeout_s <= 0:
            raise RuntimeError(f"NcclComm: timeout_s must be > 0, got {timeout_s}")
        if device != 0:
            raise RuntimeError(f"NcclComm: device must be a device index in [0, 1), got {device}")
        self._prefix, self._rank, self._size, self._device, self._timeout = prefix, rank, nranks, device, timeout_s
        self._max_ctas, self._cta_policy = max_ctas, cta_policy
        self._mode = _MODE
        self._aborted = self._destroyed = False
        self._abort_reason = ""
        self._splits = itertools.count()
        self._lock = threading.Lock()  # R6: issue to enqueue
        self._cv = threading.Condition()  # the worker's queue, the ops' completion, abort
        self._queue: deque[_Op] = deque()
        self._running: _Op | None = None
        self._stuck = ""  # R3: why the worker stopped (a gloo error or timeout), for messages
        self._worker: threading.Thread | None = None
        self.launches = 0
        self._pg = store_group(self._store, prefix, rank, nranks, "gloo", timedelta(seconds=timeout_s))
        # R11: every rank has its communicator before any returns
        self._store.set(f"{prefix}/ready/{rank}", "1")
        try:
            self._store.wait([f"{prefix}/ready/{r}" for r in range(nranks)], timedelta(seconds=timeout_s))
        except RuntimeError as e:  # NOTE: the store's timeout (a DistStoreError)
            raise NcclTimeoutError(f"NcclComm init: rank {rank} of {nranks} (stand-in): the peers did not all "
                                   f"join within {timeout_s:g} s: {e}") from e

    # ---- properties of the binding ----
    rank = property(lambda self: self._rank)
    size = property(lambda self: self._size)
    device = property(lambda self: self._device)
    timeout = property(lambda self: self._timeout)
    is_aborted = property(lambda self: self._aborted)
    is_destroyed = property(lambda self: self._destroyed)
    max_ctas = property(lambda self: self._max_ctas)
    cta_policy = property(lambda self: self._cta_policy)

    def __repr__(self) -> str:
        state = "aborted" if self._aborted else "destroyed" if self._destroyed else "ok"
        return f"NcclComm(rank={self._rank}, size={self._size}, device=cpu (stand-in), {state})"

    # ---- checks, as the real class words them ----
    def _where(self) -> str:
        return f"NCCL communicator rank {self._rank} of {self._size} on cpu (stand-in)"

    def _check_alive(self, what: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"{what}: the {self._where()} was destroyed")
        if self._aborted:
            raise RuntimeError(f"{what}: the {self._where()} was aborted ({self._abort_reason})")

    def _check_tensor(self, what: str, name: str, t: torch.Tensor) -> None:
        if t.device.type != "cpu" or t.is_pinned():  # R7: page-locked host memory is not the device's
            where = "page-locked host memory" if t.device.type == "cpu" else str(t.device)
            raise RuntimeError(f"{what}: {name} must be on the communicator's device (cpu), got {where}")
        if not t.is_contiguous():
            raise RuntimeError(f"{what}: {name} must be contiguous, got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise RuntimeError(f"{what}: dtype must be one of float32, bfloat16, float16, float64, int8, uint8, "
                               f"int32, int64; got {t.dtype}")

    def _check_pair(self, what: str, output: torch.Tensor, input: torch.Tensor) -> None:
        self._check_tensor(what, "output", output)
        self._check_tensor(what, "input", input)
        if output.dtype != input.dtype:
            raise RuntimeError(f"{what}: output and input must have one dtype, got {output.dtype} and {input.dtype}")

    def _check_op(self, what: str, op: str) -> None:
        if op not in _OPS:
            raise RuntimeError(f"{what}: op must be one of sum, avg, max, min; got '{op}'")

    def _pre(self, op: str, t: torch.Tensor) -> torch.Tensor:
        """R8, run by the worker: a floating avg's input times 1/n, in its dtype (a copy)."""
        if op == "avg" and t.is_floating_point() and self._size > 1:
            return t * torch.tensor(1.0 / self._size, dtype=t.dtype).item()
        return t

    def _post(self, op: str, out: torch.Tensor) -> Callable[[], None] | None:
        """R8: an integer avg's sum divided by n, truncating."""
        if op == "avg" and not out.is_floating_point() and self._size > 1:
            n = self._size
            return lambda: out.copy_(torch.div(out, n, rounding_mode="trunc"))
        return None

    def _check_group(self, what: str) -> None:
        if _TL.depth and _TL.comm is not self:
            raise RuntimeError(f"{what}: a group of another communicator is open on this thread "
                               "(NCCL groups are per thread): call its group_end() first")

    # ---- the worker: the communicator's stream (R1, R3) ----
    def _enqueue(self, op: _Op) -> None:
        with self._cv:
            self._queue.append(op)
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, daemon=True, name=f"fake-nccl-{self._prefix}")
                self._worker.start()
            self._cv.notify_all()

    def _work(self) -> None:
        limit = timedelta(seconds=self._timeout)
        while True:
            with self._cv:
                while not self._queue and not (self._aborted or self._destroyed):
                    self._cv.wait()
                if self._aborted or self._destroyed or self._stuck:
                    return
                op = self._running = self._queue.popleft()
            try:
                for w in [issue() for issue in op.issues]:
                    w.wait(limit)
                for post in op.posts:
                    post()
            except RuntimeError as e:
                with self._cv:
                    self._running = None
                    if self._mode == "lenient":
                        op.error = e
                        self._cv.notify_all()
                        continue
                    # R3: a lost or silent peer: this op, and all behind it, pending until abort()
                    self._stuck = f"{type(e).__name__}: {e}"
                    self._queue.appendleft(op)
                    return
            with self._cv:
                self._running = None
                op.finished = True
                self._cv.notify_all()

    def _await(self, op: _Op, timeout_s: float | None) -> bool:
        """Wait until ``op`` finished (True) or the communicator was aborted or destroyed, or
        ``timeout_s`` passed (False). Lenient mode: the op's gloo error aborts and raises."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while not op.finished and op.error is None and not (self._aborted or self._destroyed):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
            error = op.error
        if error is not None:
            msg = f"NcclWork.wait: the {self._where()} failed: {error}; the communicator was aborted"
            self._abort(msg)
            raise (NcclTimeoutError if "time" in str(error).lower() else RuntimeError)(msg) from error
        return op.finished

    # ---- launches ----
    def _launch(self, what: str, issue: Callable[[], Any], outputs: list[torch.Tensor],
                post: Callable[[], None] | None = None) -> NcclWork:
        with self._lock:
            self._check_alive(what)
            self._check_group(what)
            work = NcclWork(self)
            if _TL.depth:
                _TL.pending.append((work, issue, outputs, post))
                return work
            self.launches += 1
            work._op = _Op([issue], outputs, [post] if post else [])
            self._enqueue(work._op)
            return work

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> NcclWork:
        what = "NcclComm.all_reduce"
        self._check_tensor(what, "tensor", tensor)
        self._check_op(what, op)
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[op]

        def issue() -> Any:
            pre = self._pre(op, tensor)
            if pre is not tensor:
                tensor.copy_(pre)
            return self._pg.allreduce([tensor], opts)

        return self._launch(what, issue, [tensor], self._post(op, tensor))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum") -> NcclWork:
        what = "NcclComm.reduce_scatter"
        self._check_pair(what, output, input)
        if input.numel() != output.numel() * self._size:
            raise RuntimeError(f"{what}: input must have size * output.numel() = {output.numel() * self._size} "
                               f"elements, got {input.numel()}")
        self._check_op(what, op)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _OPS[op]
        return self._launch(what, lambda: self._pg._reduce_scatter_base(output, self._pre(op, input), opts),
                            [output], self._post(op, output))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> NcclWork:
        what = "NcclComm.all_gather"
        self._check_pair(what, output, input)
        if output.numel() != input.numel() * self._size:
            raise RuntimeError(f"{what}: output must have size * input.numel() = {input.numel() * self._size} "
                               f"elements, got {output.numel()}")
        return self._launch(what, lambda: self._pg._allgather_base(output, input), [output])

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> NcclWork:
        what = "NcclComm.all_to_all"
        self._check_pair(what, output, input)
        if output.numel() != input.numel():
            raise RuntimeError(f"{what}: output and input must have one size, got {output.numel()} and "
                               f"{input.numel()}")
        if input.numel() % self._size:
            raise RuntimeError(f"{what}: {input.numel()} elements do not split into {self._size} equal parts")
        return self._launch(what, lambda: self._pg.alltoall_base(output, input, [], [], dist.AllToAllOptions()),
                            [output])

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> NcclWork:
        what = "NcclComm.broadcast"
        self._check_tensor(what, "tensor", tensor)
        if not 0 <= root < self._size:
            raise RuntimeError(f"{what}: root must be a rank in [0, {self._size}), got {root}")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        return self._launch(what, lambda: self._pg.broadcast([tensor], opts), [tensor])

    # ---- groups ----
    def group_start(self) -> None:
        if _TL.depth and _TL.comm is not self:
            raise RuntimeError("NcclComm.group_start: a group of another communicator is open on this thread "
                               "(NCCL groups are per thread): call its group_end() first")
        self._check_alive("NcclComm.group_start")
        if _TL.depth == 0:
            _TL.comm, _TL.pending = self, []
        _TL.depth += 1

    def group_end(self) -> NcclWork | None:
        what = "NcclComm.group_end"
        if _TL.depth == 0:
            raise RuntimeError(f"{what}: no open group on this thread (call group_start() first)")
        if _TL.comm is not self:
            raise RuntimeError(f"{what}: the open group belongs to another communicator")
        _TL.depth -= 1
        if _TL.depth:
            return None
        pending, _TL.pending, _TL.comm = _TL.pending, [], None
        with self._lock:
            # NOTE: the thread has left the group before any error is reported (as the real group_end)
            self._check_alive(what)
            self.launches += 1
            op = _Op([issue for _, issue, _, _ in pending], [t for _, _, ts, _ in pending for t in ts],
                     [post for _, _, _, post in pending if post is not None])
            end = NcclWork(self)
            for work, *_ in [*pending, (end,)]:
                work._op = op
            self._enqueue(op)
        return end

    # ---- membership ----
    def split(self, color: int, key: int, timeout_s: float = -1.0, max_ctas: int = 0,
              cta_policy: int = -1) -> NcclComm | None:
        what = "NcclComm.split"
        self._check_alive(what)
        if _TL.depth:
            raise RuntimeError(f"{what}: not allowed while a group_start() is open on this thread")
        if max_ctas < 0:
            raise RuntimeError(f"{what}: max_ctas must be >= 0 (0: NCCL's default), got {max_ctas}")
        if cta_policy != -1 and cta_policy not in NCCL_CTA_POLICIES.values():
            raise RuntimeError(f"{what}: cta_policy must be -1 (NCCL's default) or one of "
                               f"{sorted(NCCL_CTA_POLICIES.values())}, got {cta_policy}")
        limit = self._timeout if timeout_s < 0 else timeout_s
        n = next(self._splits)
        # R10: host side, through the bootstrap store (not on the stream, as ncclCommSplit)
        base = f"{self._prefix}/split{n}/"
        self._store.set(f"{base}{self._rank}", f"{color},{key}")
        try:
            self._store.wait([f"{base}{r}" for r in range(self._size)], timedelta(seconds=limit))
        except RuntimeError as e:  # NOTE: the store's timeout (a DistStoreError)
            msg = f"{what}: the {self._where()} did not complete the split within {limit:g} s"
            self._abort(msg)
            raise NcclTimeoutError(f"{msg}: {e}") from e
        if color < 0:
            return None
        rows = [(*map(int, self._store.get(f"{base}{r}").decode().split(",")), r) for r in range(self._size)]
        members = sorted((k, r) for c, k, r in rows if c == color)
        rank = members.index((key, self._rank))
        return NcclComm._child(f"{self._prefix}/s{n}/c{color}", len(members), rank, self, max_ctas, cta_policy)

    def abort(self) -> None:
        self._abort("abort() was called")

    def _abort(self, reason: str) -> None:
        """R4: pending operations end, their outputs undefined; every waiter wakes."""
        with self._cv:
            if self._aborted or self._destroyed:
                return
            self._aborted, self._abort_reason = True, reason
            ops = list(self._queue) + ([self._running] if self._running is not None else [])
            for op in ops:
                for t in op.outputs:
                    _poison(t)
            self._cv.notify_all()
        abort = getattr(self._pg, "abort", None)
        if abort is not None:
            try:
                abort()
            except RuntimeError:
                pass

    def destroy(self) -> None:
        """R9: ncclCommFinalize (the pending operations complete, bounded by the timeout), then free."""
        if self._destroyed:
            return
        self._check_group("NcclComm.destroy")
        if not self._aborted:
            with self._cv:
                last = self._queue[-1] if self._queue else self._running
            if last is not None and not self._await(last, self._timeout) and not self._aborted:
                msg = (f"NcclComm.destroy (ncclCommFinalize): the {self._where()} did not complete within "
                       f"{self._timeout:g} s (a peer did not join or is stuck); the communicator was aborted")
                self._abort(msg)
                raise NcclTimeoutError(msg)
        with self._cv:
            self._destroyed = True
            self._cv.notify_all()
