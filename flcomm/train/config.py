"""The run's settings (:class:`TrainConfig`, one field per command-line flag), the strategy's
topology for a world (:func:`resolve_topology`) and the learning-rate schedule (:func:`lr_at`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from datetime import timedelta
from typing import Any

from flcomm.codecs import DENSE_CODECS, check_replicate_codec
from flcomm.federated.config import FedAvgConfig, add_field_arguments
from flcomm.federated.mesh import MeshConfig, TransportKind
from flcomm.federated.strategy import Strategy
from flcomm.federated.topology import Topology
from flcomm.train.model import MODEL_PRESETS, get_config
from flcomm.validate import integer, number

NAN_POLICIES = ("stop", "skip-step")

# the titles of the trainer's flag groups in --help (a field of none: the parser's own option)
TOPOLOGY = "topology"
REPLICATE = "replicate all-reduce (hsdp, fl-hsdp)"
FEDAVG = "FedAvg (fl-fsdp, fl-hsdp)"
ELASTIC = "elastic federation (fl-fsdp, fl-hsdp)"
MODEL = "model and optimization"
DATA = "data and evaluation"
OUTPUT = "output"
RUNTIME = "runtime"


def _flag(default: Any, group: str | None, help: str | None = None, **flag: Any) -> Any:
    """A field of :class:`TrainConfig` with its command-line flag: the title of its group, its help
    (None: none) and add_argument keywords of its own (:func:`~flcomm.federated.config.add_field_arguments`)."""
    return field(default=default, metadata={"help": help, "group": group, **({"flag": flag} if flag else {})})


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs; the CLI flags map one to one (``--sync-every`` -> sync_every),
    made from the fields (:meth:`add_arguments`: the help and group of each field are in its
    metadata; ``beta1`` and ``beta2`` have no flag).

    Topology (None = the strategy's default, see :func:`resolve_topology`): ``ranks_per_node``,
    ``group_size`` (G, ranks per federation group), ``shard_size`` (S, ranks per shard group).
    Batch sizes are per rank; a step consumes ``world * batch_size * seq_len`` tokens.
    ``strategy`` is a :class:`~flcomm.federated.strategy.Strategy`, given as one or as its name;
    the records (:meth:`to_dict`) hold the name.
    """

    strategy: Strategy = _flag(Strategy.FSDP, None, " | ".join(Strategy.values()))
    ranks_per_node: int | None = _flag(None, TOPOLOGY, "L, ranks per (emulated) node (default: LOCAL_WORLD_SIZE "
                                                       "or the world)")
    group_size: int | None = _flag(None, TOPOLOGY, "G, ranks per federation group (fl-*; default: one node)")
    shard_size: int | None = _flag(None, TOPOLOGY, "S, ranks per shard group (hsdp / fl-hsdp; default: one node)")
    # a no-op when the shard group does not span nodes
    hierarchical: bool = _flag(False, TOPOLOGY, "FSDP reduce-scatter / all-gather in two stages (intra-node, then "
                                                "inter-node) when the shard group spans nodes")
    # HSDP / FL+HSDP, through flcomm.fsdp.apply_all_reduce_hook
    replicate_codec: str = _flag("none", REPLICATE, "the gradients' all-reduce over the R replicas in this codec, "
                                                    f"through flcomm's hook (FSDP2): {' | '.join(DENSE_CODECS)} "
                                                    "(none: FSDP2's own all-reduce)")
    replicate_error_feedback: bool = _flag(False, REPLICATE, "keep what the replicate codec dropped and add it to "
                                                             "the next step's gradient")
    # FedAvg: every setting in one object (flcomm.federated.config), its flags made from its fields
    fedavg: FedAvgConfig = field(default_factory=FedAvgConfig, metadata={"group": FEDAVG})
    # elastic federation (flcomm.federated.elastic)
    elastic: bool = _flag(False, ELASTIC, "a federation group that loses a rank is dropped; the others go on "
                                          "(docs/fault-tolerance.md)")
    elastic_grace_s: float = _flag(15.0, ELASTIC, "how long a membership round waits for a silent rank before its "
                                                  "group is out")
    min_groups: int = _flag(1, ELASTIC, "end the job when fewer federation groups are left")
    rejoin: bool = _flag(False, ELASTIC, "this is a restarted group: load a survivor's latest checkpoint and join "
                                         "at the next sync (--nproc: the launcher restarts a lost group itself "
                                         "with this)")
    model: str = _flag("tiny", MODEL, f"preset: {', '.join(MODEL_PRESETS)}")
    vocab_size: int | None = _flag(None, MODEL)
    init: str = _flag("auto", MODEL, "auto | full | meta (meta: build sharded, no full copy)")
    mixed_precision: str = _flag("none", MODEL, "none | bf16")
    steps: int = _flag(100, MODEL)
    batch_size: int = _flag(8, MODEL, "sequences per rank per step")
    seq_len: int = _flag(128, MODEL)
    lr: float = _flag(3e-3, MODEL, "peak learning rate (AdamW)")
    min_lr_ratio: float = _flag(0.1, MODEL, "final lr / peak lr (cosine)")
    warmup: int | None = _flag(None, MODEL, "warm-up steps (default: steps/10, <= 100)")
    weight_decay: float = _flag(0.1, MODEL)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = _flag(1.0, MODEL, "0: off")
    seed: int = _flag(0, MODEL)
    data: str | None = _flag(None, DATA, "text file (byte level), .npy or .bin token ids (default: built-in corpus)")
    data_dtype: str | None = _flag(None, DATA, "element type of a .bin file (uint16)")
    max_tokens: int | None = _flag(None, DATA)
    eval_fraction: float = _flag(0.02, DATA)
    eval_every: int = _flag(0, DATA, "0: only at the end")
    eval_batches: int = _flag(4, DATA)
    metrics: str | None = _flag(None, OUTPUT, "JSONL file of per-step metrics")
    checkpoint_dir: str | None = _flag(None, OUTPUT)
    save_every: int = _flag(0, OUTPUT, "0: only at the end")
    keep_checkpoints: int = _flag(2, OUTPUT)
    resume: bool = _flag(False, OUTPUT, "continue from the latest checkpoint", action="store_true")
    allow_data_change: bool = _flag(False, OUTPUT, "resume even though the data differ from the checkpoint's",
                                    action="store_true")
    backend: str = _flag("auto", RUNTIME, "auto | gloo | nccl")
    transport: str = _flag("torch", RUNTIME, f"{' | '.join(TransportKind.values())}: flcomm's collectives "
                                             "(hierarchical hooks, replicate hook, FedAvg) on torch.distributed's "
                                             "process groups or on flcomm's own NCCL communicators")
    # every collective, mesh dims included
    timeout_s: float = _flag(300.0, RUNTIME, "timeout of every collective, in seconds (a dead or frozen rank is "
                                             "detected within it)")
    nan_policy: str = _flag("stop", RUNTIME, f"on a non-finite loss or gradient norm: {' | '.join(NAN_POLICIES)} "
                                             "(stop: every rank, naming the step)")
    # the launcher picks one when none is given
    log_dir: str | None = _flag(None, RUNTIME, "per-rank heartbeats and tracebacks (default: a new temporary "
                                               "directory)")
    progress: bool = _flag(True, RUNTIME)

    def __post_init__(self) -> None:
        """Checks what this config owns (``fedavg`` checked itself when it was made), the topology (L, G, S) to
        :class:`~flcomm.federated.topology.Topology`
        (:func:`~flcomm.train.checkpoint.check_before_launch`)."""
        def one_of(name: str, allowed: tuple[str, ...], label: str | None = None) -> None:
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown {label or name} {getattr(self, name)!r}; expected one of "
                                 f"{', '.join(allowed)}")

        # NOTE: a name (the command line, a record) becomes the member, parsed once; ValueError naming
        # the strategies otherwise
        object.__setattr__(self, "strategy", Strategy.parse(self.strategy))
        one_of("model", tuple(MODEL_PRESETS), "model preset")
        one_of("init", ("auto", "full", "meta"))
        one_of("mixed_precision", ("none", "bf16"))
        one_of("backend", ("auto", "gloo", "nccl"))
        one_of("nan_policy", NAN_POLICIES)
        one_of("transport", tuple(TransportKind.values()))
        # NOTE: a replicate codec needs a replicate dim (R = G / S > 1: hsdp, fl-hsdp; Strategy.topology
        # refuses one replica for them); error feedback needs a lossy codec
        object.__setattr__(self, "replicate_codec", check_replicate_codec(
            self.replicate_codec, self.replicate_error_feedback, hybrid=self.hybrid, strategy=self.strategy.value))
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
            raise ValueError(f"--elastic needs a federated strategy (fl-fsdp, fl-hsdp), got {self.strategy.value!r}")
        if self.rejoin and not (self.elastic and self.checkpoint_dir):
            raise ValueError("--rejoin needs --elastic and the job's --checkpoint-dir (a survivor's checkpoint)")
        number("eval_fraction", self.eval_fraction, 0, 1, lo_open=True, hi_open=True)
        if not isinstance(self.fedavg, FedAvgConfig):
            raise ValueError(f"fedavg must be a FedAvgConfig, got {type(self.fedavg).__name__}")
        if self.elastic:
            self.fedavg.check_elastic()
        if self.fedavg.timed:
            raise ValueError(f"--sync-period-s {self.fedavg.sync_period_s:g}: the reference trainer does not run "
                             "FedAvg's timed mode yet (its run length, evaluations and checkpoints count steps, "
                             "which differ between groups there); call flcomm.FedAvg(sync_period_s=...) from "
                             "your own loop (docs/stragglers.md), or use --sync-every")

    @property
    def federated(self) -> bool:
        return self.strategy.federated

    @property
    def hybrid(self) -> bool:
        return self.strategy.hybrid

    def model_config(self):
        over = {"vocab_size": self.vocab_size} if self.vocab_size else {}
        cfg = get_config(self.model, **over)
        if self.seq_len > cfg.max_seq_len:
            raise ValueError(f"seq_len {self.seq_len} exceeds max_seq_len {cfg.max_seq_len} of model "
                             f"preset {self.model!r}")
        return cfg

    def mesh_config(self) -> MeshConfig:
        """The mesh's settings of this run (``--transport``, ``--timeout-s``; the rest as
        :class:`~flcomm.federated.mesh.MeshConfig`'s defaults): what the mesh and an elastic
        federation read."""
        return MeshConfig(transport=self.transport, timeout=timedelta(seconds=self.timeout_s))

    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else min(100, max(1, self.steps // 10))

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON values: the strategy by name, FedAvg's :meth:`FedAvgConfig.to_dict`."""
        return {**asdict(self), "strategy": self.strategy.value, "fedavg": self.fedavg.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """The config a :meth:`to_dict` record describes."""
        return cls(**{**d, "fedavg": FedAvgConfig.from_dict(d["fedavg"])})

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def add_arguments(cls, parser: Any, defaults: TrainConfig | None = None, *,
                      groups: tuple[str | None, ...] | None = None, into: dict[str | None, Any] | None = None) -> None:
        """The flags of the fields of ``groups`` (titles: :data:`TOPOLOGY` ...; None: ``--strategy``;
        all when not given) on ``parser``, in field order, with the defaults of ``defaults``; each
        group is made on ``parser`` at its first flag unless ``into`` holds it, and FedAvg's flags
        are :meth:`FedAvgConfig.add_arguments`'s (:func:`~flcomm.federated.config.add_field_arguments`)."""
        add_field_arguments(parser, defaults or cls(), groups=groups, into=into, show_defaults=False)


def resolve_topology(cfg: TrainConfig, world_size: int, local_world_size: int | None = None) -> Topology:
    """The strategy's Topology for ``world_size`` ranks: ranks per node L = ``ranks_per_node``,
    else ``local_world_size`` (torchrun's LOCAL_WORLD_SIZE), else the whole world; G and S as
    given, else the strategy's defaults (:meth:`flcomm.federated.strategy.Strategy.topology`,
    which also refuses sizes that do not fit the world or are not the strategy)."""
    P = world_size
    L = cfg.ranks_per_node if cfg.ranks_per_node is not None else (local_world_size or P)
    return cfg.strategy.topology(P, L, cfg.group_size, cfg.shard_size)


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
