"""The reference training loop for the four strategies: FSDP, HSDP, FL+FSDP and FL+HSDP.

One rank's run (:func:`train`, inside an initialized process group) has four parts:

* :func:`build_run`: the :class:`~flcomm.federated.topology.Topology` of the strategy and its
  FedMesh (every group, mesh dims included, with the configured timeout); the model, built on
  the meta device for big presets and sharded with FSDP2 ``fully_shard`` per decoder block and
  at the root over the group's "shard" dim (FSDP) or ("replicate", "shard") (HSDP); this
  rank's data slice (one of P disjoint slices) and held-out batches; AdamW; for the FL
  strategies a FedAvg over the "fed" dim; the resume from the latest checkpoint;
* :func:`train_step`: forward, backward, gradient norm and clipping, the group's loss, the
  optimizer step (left out on a non-finite loss or gradient norm: ``nan_policy``),
  ``fed.step()``;
* :class:`StepLogger`: rank 0's JSONL record per step (loss, tokens/s, bytes per tier,
  exposed communication) and the progress bar;
* :class:`CheckpointPolicy`: evaluation every ``eval_every`` steps and checkpoints every
  ``save_every`` steps, both also at the end (``fed.finish()`` first).

Every phase of a step is announced to a :class:`~flcomm.train.monitor.Monitor` (heartbeats,
failure reports). :mod:`flcomm.train.launch` starts the ranks.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flcomm.comm.base import LinkTier
from flcomm.federated.fedavg import FedAvg
from flcomm.federated.inner import InnerState
from flcomm.federated.outer import Outer
from flcomm.federated.strategy import Strategy
from flcomm.federated.topology import Topology
from flcomm.train import checkpoint as ckpt
from flcomm.train.data import (BUILTIN_CORPUS, ShardedLoader, Split, check_slices, check_vocab, data_record,
                               data_source, eval_batches, fingerprint, load_tokens, split_tokens)
from flcomm.train.metrics import FsdpTraffic, MetricsWriter, TierCounter, perplexity
from flcomm.train.model import PRESETS, Transformer, build_model, get_config, lm_loss
from flcomm.train.monitor import Monitor

if TYPE_CHECKING:
    import numpy as np

    from flcomm.federated.elastic import Federation
    from flcomm.federated.topology import FedMesh

STRATEGIES = Strategy.values()
OUTERS = Outer.values()
INNER_STATES = InnerState.values()
NAN_POLICIES = ("stop", "skip-step")


def _pos_int(name: str, v: object, allow_zero: bool = False) -> None:
    lo = 0 if allow_zero else 1
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")


def _finite(name: str, v: object, lo: float, lo_open: bool = False) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v > lo if lo_open else v >= lo)
    if not ok:
        raise ValueError(f"{name} must be a finite number {'>' if lo_open else '>='} {lo}, got {v!r}")


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs; the CLI flags map one to one (``--sync-every`` -> sync_every).

    Topology (None = the strategy's default, see :func:`resolve_topology`): ``ranks_per_node``,
    ``group_size`` (G, ranks per federation group), ``shard_size`` (S, ranks per shard group).
    Batch sizes are per rank; a step consumes ``world * batch_size * seq_len`` tokens.
    """

    strategy: str = "fsdp"
    ranks_per_node: int | None = None
    group_size: int | None = None
    shard_size: int | None = None
    # hierarchical FSDP collectives (intra-node stage, then inter-node) for a shard group that
    # spans nodes; a no-op when it does not
    hierarchical: bool = False
    # FedAvg
    sync_every: int = 8
    codec: str = "none"
    error_feedback: bool = False
    outer: str = "avg"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    inner_state: str = "keep"
    overlap: bool = False
    overlap_steps: int = 1  # k: apply the average k steps after the sync (with overlap)
    fragments: int = 1  # K: streaming, 1/K of the shard every E/K steps
    offload: str | None = None  # "cpu": FedAvg's full-size buffers in pinned host memory
    residual_dtype: str = "fp32"  # fp32 | bf16: the error-feedback residuals
    sharded_exchange: bool | None = None  # FL+HSDP: 1/R of the shard per replica (None: on when R > 1)
    bucket_mb: float = 25.0
    # elastic federation (flcomm.federated.elastic)
    elastic: bool = False
    elastic_grace_s: float = 15.0
    min_groups: int = 1
    rejoin: bool = False  # a restarted group: a survivor's checkpoint, then admitted at a sync
    # model and optimization
    model: str = "tiny"
    vocab_size: int | None = None
    init: str = "auto"  # auto | full | meta
    mixed_precision: str = "none"  # none | bf16
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int | None = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    # data and evaluation
    data: str | None = None
    data_dtype: str | None = None
    max_tokens: int | None = None
    eval_fraction: float = 0.02
    eval_every: int = 0
    eval_batches: int = 4
    # output
    metrics: str | None = None
    checkpoint_dir: str | None = None
    save_every: int = 0
    keep_checkpoints: int = 2
    resume: bool = False
    allow_data_change: bool = False  # resume with other data than the checkpoint's
    progress: bool = True
    # runtime
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: float = 300.0  # every collective, mesh dims included
    nan_policy: str = "stop"  # stop | skip-step, on a non-finite loss or gradient norm
    log_dir: str | None = None  # per-rank heartbeats and tracebacks (the launcher picks one)

    def __post_init__(self) -> None:
        """Checks what this config owns; codec / outer / inner_state go to their owners' parsers
        (:meth:`check_federation`), the topology (L, G, S) to
        :class:`~flcomm.federated.topology.Topology` (:func:`check_before_launch`)."""
        def one_of(name: str, allowed: tuple[str, ...], label: str | None = None) -> None:
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown {label or name} {getattr(self, name)!r}; expected one of "
                                 f"{', '.join(allowed)}")

        Strategy.parse(self.strategy)
        one_of("model", tuple(PRESETS), "model preset")
        one_of("init", ("auto", "full", "meta"))
        one_of("mixed_precision", ("none", "bf16"))
        one_of("backend", ("auto", "gloo", "nccl"))
        one_of("nan_policy", NAN_POLICIES)
        for name in ("steps", "batch_size", "seq_len", "eval_batches"):
            _pos_int(name, getattr(self, name))
        for name in ("eval_every", "save_every", "keep_checkpoints"):
            _pos_int(name, getattr(self, name), allow_zero=True)
        for name in ("vocab_size", "max_tokens"):
            if getattr(self, name) is not None:
                _pos_int(name, getattr(self, name))
        if self.warmup is not None:
            _pos_int("warmup", self.warmup, allow_zero=True)
        for name, lo, lo_open in (("lr", 0.0, True), ("timeout_s", 0.0, True), ("weight_decay", 0.0, False),
                                  ("grad_clip", 0.0, False), ("outer_lr", 0.0, True), ("outer_momentum", 0.0, False)):
            _finite(name, getattr(self, name), lo, lo_open)
        for name in ("min_lr_ratio", "beta1", "beta2"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0):
                raise ValueError(f"{name} must be in [0, 1], got {v!r}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs a checkpoint directory (--checkpoint-dir)")
        if self.save_every and not self.checkpoint_dir:
            raise ValueError("save_every needs a checkpoint directory (--checkpoint-dir)")
        _finite("elastic_grace_s", self.elastic_grace_s, 0.0, True)
        _pos_int("min_groups", self.min_groups)
        if self.elastic and not self.federated:
            raise ValueError(f"--elastic needs a federated strategy (fl-fsdp, fl-hsdp), got {self.strategy!r}")
        if self.rejoin and not (self.elastic and self.checkpoint_dir):
            raise ValueError("--rejoin needs --elastic and the job's --checkpoint-dir (a survivor's checkpoint)")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        self.check_federation()

    def check_federation(self) -> None:
        """The FedAvg settings, by FedAvg's own check (before any process starts)."""
        FedAvg.check_config(sync_every=self.sync_every, bucket_mb=self.bucket_mb, overlap_steps=self.overlap_steps,
                            fragments=self.fragments, inner_state=self.inner_state,
                            residual_dtype=self.residual_dtype, offload=self.offload, codec=self.codec,
                            outer=self.outer, elastic=self.elastic, overlap=self.overlap)

    @property
    def federated(self) -> bool:
        return Strategy.parse(self.strategy).federated

    @property
    def hybrid(self) -> bool:
        return Strategy.parse(self.strategy).hybrid

    def model_config(self):
        over = {"vocab_size": self.vocab_size} if self.vocab_size else {}
        cfg = get_config(self.model, **over)
        if self.seq_len > cfg.max_seq_len:
            raise ValueError(f"seq_len {self.seq_len} exceeds max_seq_len {cfg.max_seq_len} of model "
                             f"preset {self.model!r}")
        return cfg

    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else min(100, max(1, self.steps // 10))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def resolve_topology(cfg: TrainConfig, world_size: int, local_world_size: int | None = None) -> Topology:
    """The strategy's Topology for ``world_size`` ranks: ranks per node L = ``ranks_per_node``,
    else ``local_world_size`` (torchrun's LOCAL_WORLD_SIZE), else the whole world; G and S as
    given, else the strategy's defaults (:meth:`flcomm.federated.strategy.Strategy.topology`,
    which also refuses sizes that do not fit the world or are not the strategy)."""
    P = world_size
    L = cfg.ranks_per_node if cfg.ranks_per_node is not None else (local_world_size or P)
    return Strategy.parse(cfg.strategy).topology(P, L, cfg.group_size, cfg.shard_size)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Learning rate of 1-based ``step``: linear warm-up to ``lr`` over the warm-up steps, then
    cosine decay to ``min_lr_ratio * lr`` at ``steps``."""
    w = cfg.warmup_steps()
    if w and step <= w:
        return cfg.lr * step / w
    span = max(1, cfg.steps - w)
    t = min(1.0, (step - w) / span)
    lo = cfg.lr * cfg.min_lr_ratio
    return lo + 0.5 * (cfg.lr - lo) * (1 + math.cos(math.pi * t))


@dataclass
class TrainResult:
    """What :func:`train` returns on every rank."""

    losses: list[float] = field(default_factory=list)          # group-mean loss per step run here
    eval_losses: dict[int, float] = field(default_factory=dict)  # step -> world-mean eval loss
    start_step: int = 0
    final_step: int = 0
    params: dict[str, Tensor] | None = None                     # full parameters (return_params)
    tokens_per_step: int = 0
    wall_s: float = 0.0
    bytes_per_step: dict[str, float] = field(default_factory=dict)
    num_syncs: int = 0


def _device(backend: str) -> torch.device:
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def shard_model(model: Transformer, mesh: "FedMesh", mp_policy: Any = None) -> list[tuple[nn.Module, bool]]:
    """FSDP2 ``fully_shard`` per decoder block (reshard after forward) and on the root (kept
    unsharded from forward to backward), over the federation group's mesh. Returns the FSDP
    units, innermost first, with their reshard-after-forward flag."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dm = mesh.device_mesh["shard"] if mesh.topology.num_replicas == 1 else mesh.device_mesh["replicate", "shard"]
    kw: dict[str, Any] = {"mesh": dm, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    units: list[tuple[nn.Module, bool]] = []
    for block in model.layers:
        fully_shard(block, reshard_after_forward=True, **kw)
        units.append((block, True))
    # NOTE: explicit False for the root (FSDP2's default for the root too): it is needed again
    # right at the start of backward, and it makes the traffic count in FsdpTraffic exact.
    fully_shard(model, reshard_after_forward=False, **kw)
    units.append((model, False))
    return units


STARTUP_TIMEOUT_S = 120.0


def _startup_barrier(cfg: TrainConfig) -> None:
    """Wait for every rank to have built its model and read its data, for up to
    max(timeout_s, STARTUP_TIMEOUT_S); then the default group gets ``timeout_s``."""
    # NOTE: ranks start and build their models at different speeds (a loaded host, a slow file
    # system, torch imported by each rank); the first collectives would otherwise time out
    # after timeout_s, which is meant for a step's collectives. The launchers initialize the
    # default group with the start-up timeout; a group of its own carries it here (its
    # creation already waits for every rank).
    g = dist.new_group(timeout=timedelta(seconds=max(cfg.timeout_s, STARTUP_TIMEOUT_S)))
    dist.barrier(group=g)
    dist.destroy_process_group(g)
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout  # torch < 2.12
    set_timeout(timedelta(seconds=cfg.timeout_s))


def _check_same_data(fp: int, device: torch.device) -> None:
    t = torch.tensor([fp, -fp], dtype=torch.int64, device=device)
    mx = t.clone()
    dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    if int(mx[0]) != fp or int(-mx[1]) != fp:
        raise RuntimeError(f"ranks read different datasets (fingerprints differ, e.g. {fp:x} here): "
                           "the built-in corpus depends on the Python version; use the same "
                           "environment on every node or --data PATH")


def _full_params(model: nn.Module) -> dict[str, Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.cpu().clone()
    return out


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[Tensor, Tensor]], device: torch.device,
             fed: Any = None, step: int = 0) -> float:
    """World-mean loss over every rank's held-out batches (collective over the world; an elastic
    run's world is its group: the groups' sums then add up over the live groups, as an agreed
    round of ``fed``, :meth:`FedAvg.cross_group`)."""
    was = model.training
    model.eval()
    tot = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        tot[0] += lm_loss(model(x), y).double() * y.numel()
        tot[1] += y.numel()
    dist.all_reduce(tot)
    model.train(was)
    if fed is not None and fed.federation is not None:
        def over_groups(transport: Any) -> Tensor:
            t = tot.clone().to(transport.device)
            transport.all_reduce(t, op="sum")
            return t

        tot = fed.cross_group(f"eval{step}", over_groups)
    return float(tot[0] / tot[1])


class NonFiniteLossError(FloatingPointError):
    """A non-finite loss or gradient norm with ``--nan-policy stop`` (the same on every rank)."""


@dataclass
class Run:
    """Everything :func:`build_run` sets up for one rank; the loop's state lives here too."""

    cfg: TrainConfig
    rank: int
    device: torch.device
    topo: Topology
    mesh: "FedMesh"
    model: nn.Module
    optimizer: torch.optim.Optimizer
    traffic: FsdpTraffic
    fed: Any
    loader: ShardedLoader
    held: list[tuple[Tensor, Tensor]]
    meta: dict[str, Any]                 # what every checkpoint's meta.json records
    info: dict[str, Any]                 # the metrics file's config record (beyond cfg)
    monitor: Monitor
    start_step: int = 0
    elapsed0: float = 0.0
    resumed_from: str | None = None
    bad_step: int | None = None          # first non-finite step of this group, not yet agreed
    federation: "Federation | None" = None  # --elastic

    @property
    def tokens_per_step(self) -> int:
        ranks = len(self.federation.live_ranks()) if self.federation is not None else self.topo.world_size
        return ranks * self.cfg.batch_size * self.cfg.seq_len

    def checkpoint_dir(self) -> str:
        """Where this rank's checkpoints go: elastic runs save per federation group."""
        assert self.cfg.checkpoint_dir
        if self.federation is None:
            return self.cfg.checkpoint_dir
        return elastic_checkpoint_dir(self.cfg.checkpoint_dir, self.mesh.coords.group)


def elastic_checkpoint_dir(root: str, group: int) -> str:
    """Federation group ``group``'s checkpoint folder under an elastic run's ``root``."""
    return os.path.join(root, f"group{group}")


def elastic_checkpoint_groups(root: str) -> list[int]:
    """The groups with a folder under an elastic run's ``root`` (:func:`elastic_checkpoint_dir`)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(n[5:]) for n in names if n.startswith("group") and n[5:].isdigit())


def newest_group_checkpoints(root: str) -> dict[int, tuple[int, str]]:
    """Every group's newest checkpoint under an elastic run's ``root``: group -> (step, path)."""
    found = {}
    for f in elastic_checkpoint_groups(root):
        path = ckpt.latest_checkpoint(elastic_checkpoint_dir(root, f))
        if path is not None:
            found[f] = (int(ckpt.read_meta(path)["step"]), path)
    return found


def _of_the_newest_step(root: str) -> dict[int, str]:
    """The groups' newest checkpoints of the newest step among them (what an elastic resume
    loads): group -> path."""
    found = newest_group_checkpoints(root)
    newest = max((st for st, _ in found.values()), default=None)
    return {f: path for f, (st, path) in found.items() if st == newest}


def _build_model(cfg: TrainConfig, mesh: "FedMesh", device: torch.device) -> tuple[nn.Module, FsdpTraffic]:
    """The model, sharded with FSDP2 over ``mesh`` (hierarchical collectives on request), and
    the counter of FSDP's traffic."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mcfg = cfg.model_config()
    use_meta = cfg.init == "meta" or (cfg.init == "auto" and mcfg.num_params() > 300_000_000)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if cfg.mixed_precision == "bf16" else MixedPrecisionPolicy())
    if use_meta:
        model = build_model(mcfg, device="meta")
        units = shard_model(model, mesh, mp)
        model.to_empty(device=device)
        # NOTE: every rank draws its own shards from one seed: ranks with the same shard
        # coordinates (the fed peers) get identical values, so all groups start equal.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(cfg.seed)
            model.init_weights()
    else:
        model = build_model(mcfg, device="cpu", seed=cfg.seed).to(device)
        units = shard_model(model, mesh, mp)
    topo = mesh.topology
    hierarchical = cfg.hierarchical and len({r // topo.ranks_per_node for r in mesh.group_ranks["shard"]}) > 1
    if hierarchical:
        from flcomm.fsdp.fsdp2 import apply_hierarchical_collectives

        # NOTE: the hooks' transports count their own bytes (intra- and inter-node apart) into
        # mesh.stats, so FsdpTraffic leaves the shard-dim collectives out.
        apply_hierarchical_collectives(model, mesh.hierarchy("shard"))
    elif cfg.hierarchical and mesh.rank == 0:
        print("flcomm.train: --hierarchical has no effect: the shard group lies inside one node",
              file=sys.stderr, flush=True)
    return model, FsdpTraffic(units, mesh, mp.param_dtype, mp.reduce_dtype, count_shard_dim=not hierarchical)


def _split(cfg: TrainConfig, tokens: "np.ndarray", P: int) -> Split:
    """The train / held-out split of ``tokens`` for P ranks; each rank's train slice checked to
    hold a window."""
    split = split_tokens(tokens, cfg.eval_fraction, P * cfg.batch_size * (cfg.seq_len + 1) + P)
    check_slices(len(split.train), P, cfg.seq_len)
    return split


def _build_data(cfg: TrainConfig, mesh: "FedMesh", device: torch.device):
    """This rank's loader (slice ``group * G + index`` of P), its held-out batches, and the
    data record a checkpoint keeps (:func:`flcomm.train.data.data_record`)."""
    topo, coords = mesh.topology, mesh.coords
    P = topo.world_size
    tokens = load_tokens(cfg.data, cfg.data_dtype, cfg.max_tokens)
    check_vocab(tokens, cfg.model_config().vocab_size, data_source(cfg.data))
    _startup_barrier(cfg)
    _check_same_data(fingerprint(tokens), device)
    split = _split(cfg, tokens, P)
    index = coords.group * topo.group_size + coords.index
    loader = ShardedLoader(split.train, cfg.seq_len, cfg.batch_size, P, index, cfg.seed, device=device)
    held = eval_batches(split.heldout, cfg.seq_len, cfg.batch_size, cfg.eval_batches, P, index)
    sizes = {"train_tokens": len(split.train), "heldout_tokens": len(split.heldout)}
    return loader, held, data_record(cfg.data, tokens), sizes


def build_run(cfg: TrainConfig, monitor: Monitor, store: Any = None) -> Run:
    """Mesh, model, sharding, hooks, data, FedAvg and resume of this rank (collective).
    ``--elastic``: torch.distributed's world is this rank's federation group (see
    :func:`flcomm.train.launch.worker_main`), RANK / WORLD_SIZE the job's, and ``store`` the
    job's store, which the :class:`~flcomm.federated.elastic.Federation` works through."""
    if cfg.elastic:
        P, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    else:
        P, rank = dist.get_world_size(), dist.get_rank()
    backend = str(dist.get_backend()).lower()
    device = _device(backend)
    local_ws = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
    topo = resolve_topology(cfg, P, local_ws)
    timeout = timedelta(seconds=cfg.timeout_s)
    mesh = topo.build(device_type=device.type, timeout=timeout, group_rank=rank if cfg.elastic else None)
    federation = None
    if cfg.elastic:
        from flcomm.federated.elastic import Federation

        if store is None:
            raise RuntimeError("--elastic needs the job's store (flcomm.train.launch.worker_main passes it)")
        federation = Federation(store, topo, rank, backend=backend, timeout=timeout, grace_s=cfg.elastic_grace_s,
                                min_groups=cfg.min_groups, stats=mesh.stats, rejoin_mode=cfg.rejoin)
    monitor.set_groups({k: list(v) for k, v in mesh.group_ranks.items()})
    # NOTE: the global generators are seeded, so the RNG state a checkpoint saves is the same
    # run to run (nothing in the loop draws from them today; dropout would).
    torch.manual_seed(cfg.seed)
    model, traffic = _build_model(cfg, mesh, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                  weight_decay=cfg.weight_decay)
    loader, held, data_rec, sizes = _build_data(cfg, mesh, device)
    fed = None
    if cfg.federated:
        fed = FedAvg(model, mesh, sync_every=cfg.sync_every, codec=cfg.codec,
                     error_feedback=cfg.error_feedback, outer=cfg.outer, outer_lr=cfg.outer_lr,
                     outer_momentum=cfg.outer_momentum, inner_state=cfg.inner_state,
                     overlap=cfg.overlap, overlap_steps=cfg.overlap_steps, fragments=cfg.fragments,
                     offload=cfg.offload, residual_dtype=cfg.residual_dtype,
                     sharded_exchange=cfg.sharded_exchange, bucket_mb=cfg.bucket_mb, optimizer=optimizer,
                     federation=federation, sync_init=not cfg.rejoin)
    mcfg = cfg.model_config()
    meta = {"strategy": cfg.strategy, "topology": topo.to_dict(), "model": mcfg.to_dict(), "seed": cfg.seed,
            "seq_len": cfg.seq_len, "batch_size": cfg.batch_size, "data": data_rec}
    info = {"world_size": P, "mesh_shape": list(topo.mesh_shape), "ranks_per_node": topo.ranks_per_node,
            "group_size": topo.group_size, "shard_size": topo.shard_size, "num_params": mcfg.num_params(),
            "tokens_per_step": P * cfg.batch_size * cfg.seq_len, "backend": backend,
            "data_name": cfg.data or BUILTIN_CORPUS, **sizes,
            "fsdp_bytes_per_step": {t.value: b for t, b in traffic.bytes_per_step.items()}}
    run = Run(cfg, rank, device, topo, mesh, model, optimizer, traffic, fed, loader, held, meta, info, monitor,
              federation=federation)
    monitor.poison = lambda: _poison(model)
    if cfg.resume or cfg.rejoin:
        _resume(run)
    if cfg.rejoin:
        _rejoin(run)
    return run


def _rejoin(run: Run) -> None:
    """A restarted group: wait until the survivors admit it at a sync, take their anchor, and go
    on from that step (the data position follows the step; the optimizer state is the
    checkpoint's)."""
    run.monitor.enter(run.start_step, "rejoin")
    step = run.fed.rejoin()
    run.start_step = step
    run.loader.position = step * run.cfg.batch_size
    print(f"flcomm.train: rank {run.rank}: federation group {run.mesh.coords.group} rejoined at step {step} "
          f"(generation {run.federation.generation})", file=sys.stderr, flush=True)


@torch.no_grad()
def _poison(model: nn.Module) -> None:
    """NaN into this rank's parameters (the fault tests' "nan" action)."""
    for p in model.parameters():
        p.fill_(float("nan"))


def _resume(run: Run) -> None:
    """Load the latest checkpoint of ``run.cfg.checkpoint_dir``, if there is one: model,
    optimizer, data position, FedAvg state, step (refusing another topology, model, seed or,
    without ``allow_data_change``, other data)."""
    cfg = run.cfg
    coords = run.mesh.coords
    path, src, pin = (ckpt.latest_checkpoint(cfg.checkpoint_dir), coords.group, None) if run.federation is None \
        else _elastic_source(run)
    try:
        if path is not None:
            _load(run, pin or path, src)
            run.resumed_from = path
    finally:
        if pin is not None:
            dist.barrier()  # NOTE: every rank of the group has read its files
            if dist.get_rank() == 0:
                shutil.rmtree(os.path.dirname(pin), ignore_errors=True)
    if run.rank == 0:
        print(f"flcomm.train: resuming from {path} (step {run.start_step})" if path else
              f"flcomm.train: no checkpoint in {cfg.checkpoint_dir}, starting at step 0",
              file=sys.stderr, flush=True)


def _load(run: Run, path: str, src: int) -> None:
    """:func:`_resume` of checkpoint ``path``, federation group ``src``'s state in it."""
    cfg, coords = run.cfg, run.mesh.coords
    ckpt.check_resume(ckpt.read_meta(path), run.meta, path, cfg.allow_data_change)
    _, rs = ckpt.load(path, run.model, run.optimizer, src, run.topo, run.meta["model"],
                      same_group_shape=run.federation is not None)
    if run.federation is not None and (src != coords.group or rs["data"].get("n_windows") != run.loader.n_windows):
        # NOTE: elastic, another group's (or another number of groups'): the data position only
        # (the windows consumed per rank: the same on every rank)
        run.loader.position = int(rs["data"]["position"])
    else:
        run.loader.load_state_dict(rs["data"])
    if run.fed is not None:
        if rs.get("fed") is None:
            raise ValueError(f"checkpoint {path} has no FedAvg state (written by strategy "
                             f"without federation), cannot resume {cfg.strategy}")
        # NOTE: elastic: another group's entry for the rank with this rank's shard coordinates
        run.fed.load_state_dict(rs["fed"], source_rank=src * run.topo.group_size + coords.index)
    run.start_step, run.elapsed0 = int(rs["step"]), float(rs.get("elapsed_s", 0.0))


def _elastic_source(run: Run) -> tuple[str | None, int, str | None]:
    """An elastic resume: the newest checkpoint of any group (their number may differ from this
    run's), this rank's own group's when it has that step; the group it belongs to; and for a
    rejoining group, the checkpoint pinned (:func:`flcomm.train.checkpoint.pin_latest`: the
    survivors go on saving and pruning while it loads), else None."""
    root = run.cfg.checkpoint_dir
    mine = run.mesh.coords.group
    choice: tuple[str | None, int, str | None] = (None, mine, None)
    error = None
    if dist.get_rank() == 0:
        try:
            newest = _of_the_newest_step(root)
            if newest:
                src = mine if mine in newest else min(newest)
                choice = (newest[src], src, None)
                if run.cfg.rejoin:
                    into = os.path.join(elastic_checkpoint_dir(root, mine), ckpt.PIN_DIR)
                    shutil.rmtree(into, ignore_errors=True)  # NOTE: a pin a crashed rejoin left
                    pinned = ckpt.pin_latest(elastic_checkpoint_dir(root, src), into)
                    choice = (pinned[1], src, pinned[0]) if pinned is not None else choice
        except (OSError, ValueError, RuntimeError) as e:
            error = (type(e).__name__, str(e))
    # NOTE: the group's first rank chooses for all: survivors may publish a newer one meanwhile
    box = [(choice, error)]
    dist.broadcast_object_list(box, src=0)
    choice, error = box[0]
    if error is not None:
        raise (ValueError if error[0] == "ValueError" else RuntimeError)(
            f"the group's first rank could not choose a checkpoint under {root}: {error[0]}: {error[1]}")
    return choice


def _agree_non_finite(run: Run, step: int) -> None:
    """World-wide agreement on a non-finite step (``--nan-policy stop``): every rank raises
    the same :class:`NonFiniteLossError`, naming the first bad step and the groups."""
    F = run.topo.num_groups
    t = torch.zeros(F, dtype=torch.int64, device=run.device)
    if run.bad_step is not None:
        t[run.mesh.coords.group] = run.bad_step
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    bad = {f: int(s) for f, s in enumerate(t.tolist()) if s > 0}
    if bad:
        first = min(bad.values())
        raise NonFiniteLossError(
            f"non-finite loss or gradient norm at step {first} (federation group(s) "
            f"{sorted(bad)}, first bad step per group {bad}); stopped at step {step} on every rank "
            "(--nan-policy stop; --nan-policy skip-step skips such steps instead)")


def train_step(run: Run, step: int) -> float:
    """One step: forward, backward, gradient norm (and clipping), the group's loss, then,
    when everything is finite, the optimizer step; FedAvg's step either way (its schedule
    must stay in step across groups). Returns the group-mean loss.

    A non-finite loss or gradient norm is agreed on inside the federation group (with the
    loss all-reduce); ``skip-step`` leaves the step out, ``stop`` leaves it out and raises on
    every rank at the next world-wide point (at once for FSDP / HSDP, at the next FedAvg sync
    for the FL strategies: the groups do not talk between syncs).
    """
    cfg, mon = run.cfg, run.monitor
    for g in run.optimizer.param_groups:
        g["lr"] = lr_at(cfg, step)
    mon.enter(step, "forward")
    x, y = run.loader.next_batch()
    loss = lm_loss(run.model(x), y)
    mon.enter(step, "backward")
    loss.backward()
    mon.enter(step, "optimizer")
    # NOTE: max_norm inf measures without scaling (the clip coefficient clamps to 1)
    gn = torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn
    mon.enter(step, "loss")
    # NOTE: the logged loss is the mean over this rank's federation group (an intra-group
    # collective); a world-wide one per step would put a sync on the slow links.
    lt = torch.stack([loss.detach().float(), (~torch.isfinite(gn.detach().float())).float()])
    dist.all_reduce(lt, group=run.mesh.groups["group"])
    loss_v = float(lt[0]) / run.topo.group_size
    bad = not math.isfinite(loss_v) or float(lt[1]) > 0
    if bad and run.bad_step is None and cfg.nan_policy == "stop":
        run.bad_step = step
    if bad or run.bad_step is not None:
        run.optimizer.zero_grad(set_to_none=True)
        if bad and run.rank == run.topo.group_ranks(run.mesh.coords.group)[0]:
            print(f"flcomm.train: step {step}: non-finite loss or gradient norm in federation group "
                  f"{run.mesh.coords.group}; step skipped", file=sys.stderr, flush=True)
    else:
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
    run.traffic.record_step()
    if run.fed is not None:
        if cfg.nan_policy == "stop" and step % cfg.sync_every == 0:
            mon.enter(step, "nan-check")
            _agree_non_finite(run, step)
        mon.enter(step, "fedavg")
        run.fed.step()
    elif run.bad_step is not None:
        _agree_non_finite(run, step)
    return loss_v


class StepLogger:
    """Rank 0's per-step records (metrics JSONL and progress bar): loss, tokens/s, bytes per
    link tier since the last record, exposed FedAvg time; the config record first and the
    summary last."""

    def __init__(self, run: Run) -> None:
        cfg = run.cfg
        self.run = run
        self.writer = MetricsWriter(cfg.metrics if self._leads() else None,
                                    append=run.resumed_from is not None or cfg.rejoin)
        self.writer.write({"config": {**cfg.to_dict(), **run.info, "resumed_from": run.resumed_from,
                                      "start_step": run.start_step}})
        self.counter = TierCounter(run.mesh.stats)
        self.sums = {t: 0 for t in LinkTier}
        self.exposed_prev = run.fed.exposed_comm_s if run.fed is not None else 0.0
        self.t_start = time.perf_counter() - run.elapsed0
        # NOTE: cumulative: an elastic run's tokens per step change with its live groups
        self.tokens = run.start_step * run.tokens_per_step
        self.bar = None
        if cfg.progress and run.rank == 0:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.steps, initial=run.start_step, desc=cfg.strategy, unit="step",
                            dynamic_ncols=True, file=sys.stderr)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def _leads(self) -> bool:
        """This rank writes the metrics: rank 0, or in an elastic run the first rank of the
        lowest live group (it changes when groups are lost or rejoin)."""
        fed = self.run.federation
        return fed.is_leader() if fed is not None else self.run.rank == 0

    def _membership(self) -> None:
        """Elastic: hand the metrics file over to the current leader, and record every
        membership change (step, generation, groups lost and joined, seconds it took)."""
        fed, path = self.run.federation, self.run.cfg.metrics
        if fed is None:
            return
        if path and self._leads() != (self.writer.path is not None):
            self.writer.close()
            self.writer = MetricsWriter(path if self._leads() else None, append=True)
        for ev in fed.events:
            self.writer.write({"membership": ev})
        fed.events.clear()

    def step(self, step: int, loss: float, dt: float, ev: float | None) -> None:
        """Record ``step``; bytes and exposed time are read here, after evaluation and
        checkpointing, whose ``fed.finish()`` may complete (and, bucket by bucket, issue) this
        step's exchange."""
        self._membership()
        fed, tps = self.run.fed, self.run.tokens_per_step
        self.tokens += tps
        exposed = (fed.exposed_comm_s - self.exposed_prev) if fed is not None else 0.0
        self.exposed_prev = fed.exposed_comm_s if fed is not None else 0.0
        d = self.counter.delta()
        for t in LinkTier:
            self.sums[t] += d[t]
        rec: dict[str, Any] = {
            "step": step, "loss": loss, "lr": lr_at(self.run.cfg, step), "tokens": self.tokens,
            "time_s": self.elapsed(), "wall_time": time.time(), "tokens_per_s": tps / dt, "step_time_s": dt,
            "exposed_comm_s": exposed,
            "internode_bytes": d[LinkTier.INTER_NODE], "intergroup_bytes": d[LinkTier.INTER_GROUP],
            "intranode_bytes": d[LinkTier.INTRA_NODE],
        }
        if fed is not None:
            rec["num_syncs"] = fed.num_syncs
        if ev is not None:
            rec["eval_loss"], rec["eval_ppl"] = ev, perplexity(ev)
        self.writer.write(rec)
        if self.bar is not None:
            self.bar.update(1)
            post = {"loss": f"{loss:.3f}", "tok/s": f"{rec['tokens_per_s']:.0f}"}
            if ev is not None:
                post["eval"] = f"{ev:.3f}"
            self.bar.set_postfix(post, refresh=False)

    def finish(self, res: TrainResult, step: int) -> None:
        """Fill ``res``'s totals and write the summary record."""
        res.final_step, res.wall_s = step, self.elapsed()
        n = max(1, step - res.start_step)
        res.bytes_per_step = {t.value: self.sums[t] / n for t in LinkTier}
        res.num_syncs = self.run.fed.num_syncs if self.run.fed is not None else 0
        ev = res.eval_losses.get(step)
        self.writer.write({"summary": {"steps": step, "wall_s": res.wall_s,
                                       "final_loss": res.losses[-1] if res.losses else None, "eval_loss": ev,
                                       "eval_ppl": perplexity(ev) if ev is not None else None,
                                       "bytes_per_step": res.bytes_per_step, "num_syncs": res.num_syncs}})

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.writer.close()


@dataclass
class CheckpointPolicy:
    """When to evaluate and to save: every ``eval_every`` / ``save_every`` steps and at the last
    step; both finish an exchange in flight first."""

    cfg: TrainConfig
    end: int
    fault: Any = None  # ``fault(tmp_dir)``, passed to every save (tests inject a crash)

    def eval_due(self, step: int) -> bool:
        return bool(self.cfg.eval_every and step % self.cfg.eval_every == 0) or step == self.end

    def save_due(self, step: int) -> bool:
        c = self.cfg
        return bool(c.checkpoint_dir) and (bool(c.save_every and step % c.save_every == 0) or step == self.end)

    def save(self, run: Run, step: int, elapsed_s: float) -> None:
        run.monitor.enter(step, "checkpoint")
        if run.fed is not None:
            run.fed.finish()
        rank_state = {"step": step, "data": run.loader.state_dict(),
                      "fed": run.fed.state_dict() if run.fed is not None else None, "elapsed_s": elapsed_s}
        meta = run.meta
        if run.federation is not None:
            m = run.federation.membership
            meta = {**meta, "elastic": {"generation": m.generation, "groups": list(m.groups)}}
        ckpt.save(run.checkpoint_dir(), step, run.model, run.optimizer, rank_state, meta,
                  run.mesh.coords.group, self.cfg.keep_checkpoints, self._fault_hook(run, step))

    def _fault_hook(self, run: Run, step: int) -> Any:
        f = run.monitor.fault
        if f is None or f.phase != "checkpoint" or f.rank != run.rank or f.step != step:
            return self.fault
        return lambda tmp: f.fire()  # NOTE: an injected checkpoint fault fires after the files are written


def train(cfg: TrainConfig, return_params: bool = False, stop_after: int | None = None,
          _save_fault: Any = None, monitor: Monitor | None = None, store: Any = None) -> TrainResult:
    """Run ``cfg`` on this rank of an initialized process group (see the module docstring).

    ``return_params`` adds the full (unsharded) parameters at the end to the result (tests).
    ``stop_after`` ends the run after that step as if the job were stopped there (a time limit):
    it evaluates and checkpoints as at the end, but the schedule still spans ``cfg.steps``.
    ``_save_fault(tmp_dir)`` is passed to every checkpoint save (tests inject a crash).
    ``monitor`` records this rank's phases and failure (:mod:`flcomm.train.monitor`); a
    failure is re-raised with the one-line report added as a note. ``store``: the job's store
    (``--elastic``).
    """
    if not dist.is_initialized():
        raise RuntimeError("train() needs torch.distributed to be initialized (use launch_local, "
                           "worker_main or torchrun)")
    mon = monitor or Monitor(None, dist.get_rank(), dist.get_world_size())
    try:
        return _train(cfg, mon, return_params, stop_after, _save_fault, store)
    except BaseException as e:
        msg = mon.fail(e)
        if hasattr(e, "add_note"):  # NOTE: Python >= 3.11; the monitor keeps it either way
            e.add_note(msg)
        raise


def _train(cfg: TrainConfig, mon: Monitor, return_params: bool, stop_after: int | None,
           save_fault: Any, store: Any = None) -> TrainResult:
    run = build_run(cfg, mon, store)
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    policy = CheckpointPolicy(cfg, end, save_fault)
    log = StepLogger(run)
    res = TrainResult(start_step=run.start_step, tokens_per_step=run.tokens_per_step)
    run.model.train()
    step = run.start_step
    try:
        if cfg.rejoin:
            # NOTE: admitted in the middle of the survivors' step: its evaluation and checkpoint are still to come
            _eval_and_save(run, policy, log, res, step)
        for step in range(run.start_step + 1, end + 1):
            t0 = time.perf_counter()
            res.losses.append(train_step(run, step))
            dt = time.perf_counter() - t0
            if cfg.nan_policy == "stop" and (policy.eval_due(step) or policy.save_due(step)):
                mon.enter(step, "nan-check")
                _agree_non_finite(run, step)
            ev = _eval_and_save(run, policy, log, res, step)
            log.step(step, res.losses[-1], dt, ev)
        mon.enter(step, "end")
        if run.fed is not None:
            run.fed.finish()
        if run.federation is not None:
            run.federation.finish()
        log.finish(res, step)
    finally:
        log.close()
    mon.done()
    if return_params:
        res.params = _full_params(run.model)
    return res


def _eval_and_save(run: Run, policy: CheckpointPolicy, log: StepLogger, res: TrainResult, step: int) -> float | None:
    """Evaluation and checkpoint of ``step`` when due (both finish an exchange in flight first);
    the evaluation loss, if any."""
    ev = None
    if policy.eval_due(step):
        run.monitor.enter(step, "eval")
        if run.fed is not None:
            run.fed.finish()
        ev = res.eval_losses[step] = log.counter.excluding(
            lambda: evaluate(run.model, run.held, run.device, run.fed, step))
    if policy.save_due(step):
        policy.save(run, step, log.elapsed())
    return ev


def check_before_launch(cfg: TrainConfig, world_size: int) -> Topology:
    """What can be refused before any process starts: the topology against the world size,
    the model (``seq_len`` within its ``max_seq_len``), the data file and its token ids, and
    a checkpoint to resume from (its files' hashes, and the same topology, model, seed and,
    without ``allow_data_change``, data)."""
    topo = resolve_topology(cfg, world_size, cfg.ranks_per_node)
    if cfg.elastic and cfg.min_groups > topo.num_groups:
        raise ValueError(f"--min-groups {cfg.min_groups} exceeds the {topo.num_groups} federation groups of "
                         f"{world_size} ranks in groups of {topo.group_size}")
    if cfg.elastic and topo.node_groups is not None:
        raise ValueError("--elastic needs contiguous federation groups (no explicit node_groups)")
    mcfg = cfg.model_config()
    tokens = load_tokens(cfg.data, cfg.data_dtype, cfg.max_tokens)
    check_vocab(tokens, mcfg.vocab_size, data_source(cfg.data))
    _split(cfg, tokens, world_size)
    if cfg.resume and cfg.checkpoint_dir:
        run_meta = {"seed": cfg.seed, "data": data_record(cfg.data, tokens)}
        for path in _resume_candidates(cfg):
            meta = ckpt.read_meta(path)
            ckpt.check_compatible(meta, topo, mcfg.to_dict(), path, same_group_shape=cfg.elastic)
            ckpt.check_resume(meta, run_meta, path, cfg.allow_data_change)
            ckpt.verify_files(path, meta)
    return topo


def _resume_candidates(cfg: TrainConfig) -> list[str]:
    """The checkpoints a ``--resume`` may load: the newest one; for ``--elastic`` every group's
    newest of the newest step among the groups (:func:`_elastic_source` picks from these;
    every group's ``latest`` is read)."""
    root = cfg.checkpoint_dir
    if not cfg.elastic:
        path = ckpt.latest_checkpoint(root)
        return [] if path is None else [path]
    return list(_of_the_newest_step(root).values())
