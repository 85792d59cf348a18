"""Alpha-beta cost model of FSDP, HSDP, FL+FSDP and FL+HSDP on a two-tier cluster.

The model predicts a training step's time from the model size, the cluster's shape and the
bandwidth and latency of each link tier, finds where federated training stops paying, and
recommends a configuration. ``--measure`` probes the tiers of the cluster it runs on.

Units and conventions
---------------------
* ``Link.bandwidth`` in bytes/s, ``Link.latency`` in s (per ring step, the alpha term).
  - intra-node: the bus bandwidth one rank reaches in a ring over its node's ranks;
  - inter-node and inter-group: the egress bandwidth of one whole **node** (all its NICs);
    the ranks of a node that cross it at the same time share it.
* A collective of kind k on a buffer of B bytes over n ranks costs, on one tier,
  ``steps(k, n) * alpha + factor(k, n) * B / bw`` with the ring's
  ``steps = n-1 (reduce_scatter, all_gather), 2(n-1) (all_reduce)`` and the nccl-tests
  ``factor = (n-1)/n, (n-1)/n, 2(n-1)/n`` (B: the full, unsharded buffer).
* A group of n ranks spread over k nodes with m ranks on each, of which c such groups share a
  node (c = ranks_per_node / m):
  - k = 1: intra-node ring;
  - flat (m >= 1, k > 1): one ring in rank order; it leaves each node once, so the node's NIC
    carries ``c * factor(n) * B`` and each rank ``factor(n) * B`` on its intra link:
    ``steps(n) * alpha_inter + max(c * factor(n) * B / bw_node, factor(n) * B / bw_intra)``;
  - hierarchical (m > 1, k > 1): intra stage over m ranks on B, then inter stage over k nodes
    on B / m, m * c ranks of a node at once (all_reduce: reduce_scatter intra, all_reduce
    inter, all_gather intra).
* Each collective is issued once per FSDP unit on its share of the buffer (``fsdp_units``: the
  latency term counts that often).
* gloo runs a reduce-scatter as a full all-reduce (``Cluster.reduce_scatter_as_all_reduce``).
* Bytes per step are reported in :class:`flcomm.comm.base.CommStats`' convention: the wire
  bytes one rank sends, per tier.

One training step of a rank (P ranks, L per node, federation groups of G ranks, shards of S
ranks, R = G / S replicas, F = P / G groups, N parameters)::

    inner  = a * AG(N * param_bytes over S) + RS(N * grad_bytes over S)
             [+ AR(N * grad_bytes / S over R), HSDP replicas]
    fed    = AR_codec(N / S elements over F), once every E steps (FL only)
    step   = compute + inner - min(fsdp_overlap * inner, compute) + exposed(fed) / E
    exposed(fed) = fed without overlap; max(0, fed - overlap_steps * compute) with overlap

``a`` = all-gathers per step (2: forward and backward with resharding). The FedAvg exchange
is a compressed two-hop all-reduce whose wire bytes equal a ring all-reduce of the encoded
buffer: codec bytes per element none 4, bf16/fp16 2, int8/fp8 1 plus a 4-byte scale per block
(16-byte alignment ignored).

CLI::

    flcomm-costmodel --preset llama3.1-8b-leonardo                  # the four strategies
    flcomm-costmodel --params 1e9 --nodes 16 --ranks-per-node 8 --intra-gbit 2400 \\
        --inter-gbit 400 --tokens-per-rank 8192 --compute-s 1.5 --group-size 8 --sync-every 8 \\
        --codec int8 --crossover --recommend
    torchrun --nproc-per-node 4 -m flcomm.costmodel --measure --ranks-per-node 4 --measure-json m.json
    flcomm-costmodel --cluster-json m.json --params 1e8 ...   # model a measured cluster
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any

from flcomm.comm.base import LinkTier, wire_bytes
from flcomm.kernels import DEFAULT_BLOCK_SIZE

__all__ = [
    "Strategy", "Link", "Cluster", "Workload", "Plan", "Prediction", "Crossover", "Recommendation",
    "CODEC_BYTES", "codec_nbytes", "collective_time", "predict", "predict_strategies", "speedup",
    "crossover_bandwidth_ratio", "crossover_sync_every", "recommend", "compute_time_from_flops",
    "measure_tiers", "PRESETS", "main",
]

GBIT = 1e9 / 8  # bytes/s in one Gbit/s


class Strategy(str, Enum):
    FSDP = "fsdp"
    HSDP = "hsdp"
    FL_FSDP = "fl-fsdp"
    FL_HSDP = "fl-hsdp"

    @property
    def federated(self) -> bool:
        return self in (Strategy.FL_FSDP, Strategy.FL_HSDP)

    @property
    def hybrid(self) -> bool:
        return self in (Strategy.HSDP, Strategy.FL_HSDP)

    @classmethod
    def parse(cls, s: "Strategy | str") -> "Strategy":
        if isinstance(s, Strategy):
            return s
        try:
            return cls(str(s).lower().replace("_", "-").replace("+", "-"))
        except ValueError:
            raise ValueError(f"strategy must be one of {', '.join(x.value for x in cls)}, got {s!r}") from None


# (bytes per element, whether a 4-byte fp32 scale is added per block)
CODEC_BYTES: dict[str, tuple[int, bool]] = {
    "none": (4, False), "bf16": (2, False), "fp16": (2, False), "int8": (1, True), "fp8": (1, True),
}
DEFAULT_BLOCK = DEFAULT_BLOCK_SIZE  # the codecs' block, so model and wire agree
# NOTE: order used to break ties in recommendations: least lossy first.
_CODEC_LOSS_ORDER = ("none", "bf16", "fp16", "fp8", "int8")


def codec_nbytes(codec: str, numel: int, block_size: int = DEFAULT_BLOCK) -> int:
    """Encoded bytes of ``numel`` fp32 elements under ``codec`` (payload + block scales)."""
    if codec not in CODEC_BYTES:
        raise ValueError(f"codec must be one of {', '.join(CODEC_BYTES)}, got {codec!r}")
    if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
        raise ValueError(f"numel must be a non-negative integer, got {numel!r}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    per, scaled = CODEC_BYTES[codec]
    return numel * per + (4 * -(-numel // block_size) if scaled else 0)


def _pos(name: str, v: Any, allow_zero: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {v!r}")
    return float(v)


def _posint(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return v


@dataclass(frozen=True)
class Link:
    """One link tier: ``bandwidth`` in bytes/s (see the module docstring for per-rank vs
    per-node), ``latency`` in seconds per ring step."""

    bandwidth: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        _pos("bandwidth", self.bandwidth)
        _pos("latency", self.latency, allow_zero=True)

    @classmethod
    def gbit(cls, gbit_per_s: float, latency_us: float = 0.0) -> "Link":
        return cls(_pos("bandwidth (Gbit/s)", gbit_per_s) * GBIT, _pos("latency (us)", latency_us, True) * 1e-6)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``ranks_per_node`` ranks; ``intra`` per rank, ``inter_node`` and
    ``inter_group`` per node (``inter_group`` defaults to ``inter_node``: the same fabric).

    ``reduce_scatter_as_all_reduce``: the backend runs a reduce-scatter as a full all-reduce
    and keeps its chunk (gloo does: on the emulated cluster a reduce_scatter_tensor of B bytes
    over 8 ranks on 4 nodes sent 1.76 B per node, the same as an all_reduce, against 0.88 B for
    all_gather_into_tensor); NCCL does not."""

    nodes: int
    ranks_per_node: int
    intra: Link
    inter_node: Link
    inter_group: Link | None = None
    reduce_scatter_as_all_reduce: bool = False

    def __post_init__(self) -> None:
        _posint("nodes", self.nodes)
        _posint("ranks_per_node", self.ranks_per_node)
        for name in ("intra", "inter_node"):
            if not isinstance(getattr(self, name), Link):
                raise TypeError(f"{name} must be a Link, got {type(getattr(self, name)).__name__}")
        if self.inter_group is None:
            object.__setattr__(self, "inter_group", self.inter_node)
        elif not isinstance(self.inter_group, Link):
            raise TypeError(f"inter_group must be a Link or None, got {type(self.inter_group).__name__}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def scale_inter(self, factor: float) -> "Cluster":
        """The same cluster with inter-node and inter-group bandwidth times ``factor``."""
        _pos("factor", factor)
        return replace(self, inter_node=replace(self.inter_node, bandwidth=self.inter_node.bandwidth * factor),
                       inter_group=replace(self.inter_group, bandwidth=self.inter_group.bandwidth * factor))

    @property
    def bandwidth_ratio(self) -> float:
        """Inter-node over intra-node bandwidth, both per rank."""
        return self.inter_node.bandwidth / self.ranks_per_node / self.intra.bandwidth

    @classmethod
    def from_measurement(cls, m: dict, nodes: int | None = None) -> "Cluster":
        """From the JSON ``--measure`` writes (optionally for another node count)."""
        def link(key: str) -> Link | None:
            v = m.get(key)
            return None if not v else Link(float(v["bandwidth_Bps"]), float(v.get("latency_s", 0.0)))

        intra, inter = link("intra_node"), link("inter_node")
        if intra is None or inter is None:
            raise ValueError("measurement must have intra_node and inter_node entries with bandwidth_Bps; "
                             f"got keys {sorted(m)}")
        return cls(nodes or int(m["nodes"]), int(m["ranks_per_node"]), intra, inter, link("inter_group"),
                   reduce_scatter_as_all_reduce=str(m.get("backend", "")).lower() == "gloo")


@dataclass(frozen=True)
class Workload:
    """What one step of one rank does.

    Args:
        params: N, parameters of the model.
        tokens_per_rank: tokens one rank processes per step (tokens/s = P * this / step time).
        compute_s: forward + backward + optimizer time of a step without communication.
        param_bytes: bytes per element of the all-gathered parameters (bf16: 2).
        grad_bytes: bytes per element of the reduce-scattered gradients (bf16: 2, fp32: 4).
        allgathers_per_step: parameter all-gathers per step (2: forward and backward; may be
            fractional, weighted by parameters, e.g. when the root unit is gathered once).
        fsdp_units: FSDP units (e.g. one per transformer block): each in-group collective is
            issued once per unit on 1/units of the buffer, so its latency term counts that often.
        fsdp_overlap: fraction of the in-group communication hidden behind compute (prefetch);
            0 = serial (gloo on CPU), about 0.8-1 with NCCL on GPUs.
        overlap_steps: steps of compute an overlapped FedAvg exchange can hide behind.
        state_bytes_per_param: sharded training state per parameter (bf16 params + fp32
            master + Adam: 16), used for the memory limit of recommendations.
    """

    params: float
    tokens_per_rank: float
    compute_s: float
    param_bytes: int = 2
    grad_bytes: int = 2
    allgathers_per_step: float = 2
    fsdp_units: int = 1
    fsdp_overlap: float = 0.0
    overlap_steps: int = 1
    state_bytes_per_param: float = 16.0

    def __post_init__(self) -> None:
        _pos("params", self.params)
        _pos("tokens_per_rank", self.tokens_per_rank)
        _pos("compute_s", self.compute_s, allow_zero=True)
        _posint("param_bytes", self.param_bytes)
        _posint("grad_bytes", self.grad_bytes)
        _pos("allgathers_per_step", self.allgathers_per_step, allow_zero=True)
        if not 0.0 <= _pos("fsdp_overlap", self.fsdp_overlap, True) <= 1.0:
            raise ValueError(f"fsdp_overlap must be in [0, 1], got {self.fsdp_overlap}")
        _posint("overlap_steps", self.overlap_steps)
        _posint("fsdp_units", self.fsdp_units)
        _pos("state_bytes_per_param", self.state_bytes_per_param)


@dataclass(frozen=True)
class Plan:
    """A strategy and its knobs. ``group_size`` (G) is required for the FL strategies;
    ``shard_size`` (S) defaults to G (FSDP) or the node size (HSDP); ``sync_every`` (E),
    ``codec`` and ``overlap`` apply to the FedAvg exchange; ``hierarchical`` makes in-group
    collectives that span nodes go intra-node first."""

    strategy: Strategy | str
    group_size: int | None = None
    shard_size: int | None = None
    sync_every: int = 1
    codec: str = "none"
    overlap: bool = False
    hierarchical: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", Strategy.parse(self.strategy))
        _posint("sync_every", self.sync_every)
        if self.codec not in CODEC_BYTES:
            raise ValueError(f"codec must be one of {', '.join(CODEC_BYTES)}, got {self.codec!r}")
        for name in ("group_size", "shard_size"):
            v = getattr(self, name)
            if v is not None:
                _posint(name, v)

    def label(self) -> str:
        s = self.strategy.value
        if self.strategy.federated:
            s += f" G={self.group_size} E={self.sync_every} {self.codec}" + (" overlap" if self.overlap else "")
        if self.strategy.hybrid:
            s += f" S={self.shard_size}"
        return s


@dataclass(frozen=True)
class Prediction:
    plan: Plan
    world_size: int
    group_size: int
    shard_size: int
    step_time_s: float
    compute_s: float
    inner_comm_s: float          # in-group collectives of one step, before overlap
    fed_comm_s: float            # one FedAvg exchange (0 without federation)
    exposed_comm_s: float        # step_time_s - compute_s
    tokens_per_s: float
    bytes_per_step: dict[str, float] = field(default_factory=dict)   # per rank, per tier
    state_bytes_per_rank: float = 0.0

    @property
    def internode_bytes_per_step(self) -> float:
        return self.bytes_per_step.get(LinkTier.INTER_NODE.value, 0.0)

    @property
    def intergroup_bytes_per_step(self) -> float:
        return self.bytes_per_step.get(LinkTier.INTER_GROUP.value, 0.0)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["plan"] = {**asdict(self.plan), "strategy": self.plan.strategy.value}
        d["label"] = self.plan.label()
        return d


# ---------------------------------------------------------------- collectives ----

_KINDS = ("reduce_scatter", "all_gather", "all_reduce")


def _ring(kind: str, nbytes: float, n: int, bw: float, alpha: float) -> float:
    if n == 1:
        return 0.0
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    factor = (2 if kind == "all_reduce" else 1) * (n - 1) / n
    return steps * alpha + factor * nbytes / bw


def _placement(n: int, stride: int, ranks_per_node: int) -> tuple[int, int, int]:
    """(m ranks per node, k nodes, c groups sharing a node) of a group of ``n`` ranks whose
    members are ``stride`` ranks apart (contiguous rank blocks, node = rank // L)."""
    L = ranks_per_node
    m = min(n, max(1, L // stride)) if stride < L else 1
    return m, -(-n // m), max(1, L // m)


def collective_time(kind: str, nbytes: float, n: int, cluster: Cluster, *, stride: int = 1,
                    inter: Link | None = None, inter_tier: LinkTier = LinkTier.INTER_NODE,
                    hierarchical: bool = False) -> tuple[float, dict[str, float]]:
    """Time of one collective and the wire bytes one rank sends per tier.

    Args:
        kind: reduce_scatter, all_gather or all_reduce.
        nbytes: the full buffer (reduce_scatter input, all_gather output, all_reduce tensor).
        n: ranks in the group; ``stride``: rank distance between consecutive members.
        inter: the link used between nodes (default ``cluster.inter_node``); ``inter_tier``:
            the tier its bytes are counted under.
        hierarchical: intra-node stage first when the group has several ranks per node.
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {', '.join(_KINDS)}, got {kind!r}")
    if kind == "reduce_scatter" and cluster.reduce_scatter_as_all_reduce:
        kind = "all_reduce"  # NOTE: its time and its wire bytes; the caller keeps its chunk
    _posint("n", n)
    _posint("stride", stride)
    _pos("nbytes", nbytes, allow_zero=True)
    inter = inter or cluster.inter_node
    itier = LinkTier(inter_tier).value
    L = cluster.ranks_per_node
    m, k, c = _placement(n, stride, L)
    nb = int(nbytes)
    intra_t = cluster.intra
    if n == 1:
        return 0.0, {}
    if k == 1:
        return _ring(kind, nbytes, n, intra_t.bandwidth, intra_t.latency), \
            {LinkTier.INTRA_NODE.value: float(wire_bytes(kind, nb, n))}
    if not hierarchical or m == 1:
        steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
        factor = (2 if kind == "all_reduce" else 1) * (n - 1) / n
        t = steps * inter.latency + max(c * factor * nbytes / inter.bandwidth,
                                        factor * nbytes / intra_t.bandwidth if m > 1 else 0.0)
        return t, {itier: float(wire_bytes(kind, nb, n))}
    # hierarchical: intra stage over m ranks on B, inter stage over k nodes on B / m
    inter_link = replace(inter, bandwidth=inter.bandwidth / (m * c))  # m*c ranks share the NIC
    shard = nbytes / m
    if kind == "all_reduce":
        t = 2 * _ring("reduce_scatter", nbytes, m, intra_t.bandwidth, intra_t.latency) + \
            _ring("all_reduce", shard, k, inter_link.bandwidth, inter_link.latency)
        intra_b = 2 * wire_bytes("reduce_scatter", nb, m)
    else:
        t = _ring(kind, nbytes, m, intra_t.bandwidth, intra_t.latency) + \
            _ring(kind, shard, k, inter_link.bandwidth, inter_link.latency)
        intra_b = wire_bytes(kind, nb, m)
    return t, {LinkTier.INTRA_NODE.value: float(intra_b), itier: float(wire_bytes(kind, int(shard), k))}


def _add(acc: dict[str, float], b: dict[str, float], times: float = 1.0) -> None:
    for key, v in b.items():
        acc[key] = acc.get(key, 0.0) + v * times


# ---------------------------------------------------------------- prediction ----

def _resolve(plan: Plan, cluster: Cluster) -> tuple[int, int]:
    """(G, S) of ``plan`` on ``cluster``, validated with flcomm's Topology rules."""
    from flcomm.federated.topology import Topology

    P, L = cluster.world_size, cluster.ranks_per_node
    st = plan.strategy
    if st.federated:
        if plan.group_size is None:
            raise ValueError(f"{st.value} needs group_size (ranks per federation group), got None")
        G = plan.group_size
        if G >= P:
            raise ValueError(f"{st.value} needs group_size < world size {P} (at least two groups), got {G}")
    else:
        if plan.group_size not in (None, P):
            raise ValueError(f"{st.value} has one group of all {P} ranks; got group_size {plan.group_size}")
        G = P
    if st.hybrid:
        S = plan.shard_size or min(L, G)
        if S >= G:
            raise ValueError(f"{st.value} needs shard_size < group size {G} (at least two replicas), got {S}")
    else:
        if plan.shard_size not in (None, G):
            raise ValueError(f"{st.value} shards over the whole group of {G}; got shard_size {plan.shard_size}")
        S = G
    Topology(P, L, group_size=G, shard_size=S)  # raises ValueError with the reason if invalid
    return G, S


def predict(cluster: Cluster, workload: Workload, plan: Plan) -> Prediction:
    """Predict one step of ``plan``.

    Steps:
      1. resolve G and S and check them against the topology rules;
      2. in-group cost: ``a`` all-gathers of N * param_bytes and one reduce-scatter of
         N * grad_bytes over the S ranks of a shard group (stride 1); HSDP adds the all-reduce
         of the N / S gradient shard over the R replicas (stride S); each issued once per FSDP
         unit on 1/units of the buffer;
      3. FL: one FedAvg exchange = all-reduce of the codec's encoding of the N / S shard over F
         groups (stride G, inter-group link), amortized over E steps; with overlap only what
         does not fit behind ``overlap_steps`` steps of compute is exposed;
      4. step = compute + inner - hidden inner + exposed exchange / E.
    """
    if not isinstance(cluster, Cluster) or not isinstance(workload, Workload) or not isinstance(plan, Plan):
        raise TypeError("predict(cluster: Cluster, workload: Workload, plan: Plan), got "
                        f"({type(cluster).__name__}, {type(workload).__name__}, {type(plan).__name__})")
    G, S = _resolve(plan, cluster)
    P = cluster.world_size
    N = workload.params
    R, F = G // S, P // G
    h = plan.hierarchical
    U = workload.fsdp_units
    inner, per_step = 0.0, {}
    t, b = collective_time("all_gather", N * workload.param_bytes / U, S, cluster, hierarchical=h)
    inner += workload.allgathers_per_step * U * t
    _add(per_step, b, workload.allgathers_per_step * U)
    t, b = collective_time("reduce_scatter", N * workload.grad_bytes / U, S, cluster, hierarchical=h)
    inner += U * t
    _add(per_step, b, U)
    if R > 1:
        t, b = collective_time("all_reduce", N * workload.grad_bytes / S / U, R, cluster, stride=S, hierarchical=h)
        inner += U * t
        _add(per_step, b, U)
    fed = 0.0
    if F > 1:
        enc = codec_nbytes(plan.codec, int(math.ceil(N / S)))
        fed, b = collective_time("all_reduce", enc, F, cluster, stride=G, inter=cluster.inter_group,
                                 inter_tier=LinkTier.INTER_GROUP, hierarchical=h)
        # NOTE: the exchange is tagged inter-group whatever links it crosses, as FedMesh does.
        moved = {LinkTier.INTER_GROUP.value: sum(b.values())}
        _add(per_step, moved, 1.0 / plan.sync_every)
    c = workload.compute_s
    hidden = min(workload.fsdp_overlap * inner, c)
    fed_exposed = max(0.0, fed - workload.overlap_steps * c) if plan.overlap else fed
    step = c + inner - hidden + fed_exposed / plan.sync_every
    plan = replace(plan, group_size=G if plan.strategy.federated else None,
                   shard_size=S if plan.strategy.hybrid else None)
    return Prediction(plan=plan, world_size=P, group_size=G, shard_size=S, step_time_s=step, compute_s=c,
                      inner_comm_s=inner, fed_comm_s=fed, exposed_comm_s=step - c,
                      tokens_per_s=P * workload.tokens_per_rank / step if step > 0 else math.inf,
                      bytes_per_step=per_step, state_bytes_per_rank=N * workload.state_bytes_per_param / S)


def predict_strategies(cluster: Cluster, workload: Workload, group_size: int | None = None,
                       shard_size: int | None = None, sync_every: int = 8, codec: str = "none",
                       overlap: bool = False, hierarchical: bool = False,
                       hsdp_group_size: int | None = None) -> list[Prediction]:
    """FSDP, HSDP, FL+FSDP and FL+HSDP with one set of knobs.

    FL+FSDP uses groups of ``group_size`` (default one node); FL+HSDP groups of
    ``hsdp_group_size`` (default: ``group_size`` when it holds two shards or more, else two
    shards) with shards of ``shard_size`` (default one node). A variant the cluster is too
    small for (one group, or one replica) is left out."""
    P, L = cluster.world_size, cluster.ranks_per_node
    G = group_size or L
    S = shard_size or L
    GH = hsdp_group_size or (G if G >= 2 * S else 2 * S)
    out = [predict(cluster, workload, Plan(Strategy.FSDP, hierarchical=hierarchical))]
    if P > S:
        out.append(predict(cluster, workload, Plan(Strategy.HSDP, shard_size=S, hierarchical=hierarchical)))
    if G < P:
        out.append(predict(cluster, workload, Plan(Strategy.FL_FSDP, G, None, sync_every, codec, overlap, hierarchical)))
    if S < GH < P:
        out.append(predict(cluster, workload, Plan(Strategy.FL_HSDP, GH, S, sync_every, codec, overlap, hierarchical)))
    return out


def speedup(cluster: Cluster, workload: Workload, plan: Plan, baseline: Plan | str = "fsdp") -> float:
    """tokens/s of ``plan`` over tokens/s of ``baseline`` (a Plan or a strategy name)."""
    base = baseline if isinstance(baseline, Plan) else Plan(baseline, hierarchical=plan.hierarchical)
    return predict(cluster, workload, base).step_time_s / predict(cluster, workload, plan).step_time_s


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
    _pos("threshold", threshold)
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
    _posint("max_sync_every", max_sync_every)

    def s(E: int) -> float:
        return speedup(cluster, workload, replace(plan, sync_every=E), baseline)

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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def recommend(cluster: Cluster, workload: Workload, *, codecs: Sequence[str] = ("none", "bf16", "int8", "fp8"),
              max_sync_every: int = 32, allow_overlap: bool = True, memory_bytes: float | None = None,
              tolerance: float = 0.05, top: int = 10) -> Recommendation:
    """Recommend strategy, group size, E and codec for ``cluster``.

    Steps:
      1. enumerate the valid plans: FSDP, HSDP (every S that divides P), and for FL every G
         dividing P (< P) and every S of G, E in powers of two up to ``max_sync_every``, each
         codec, overlap off/on;
      2. drop plans whose sharded state (``state_bytes_per_param * N / S``) exceeds
         ``memory_bytes`` per rank;
      3. predict each; among those within ``tolerance`` of the best tokens/s, prefer the one
         closest to synchronous training: fewest groups, then smallest E, least lossy codec,
         no overlap (an overlapped exchange is applied one step late).
    NOTE: the model knows time, not convergence; the preference in step 3 stands in for it,
    and ``max_sync_every`` caps how stale the groups may get.
    """
    for c in codecs:
        if c not in CODEC_BYTES:
            raise ValueError(f"codecs must be among {', '.join(CODEC_BYTES)}, got {c!r}")
    _posint("max_sync_every", max_sync_every)
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
                        plans.append(Plan(st, G, S if st.hybrid else None, E, codec, ov))
    preds = []
    for pl in plans:
        try:
            pr = predict(cluster, workload, pl)
        except ValueError:
            continue
        if memory_bytes is not None and pr.state_bytes_per_rank > memory_bytes:
            continue
        preds.append(pr)
    if not preds:
        raise ValueError(f"no plan fits: every sharding needs more than memory_bytes={memory_bytes:.3g} "
                         "per rank for its state")
    preds.sort(key=lambda p: -p.tokens_per_s)
    best_tps = preds[0].tokens_per_s

    def closeness(p: Prediction) -> tuple:
        return (p.world_size // p.group_size, p.plan.sync_every if p.plan.strategy.federated else 0,
                _CODEC_LOSS_ORDER.index(p.plan.codec) if p.plan.strategy.federated else 0,
                p.plan.overlap, -p.tokens_per_s)

    near = [p for p in preds if p.tokens_per_s >= (1 - tolerance) * best_tps]
    best = min(near, key=closeness)
    reason = (f"{best.plan.label()}: {best.tokens_per_s:.4g} tokens/s, within {100 * tolerance:g}% of the "
              f"fastest plan ({preds[0].plan.label()}, {best_tps:.4g} tokens/s) and the closest to "
              f"synchronous training among those ({len(near)} candidates)")
    return Recommendation(best, preds[:top], reason)


def compute_time_from_flops(params: float, tokens_per_rank: float, peak_flops: float, mfu: float) -> float:
    """Step compute time from the 6 * N * tokens rule (forward + backward)."""
    _pos("params", params)
    _pos("tokens_per_rank", tokens_per_rank)
    _pos("peak_flops", peak_flops)
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    return 6 * params * tokens_per_rank / (peak_flops * mfu)


# ---------------------------------------------------------------- presets ----

PRESETS: dict[str, dict[str, Any]] = {
    # The paper's setup (Leonardo booster): Llama 3.1 8B, 128 nodes x 4 A100 64 GB, bf16.
    # Assumptions: NVLink 3 at 200 GB/s bus bandwidth per GPU (nccl-tests all-reduce on 4 A100);
    # one HDR100 port (100 Gbit/s) per GPU -> 400 Gbit/s per node, 3 us latency; NVLink 5 us;
    # 8192 tokens per GPU per step; 312 TFLOP/s bf16 at 40% MFU; FSDP prefetch hides 80% of the
    # in-group communication; one FSDP unit per transformer block plus the embeddings (33).
    "llama3.1-8b-leonardo": dict(params=8.03e9, nodes=128, ranks_per_node=4, intra_gbit=1600.0,
                                 inter_gbit=400.0, intra_lat_us=5.0, inter_lat_us=3.0,
                                 tokens_per_rank=8192, tflops=312.0, mfu=0.4, fsdp_overlap=0.8,
                                 fsdp_units=33, param_bytes=2, grad_bytes=2),
}


# ---------------------------------------------------------------- measurement ----

def measure_tiers(ranks_per_node: int, group_size: int | None = None, nbytes: int = 4 << 20,
                  iters: int = 3, warmup: int = 1, latency_iters: int = 20) -> dict[str, Any]:
    """Probe each tier's bandwidth and latency with all_reduce on the running job.

    Collective: every rank calls it after ``torch.distributed`` is initialized. Steps:
      1. build FedMesh for FSDP over all ranks (hierarchical groups: ``shard_intra`` = my
         node's ranks, ``shard_inter`` = my local position on every node) and, with more than
         one group of ``group_size`` (default: one node), FL+FSDP (``fed``);
      2. per tier, in turn (world barrier between): ``warmup`` + ``iters`` all_reduces of
         ``nbytes``, then ``latency_iters`` of 4 bytes, on every group of that tier at once;
      3. time = the slowest rank's (all_reduce MAX); bus bandwidth = wire bytes / time per
         call; for inter tiers times the ranks of a node crossing at once (per-node figure);
         latency = small-call time / ring steps.
    Returns ``{nodes, ranks_per_node, group_size, backend, intra_node, inter_node,
    inter_group}``, each tier
    ``{bandwidth_Bps, latency_s, ranks, per}`` or None when the job has no such tier.
    """
    import time

    import torch
    import torch.distributed as dist

    from flcomm.federated.topology import Topology

    if not dist.is_initialized():
        raise RuntimeError("measure_tiers needs torch.distributed initialized (run under torchrun or "
                           "bench/cluster/netns.py run)")
    P = dist.get_world_size()
    L = _posint("ranks_per_node", ranks_per_node)
    if P % L:
        raise ValueError(f"world size {P} is not a whole number of nodes of {L} ranks")
    _posint("nbytes", nbytes)
    G = group_size or L
    fsdp = Topology(P, L).build("cpu", hierarchical=True)
    fl = Topology(P, L, group_size=G).build("cpu", hierarchical=False) if P // G > 1 else None
    world = dist.group.WORLD

    def timed(transport, numel: int, n_iter: int) -> float:
        x = torch.ones(numel, dtype=torch.float32)
        dist.barrier(group=world)
        t0 = time.perf_counter()
        for _ in range(n_iter):
            transport.all_reduce(x)
        dt = torch.tensor([(time.perf_counter() - t0) / n_iter], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=world)
        return float(dt.item())

    def probe(transport, per_node: int) -> dict[str, Any]:
        n = transport.size
        numel = max(1, nbytes // 4)
        timed(transport, numel, warmup)
        t = timed(transport, numel, iters)
        lat = timed(transport, 1, latency_iters)
        bus = wire_bytes("all_reduce", numel * 4, n) / t
        return {"bandwidth_Bps": bus * per_node, "latency_s": lat / (2 * (n - 1)), "ranks": n,
                "per": "rank" if transport.tier is LinkTier.INTRA_NODE else "node",
                "bus_Bps_per_rank": bus, "time_s": t, "nbytes": numel * 4}

    out: dict[str, Any] = {"nodes": P // L, "ranks_per_node": L, "group_size": G,
                           "backend": str(dist.get_backend()).lower(),
                           "intra_node": None, "inter_node": None, "inter_group": None}
    if L > 1:
        out["intra_node"] = probe(fsdp.transport("shard_intra"), 1)
    if P // L > 1:
        out["inter_node"] = probe(fsdp.transport("shard_inter"), L)
    if fl is not None:
        _, _, sharing = _placement(P // G, G, L)  # fed groups crossing one node at once
        out["inter_group"] = probe(fl.transport("fed"), sharing)
    return out


def _measure_main(a: argparse.Namespace) -> int:
    import torch.distributed as dist

    from datetime import timedelta

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("error: --measure runs on every rank of a job: launch it with torchrun or "
              "`python -m bench.cluster.netns run` (RANK/WORLD_SIZE not set)", file=sys.stderr)
        return 2
    if a.ranks_per_node is None:
        a.ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    dist.init_process_group(a.backend, timeout=timedelta(seconds=a.measure_timeout))
    try:
        res = measure_tiers(a.ranks_per_node, a.group_size, int(a.measure_mb * (1 << 20)), a.measure_iters)
        if dist.get_rank() == 0:
            text = json.dumps(res, indent=2)
            if a.measure_json:
                with open(a.measure_json, "w") as f:
                    f.write(text)
            print(text)
    finally:
        dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- CLI ----

def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(b) < 1000 or unit == "TB":
            return f"{b:.3g} {unit}"
        b /= 1000
    return f"{b:.3g} TB"


def format_table(preds: Sequence[Prediction]) -> str:
    """Table of predictions with speedups vs FSDP and HSDP (when present)."""
    base = {p.plan.strategy: p for p in preds if not p.plan.strategy.federated}
    fsdp, hsdp = base.get(Strategy.FSDP), base.get(Strategy.HSDP)
    hdr = f"{'plan':<34} {'step s':>9} {'comm s':>9} {'tokens/s':>11} {'vs FSDP':>8} {'vs HSDP':>8} " \
          f"{'inter-node/step':>15} {'inter-group/step':>16}"
    lines = [hdr, "-" * len(hdr)]
    for p in preds:
        vs_f = f"{fsdp.step_time_s / p.step_time_s:.2f}x" if fsdp else "-"
        vs_h = f"{hsdp.step_time_s / p.step_time_s:.2f}x" if hsdp else "-"
        lines.append(f"{p.plan.label():<34} {p.step_time_s:9.4g} {p.exposed_comm_s:9.4g} {p.tokens_per_s:11.4g} "
                     f"{vs_f:>8} {vs_h:>8} {_fmt_bytes(p.internode_bytes_per_step):>15} "
                     f"{_fmt_bytes(p.intergroup_bytes_per_step):>16}")
    return "\n".join(lines)


def _build(a: argparse.Namespace) -> tuple[Cluster, Workload]:
    if a.cluster_json:
        with open(a.cluster_json) as f:
            cluster = Cluster.from_measurement(json.load(f), a.nodes)
    else:
        missing = [n for n in ("nodes", "ranks_per_node", "intra_gbit", "inter_gbit") if getattr(a, n) is None]
        if missing:
            raise ValueError(f"need --{', --'.join(m.replace('_', '-') for m in missing)} "
                             "(or --cluster-json from --measure, or --preset)")
        cluster = Cluster(a.nodes, a.ranks_per_node, Link.gbit(a.intra_gbit, a.intra_lat_us),
                          Link.gbit(a.inter_gbit, a.inter_lat_us),
                          Link.gbit(a.group_gbit, a.group_lat_us if a.group_lat_us is not None else a.inter_lat_us)
                          if a.group_gbit else None, reduce_scatter_as_all_reduce=a.gloo)
    if a.params is None or a.tokens_per_rank is None:
        raise ValueError("need --params and --tokens-per-rank (or --preset)")
    if a.compute_s is None:
        if a.tflops is None:
            raise ValueError("need --compute-s, or --tflops (with --mfu) to derive it from 6 * N * tokens")
        a.compute_s = compute_time_from_flops(a.params, a.tokens_per_rank, a.tflops * 1e12, a.mfu)
    wl = Workload(a.params, a.tokens_per_rank, a.compute_s, a.param_bytes, a.grad_bytes,
                  a.allgathers_per_step, a.fsdp_units, a.fsdp_overlap)
    return cluster, wl


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flcomm-costmodel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="fill in a documented setup (flags override)")
    g = p.add_argument_group("cluster")
    g.add_argument("--nodes", type=int)
    g.add_argument("--ranks-per-node", type=int)
    g.add_argument("--intra-gbit", type=float, help="intra-node bus bandwidth per rank, Gbit/s")
    g.add_argument("--inter-gbit", type=float, help="inter-node egress bandwidth per node, Gbit/s")
    g.add_argument("--group-gbit", type=float, help="inter-group bandwidth per node (default: inter-node)")
    g.add_argument("--intra-lat-us", type=float, default=0.0)
    g.add_argument("--inter-lat-us", type=float, default=0.0)
    g.add_argument("--group-lat-us", type=float)
    g.add_argument("--cluster-json", help="links from a --measure result (replaces the flags above)")
    g.add_argument("--gloo", action="store_true",
                   help="collectives as gloo runs them (reduce-scatter = all-reduce); implied by a "
                        "gloo --cluster-json")
    w = p.add_argument_group("workload")
    w.add_argument("--params", type=float, help="model parameters, e.g. 8e9")
    w.add_argument("--tokens-per-rank", type=float, help="tokens per rank per step")
    w.add_argument("--compute-s", type=float, help="compute time per step (s)")
    w.add_argument("--tflops", type=float, help="peak TFLOP/s per rank (derives --compute-s)")
    w.add_argument("--mfu", type=float, default=0.4)
    w.add_argument("--param-bytes", type=int, default=2)
    w.add_argument("--grad-bytes", type=int, default=2)
    w.add_argument("--allgathers-per-step", type=float, default=2.0)
    w.add_argument("--fsdp-overlap", type=float, default=0.0, help="fraction of in-group comm hidden (0-1)")
    w.add_argument("--fsdp-units", type=int, default=1, help="FSDP units (latency counts once per unit)")
    s = p.add_argument_group("plan")
    s.add_argument("--group-size", type=int, help="G (default: one node)")
    s.add_argument("--shard-size", type=int, help="S for HSDP variants (default: one node)")
    s.add_argument("--hsdp-group-size", type=int, help="G of FL+HSDP (default: two shards)")
    s.add_argument("--sync-every", type=int, default=8)
    s.add_argument("--codec", default="none", choices=list(CODEC_BYTES))
    s.add_argument("--overlap", action="store_true")
    s.add_argument("--hierarchical", action="store_true")
    m = p.add_argument_group("modes")
    m.add_argument("--crossover", action="store_true", help="bandwidth-ratio and E crossovers of the FL plans")
    m.add_argument("--threshold", type=float, default=1.0, help="speedup that counts as paying")
    m.add_argument("--recommend", action="store_true")
    m.add_argument("--max-sync-every", type=int, default=32)
    m.add_argument("--memory-gb", type=float, help="per-rank memory for training state (recommend)")
    m.add_argument("--json", help="write the predictions here")
    m.add_argument("--measure", action="store_true", help="probe the tiers of this job (run on every rank)")
    m.add_argument("--backend", default="gloo")
    m.add_argument("--measure-mb", type=float, default=4.0)
    m.add_argument("--measure-iters", type=int, default=3)
    m.add_argument("--measure-json")
    m.add_argument("--measure-timeout", type=float, default=300.0)
    return p


def main(argv: list[str] | None = None) -> int:
    p = make_parser()
    a = p.parse_args(argv)
    if a.preset:
        # NOTE: the preset becomes the defaults and the command line is parsed again, so flags
        # given explicitly win, also when they equal the parser's own default.
        p.set_defaults(**PRESETS[a.preset])
        a = p.parse_args(argv)
    if a.measure:
        return _measure_main(a)
    try:
        cluster, wl = _build(a)
        preds = predict_strategies(cluster, wl, a.group_size, a.shard_size, a.sync_every, a.codec, a.overlap,
                                   a.hierarchical, a.hsdp_group_size)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"cluster: {cluster.nodes} nodes x {cluster.ranks_per_node} ranks; intra {cluster.intra.bandwidth / GBIT:.4g} "
          f"Gbit/s per rank, inter-node {cluster.inter_node.bandwidth / GBIT:.4g} Gbit/s per node "
          f"(inter/intra per rank {cluster.bandwidth_ratio:.3g}); compute {wl.compute_s:.4g} s/step, "
          f"{wl.params:.3g} params")
    print(format_table(preds))
    record: dict[str, Any] = {"predictions": [x.as_dict() for x in preds]}
    if a.crossover:
        record["crossover"] = []
        for pr in preds:
            if not pr.plan.strategy.federated:
                continue
            base = "hsdp" if pr.plan.strategy is Strategy.FL_HSDP else "fsdp"
            cb = crossover_bandwidth_ratio(cluster, wl, pr.plan, base, a.threshold)
            ce = crossover_sync_every(cluster, wl, pr.plan, base, a.threshold)
            print(f"{pr.plan.label()} vs {base}: {cb.describe()}; {ce.describe()}")
            record["crossover"].append({"plan": pr.plan.label(), "baseline": base,
                                        "bandwidth_ratio": asdict(cb), "sync_every": asdict(ce)})
    if a.recommend:
        rec = recommend(cluster, wl, max_sync_every=a.max_sync_every,
                        memory_bytes=a.memory_gb * 1e9 if a.memory_gb else None)
        print("recommended:", rec.reason)
        record["recommendation"] = {"reason": rec.reason, "best": rec.best.as_dict()}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(record, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
