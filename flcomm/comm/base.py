"""The transport protocol every flcomm collective is written against.

A transport is one communicator over an ordered set of ranks on one link tier. It offers
``all_reduce``, ``reduce_scatter``, ``all_gather``, ``all_to_all`` and ``broadcast``, each
synchronous or asynchronous (``async_op=True`` returns a :class:`Work`), and keeps
:class:`CommStats`: calls, bytes and time per :class:`LinkTier`.

Byte convention (``wire_bytes``): the bytes *one rank sends* under the ring algorithm, for a
buffer of B bytes (the full, unsharded buffer) on n ranks:

=============== ======================
all_reduce      2 (n-1)/n * B
reduce_scatter  (n-1)/n * B  (B = input)
all_gather      (n-1)/n * B  (B = output)
all_to_all      (n-1)/n * B
broadcast       B            (pipelined chain; 0 when n = 1)
=============== ======================

These are the nccl-tests bus-bandwidth factors, so ``bytes / time`` is the bus bandwidth.
Time is wall time from issue until the caller saw completion (``wait()`` for async work).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from flcomm.enums import Choice

DEFAULT_TIMEOUT = timedelta(seconds=300)
# NOTE: the inter-group exchange runs for long stretches over the slowest links, beside
# compute. A few CTAs move its bytes as fast as such a link allows; NCCL's default would hold
# up to 32 SMs for the whole transfer.
EXCHANGE_MAX_CTAS = 4


class ReduceOp(Choice, what="reduce op"):
    SUM = "sum"
    AVG = "avg"
    MAX = "max"

    @classmethod
    def _missing_value(cls, op: Any) -> ReduceOp | None:
        """Also a torch.distributed.ReduceOp (or its value) of sum, avg or max."""
        if isinstance(op, str):
            return None
        import torch.distributed as dist

        for ours in cls:
            theirs = getattr(dist.ReduceOp, ours.name)
            if op == theirs or op == getattr(theirs, "value", object()):
                return ours
        return None


class LinkTier(str, Enum):
    """Which links a collective crosses: inside a node, between nodes of one federation group,
    or between federation groups."""

    INTRA_NODE = "intra_node"
    INTER_NODE = "inter_node"
    INTER_GROUP = "inter_group"


@dataclass
class TierStats:
    calls: int = 0
    bytes: int = 0
    time_s: float = 0.0


@dataclass
class CommStats:
    """Calls, wire bytes and time per link tier. One object may be shared by several transports
    (e.g. all of one rank's), so a training loop reads one total per tier."""

    tiers: dict[LinkTier, TierStats] = field(default_factory=lambda: {t: TierStats() for t in LinkTier})

    def record_issue(self, tier: LinkTier, nbytes: int) -> None:
        s = self.tiers[tier]
        s.calls += 1
        s.bytes += int(nbytes)

    def record_time(self, tier: LinkTier, seconds: float) -> None:
        self.tiers[tier].time_s += seconds

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {t.value: {"calls": s.calls, "bytes": s.bytes, "time_s": s.time_s} for t, s in self.tiers.items()}

    def bytes(self, tier: LinkTier | str) -> int:
        return self.tiers[LinkTier(tier)].bytes

    def reset(self) -> None:
        for s in self.tiers.values():
            s.calls, s.bytes, s.time_s = 0, 0, 0.0


def format_bytes(b: float) -> str:
    """``b`` bytes with a decimal unit and three significant digits, for tables ("1.23 GB")."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(b) < 1000:
            return f"{b:.3g} {unit}"
        b /= 1000
    return f"{b:.3g} TB"


def _ratio(collective: str, n: int) -> tuple[int, int]:
    """(numerator, denominator) of the bytes one rank sends per byte of the full buffer."""
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    if collective == "all_reduce":
        return 2 * (n - 1), n
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        return n - 1, n
    if collective == "broadcast":
        return (1, 1) if n > 1 else (0, 1)
    raise ValueError(f"collective must be one of {', '.join(COLLECTIVES)}, got {collective!r}")


#: the collectives of the protocol, in the order of the table in the module docstring
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")


def bus_factor(collective: str, n: int) -> float:
    """The nccl-tests bus-bandwidth factor of ``collective`` over ``n`` ranks (the table in the
    module docstring): ``busbw = algbw * bus_factor``; also the cost model's bytes factor."""
    num, den = _ratio(collective, n)
    return num / den


def wire_bytes(collective: str, nbytes: int, n: int) -> int:
    """Bytes one rank sends for ``collective`` on a buffer of ``nbytes`` over ``n`` ranks (see
    the module docstring for the convention)."""
    num, den = _ratio(collective, n)
    return num * nbytes // den


@runtime_checkable
class Handle(Protocol):
    """What every asynchronous flcomm operation returns: a transport's :class:`Work`, and the
    handles of the collectives and of the FedAvg exchange built on it.

    ``wait(timeout)`` waits until the operation completed and returns its result; calling it
    again returns the same result. On CPU (and for host-blocking transports) it blocks the host,
    bounded by ``timeout`` or the owner's timeout, raising ``TimeoutError`` past it. On a
    stream-ordered CUDA transport (NCCL: torch's, and flcomm's by default) it makes the current
    stream wait instead and returns at once, as torch's NCCL ``Work.wait()``: kernels issued after
    it run after the operation. ``is_completed()`` polls without blocking.
    """

    def wait(self, timeout: timedelta | float | None = None) -> Any: ...

    def is_completed(self) -> bool: ...


class Done:
    """The :class:`Handle` of an operation that completed when it was issued."""

    def __init__(self, result: Any = None) -> None:
        self.result = result

    def wait(self, timeout: timedelta | float | None = None) -> Any:
        return self.result

    def is_completed(self) -> bool:
        return True


class Work:
    """Handle of an asynchronous collective. ``wait()`` blocks the host (bounded by the
    transport's timeout) or, on a stream-ordered transport, makes the current stream wait (see
    :class:`Handle`); it runs the post-processing (e.g. the division of an AVG done as SUM) and
    records the elapsed time in the stats (the issue only, when stream-ordered)."""

    def __init__(self, handle: Any, tier: LinkTier, stats: CommStats, t0: float,
                 timeout: timedelta, post: Callable[[], None] | None = None,
                 result: Any = None, stream_wait: bool = False) -> None:
        self._handle = handle
        # NOTE: torch's NCCL work blocks the CPU thread until completion when wait() gets a
        # timeout; without one it only makes the current CUDA stream wait, which keeps
        # compute overlapped. Its timeout is then the process group's own (watchdog).
        self._stream_wait = stream_wait
        self._tier, self._stats, self._t0 = tier, stats, t0
        self._timeout = timeout
        self._post = post
        self._done = False
        self.result = result

    def is_completed(self) -> bool:
        if self._done:
            return True
        return self._handle is None or bool(self._handle.is_completed())

    def wait(self, timeout: timedelta | float | None = None) -> Any:
        """Wait for completion and return ``result`` (the output tensor)."""
        if self._done:
            return self.result
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        if self._handle is not None:
            self._wait_handle(timeout or self._timeout)
        if self._post is not None:
            self._post()
        self._stats.record_time(self._tier, time.perf_counter() - self._t0)
        self._done = True
        return self.result

    def _wait_handle(self, timeout: timedelta) -> None:
        if self._stream_wait:
            self._handle.wait()
            return
        try:
            ok = self._handle.wait(timeout)
        except TypeError:  # handle without a timeout argument (e.g. a torch Future)
            ok = self._handle.wait()
        if ok is False:
            raise TimeoutError(f"collective did not complete within {timeout}")


def check_tensor(name: str, t: Tensor, device: torch.device | None = None) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def check_op(op: ReduceOp, t: Tensor) -> None:
    """ValueError when ``op`` cannot reduce ``t`` (avg needs a floating dtype)."""
    if op is ReduceOp.AVG and not t.is_floating_point():
        raise ValueError(f"avg needs a floating dtype, got {t.dtype}")


def check_pair(collective: str, output: Tensor, input: Tensor, out_numel: int) -> None:
    """Same dtype and device, contiguous, and ``output.numel() == out_numel``."""
    check_tensor("input", input)
    check_tensor("output", output)
    if output.dtype != input.dtype:
        raise ValueError(f"{collective}: output and input must have one dtype, got {output.dtype} "
                         f"and {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"{collective}: output and input must be on one device, got "
                         f"{output.device} and {input.device}")
    if output.numel() != out_numel:
        raise ValueError(f"{collective}: expected output of {out_numel} elements for input of "
                         f"{input.numel()} elements, got {output.numel()}")


class Transport(ABC):
    """One communicator over ``size`` ranks on one link tier.

    Subclasses implement the ``_``-prefixed methods, which return a handle with
    ``wait(timeout)`` / ``is_completed()`` (or None when already complete). The public methods
    validate, count bytes, and wrap the handle in :class:`Work`.
    """

    name: str = "transport"
    # True where a handle's wait() without a timeout is stream-ordered (torch's NCCL work)
    _stream_wait: bool = False
    #: what ended this transport's communicator, where a watchdog watches it
    #: (:mod:`flcomm.comm.watchdog`: a CommFailure); None while it is healthy
    failure: Exception | None = None

    def __init__(self, rank: int, size: int, tier: LinkTier, stats: CommStats | None = None,
                 timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        self.rank, self.size, self.tier = rank, size, LinkTier(tier)
        self.stats = stats if stats is not None else CommStats()
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size}, tier={self.tier.value})"

    # ---- the protocol ----
    def all_reduce(self, tensor: Tensor, op: Any = ReduceOp.SUM, async_op: bool = False) -> Work | Tensor:
        """In place: ``tensor`` becomes the reduction over all ranks."""
        op = ReduceOp.parse(op)
        check_tensor("tensor", tensor)
        self._check_op(op, tensor)
        return self._run("all_reduce", tensor.numel() * tensor.element_size(),
                         lambda: self._all_reduce(tensor, op), tensor, async_op)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: Any = ReduceOp.SUM,
                       async_op: bool = False) -> Work | Tensor:
        """``output`` (n elements) = the reduction of chunk ``rank`` of every rank's ``input``
        (size * n elements, flat layout)."""
        op = ReduceOp.parse(op)
        if input.numel() % self.size:
            raise ValueError(f"reduce_scatter: input of {input.numel()} elements does not split "
                             f"into {self.size} equal chunks (pad it to a multiple of {self.size})")
        check_pair("reduce_scatter", output, input, input.numel() // self.size)
        self._check_op(op, input)
        return self._run("reduce_scatter", input.numel() * input.element_size(),
                         lambda: self._reduce_scatter(output, input, op), output, async_op)

    def all_gather(self, output: Tensor, input: Tensor, async_op: bool = False) -> Work | Tensor:
        """``output`` (size * n elements) = every rank's ``input`` (n elements), in rank order."""
        check_pair("all_gather", output, input, input.numel() * self.size)
        return self._run("all_gather", output.numel() * output.element_size(),
                         lambda: self._all_gather(output, input), output, async_op)

    def all_to_all(self, output: Tensor, input: Tensor, async_op: bool = False) -> Work | Tensor:
        """Chunk j of ``input`` goes to rank j; chunk i of ``output`` comes from rank i."""
        if input.numel() % self.size:
            raise ValueError(f"all_to_all: input of {input.numel()} elements does not split into "
                             f"{self.size} equal chunks")
        check_pair("all_to_all", output, input, input.numel())
        return self._run("all_to_all", input.numel() * input.element_size(),
                         lambda: self._all_to_all(output, input), output, async_op)

    def broadcast(self, tensor: Tensor, src: int = 0, async_op: bool = False) -> Work | Tensor:
        """In place: every rank gets ``tensor`` of group rank ``src``."""
        if not 0 <= src < self.size:
            raise ValueError(f"broadcast: src must be a group rank in [0, {self.size}), got {src}")
        check_tensor("tensor", tensor)
        return self._run("broadcast", tensor.numel() * tensor.element_size(),
                         lambda: self._broadcast(tensor, src), tensor, async_op)

    def barrier(self) -> None:
        t = torch.zeros(1, device=self.device)
        self._run("all_reduce", 0, lambda: self._all_reduce(t, ReduceOp.SUM), t, False)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def stream_ordered(self) -> bool:
        """Whether ``wait()`` only orders the current stream after the work (torch's NCCL, the
        native transport by default): a host wait on a job then bounds its issue, not the wire."""
        return self._stream_wait

    def raise_if_failed(self, what: str) -> None:
        """Raise :attr:`failure` (the watchdog aborted the communicator: what its collectives
        left is undefined), as a RuntimeError naming ``what`` was waited for; else nothing."""
        if self.failure is not None:
            raise RuntimeError(f"{what}: {self.failure}") from self.failure

    # ---- helpers ----
    def _check_op(self, op: ReduceOp, t: Tensor) -> None:
        check_op(op, t)

    def _run(self, collective: str, nbytes: int, issue: Callable[[], Any], result: Tensor,
             async_op: bool) -> Work | Tensor:
        self.stats.record_issue(self.tier, wire_bytes(collective, nbytes, self.size))
        t0 = time.perf_counter()
        handle = issue()
        post = None
        if isinstance(handle, tuple):  # (handle, post-processing)
            handle, post = handle
        work = Work(handle, self.tier, self.stats, t0, self.timeout, post, result, self._stream_wait)
        return work if async_op else work.wait()

    # ---- implementations ----
    @abstractmethod
    def _all_reduce(self, tensor: Tensor, op: ReduceOp) -> Any: ...

    @abstractmethod
    def _reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp) -> Any: ...

    @abstractmethod
    def _all_gather(self, output: Tensor, input: Tensor) -> Any: ...

    @abstractmethod
    def _all_to_all(self, output: Tensor, input: Tensor) -> Any: ...

    @abstractmethod
    def _broadcast(self, tensor: Tensor, src: int) -> Any: ...
