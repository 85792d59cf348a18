"""The native transport's watchdog: every outstanding NCCL work has a deadline.

NCCL bounds nothing by itself: a stream-ordered wait (``NcclWork.stream_wait``, a
``cudaStreamWaitEvent``) returns at once, and a kernel whose peer died or froze spins forever, so
the host hangs at its next read of a result. ProcessGroupNCCL has a watchdog thread for that;
this is flcomm's, for :class:`~flcomm.comm.nccl.NcclTransport`.

Rules (one thread per process, started with the first watched work):

1. every work an NcclTransport launches is watched, with a deadline of its issue time plus the
   transport's timeout;
2. every ``POLL_S`` (at most a tenth of the shortest timeout) the thread polls each outstanding
   work (``is_completed``: a CUDA event query and ``ncclCommGetAsyncError``); a completed one is
   dropped;
3. a work past its deadline, or whose communicator reported an asynchronous error, ends its
   communicator: ``ncclCommAbort``, so its kernels exit and whatever waits behind them (a host
   read, the stream) runs on; the transport's :attr:`failure` is set, once, to a
   :class:`CommFailure` naming the tier, the rank, the peers (global ranks, where known), the
   operation and how long it was outstanding;
4. the transport's users read it after their waits (:meth:`Transport.raise_if_failed
   <flcomm.comm.base.Transport.raise_if_failed>`): what an aborted collective left is undefined,
   so it is never used.

``FLCOMM_NCCL_WATCHDOG=0`` turns it off for transports made afterwards. Nothing then bounds a
lost peer on the native transport: the job hangs, as NCCL does.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

__all__ = ["CommFailure", "Watchdog", "enabled", "get_watchdog"]

_log = logging.getLogger(__name__)

ENV = "FLCOMM_NCCL_WATCHDOG"
POLL_S = 0.1  # the longest wait between two polls


def enabled() -> bool:
    """Whether transports made now are watched (``FLCOMM_NCCL_WATCHDOG``, default on)."""
    raw = os.environ.get(ENV, "1").strip().lower()
    if raw not in ("0", "1", "false", "true", "off", "on", ""):
        raise ValueError(f"{ENV} must be 0 or 1, got {raw!r}")
    return raw not in ("0", "false", "off")


class CommFailure(RuntimeError):
    """A native collective that did not complete within its transport's timeout, or whose
    communicator reported an NCCL error; the watchdog aborted the communicator.

    Attributes: ``tier`` (the link tier's name), ``rank`` (this rank in the communicator),
    ``peers`` (the members' global ranks, or None), ``op``, ``reason``, ``seconds`` (how long
    the work was outstanding)."""

    def __init__(self, tier: str, rank: int, peers: list[int] | None, op: str, reason: str,
                 seconds: float) -> None:
        who = f"of global ranks {peers}" if peers is not None else "(members unknown)"
        super().__init__(f"the {op} on the {tier} NCCL communicator {who} (here its rank {rank}) {reason} "
                         f"after {seconds:.1f} s; the watchdog aborted the communicator")
        self.tier, self.rank, self.peers, self.op, self.reason, self.seconds = tier, rank, peers, op, reason, seconds


@dataclass
class _Entry:
    transport: weakref.ref
    work: Any
    op: str
    t0: float
    deadline: float


class Watchdog:
    """The process's watchdog thread (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[_Entry] = []
        self._thread: threading.Thread | None = None
        self._poll_s = POLL_S

    def watch(self, transport: Any, work: Any, op: str) -> None:
        """Rule 1: watch ``work`` (a native NcclWork) of ``transport`` until it completes."""
        now = time.monotonic()
        timeout = transport.timeout.total_seconds()
        entry = _Entry(weakref.ref(transport), work, op, now, now + timeout)
        with self._lock:
            self._entries.append(entry)
            self._poll_s = min(self._poll_s, max(0.005, timeout / 10))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, daemon=True, name="flcomm-nccl-watchdog")
                self._thread.start()

    def forget(self, transport: Any) -> None:
        """Stop watching ``transport``'s works (it is being aborted or closed on purpose)."""
        with self._lock:
            self._entries = [e for e in self._entries if e.transport() not in (None, transport)]

    def outstanding(self) -> int:
        with self._lock:
            return len(self._entries)

    def _loop(self) -> None:
        while True:
            time.sleep(self._poll_s)
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - NOTE: the thread is the bound: it must outlive a bad poll
                _log.exception("flcomm NCCL watchdog: a poll failed")

    def poll(self) -> None:
        """Rules 2-3, once."""
        with self._lock:
            entries = list(self._entries)
        done, failed = set(), []
        now = time.monotonic()
        for e in entries:
            t = e.transport()
            if t is None:
                done.add(id(e))
                continue
            try:
                if e.work.is_completed():
                    done.add(id(e))
                    continue
            except Exception as err:  # noqa: BLE001 - an asynchronous NCCL error: the binding aborted
                if getattr(t, "_deliberate", False):  # NOTE: aborted or closed by its owner
                    done.add(id(e))
                    continue
                failed.append((t, e, f"failed: {err}"))
                continue
            if now > e.deadline:
                failed.append((t, e, f"did not complete within {t.timeout.total_seconds():g} s (a peer is lost "
                                     f"or stuck)"))
        for t, e, reason in failed:
            self._fail(t, e, reason, now)
        hit = {id(t) for t, _, _ in failed}
        with self._lock:
            self._entries = [e for e in self._entries
                             if id(e) not in done and id(e.transport()) not in hit]

    def _fail(self, transport: Any, e: _Entry, reason: str, now: float) -> None:
        if transport.failure is None:
            transport.failure = CommFailure(transport.tier.value, transport.rank, transport.ranks, e.op, reason,
                                            now - e.t0)
            _log.error("flcomm NCCL watchdog: %s", transport.failure)
        try:
            transport.comm.abort()
        except Exception:  # noqa: BLE001 - already aborted or destroyed
            pass


_WATCHDOG = Watchdog()


def get_watchdog() -> Watchdog:
    """The process's watchdog."""
    return _WATCHDOG
