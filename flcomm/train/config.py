"""The run's settings (:class:`TrainConfig`, one field per command-line flag), the strategy's
topology for a world (:func:`resolve_topology`) and the learning-rate schedule (:func:`lr_at`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from flcomm.codecs import DENSE_CODECS
from flcomm.federated.config import FedAvgConfig
from flcomm.federated.strategy import Strategy
from flcomm.federated.topology import Topology
from flcomm.train.model import PRESETS, get_config
from flcomm.validate import integer, number

STRATEGIES = Strategy.values()
NAN_POLICIES = ("stop", "skip-step")
TRANSPORTS = ("torch", "native")


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
    # HSDP / FL+HSDP: the gradients' all-reduce over the replicate dim through flcomm's hook
    # (flcomm.fsdp.apply_all_reduce_hook) in this codec, with error feedback on request; "none":
    # FSDP2's own all-reduce (native HSDP)
    replicate_codec: str = "none"
    replicate_error_feedback: bool = False
    # flcomm's collectives on torch.distributed's process groups, or on its own NCCL communicators
    transport: str = "torch"
    # FedAvg: every setting in one object (flcomm.federated.config), its flags made from its fields
    fedavg: FedAvgConfig = field(default_factory=FedAvgConfig)
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
        """Checks what this config owns (``fedavg`` checked itself when it was made), the topology (L, G, S) to
        :class:`~flcomm.federated.topology.Topology`
        (:func:`~flcomm.train.checkpoint.check_before_launch`)."""
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
        one_of("transport", TRANSPORTS)
        one_of("replicate_codec", DENSE_CODECS, "replicate codec")
        self._check_replicate()
        for name in ("steps", "batch_size", "seq_len", "eval_batches"):
            integer(name, getattr(self, name), 1)
        for name in ("eval_every", "save_every", "keep_checkpoints"):
            integer(name, getattr(self, name), 0)
        for name in ("vocab_size", "max_tokens"):
            if getattr(self, name) is not None:
                integer(name, getattr(self, name), 1)
        if self.warmup is not None:
            integer("warmup", self.warmup, 0)
        for name, lo_open in (("lr", True), ("timeout_s", True), ("weight_decay", False), ("grad_clip", False)):
            number(name, getattr(self, name), 0, lo_open=lo_open)
        for name in ("min_lr_ratio", "beta1", "beta2"):
            number(name, getattr(self, name), 0, 1)
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs a checkpoint directory (--checkpoint-dir)")
        if self.save_every and not self.checkpoint_dir:
            raise ValueError("save_every needs a checkpoint directory (--checkpoint-dir)")
        number("elastic_grace_s", self.elastic_grace_s, 0, lo_open=True)
        integer("min_groups", self.min_groups, 1)
        if self.elastic and not self.federated:
            raise ValueError(f"--elastic needs a federated strategy (fl-fsdp, fl-hsdp), got {self.strategy!r}")
        if self.rejoin and not (self.elastic and self.checkpoint_dir):
            raise ValueError("--rejoin needs --elastic and the job's --checkpoint-dir (a survivor's checkpoint)")
        number("eval_fraction", self.eval_fraction, 0, 1, lo_open=True, hi_open=True)
        if not isinstance(self.fedavg, FedAvgConfig):
            raise ValueError(f"fedavg must be a FedAvgConfig, got {type(self.fedavg).__name__}")
        if self.elastic:
            self.fedavg.check_elastic()

    def _check_replicate(self) -> None:
        """A replicate codec needs a replicate dim (R = G / S > 1: hsdp, fl-hsdp; Strategy.topology
        refuses one replica for them); error feedback needs a lossy codec."""
        if self.replicate_codec != "none" and not self.hybrid:
            raise ValueError(f"--replicate-codec {self.replicate_codec} compresses the all-reduce over the replicate "
                             f"dim, which strategy {self.strategy} does not have; expected strategy hsdp or fl-hsdp "
                             f"(R = G / S > 1 replicas), got {self.strategy}")
        if self.replicate_error_feedback and self.replicate_codec == "none":
            raise ValueError("--replicate-error-feedback keeps what the replicate codec dropped; expected "
                             f"--replicate-codec one of {', '.join(c for c in DENSE_CODECS if c != 'none')}, got none")

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
        return {**asdict(self), "fedavg": self.fedavg.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """The config a :meth:`to_dict` record describes."""
        return cls(**{**d, "fedavg": FedAvgConfig.from_dict(d["fedavg"])})

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
