"""The accounting of :attr:`FedAvg.exposed_comm_s <flcomm.federated.fedavg.FedAvg.exposed_comm_s>`:
the time the training loop spent on the exchange (starting a sync, waiting for an apply), on the
host clock on CPU and between CUDA events on the compute stream on CUDA."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ExposedTime", "cuda_event"]


def cuda_event(device: torch.device | None = None) -> Any:
    """A timing event recorded now on the current CUDA stream of ``device``."""
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(torch.cuda.current_stream(device))
    return ev


_FOLD_AT = 256  # pending windows before the completed ones are folded in (:meth:`ExposedTime.end`)


class ExposedTime:
    """The accounting of exposed time, window by window (a sync's start, an apply: what the
    training loop does for the exchange).

    * CPU (``events=False``): the host seconds of each window (``clock``).
    * CUDA (``events=True``): only the time the compute stream spent between two events recorded
      at the window's ends (``new_event()``: an event recorded on the current stream). A host
      wait for a late exchange shows there already (the stream runs dry while the host waits),
      so the host time is not added: a late exchange is counted once. The caller keeps host
      reads of device values out of the windows (they would drain the compute stream into it).

    Events are read (synchronized) only by :attr:`seconds`.
    """

    def __init__(self, events: bool, clock: Callable[[], float] = time.perf_counter,
                 new_event: Callable[[], Any] = cuda_event) -> None:
        self.events = events
        self._clock, self._new_event = clock, new_event
        self._s = 0.0
        self._pending: list[tuple[Any, Any]] = []

    def begin(self) -> tuple[float, Any]:
        return self._clock(), self._new_event() if self.events else None

    def end(self, token: tuple[float, Any]) -> None:
        t0, ev0 = token
        if ev0 is None:
            self._s += self._clock() - t0
        else:
            self._pending.append((ev0, self._new_event()))
            if len(self._pending) > _FOLD_AT:
                self._fold_done()

    def _fold_done(self) -> None:
        """Adds the windows whose end event has completed and drops their events, without a
        sync: a run that never reads :attr:`seconds` keeps a bounded list of events."""
        done = 0
        for e0, e1 in self._pending:
            if not e1.query():
                break
            self._s += e0.elapsed_time(e1) / 1e3
            done += 1
        del self._pending[:done]

    @property
    def seconds(self) -> float:
        for e0, e1 in self._pending:
            e1.synchronize()
            self._s += e0.elapsed_time(e1) / 1e3
        self._pending.clear()
        return self._s

    def reset(self, value: float = 0.0) -> None:
        self._pending.clear()
        self._s = float(value)
