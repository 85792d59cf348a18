"""``overlap_steps="auto"``: the smallest k that hides the exchange, measured.

FedAvg starts with the largest k it allows (``k_max = E / K``: the most hiding, and fragments
never meet) and, per rank, times its exchanges (:meth:`Job.seconds
<flcomm.comm.engine.Job.seconds>`: on CUDA the communication stream's time from the submit
point, on the CPU the job's run time) against the steps that ran meanwhile (the median interval
between ``FedAvg.step()`` calls). The first exchange is left out: it carries one-time costs
(staging buffers, codec plans, the transports' first use). After :data:`SAMPLES` more, a rank
proposes ``ceil(MARGIN * exchange / step)`` clamped to ``[1, k_max]``; FedAvg then takes the
largest proposal of the federation group (a max over the group), so every rank of a group
applies at the same step (groups need not agree: each applies its own copy of the average), and
keeps it (:meth:`AutoOverlap.settle`), logs it once, and saves it with its state.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from flcomm.comm.base import Transport

__all__ = ["MARGIN", "SAMPLES", "AutoOverlap", "steps_to_hide"]

_log = logging.getLogger("flcomm.federated.fedavg")

MARGIN = 1.25  # the exchange must fit in k steps with this much room (jitter, a slower step)
SKIP = 1  # exchanges left out of the measurement (one-time costs)
SAMPLES = 2  # exchanges measured before a rank proposes its k


def steps_to_hide(exchange_s: float, step_s: float, k_max: int) -> int:
    """The smallest k in [1, k_max] with ``k * step_s >= MARGIN * exchange_s`` (k_max for a step
    of no time). The cost model predicts ``"auto"`` with it too."""
    if step_s <= 0:
        return k_max
    return max(1, min(k_max, math.ceil(MARGIN * exchange_s / step_s)))


class AutoOverlap:
    """The measurement of one FedAvg (module docstring). ``k``: the k to use now."""

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max
        self.chosen: int | None = None
        self.exchange_s: float | None = None  # what the choice was measured on
        self.step_s: float | None = None
        self._last: float | None = None
        self._intervals: list[float] = []
        self._seen = 0
        self._samples: list[tuple[float, float]] = []

    @property
    def k(self) -> int:
        """The chosen k once settled, k_max while measuring."""
        return self.k_max if self.chosen is None else self.chosen

    @property
    def measuring(self) -> bool:
        return self.chosen is None

    def tick(self, now: float | None = None) -> None:
        """A step ended (``FedAvg.step()`` is called): the interval since the last one counts."""
        now = time.perf_counter() if now is None else now
        if self._last is not None and self.measuring:
            self._intervals.append(now - self._last)
        self._last = now


    def sample(self, exchange_s: float) -> int | None:
        """An exchange was applied on time, after ``exchange_s`` seconds of work; returns this
        rank's proposal once :data:`SAMPLES` exchanges past the first are in, else None."""
        intervals, self._intervals = self._intervals, []
        self._seen += 1
        if self._seen <= SKIP or not self.measuring:
            return None
        # NOTE: no interval (steps not ticked) counts as a step of 0 s: k_max
        self._samples.append((exchange_s, statistics.median(intervals) if intervals else 0.0))
        if len(self._samples) < SAMPLES:
            return None
        return max(steps_to_hide(x, s, self.k_max) for x, s in self._samples)

    def applied(self, seconds: Callable[[], float], group: Transport, device: torch.device, step: int) -> None:
        """An exchange was applied on time: while measuring, its ``seconds()`` (on CUDA a wait
        for its end event: only then) are sampled; once this rank proposes, the largest proposal
        of the federation group (``group``) is taken from now on (every rank of a group must
        apply at the same step; the groups need not agree) and logged at ``step``."""
        if not self.measuring or (proposal := self.sample(seconds())) is None:
            return
        k = torch.tensor([proposal], dtype=torch.int32, device=device)
        group.all_reduce(k, op="max")
        self.settle(int(k.item()))
        _log.info("FedAvg: overlap_steps='auto' chose k=%d at step %d (exchange %.3f s, step %.3f s, k_max %d)",
                  self.k, step, self.exchange_s or 0.0, self.step_s or 0.0, self.k_max)

    def settle(self, k: int) -> None:
        """Use ``k`` from now on (the world's agreed choice, or a checkpoint's)."""
        self.chosen = max(1, min(self.k_max, int(k)))
        if self._samples:
            self.exchange_s = max(x for x, _ in self._samples)
            self.step_s = statistics.median(s for _, s in self._samples)
