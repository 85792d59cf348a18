"""What a slow federation group costs, by steps and by time (``FedAvgConfig.sync_period_s``).

Given each group's step time s_g, the tokens a group trains on per step and the seconds a sync
blocks the loop (``exposed_s``: the exchange's exposed time, about 0 when overlap hides it):

* by steps (every E steps) every group waits at each sync for the slowest: a round takes
  ``E max_g s_g + exposed_s`` and every group trains E steps in it;
* by time (period T; with K fragments one event every T / K) the deadlines are absolute, so a
  round takes T. Blocking, group g reaches the deadline late by u_g (uniform on ``[0, s_g]``,
  independently of the others) and waits there until the last group, L = max_g u_g, then for the
  exchange: it trains ``T - L - exposed_s + u_g`` seconds a round, on average
  ``(T - E[L] - exposed_s + s_g / 2) / s_g`` steps, with
  ``E[L] = integral_0^max s (1 - prod_g min(t / s_g, 1)) dt``. With overlap nobody waits at the
  start: group g trains ``T - exposed_s`` a round, at its own pace.

The figures are per round, in tokens per second; :func:`predict_pacing` reads E, T and the mode
from a :class:`~flcomm.federated.config.FedAvgConfig`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flcomm.federated.config import FedAvgConfig
from flcomm.validate import number

__all__ = ["PacingPrediction", "expected_lateness", "predict_pacing"]


@dataclass(frozen=True)
class PacingPrediction:
    """``round_s``: seconds per round; ``group_tokens_per_s``: per group; ``wait_s``: per group,
    the seconds a round it spends waiting at the sync (for the slower groups and the exchange)."""

    round_s: float
    group_tokens_per_s: list[float]
    wait_s: list[float]

    @property
    def job_tokens_per_s(self) -> float:
        return sum(self.group_tokens_per_s)


def expected_lateness(step_s: Sequence[float], points: int = 4096) -> float:
    """E[max_g U(0, s_g)] (module docstring), by the midpoint rule on ``points`` intervals."""
    top = max(step_s)
    h = top / points
    total = 0.0
    for i in range(points):
        t = (i + 0.5) * h
        cdf = 1.0
        for s in step_s:
            cdf *= min(t / s, 1.0)
        total += (1.0 - cdf) * h
    return total


def predict_pacing(cfg: FedAvgConfig, step_s: Sequence[float], tokens_per_step: float,
                   exposed_s: float = 0.0) -> PacingPrediction:
    """Tokens per second of each group, by ``cfg``'s rule (module docstring)."""
    if not step_s:
        raise ValueError("step_s must name one step time per federation group, got none")
    for g, s in enumerate(step_s):
        number(f"step_s[{g}] (seconds per step of group {g})", s, 0, lo_open=True)
    number("tokens_per_step", tokens_per_step, 0, lo_open=True)
    number("exposed_s", exposed_s, 0)
    if cfg.sync_period_s is None:
        E = cfg.sync_every
        round_s = E * max(step_s) + exposed_s
        return PacingPrediction(round_s, [E * tokens_per_step / round_s for _ in step_s],
                                [E * (max(step_s) - s) + exposed_s for s in step_s])
    period = cfg.sync_period_s / cfg.fragments  # NOTE: one event per T / K, each moving 1/K of the shard
    if max(step_s) > period:
        raise ValueError(f"sync_period_s / fragments = {period:g} s is shorter than the slowest step "
                         f"({max(step_s):g} s): every step would sync")
    if cfg.overlap:
        return PacingPrediction(period, [(period - exposed_s) / s * tokens_per_step / period for s in step_s],
                                [exposed_s for _ in step_s])
    late = expected_lateness(step_s)
    train = [period - late - exposed_s + s / 2 for s in step_s]
    if min(train) <= 0:
        raise ValueError(f"a round of {period:g} s cannot hold the wait for the last group ({late:.3f} s) and the "
                         f"exchange ({exposed_s:g} s): raise sync_period_s")
    return PacingPrediction(period, [t / s * tokens_per_step / period for t, s in zip(train, step_s)],
                            [late - s / 2 + exposed_s for s in step_s])
