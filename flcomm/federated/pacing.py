"""When FedAvg's fragments sync: every E local steps, or on the wall clock so that no federation
group waits for a slow one (``sync_period_s``, :class:`TimedSchedule`).

By steps (:class:`StepSchedule`, the paper's rule): fragment k of K syncs at the local steps with
``(step - k E / K) % E == 0``; every group runs E steps per round, so the fastest waits at
every sync for the slowest.

By time (``sync_period_s`` = T), the rule, as :class:`TimedSchedule` and the exchange run it:

1. At construction the ranks agree on a start time t0: the largest ``clock()`` over the
   federation group, then over the fed dim (two one-element all-reduces).
2. Sync event p = 1, 2, ... is due at ``t0 + p T / K`` and moves fragment ``(p - 1) % K``.
3. At every step boundary (``FedAvg.step(tokens=n)``), the ranks of a federation group sum
   ``[clock() >= the next event's deadline, n]`` over the group (one two-element all-reduce on
   the group's fast links, read on the host). The group starts the next event at the first
   boundary where any of its ranks has passed the deadline; at most one event per boundary
   (a group that fell more than one period behind, e.g. paused by an evaluation, catches up one
   event per step). ``n`` defaults to 1 per rank: the group's tokens are then its steps times
   its ranks. The same all-reduce carries each rank's step time (from the end of its last
   ``FedAvg.step()``: syncs left out): once the median of the group's mean step over its last 5
   steps (from its third step on; the first ones carry one-time costs) is longer than T / K,
   all of its ranks raise ValueError naming both numbers.
4. Each fragment counts the group's tokens t_g and local steps since its last sync. Its
   exchange first sums both per group over the fed dim (exact, int64, in the exchange's job),
   then weighs the group's delta by ``F t_g / sum(t)`` before the codec (error feedback keeps
   what the codec dropped of the weighted delta), so the fed dim's average is the
   token-weighted mean ``sum_g t_g delta_g / sum_g t_g``; the outer update takes it as it takes
   the plain mean (``avg``: ``anchor += mean``; ``nesterov``: its pseudo-gradient). Buffers take
   the weighted mean too; in the paper's in-place mode the shards themselves are weighted.
5. With overlap k, an exchange is applied k local steps after its start, as by steps; a
   fragment whose next event comes before that is applied first (the wait counts as exposed).

Every group meets the others at each deadline; a fast group waits at a sync only for the slow
group's step in progress and the exchange, and the slow group's fewer steps count by their
tokens. Each applied round is a :class:`RoundRecord` (``FedAvg.schedule.rounds``): the groups that took
part, their tokens, steps and staleness (0: every group takes part in every round).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from flcomm.comm.base import Transport
    from flcomm.federated.fragment import Fragment

__all__ = ["RoundRecord", "StepSchedule", "TimedSchedule", "check_period"]

WARM_STEPS = 3  # the step time is judged from this boundary on (the first steps carry one-time costs)
RECENT = 5  # ... as the median of the group's mean step at this many last boundaries


@dataclass(frozen=True)
class RoundRecord:
    """One applied round of the timed mode: ``round`` (its sync event p), ``fragment``,
    ``step`` (this rank's local step at its start), per taking-part group (by fed index,
    ``groups``) its ``tokens``, ``steps`` and ``staleness`` (rounds late; 0 here)."""

    round: int
    fragment: int
    step: int
    groups: list[int]
    tokens: list[int]
    steps: list[int]
    staleness: list[int]

    @classmethod
    def of(cls, round_: int, fragment: int, step: int, groups: list[int], tallies: torch.Tensor) -> RoundRecord:
        """From the fed dim's summed (tokens, steps), ``tallies`` (2 x F; read on the host)."""
        tokens, steps = tallies.tolist()
        return cls(round_, fragment, step, groups, tokens, steps, [0] * len(groups))

    def to_dict(self) -> dict:
        return asdict(self)


class StepSchedule:
    """Fragment k of K syncs at the steps with ``(step - k E / K) % E == 0`` (module docstring)."""

    timed = False

    def __init__(self, sync_every: int, fragments: int) -> None:
        self.sync_every, self.fragments = sync_every, fragments
        self.events = 0  # syncs started
        self.rounds: list[RoundRecord] = []  # none by steps

    def offset(self, fragment: int) -> int:
        return fragment * self.sync_every // self.fragments

    def due(self, step: int, tokens: int = 1) -> list[int]:
        """The fragments that start at ``step`` (1-based), counted; ``tokens`` is not."""
        due = self._at(step)
        self.events += len(due)
        return due

    def _at(self, step: int) -> list[int]:
        return [f for f in range(self.fragments) if (step - self.offset(f)) % self.sync_every == 0]

    def step_ended(self) -> None:
        """By steps no step is timed."""

    def hand(self, fragment: Fragment) -> None:
        """By steps a fragment's round is not weighted."""

    def record(self, fragment: Fragment, groups: list[int]) -> None:
        """By steps no round is recorded."""

    def predictable(self, step: int) -> bool:
        """Whether ``step`` starts a sync, known before it runs."""
        return bool(self._at(step))


class TimedSchedule:
    """The timed rule (module docstring, steps 1-4) of one rank: ``period_s`` (T), ``fragments``
    (K), ``clock`` (seconds; ``time.time`` by default, which is comparable across hosts; a test
    passes a simulated one). :meth:`agree_start` gives it the federation group's transport."""

    timed = True

    def __init__(self, period_s: float, fragments: int, clock: Callable[[], float] | None = None) -> None:
        self.period_s, self.fragments = period_s, fragments
        self.clock = clock or time.time
        self.group: Transport | None = None
        self.device = torch.device("cpu")
        self.t0: float | None = None
        self.events = 0  # sync events started
        self.tokens = [0] * fragments  # the group's tokens and steps since each fragment's last sync
        self.steps = [0] * fragments
        self.rounds: list[RoundRecord] = []  # applied rounds
        self._ended: float | None = None  # the clock at the end of the last FedAvg.step()
        self._recent: list[float] = []  # the group's mean step, at the last RECENT boundaries
        self._seen = 0  # boundaries seen

    def agree_start(self, group: Transport, fed: Transport | None, device: torch.device) -> None:
        """Step 1: t0, the largest clock over the federation group (``group``, which step 3 then
        uses), then over the fed dim (``fed``); ``device``: the transports'."""
        self.group, self.device = group, device
        t = torch.tensor([self.clock()], dtype=torch.float64, device=self.device)
        self.group.all_reduce(t, op="max")
        if fed is not None:
            fed.all_reduce(t, op="max")
        self.t0 = float(t.item())

    def deadline(self, event: int) -> float:
        """When sync event ``event`` (1-based) is due."""
        assert self.t0 is not None, "agree_start() first"
        return self.t0 + event * self.period_s / self.fragments

    def due(self, step: int, tokens: int = 1) -> list[int]:
        """Step 3 at a step boundary: count the group's ``tokens`` (this rank's for the step) and
        the step, and return the fragment that starts here (at most one)."""
        now = self.clock()
        # NOTE: the step's own time, from the end of the last FedAvg.step() (its syncs left out)
        step_us = 0 if self._ended is None else round((now - self._ended) * 1e6)
        assert self.group is not None, "agree_start() first"
        mine = [int(now >= self.deadline(self.events + 1)), tokens, step_us]
        t = torch.tensor(mine, dtype=torch.int64, device=self.device)
        self.group.all_reduce(t, op="sum")
        passed, group_tokens, group_us = t.tolist()
        self._seen += 1
        if self._ended is not None:
            self._recent = [*self._recent[-(RECENT - 1):], group_us / 1e6 / self.group.size]
        if self._seen >= WARM_STEPS and self._recent:
            check_period(self.period_s / self.fragments, statistics.median(self._recent))
        for f in range(self.fragments):
            self.tokens[f] += group_tokens
            self.steps[f] += 1
        if not passed:
            return []
        self.events += 1
        return [(self.events - 1) % self.fragments]

    def step_ended(self) -> None:
        """``FedAvg.step()`` returns: the next step's time counts from here."""
        self._ended = self.clock()

    def hand(self, fragment: Fragment) -> None:
        """Give the fragment that starts now (step 4) the group's (tokens, steps) since its last
        sync, counted from now on anew, and its event."""
        f = fragment.index
        fragment.counts, fragment.round = (self.tokens[f], self.steps[f]), self.events
        self.tokens[f] = self.steps[f] = 0

    def record(self, fragment: Fragment, groups: list[int]) -> None:
        """The applied round of ``fragment`` (``groups``: the fed dim's federation groups)."""
        if fragment.tallies is not None:
            self.rounds.append(RoundRecord.of(fragment.round, fragment.index, fragment.sync_step, groups,
                                              fragment.tallies))

    def predictable(self, step: int) -> bool:
        """A timed sync is decided at its boundary, not before."""
        return False

    def state_dict(self) -> dict:
        return {"events": self.events, "tokens": list(self.tokens), "steps": list(self.steps)}

    def load_state_dict(self, sd: dict) -> None:
        if len(sd.get("tokens", [])) != self.fragments or len(sd.get("steps", [])) != self.fragments:
            raise ValueError(f"the timed schedule's state has {len(sd.get('tokens', []))} fragments' counts, this "
                             f"run {self.fragments}")
        self.events = int(sd["events"])
        self.tokens, self.steps = [int(x) for x in sd["tokens"]], [int(x) for x in sd["steps"]]
        if self.t0 is not None:  # NOTE: t0 was agreed anew at construction: the next event is a period away
            self.t0 -= self.events * self.period_s / self.fragments


def check_period(period_s: float, step_s: float) -> None:
    """ValueError when the time between two sync events (``period_s``: T / K) cannot hold one
    step (``step_s``, measured)."""
    if math.isfinite(step_s) and step_s > period_s:
        raise ValueError(f"sync_period_s / fragments = {period_s:g} s is shorter than one step of this federation "
                         f"group ({step_s:.3f} s measured): every step would sync; raise sync_period_s above "
                         f"{step_s:.3f} s x fragments")
