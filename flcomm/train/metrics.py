"""Per-step metrics: a JSONL file (one JSON object per line) written by rank 0, and the byte
counts per link tier taken from the FedMesh's :class:`~flcomm.comm.base.CommStats`.

File layout::

    {"config": {...}}                     first line: the run's configuration
    {"step": 1, "loss": ..., ...}         one line per training step (STEP_FIELDS, plus
                                          eval_loss / eval_ppl on evaluation steps)
    {"summary": {...}}                    last line when the run finished

Step fields: ``loss`` (mean over this rank's federation group), ``tokens_per_s`` (all ranks'
tokens of the step over its wall time), ``step_time_s`` (rank 0, forward to ``fed.step()``),
``exposed_comm_s`` (seconds rank 0 was blocked on the FedAvg exchange in the step; 0 for
FSDP/HSDP, whose collectives run inside ``step_time_s``), ``group_wait_s`` (``--nan-policy
stop``: seconds rank 0 spent in the world-wide non-finite checks before a sync, an evaluation
or a checkpoint, mostly waiting for slower federation groups; outside ``exposed_comm_s``; the
check before a sync is inside ``step_time_s``), ``internode_bytes`` /
``intergroup_bytes`` / ``intranode_bytes``, ``time_s`` (wall time since the start), ``tokens``
(cumulative), ``lr``, ``num_syncs`` (FL), ``eval_loss`` / ``eval_ppl`` (evaluation steps).

Byte fields are *per step* and follow the transport convention (bytes one rank puts on the
wire, ring-algorithm counts; see flcomm.comm.base). FedAvg's exchange counts itself through
the mesh's transports. FSDP2 issues its all-gathers and reduce-scatters on its own process
groups, so :class:`FsdpTraffic` records what they put on the wire from the sharded parameter
sizes (exact under the convention: FSDP2 pads dim 0 to a multiple of the shard size).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from flcomm.comm.base import CommStats, LinkTier, wire_bytes
from flcomm.federated.strategy import Strategy

T = TypeVar("T")

if TYPE_CHECKING:
    from flcomm.federated.mesh import FedMesh

STEP_FIELDS = ("step", "loss", "tokens_per_s", "step_time_s", "exposed_comm_s", "internode_bytes",
               "intergroup_bytes")


class MetricsWriter:
    """Appends JSON records to ``path`` (line-buffered: a crash loses at most one line).
    ``path=None`` (or a rank other than 0) writes nothing."""

    def __init__(self, path: str | None, append: bool = False) -> None:
        self.path = path
        self._f: IO[str] | None = None
        if path:
            d = os.path.dirname(os.path.abspath(path))
            os.makedirs(d, exist_ok=True)
            self._f = open(path, "a" if append else "w", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps(record, allow_nan=True) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class RunMetrics:
    """A metrics file read back: its config, step records, summary (None if unfinished) and
    an elastic run's membership changes, in order."""

    path: str
    config: dict[str, Any]
    steps: list[dict[str, Any]]
    summary: dict[str, Any] | None
    membership: list[dict[str, Any]] = field(default_factory=list)

    @property
    def label(self) -> str:
        c = self.config
        if not c:
            return os.path.basename(self.path)
        s = c.get("strategy", "?")
        if s in Strategy.values() and Strategy.parse(s).federated:
            fed = c.get("fedavg", c)  # NOTE: files written before FedAvgConfig kept its fields at the top
            s += f" E={fed.get('sync_every')} {fed.get('codec')}"
        if c.get("replicate_codec", "none") != "none":
            s += f" rep={c['replicate_codec']}" + ("+ef" if c.get("replicate_error_feedback") else "")
        return s

    def evals(self) -> list[dict[str, Any]]:
        return [r for r in self.steps if r.get("eval_loss") is not None]


def eval_at_time(steps: list[dict[str, Any]], t: float) -> float | None:
    """Eval loss at wall time ``t``, linear between evaluations (None before the first, the
    last one after it)."""
    ev = [(r["time_s"], r["eval_loss"]) for r in steps if r.get("eval_loss") is not None]
    if not ev or t < ev[0][0]:
        return None
    for (t0, l0), (t1, l1) in zip(ev, ev[1:]):
        if t0 <= t <= t1:
            return l0 + (l1 - l0) * (t - t0) / (t1 - t0) if t1 > t0 else l1
    return ev[-1][1]


def read_metrics(path: str) -> RunMetrics:
    """Parse a metrics JSONL file. A resumed run appends to the same file: a step seen twice
    keeps its last record."""
    config: dict[str, Any] = {}
    by_step: dict[int, dict[str, Any]] = {}
    summary = None
    membership: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(_lines(f, path), 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
            if "config" in rec:
                config = rec["config"]
            elif "summary" in rec:
                summary = rec["summary"]
            elif "membership" in rec:
                membership.append(rec["membership"])
            elif "step" in rec:
                by_step[int(rec["step"])] = rec
    return RunMetrics(path, config, [by_step[k] for k in sorted(by_step)], summary, membership)


def _lines(f: Any, path: str) -> Any:
    """The lines of text file ``f``; a ValueError names ``path`` if it is not UTF-8."""
    try:
        yield from f
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not a metrics file: it is not UTF-8 text ({e.reason})") from None


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")


class TierCounter:
    """Per-step deltas of a CommStats' bytes per tier."""

    def __init__(self, stats: CommStats) -> None:
        self.stats = stats
        self._last = {t: stats.bytes(t) for t in LinkTier}

    def excluding(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` and leave the bytes it moves out of the next :meth:`delta` (evaluation's
        FSDP all-gathers are not training traffic)."""
        before = {t: self.stats.bytes(t) for t in LinkTier}
        out = fn()
        for t in LinkTier:
            self._last[t] += self.stats.bytes(t) - before[t]
        return out

    def delta(self) -> dict[LinkTier, int]:
        now = {t: self.stats.bytes(t) for t in LinkTier}
        d = {t: now[t] - self._last[t] for t in LinkTier}
        self._last = now
        return d


class FsdpTraffic:
    """What FSDP2's own collectives put on the wire per training step, recorded into the mesh's
    CommStats at the tier of the shard (and replicate) groups.

    Per FSDP unit with unsharded padded size B bytes (all parameters of the unit, dim 0 padded
    to a multiple of S):
      * forward all-gather over the S shard ranks, and a second one in backward for units that
        reshard after forward (every decoder block; not the root, which keeps its parameters
        until backward): (S-1)/S * B each;
      * gradient reduce-scatter over the shard ranks: (S-1)/S * B (in the reduce dtype);
      * HSDP: all-reduce of the reduced shard over the R replicas: 2(R-1)/R * B/S.

    ``count_shard_dim=False`` leaves out the shard-dim collectives, for when flcomm's
    hierarchical FSDP hooks run them and count them through their transports;
    ``count_replicate_dim=False`` the replicate all-reduce, for when flcomm's replicate hook
    runs it (``--replicate-codec``) and counts it through its transport.
    """

    def __init__(self, units: Iterable[tuple[nn.Module, bool]], mesh: FedMesh,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 count_shard_dim: bool = True, count_replicate_dim: bool = True) -> None:
        F_, R, S = mesh.topology.mesh_shape
        self.stats = mesh.stats
        self.shard_tier = mesh.tier("shard")
        self.replicate_tier = mesh.tier("replicate")
        self.records: list[tuple[LinkTier, int]] = []
        seen: set[int] = set()
        units = list(units)
        # NOTE: a unit owns the parameters of its subtree that no inner unit owns: walk the
        # innermost units first.
        for module, reshards in units:
            numel_padded = 0
            for p in module.parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                shape = tuple(p.shape)  # the global (unsharded) shape, also for DTensors
                rows = shape[0] if shape else 1
                rest = math.prod(shape[1:]) if len(shape) > 1 else 1
                numel_padded += math.ceil(rows / S) * S * rest
            if numel_padded == 0:
                continue
            pb = torch.finfo(param_dtype).bits // 8 if param_dtype else 4
            rb = torch.finfo(reduce_dtype).bits // 8 if reduce_dtype else pb
            n_ag = 2 if reshards else 1
            if count_shard_dim:
                for _ in range(n_ag):
                    self.records.append((self.shard_tier, wire_bytes("all_gather", numel_padded * pb, S)))
                self.records.append((self.shard_tier, wire_bytes("reduce_scatter", numel_padded * rb, S)))
            if R > 1 and count_replicate_dim:
                self.records.append((self.replicate_tier,
                                     wire_bytes("all_reduce", numel_padded // S * rb, R)))
        self.bytes_per_step = {t: 0 for t in LinkTier}
        for t, b in self.records:
            self.bytes_per_step[t] += b

    def record_step(self) -> None:
        for tier, nbytes in self.records:
            if nbytes:
                self.stats.record_issue(tier, nbytes)
