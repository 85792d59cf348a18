"""Alpha-beta cost model of FSDP, HSDP, FL+FSDP and FL+HSDP on a two-tier cluster.

This package: :mod:`~flcomm.costmodel.model` (the formulas, this docstring),
:mod:`~flcomm.costmodel.search` (crossover, recommendation), :mod:`~flcomm.costmodel.probe`
(``--measure``, the only part that touches torch.distributed) and ``__main__`` (the CLI).

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
             [+ AR(N * grad_bytes / S over R), HSDP replicas;
                AR(codec bytes of N / S elements over R) with a replicate codec]
    fed    = AR_codec(N / S elements over F), once every E steps (FL only)
    step   = compute + inner - min(fsdp_overlap * inner, compute) + exposed(fed) / E
    exposed(fed) = fed without overlap; max(0, fed - overlap_steps * compute) with overlap

``a`` = all-gathers per step (2: forward and backward with resharding). The FedAvg exchange
is a compressed all-reduce (two hops; one all-gather on two ranks) whose wire bytes equal a ring all-reduce
of the encoded buffer, whose size the codec itself reports (``Codec.encoded_nbytes``: none 4 bytes per element,
bf16/fp16 2, int8/fp8 1 plus a 4-byte scale per block). A replicate codec (``Plan.replicate_codec``,
the driver's ``--replicate-codec``: flcomm's hook all-reduces HSDP's gradient shards over the
replicas, compressed) sends that encoding instead of ``grad_bytes`` per element.

CLI (bandwidths as 400GB/s, 3200Gbit/s, 100gbit, or a bare number in Gbit/s; it prints every
assumption first, and --recommend needs --memory-gb)::

    flcomm-costmodel --preset llama3.1-8b-leonardo                  # the four strategies
    flcomm-costmodel --params 1e9 --nodes 16 --ranks-per-node 8 --intra-bw 300GB/s \\
        --inter-bw 400Gbit/s --tokens-per-rank 8192 --compute-s 1.5 --group-size 8 --sync-every 8 \\
        --codec int8 --crossover --recommend --memory-gb 80
    torchrun --nproc-per-node 4 -m flcomm.costmodel --measure --ranks-per-node 4 --measure-json m.json
    flcomm-costmodel --cluster-json m.json --params 1e8 ...   # model a measured cluster
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from flcomm._lazy import renamed_attributes
from flcomm.codecs import check_replicate_codec, get_codec
from flcomm.comm.base import LinkTier, bus_factor, wire_bytes
from flcomm.federated.autotune import steps_to_hide
from flcomm.federated.config import AUTO, FedAvgConfig
from flcomm.federated.strategy import Strategy
from flcomm.validate import integer, number

__all__ = [
    "CLUSTER_PRESETS", "GBIT", "Cluster", "Link", "Plan", "Prediction", "Strategy", "Workload", "codec_nbytes",
    "collective_time", "compute_time_from_flops", "fedavg_shard_copies", "memory_per_rank", "predict",
    "predict_strategies", "replicate_bytes", "speedup",
]

GBIT = 1e9 / 8  # bytes/s in one Gbit/s


def codec_nbytes(codec: str, numel: int) -> int:
    """Encoded bytes of ``numel`` fp32 elements under ``codec``: what the codec itself puts on
    the wire (payload and block scales, 16-byte aligned)."""
    integer("numel", numel, 0)
    return get_codec(codec).encoded_nbytes(numel)


@dataclass(frozen=True)
class Link:
    """One link tier: ``bandwidth`` in bytes/s (see the module docstring for per-rank vs
    per-node), ``latency`` in seconds per ring step."""

    bandwidth: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        number("bandwidth", self.bandwidth, 0, lo_open=True)
        number("latency", self.latency, 0)

    @classmethod
    def gbit(cls, gbit_per_s: float, latency_us: float = 0.0) -> Link:
        return cls(number("bandwidth (Gbit/s)", gbit_per_s, 0, lo_open=True) * GBIT,
                   number("latency (us)", latency_us, 0) * 1e-6)


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
        integer("nodes", self.nodes, 1)
        integer("ranks_per_node", self.ranks_per_node, 1)
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

    def scale_inter(self, factor: float) -> Cluster:
        """The same cluster with inter-node and inter-group bandwidth times ``factor``."""
        number("factor", factor, 0, lo_open=True)
        return replace(self, inter_node=replace(self.inter_node, bandwidth=self.inter_node.bandwidth * factor),
                       inter_group=replace(self.inter_group, bandwidth=self.inter_group.bandwidth * factor))

    @property
    def bandwidth_ratio(self) -> float:
        """Inter-node over intra-node bandwidth, both per rank."""
        return self.inter_node.bandwidth / self.ranks_per_node / self.intra.bandwidth

    @classmethod
    def from_measurement(cls, m: dict, nodes: int | None = None) -> Cluster:
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
        state_bytes_per_param: sharded training state per parameter (bf16 params + fp32
            master + Adam: 16), used for the memory limit of recommendations.
        activation_bytes: activations one rank holds at the peak of a step (an estimate the
            caller gives; the presets state theirs).
    """

    params: float
    tokens_per_rank: float
    compute_s: float
    param_bytes: int = 2
    grad_bytes: int = 2
    allgathers_per_step: float = 2
    fsdp_units: int = 1
    fsdp_overlap: float = 0.0
    state_bytes_per_param: float = 16.0
    activation_bytes: float = 0.0

    def __post_init__(self) -> None:
        number("params", self.params, 0, lo_open=True)
        number("tokens_per_rank", self.tokens_per_rank, 0, lo_open=True)
        number("compute_s", self.compute_s, 0)
        integer("param_bytes", self.param_bytes, 1)
        integer("grad_bytes", self.grad_bytes, 1)
        number("allgathers_per_step", self.allgathers_per_step, 0)
        number("fsdp_overlap", self.fsdp_overlap, 0, 1)
        integer("fsdp_units", self.fsdp_units, 1)
        number("state_bytes_per_param", self.state_bytes_per_param, 0, lo_open=True)
        number("activation_bytes", self.activation_bytes, 0)


@dataclass(frozen=True)
class Plan:
    """A strategy and its knobs. ``group_size`` (G) and ``shard_size`` (S) default to the
    strategy's (:meth:`Strategy.topology`); ``fedavg`` is the FedAvg exchange's
    :class:`~flcomm.federated.config.FedAvgConfig` (the same object FedAvg takes: E, the codec,
    overlap k, fragments K, the sharded FL+HSDP exchange, the buffers it keeps), ignored by fsdp
    and hsdp; ``hierarchical`` makes in-group collectives that span nodes go intra-node first;
    ``replicate_codec`` (hsdp, fl-hsdp): the codec of the gradients' all-reduce over the replicas
    (``"none"``: FSDP's own, in ``grad_bytes`` per element)."""

    strategy: Strategy | str
    group_size: int | None = None
    shard_size: int | None = None
    fedavg: FedAvgConfig = field(default_factory=FedAvgConfig)
    hierarchical: bool = False
    replicate_codec: str = "none"

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", Strategy.parse(self.strategy))
        object.__setattr__(self, "replicate_codec", check_replicate_codec(
            self.replicate_codec, hybrid=self.strategy.hybrid, strategy=self.strategy.value))
        if not isinstance(self.fedavg, FedAvgConfig):
            raise TypeError(f"fedavg must be a FedAvgConfig, got {type(self.fedavg).__name__}")
        for name in ("group_size", "shard_size"):
            v = getattr(self, name)
            if v is not None:
                integer(name, v, 1)

    # NOTE: read-only views of the FedAvg settings the formulas use
    sync_every = property(lambda self: self.fedavg.sync_every)
    codec = property(lambda self: self.fedavg.codec)
    overlap = property(lambda self: self.fedavg.overlap)
    error_feedback = property(lambda self: self.fedavg.error_feedback)
    outer = property(lambda self: self.fedavg.outer)
    fragments = property(lambda self: self.fedavg.fragments)
    sharded_exchange = property(lambda self: self.fedavg.sharded_exchange)

    def with_fedavg(self, **settings: Any) -> Plan:
        """This plan with FedAvg settings replaced."""
        return replace(self, fedavg=FedAvgConfig.make(self.fedavg, **settings))

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy.value, "group_size": self.group_size, "shard_size": self.shard_size,
                "fedavg": self.fedavg.to_dict(), "hierarchical": self.hierarchical,
                "replicate_codec": self.replicate_codec}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """The plan of a :meth:`to_dict` record."""
        return cls(d["strategy"], d.get("group_size"), d.get("shard_size"), FedAvgConfig.from_dict(d["fedavg"]),
                   bool(d.get("hierarchical", False)), d.get("replicate_codec", "none"))

    def label(self) -> str:
        s = self.strategy.value
        if self.strategy.federated:
            k = self.fedavg.overlap_steps
            s += f" G={self.group_size} E={self.sync_every} {self.codec}" + ("+ef" if self.error_feedback else "")
            s += (" nesterov" if self.outer == "nesterov" else "") + (f" ovl={k}" if self.overlap else "")
            s += f" frag={self.fragments}" if self.fragments > 1 else ""
            s += " unsharded" if self.sharded_exchange is False and self.strategy.hybrid else ""
        if self.strategy.hybrid:
            s += f" S={self.shard_size}" + (f" rep={self.replicate_codec}" if self.replicate_codec != "none" else "")
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
    memory_bytes: dict[str, float] = field(default_factory=dict)     # per rank, per kind (memory_per_rank)

    @property
    def memory_total(self) -> float:
        """Estimated peak bytes per rank (the sum of :attr:`memory_bytes`)."""
        return sum(self.memory_bytes.values())

    @property
    def internode_bytes_per_step(self) -> float:
        return self.bytes_per_step.get(LinkTier.INTER_NODE.value, 0.0)

    @property
    def intergroup_bytes_per_step(self) -> float:
        return self.bytes_per_step.get(LinkTier.INTER_GROUP.value, 0.0)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["plan"] = self.plan.to_dict()
        d["label"] = self.plan.label()
        return d


# ---------------------------------------------------------------- collectives ----

_KINDS = ("reduce_scatter", "all_gather", "all_reduce")


def _steps(kind: str, n: int) -> int:
    """Latency steps of the ring algorithm."""
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def _ring(kind: str, nbytes: float, n: int, bw: float, alpha: float) -> float:
    if n == 1:
        return 0.0
    return _steps(kind, n) * alpha + bus_factor(kind, n) * nbytes / bw


def placement(n: int, stride: int, ranks_per_node: int) -> tuple[int, int, int]:
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
    integer("n", n, 1)
    integer("stride", stride, 1)
    number("nbytes", nbytes, 0)
    inter = inter or cluster.inter_node
    itier = LinkTier(inter_tier).value
    L = cluster.ranks_per_node
    m, k, c = placement(n, stride, L)
    nb = int(nbytes)
    intra_t = cluster.intra
    if n == 1:
        return 0.0, {}
    if k == 1:
        return _ring(kind, nbytes, n, intra_t.bandwidth, intra_t.latency), \
            {LinkTier.INTRA_NODE.value: float(wire_bytes(kind, nb, n))}
    if not hierarchical or m == 1:
        factor = bus_factor(kind, n)
        t = _steps(kind, n) * inter.latency + max(c * factor * nbytes / inter.bandwidth,
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
    """(G, S) of ``plan`` on ``cluster``: the strategy's topology, with its defaults."""
    topo = plan.strategy.topology(cluster.world_size, cluster.ranks_per_node, plan.group_size, plan.shard_size)
    return topo.group_size, topo.shard_size


def fedavg_shard_copies(plan: Plan, *, on_device: bool = True) -> float:
    """Full-size fp32 copies of a rank's shard that FedAvg keeps for ``plan`` (besides its
    buckets): none in the paper's mode (codec none, outer avg, no overlap, no error feedback:
    averaged in place, bucket by bucket); otherwise the anchor, plus the error-feedback residual
    (half a copy with ``residual_dtype="bf16"``), the outer momentum (nesterov) and the
    local-at-sync copy (overlap) where the plan has them. ``on_device``: only what stays on the
    device (none with ``offload="cpu"``: all in host memory). This is the accounting of
    :meth:`flcomm.federated.fedavg.FedAvg.memory_stats` (``tests/dist/test_fedavg_engine.py`` ties
    the two; ``bench/memory.py`` measures it)."""
    cfg = plan.fedavg
    if not plan.strategy.federated or cfg.in_place or (on_device and cfg.offload is not None):
        return 0.0
    residual = (0.5 if cfg.residual_dtype == "bf16" else 1.0) * cfg.error_feedback
    return 1.0 + residual + (cfg.outer == "nesterov") + cfg.overlap


def memory_per_rank(workload: Workload, plan: Plan, shard_size: int) -> dict[str, float]:
    """Estimated peak memory of one rank, by kind (bytes):

    * ``state``: the sharded training state, ``state_bytes_per_param * N / S``;
    * ``unsharded``: FSDP's working set, one unit's parameters gathered and the next one
      prefetched (``2 * param_bytes``) and one unit's unsharded gradient (``grad_bytes``), each
      of ``N / units`` elements;
    * ``fedavg``: :func:`fedavg_shard_copies` fp32 copies of the ``N / S`` shard, plus two
      buckets while an exchange runs (FL only);
    * ``activations``: the workload's estimate.
    """
    N, S = workload.params, shard_size
    fed = 0.0
    if plan.strategy.federated:
        fed = fedavg_shard_copies(plan) * 4 * N / S + 2 * plan.fedavg.bucket_cap_mb * 2**20
    return {"state": workload.state_bytes_per_param * N / S,
            "unsharded": N / workload.fsdp_units * (2 * workload.param_bytes + workload.grad_bytes),
            "fedavg": fed, "activations": workload.activation_bytes}


def replicate_bytes(plan: Plan, workload: Workload, numel: float) -> float:
    """Bytes of one replicate all-reduce of ``numel`` gradient elements: ``grad_bytes`` each, or
    the replicate codec's encoding of them (:func:`codec_nbytes`)."""
    if plan.replicate_codec == "none":
        return numel * workload.grad_bytes
    return float(codec_nbytes(plan.replicate_codec, int(math.ceil(numel))))


def _exchange(cluster: Cluster, plan: Plan, N: float, G: int, S: int, F: int, R: int,
              per_step: dict[str, float]) -> float:
    """Time of one FedAvg exchange (one fragment of the N / S shard), adding its bytes per step.

    Plain: the codec's encoding of the fragment, all-reduced over the F groups (stride G).
    Sharded (FL+HSDP, R > 1): each replica all-reduces 1/R of it over the groups, then the R
    replicas (stride S, inside the group) all-gather the averaged fragment: in the codec's
    encoding when it is lossy and F > 1, in fp32 otherwise.
    A sparse codec (top-k) all-gathers the F encodings instead of all-reducing one (a sum of
    sparse encodings is not sparse), and sharded, the replicas all-gather those F encodings.
    """
    K, E = plan.fragments, plan.sync_every
    sharded = R > 1 and plan.sharded_exchange is not False
    numel = N / S / K
    enc = codec_nbytes(plan.codec, int(math.ceil(numel / (R if sharded else 1))))
    sparse = F > 1 and get_codec(plan.codec).sparse
    if sparse:
        enc *= F  # NOTE: every group's encoding, gathered
    t, b = collective_time("all_gather" if sparse else "all_reduce", enc, F, cluster, stride=G,
                           inter=cluster.inter_group, inter_tier=LinkTier.INTER_GROUP, hierarchical=plan.hierarchical)
    # NOTE: the exchange is tagged inter-group whatever links it crosses, as FedMesh does.
    _add(per_step, {LinkTier.INTER_GROUP.value: sum(b.values())}, K / E)
    if sharded:
        lossy = F > 1 and not get_codec(plan.codec).lossless
        gathered = R * enc if lossy else 4 * numel
        t2, b2 = collective_time("all_gather", gathered, R, cluster, stride=S, hierarchical=plan.hierarchical)
        t += t2
        _add(per_step, b2, K / E)
    return t


def overlap_steps(cfg: FedAvgConfig, exchange_s: float, compute_s: float) -> int:
    """The k an overlapped exchange of ``exchange_s`` seconds gets behind steps of ``compute_s``:
    the config's, or for ``"auto"`` the one FedAvg settles on
    (:func:`flcomm.federated.autotune.steps_to_hide`, with k at most E / K)."""
    if cfg.overlap_steps != AUTO:
        return int(cfg.overlap_steps)
    return steps_to_hide(exchange_s, compute_s, cfg.sync_every // cfg.fragments)


def predict(cluster: Cluster, workload: Workload, plan: Plan) -> Prediction:
    """Predict one step of ``plan``.

    Steps:
      1. resolve G and S and check them against the topology rules;
      2. in-group cost: ``a`` all-gathers of N * param_bytes and one reduce-scatter of
         N * grad_bytes over the S ranks of a shard group (stride 1); HSDP adds the all-reduce
         of the N / S gradient shard over the R replicas (stride S); each issued once per FSDP
         unit on 1/units of the buffer; with a replicate codec that all-reduce carries the codec's
         encoding of the unit's N / S / units elements (:func:`replicate_bytes`);
      3. FL: one FedAvg exchange = all-reduce of the codec's encoding of the N / S shard over F
         groups (stride G, inter-group link), amortized over E steps (:func:`_exchange`: K
         fragments, the sharded FL+HSDP exchange); with overlap only what does not fit behind
         k steps of compute is exposed (:func:`overlap_steps`: ``"auto"`` as FedAvg chooses it);
      4. step = compute + inner - hidden inner + exposed exchange / E;
      5. memory per rank: :func:`memory_per_rank`.
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
        t, b = collective_time("all_reduce", replicate_bytes(plan, workload, N / S / U), R, cluster, stride=S,
                               hierarchical=h)
        inner += U * t
        _add(per_step, b, U)
    fed = _exchange(cluster, plan, N, G, S, F, R, per_step) if F > 1 else 0.0
    c = workload.compute_s
    hidden = min(workload.fsdp_overlap * inner, c)
    fed_exposed = max(0.0, fed - overlap_steps(plan.fedavg, fed, c) * c) if plan.overlap else fed
    # NOTE: K fragments: an exchange of 1/K of the shard every E/K steps
    step = c + inner - hidden + fed_exposed * plan.fragments / plan.sync_every
    plan = replace(plan, group_size=G if plan.strategy.federated else None,
                   shard_size=S if plan.strategy.hybrid else None)
    return Prediction(plan=plan, world_size=P, group_size=G, shard_size=S, step_time_s=step, compute_s=c,
                      inner_comm_s=inner, fed_comm_s=fed, exposed_comm_s=step - c,
                      tokens_per_s=P * workload.tokens_per_rank / step if step > 0 else math.inf,
                      bytes_per_step=per_step, state_bytes_per_rank=N * workload.state_bytes_per_param / S,
                      memory_bytes=memory_per_rank(workload, plan, S))


def predict_strategies(cluster: Cluster, workload: Workload, group_size: int | None = None,
                       shard_size: int | None = None, fedavg: FedAvgConfig | None = None, hierarchical: bool = False,
                       hsdp_group_size: int | None = None, replicate_codec: str = "none") -> list[Prediction]:
    """FSDP, HSDP, FL+FSDP and FL+HSDP with one set of knobs, as the driver would run them:
    ``group_size`` (G) for both FL strategies (FL+HSDP: ``hsdp_group_size`` when given),
    ``shard_size`` (S) for the HSDP ones; None takes the strategy's default
    (:mod:`flcomm.federated.strategy`); ``replicate_codec`` for the HSDP ones. A strategy the
    cluster is too small for (one group, or one replica) is left out."""
    plans = [Plan(Strategy.FSDP, hierarchical=hierarchical),
             Plan(Strategy.HSDP, shard_size=shard_size, hierarchical=hierarchical, replicate_codec=replicate_codec),
             Plan(Strategy.FL_FSDP, group_size, None, fedavg or FedAvgConfig(), hierarchical),
             Plan(Strategy.FL_HSDP, hsdp_group_size or group_size, shard_size, fedavg or FedAvgConfig(), hierarchical,
                  replicate_codec)]
    out = []
    for plan in plans:
        try:
            _resolve(plan, cluster)
        except ValueError:
            continue  # NOTE: a strategy this cluster cannot run
        out.append(predict(cluster, workload, plan))
    return out


def speedup(cluster: Cluster, workload: Workload, plan: Plan, baseline: Plan | str = "fsdp") -> float:
    """tokens/s of ``plan`` over tokens/s of ``baseline`` (a Plan or a strategy name)."""
    base = baseline if isinstance(baseline, Plan) else Plan(baseline, hierarchical=plan.hierarchical)
    return predict(cluster, workload, base).step_time_s / predict(cluster, workload, plan).step_time_s


def compute_time_from_flops(params: float, tokens_per_rank: float, peak_flops: float, mfu: float) -> float:
    """Step compute time from the 6 * N * tokens rule (forward + backward)."""
    number("params", params, 0, lo_open=True)
    number("tokens_per_rank", tokens_per_rank, 0, lo_open=True)
    number("peak_flops", peak_flops, 0, lo_open=True)
    number("mfu", mfu, 0, 1, lo_open=True)
    return 6 * params * tokens_per_rank / (peak_flops * mfu)


# ---------------------------------------------------------------- presets ----

CLUSTER_PRESETS: dict[str, dict[str, Any]] = {
    # The paper's setup (Leonardo booster): Llama 3.1 8B, 128 nodes x 4 A100 64 GB, bf16.
    # Assumptions: NVLink 3 at 200 GB/s bus bandwidth per GPU (nccl-tests all-reduce on 4 A100);
    # one HDR100 port (100 Gbit/s) per GPU -> 400 Gbit/s per node, 3 us latency; NVLink 5 us;
    # 8192 tokens per GPU per step; 312 TFLOP/s bf16 at 40% MFU; FSDP prefetch hides 80% of the
    # in-group communication; one FSDP unit per transformer block plus the embeddings (33).
    # Memory: 64 GB per GPU; activations 8 GB per rank, assuming activation checkpointing per
    # decoder block: 2 GB of saved block inputs (8192 tokens x 4096 x bf16 x 32 blocks), ~1 GB
    # to recompute one block, 4.2 GB of fp32 logits over the 128256-token vocabulary.
    "llama3.1-8b-leonardo": dict(params=8.03e9, nodes=128, ranks_per_node=4, intra_gbit=1600.0,
                                 inter_gbit=400.0, intra_lat_us=5.0, inter_lat_us=3.0,
                                 tokens_per_rank=8192, tflops=312.0, mfu=0.4, fsdp_overlap=0.8,
                                 fsdp_units=33, param_bytes=2, grad_bytes=2, memory_gb=64.0,
                                 activation_gb=8.0),
}

# NOTE: the old name, for one release
__getattr__ = renamed_attributes(__name__, {"PRESETS": "CLUSTER_PRESETS"})

