"""A CPU stand-in for flcomm's native NCCL library (``flcomm._C``'s ``NcclComm``, ``NcclWork``,
``nccl_unique_id``, ``nccl_group_depth``), backed by gloo, so that everything above the C++ calls
into NCCL runs in CI: the native mesh, the hooks, FedAvg and the driver on ``transport="native"``.

It is a test double, injected with :func:`installed` (``flcomm.comm.nccl._LIBRARY``), or in
subprocesses through ``tests/common/fake_nccl_site`` on PYTHONPATH; nothing in flcomm ships or
selects it. ``tests/unit/test_fake_nccl.py`` checks its interface against the real
binding's signatures, so the two cannot drift.

What it keeps of the real class, as far as a CPU has it:
  - a communicator of ``nranks`` processes is made from a unique id (128 bytes that carry the
    address of a bootstrap store its maker serves, as NCCL's carries its root's; the caller shares
    them, e.g. through the c10d store); :meth:`NcclComm.split` is collective over the parent, by color
    (``< 0``: none, returns None) and key, and may carry ``max_ctas`` / ``cta_policy``;
  - the same argument checks (device, dtype, contiguity, sizes, root, op) and errors
    (RuntimeError; :class:`NcclTimeoutError`, a TimeoutError, when a wait runs past the timeout,
    which aborts the communicator);
  - abort and destroy: every later call raises, naming the communicator and why;
  - groups: per thread; collectives inside ``group_start()``/``group_end()`` are deferred to the
    group's end and launched there as one; their works cannot be waited on before; the group of
    another communicator, and split inside a group, are refused;
  - stream semantics: a CPU has no streams, so ``stream_wait()`` (the stream-ordered wait) blocks
    until the work completed, which orders whatever runs after it the same way;
  - ``launches``: how many launches the communicator made (a grouped block counts once).
"""

from __future__ import annotations

import itertools
import os
import threading
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
    pending: list[tuple[NcclWork, Callable[[], Any]]]


_TL = _Group()


def nccl_group_depth() -> int:
    """How many group_start() blocks are open on the calling thread."""
    return _TL.depth


def install() -> None:
    """Make flcomm's native path build its communicators with this stand-in, for the rest of
    the process (tests/common/fake_nccl_site: the trainer's subprocesses)."""
    import sys

    from flcomm.comm import nccl

    nccl._LIBRARY = sys.modules[__name__]


@contextmanager
def installed() -> Iterator[None]:
    """Make flcomm's native path build its communicators with this stand-in."""
    import sys

    from flcomm.comm import nccl

    before, nccl._LIBRARY = nccl._LIBRARY, sys.modules[__name__]
    try:
        yield
    finally:
        nccl._LIBRARY = before


class NcclWork:
    """One launch's completion (shared by the works of one group)."""

    def __init__(self, comm: NcclComm, post: Callable[[], None] | None = None) -> None:
        self._comm, self._post = comm, post
        self._works: list[Any] | None = None  # NOTE: None until launched (inside a group: its end)
        self._done = False

    def _launched(self, works: list[Any]) -> None:
        self._works = works

    def _check(self, what: str) -> list[Any]:
        if self._works is None:
            raise RuntimeError(f"{what}: the work of an open group completes with group_end(); call it first")
        self._comm._check_alive(what)
        return self._works

    def wait(self, timeout_s: float = -1.0) -> bool:
        """Blocks until the launch completed, at most ``timeout_s`` (< 0: the communicator's)."""
        if self._done:
            return True
        works = self._check("NcclWork.wait")
        limit = timedelta(seconds=self._comm.timeout if timeout_s < 0 else timeout_s)
        for w in works:
            try:
                w.wait(limit)
            except RuntimeError as e:
                # NOTE: as the real class: a timeout is NcclTimeoutError, a peer's failure (NCCL's
                # asynchronous error) a RuntimeError; both abort the communicator
                if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
                    msg = f"NcclWork.wait: the {self._comm._where()} failed: {e}; the communicator was aborted"
                    self._comm._abort(msg)
                    raise RuntimeError(msg) from e
                msg = (f"NcclWork.wait: the collective on the {self._comm._where()} did not complete within "
                       f"{limit.total_seconds():g} s (a peer is missing or stuck); the communicator was aborted")
                self._comm._abort(msg)
                raise NcclTimeoutError(f"{msg}: {e}") from e
        self._finish()
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        if not all(w.is_completed() for w in self._check("NcclWork")):
            return False
        self.wait()
        return True

    def stream_wait(self) -> None:
        """The stream-ordered wait; on a CPU, the work's completion (no streams to order)."""
        self._check("NcclWork.stream_wait")
        self.wait()

    def _finish(self) -> None:
        if self._post is not None:
            self._post()
        self._done = True


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
        self._aborted = self._destroyed = False
        self._abort_reason = ""
        self._splits = itertools.count()
        self._lock = threading.Lock()
        self.launches = 0
        self._pg = store_group(self._store, prefix, rank, nranks, "gloo", timedelta(seconds=timeout_s))

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
        if t.device.type != "cpu":
            raise RuntimeError(f"{what}: {name} must be on the communicator's device (cpu), got {t.device}")
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

    def _op(self, what: str, op: str, out: torch.Tensor) -> tuple[Any, Callable[[], None] | None]:
        if op not in _OPS:
            raise RuntimeError(f"{what}: op must be one of sum, avg, max, min; got '{op}'")
        if op == "avg":  # NOTE: gloo has no AVG: sum, then divide once at completion
            n = self._size
            return _OPS[op], (lambda: out.div_(n))
        return _OPS[op], None

    def _check_group(self, what: str) -> None:
        if _TL.depth and _TL.comm is not self:
            raise RuntimeError(f"{what}: a group of another communicator is open on this thread "
                               "(NCCL groups are per thread): call its group_end() first")

    # ---- launches ----
    def _launch(self, what: str, issue: Callable[[], Any], post: Callable[[], None] | None = None) -> NcclWork:
        self._check_alive(what)
        self._check_group(what)
        work = NcclWork(self, post)
        if _TL.depth:
            _TL.pending.append((work, issue))
            return work
        self.launches += 1
        work._launched([issue()])
        return work

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> NcclWork:
        what = "NcclComm.all_reduce"
        self._check_tensor(what, "tensor", tensor)
        top, post = self._op(what, op, tensor)
        opts = dist.AllreduceOptions()
        opts.reduceOp = top
        return self._launch(what, lambda: self._pg.allreduce([tensor], opts), post)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum") -> NcclWork:
        what = "NcclComm.reduce_scatter"
        self._check_pair(what, output, input)
        if input.numel() != output.numel() * self._size:
            raise RuntimeError(f"{what}: input must have size * output.numel() = {output.numel() * self._size} "
                               f"elements, got {input.numel()}")
        top, post = self._op(what, op, output)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = top
        return self._launch(what, lambda: self._pg._reduce_scatter_base(output, input, opts), post)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> NcclWork:
        what = "NcclComm.all_gather"
        self._check_pair(what, output, input)
        if output.numel() != input.numel() * self._size:
            raise RuntimeError(f"{what}: output must have size * input.numel() = {input.numel() * self._size} "
                               f"elements, got {output.numel()}")
        return self._launch(what, lambda: self._pg._allgather_base(output, input))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> NcclWork:
        what = "NcclComm.all_to_all"
        self._check_pair(what, output, input)
        if output.numel() != input.numel():
            raise RuntimeError(f"{what}: output and input must have one size, got {output.numel()} and "
                               f"{input.numel()}")
        if input.numel() % self._size:
            raise RuntimeError(f"{what}: {input.numel()} elements do not split into {self._size} equal parts")
        return self._launch(what, lambda: self._pg.alltoall_base(output, input, [], [], dist.AllToAllOptions()))

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> NcclWork:
        what = "NcclComm.broadcast"
        self._check_tensor(what, "tensor", tensor)
        if not 0 <= root < self._size:
            raise RuntimeError(f"{what}: root must be a rank in [0, {self._size}), got {root}")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        return self._launch(what, lambda: self._pg.broadcast([tensor], opts))

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
        # NOTE: the thread has left the group before any error is reported (as the real group_end)
        self._check_alive(what)
        self.launches += 1
        issued = []
        for work, issue in pending:
            w = issue()
            work._launched([w])
            issued.append(w)
        end = NcclWork(self)
        end._launched(issued)
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
        n = next(self._splits)
        mine = torch.tensor([color, key, self._rank], dtype=torch.int64)
        every = torch.empty(3 * self._size, dtype=torch.int64)
        w = self._pg._allgather_base(every, mine)
        try:
            w.wait(timedelta(seconds=self._timeout if timeout_s < 0 else timeout_s))
        except RuntimeError as e:
            msg = f"{what}: the {self._where()} did not complete the split within {timeout_s:g} s"
            self._abort(msg)
            raise NcclTimeoutError(f"{msg}: {e}") from e
        if color < 0:
            return None
        rows = every.view(-1, 3).tolist()
        members = sorted((k, r) for c, k, r in rows if c == color)
        rank = members.index((key, self._rank))
        return NcclComm._child(f"{self._prefix}/s{n}/c{color}", len(members), rank, self, max_ctas, cta_policy)

    def abort(self) -> None:
        self._abort("abort() was called")

    def _abort(self, reason: str) -> None:
        if self._aborted or self._destroyed:
            return
        self._aborted, self._abort_reason = True, reason
        abort = getattr(self._pg, "abort", None)
        if abort is not None:
            try:
                abort()
            except RuntimeError:
                pass

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._check_group("NcclComm.destroy")
        self._destroyed = True
