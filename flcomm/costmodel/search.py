"""Searches over the cost model (:mod:`flcomm.costmodel.model`): where federated training
stops paying (the crossover of the inter/intra bandwidth ratio and of E), and which plan to
recommend for a cluster."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from flcomm.codecs import get_codec
from flcomm.comm.base import format_bytes
from flcomm.costmodel.model import Cluster, Plan, Prediction, Strategy, Workload, predict, speedup
from flcomm.federated.config import AUTO, FedAvgConfig
from flcomm.validate import integer, number

__all__ = ["Crossover", "Recommendation", "crossover_bandwidth_ratio", "crossover_sync_every", "recommend"]

# NOTE: order used to break ties in recommendations: least lossy first.
_CODEC_LOSS_ORDER = ("none", "bf16", "fp16", "fp8", "int8", "topk")
#: the codecs :func:`recommend` considers by default: the dense ones and top-k at 2%, 2 bits
DEFAULT_CODECS = ("none", "bf16", "int8", "fp8", "topk:d=0.02:bits=2")


# ---------------------------------------------------------------- crossover ----

@dataclass(frozen=True)
class Crossover:
    """Where ``speedup(plan vs baseline)`` crosses ``threshold`` as ``param`` varies.

    ``value`` is None when it does not cross in [lo, hi]; then ``speedup_lo``/``speedup_hi``
    say on which side it stays."""

    param: str
    value: float | None
    threshold: float
    lo: float
    hi: float
    speedup_lo: float
    speedup_hi: float

    def describe(self) -> str:
        if self.value is not None:
            return f"speedup crosses {self.threshold:g}x at {self.param} = {self.value:.4g}"
        side = "above" if min(self.speedup_lo, self.speedup_hi) >= self.threshold else "below"
        return (f"no crossing for {self.param} in [{self.lo:g}, {self.hi:g}]: speedup stays {side} "
                f"{self.threshold:g}x ({self.speedup_lo:.3g}x .. {self.speedup_hi:.3g}x)")


def crossover_bandwidth_ratio(cluster: Cluster, workload: Workload, plan: Plan, baseline: Plan | str = "fsdp",
                              threshold: float = 1.0, lo: float = 1e-5, hi: float = 1.0,
                              tol: float = 1e-4) -> Crossover:
    """The inter/intra bandwidth ratio (per rank, :attr:`Cluster.bandwidth_ratio`) above which
    ``plan`` stops reaching ``threshold`` x the baseline's tokens/s.

    Steps: scale the inter-node and inter-group bandwidth together so the ratio spans [lo, hi]
    on a log grid of 64 points; take the first adjacent pair where speedup - threshold changes
    sign; bisect it in log space to relative width ``tol``.
    """
    number("threshold", threshold, 0, lo_open=True)
    if not 0 < lo < hi:
        raise ValueError(f"need 0 < lo < hi, got lo={lo}, hi={hi}")
    r0 = cluster.bandwidth_ratio

    def f(r: float) -> float:
        return speedup(cluster.scale_inter(r / r0), workload, plan, baseline)

    return _crossing("inter/intra bandwidth ratio", f, threshold, lo, hi, tol)


def _crossing(param: str, f, threshold: float, lo: float, hi: float, tol: float) -> Crossover:
    grid = [lo * (hi / lo) ** (i / 63) for i in range(64)]
    vals = [f(x) - threshold for x in grid]
    for (a, fa), (b, fb) in zip(zip(grid, vals), zip(grid[1:], vals[1:])):
        if fa == 0:
            return Crossover(param, a, threshold, lo, hi, vals[0] + threshold, vals[-1] + threshold)
        if (fa > 0) != (fb > 0):
            while b / a > 1 + tol:
                mid = math.sqrt(a * b)
                fm = f(mid) - threshold
                if (fm > 0) == (fa > 0):
                    a, fa = mid, fm
                else:
                    b = mid
            return Crossover(param, math.sqrt(a * b), threshold, lo, hi, vals[0] + threshold, vals[-1] + threshold)
    return Crossover(param, None, threshold, lo, hi, vals[0] + threshold, vals[-1] + threshold)


def crossover_sync_every(cluster: Cluster, workload: Workload, plan: Plan, baseline: Plan | str = "fsdp",
                         threshold: float = 1.0, max_sync_every: int = 1024) -> Crossover:
    """The smallest E in [1, max_sync_every] at which ``plan`` reaches ``threshold`` x the
    baseline (its speedup grows with E; bisection over integers)."""
    if not plan.strategy.federated:
        raise ValueError(f"sync_every only matters for fl-fsdp / fl-hsdp, got {plan.strategy.value}")
    integer("max_sync_every", max_sync_every, 1)

    def s(E: int) -> float:
        return speedup(cluster, workload, plan.with_fedavg(sync_every=E), baseline)

    s_lo, s_hi = s(1), s(max_sync_every)
    if s_lo >= threshold:
        return Crossover("sync_every", 1.0, threshold, 1, max_sync_every, s_lo, s_hi)
    if s_hi < threshold:
        return Crossover("sync_every", None, threshold, 1, max_sync_every, s_lo, s_hi)
    a, b = 1, max_sync_every  # s(a) < threshold <= s(b)
    while b - a > 1:
        mid = (a + b) // 2
        if s(mid) >= threshold:
            b = mid
        else:
            a = mid
    return Crossover("sync_every", float(b), threshold, 1, max_sync_every, s_lo, s_hi)


# ---------------------------------------------------------------- recommendation ----

@dataclass(frozen=True)
class Recommendation:
    best: Prediction
    ranked: list[Prediction]
    reason: str
    left_out: str = ""  # which plans did not fit in memory, and why
    memory_bytes: float = math.inf  # the limit every ranked plan fits in (inf: not checked)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def recommend(cluster: Cluster, workload: Workload, *, memory_bytes: float,
              codecs: Sequence[str] = DEFAULT_CODECS, max_sync_every: int = 32,
              allow_overlap: bool = True, tolerance: float = 0.05, top: int = 10) -> Recommendation:
    """Recommend strategy, group size, E and codec for ``cluster`` among the plans that fit in
    ``memory_bytes`` per rank (required: ``math.inf`` skips the check, and the reason says so).

    Steps:
      1. enumerate the valid plans: FSDP, HSDP (every S that divides P), and for FL every G
         dividing P (< P) and every S of G, E in powers of two up to ``max_sync_every``, each
         codec, overlap off/on;
      2. drop plans whose estimated memory per rank (:func:`~flcomm.costmodel.model.memory_per_rank`:
         sharded state, FSDP's unsharded working set, FedAvg's buffers, activations) exceeds
         ``memory_bytes``, and say which;
      3. predict each; among those within ``tolerance`` of the best tokens/s, prefer the one
         closest to synchronous training: fewest groups, then smallest E, least lossy codec,
         no overlap (an overlapped exchange is applied one step late).
    NOTE: the model knows time, not convergence; the preference in step 3 stands in for it,
    and ``max_sync_every`` caps how stale the groups may get.
    """
    for c in codecs:
        get_codec(c)  # NOTE: raises ValueError naming the known codecs
    if memory_bytes != math.inf:
        number("memory_bytes", memory_bytes, 0, lo_open=True, also=" per rank (math.inf skips the check)")
    integer("max_sync_every", max_sync_every, 1)
    P, L = cluster.world_size, cluster.ranks_per_node
    Es = [2 ** i for i in range(int(math.log2(max_sync_every)) + 1)]
    plans: list[Plan] = [Plan(Strategy.FSDP)]
    for S in _divisors(P):
        if S < P and (S % L == 0 or L % S == 0):
            plans.append(Plan(Strategy.HSDP, shard_size=S))
    for G in _divisors(P):
        if G == P or (G % L and L % G):
            continue
        for S in _divisors(G):
            if S % L and L % S:
                continue
            st = Strategy.FL_FSDP if S == G else Strategy.FL_HSDP
            for E in Es:
                for codec in codecs:
                    for ov in ((False, True) if allow_overlap else (False,)):
                        # NOTE: a lossy codec runs with error feedback, as it should
                        fed = FedAvgConfig(sync_every=E, codec=codec, error_feedback=codec != "none",
                                           overlap_steps=AUTO if ov else 0)
                        plans.append(Plan(st, G, S if st.hybrid else None, fed))
    preds, too_big = [], []
    for pl in plans:
        try:
            pr = predict(cluster, workload, pl)
        except ValueError:
            continue
        (too_big if pr.memory_total > memory_bytes else preds).append(pr)
    left_out = _left_out(too_big, memory_bytes)
    if not preds:
        raise ValueError(f"no plan fits: {left_out}")
    preds.sort(key=lambda p: -p.tokens_per_s)
    best_tps = preds[0].tokens_per_s

    def closeness(p: Prediction) -> tuple:
        return (p.world_size // p.group_size, p.plan.sync_every if p.plan.strategy.federated else 0,
                _CODEC_LOSS_ORDER.index(get_codec(p.plan.codec).name) if p.plan.strategy.federated else 0,
                p.plan.overlap, -p.tokens_per_s)

    near = [p for p in preds if p.tokens_per_s >= (1 - tolerance) * best_tps]
    best = min(near, key=closeness)
    reason = (f"{best.plan.label()}: {best.tokens_per_s:.4g} tokens/s, within {100 * tolerance:g}% of the "
              f"fastest plan ({preds[0].plan.label()}, {best_tps:.4g} tokens/s) and the closest to "
              f"synchronous training among those ({len(near)} candidates); "
              + (f"needs {format_bytes(best.memory_total)} of {format_bytes(memory_bytes)} per rank"
                 if memory_bytes != math.inf else
                 f"MEMORY NOT CHECKED: it needs {format_bytes(best.memory_total)} per rank"))
    return Recommendation(best, preds[:top], reason, left_out, memory_bytes)


def _left_out(too_big: list[Prediction], memory_bytes: float) -> str:
    if not too_big:
        return ""
    fastest = max(too_big, key=lambda p: p.tokens_per_s)
    parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in fastest.memory_bytes.items() if v)
    return (f"{len(too_big)} plans need more than {format_bytes(memory_bytes)} per rank, e.g. the fastest of "
            f"them, {fastest.plan.label()} ({fastest.tokens_per_s:.4g} tokens/s): "
            f"{format_bytes(fastest.memory_total)} ({parts})")

