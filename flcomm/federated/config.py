"""FedAvg's settings, in one place: :class:`FedAvgConfig`.

One frozen object holds every setting of the FedAvg synchronizer, checked once, when it is made
(``__post_init__``). :class:`~flcomm.federated.fedavg.FedAvg` takes it, the reference trainer's
:class:`~flcomm.train.config.TrainConfig` holds it, the command line's FedAvg flags are made from
its fields (:meth:`FedAvgConfig.add_arguments`), the cost model's
:class:`~flcomm.costmodel.model.Plan` carries it, and a checkpoint records it
(:meth:`FedAvgConfig.to_dict`)::

    cfg = FedAvgConfig(sync_every=8, codec="int8", error_feedback=True, overlap_steps="auto")
    fed = FedAvg(model, mesh, cfg)              # or FedAvg(model, mesh, sync_every=8, ...)

Also here: :func:`add_field_arguments` (a config's command-line flags, made from its fields'
metadata: FedAvg's and the trainer's), :func:`check_inputs` (the mesh and the optimizer FedAvg is
given) and :func:`one_device` (the averaged tensors).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
import warnings
from collections.abc import Collection
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from flcomm.codecs import CODECS, Codec, get_codec
from flcomm.federated.inner import InnerState
from flcomm.federated.outer import Outer
from flcomm.ops.quant import BLOCKED_FORMATS
from flcomm.validate import integer, number

__all__ = ["AUTO", "RESIDUAL_DTYPES", "FedAvgConfig", "add_field_arguments", "check_inputs", "must_match_on_resume",
           "one_device", "parse_overlap_steps", "renamed"]

RESIDUAL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
AUTO = "auto"  # overlap_steps: FedAvg picks k from the first exchanges (flcomm.federated.autotune)


_UNSET = object()
RENAMED = {"bucket_mb": "bucket_cap_mb"}  # FedAvgConfig's deprecated setting names (FedAvgConfig.make)


def parse_overlap_steps(text: str) -> int | str:
    """A command line's overlap_steps: ``auto`` or an integer."""
    return AUTO if text.strip().lower() == AUTO else int(text)


def _setting(default: Any, help: str, source: str = "flcomm", *, resume: Any = _UNSET,
             flag: dict[str, Any] | None = None, also: dict[str, dict[str, Any]] | None = None) -> Any:
    """A field of :class:`FedAvgConfig` with its command-line help and where it comes from.
    ``resume``: a saved FedAvg state loads only into a run with the same value of this field,
    and a state saved without the field had this value (:func:`must_match_on_resume`).
    ``flag`` and ``also``: the flag's own add_argument keywords and more flags for the field
    (:func:`add_field_arguments`)."""
    meta: dict[str, Any] = {"help": help, "source": source}
    if resume is not _UNSET:
        meta["must_match_on_resume"] = resume
    meta.update({k: v for k, v in (("flag", flag), ("also", also)) if v})
    return field(default=default, metadata=meta)


def _flag_kind(tp: Any) -> type:
    """What the flag of a field of type ``tp`` parses: bool (a switch), int or float when ``tp``
    is one of them (or one of them | None), else str."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    args = tuple(a for a in args if a is not type(None))
    return args[0] if len(args) == 1 and args[0] in (bool, int, float) else str


def add_field_arguments(parser: Any, config: Any, *, groups: Collection[str | None] | None = None,
                        into: dict[str | None, Any] | None = None, show_defaults: bool = True) -> None:
    """The command-line flags of the dataclass instance ``config``: one per field whose metadata
    has a ``"help"`` (None: a flag without help), in field order, defaulting to the field's value
    in ``config``:

    1. the flag of ``sync_every`` is ``--sync-every``, read back as ``args.sync_every``;
    2. its kind comes from the field's type (``typing.get_type_hints``, None dropped from a
       union): a switch ``--x / --no-x`` for bool, int, float, else str (the config's
       ``__post_init__`` checks and converts it: a Strategy is given as its name);
    3. ``metadata["flag"]``: add_argument keywords of its own (``action="store_true"``,
       ``type=parse_overlap_steps``); ``metadata["also"]``: ``{flag: keywords}``, more flags for
       the field, right after it (``--overlap``);
    4. with ``show_defaults``, the help ends with the default (a switch's only when it is None:
       neither ``--x`` nor ``--no-x``).

    ``metadata["group"]`` is the title of the argparse group of ``parser`` the flag goes in, made
    at its first flag unless ``into`` holds it (none or None: ``parser`` itself); ``groups``:
    only the fields of these titles (None: all). A field holding a config that has
    ``add_arguments`` (``TrainConfig.fedavg``) adds that config's flags in its group.
    """
    made = dict(into or {})
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        title, tp = f.metadata.get("group"), hints[f.name]
        nested = isinstance(tp, type) and dataclasses.is_dataclass(tp) and hasattr(tp, "add_arguments")
        if (groups is not None and title not in groups) or not (nested or "help" in f.metadata):
            continue
        if title not in made:
            made[title] = parser if title is None else parser.add_argument_group(title)
        target, value = made[title], getattr(config, f.name)
        if nested:
            tp.add_arguments(target, value)
            continue
        kind, help_ = _flag_kind(tp), f.metadata["help"]
        if kind is bool:
            kw: dict[str, Any] = {"action": argparse.BooleanOptionalAction}
            shown = " (default: None)" if value is None else ""
        else:
            kw, shown = {"type": kind}, " (default: %(default)s)"
        kw.update(default=value, help=help_ + shown if show_defaults and help_ is not None else help_)
        kw.update(f.metadata.get("flag", {}))
        target.add_argument("--" + f.name.replace("_", "-"), dest=f.name, **kw)
        for other, more in f.metadata.get("also", {}).items():
            target.add_argument(other, dest=f.name, **more)


def must_match_on_resume() -> dict[str, Any]:
    """``{field: the value a state saved without it had}`` for the fields of
    :class:`FedAvgConfig` that a resumed state must share with the run (the layout of its
    anchors, momentum and residuals depends on them)."""
    return {f.name: f.metadata["must_match_on_resume"] for f in fields(FedAvgConfig)
            if "must_match_on_resume" in f.metadata}


@dataclass(frozen=True)
class FedAvgConfig:
    """Every setting of FedAvg (:mod:`flcomm.federated.fedavg`), checked when it is made: a bad
    value raises ValueError naming the field, what is allowed and what came.

    The help of each field (``dataclasses.fields(FedAvgConfig)[i].metadata["help"]``) is also its
    command-line help; ``metadata["source"]`` says where the setting comes from: the paper
    (Mittone & Aldinucci), DiLoCo, Streaming DiLoCo, or flcomm.
    """

    sync_every: int = _setting(8, "E: local steps between syncs", "paper")
    codec: str | Codec = _setting("none", f"wire codec of the exchange: {', '.join(CODECS)}; options after the name, "
                                  "e.g. topk:d=0.02:bits=2 (a Codec object is kept as given)")
    block_size: int | None = _setting(None, "elements per scale of the int8 / fp8 codecs (None: the codec's "
                                            "own, 256)")
    error_feedback: bool = _setting(False, "keep what the codec dropped and add it to the next round's delta",
                                    resume=None)
    outer: str = _setting("avg", f"outer update: {', '.join(Outer.values())} (avg: the paper's plain "
                                 "average; nesterov: DiLoCo's SGD with Nesterov momentum)", "paper / DiLoCo",
                       resume=None)
    outer_lr: float = _setting(0.7, "learning rate of the nesterov outer optimizer", "DiLoCo")
    outer_momentum: float = _setting(0.9, "momentum of the nesterov outer optimizer, in [0, 1)", "DiLoCo")
    inner_state: str = _setting("keep", f"the inner optimizer's state at a sync: {', '.join(InnerState.values())}"
                                        " (average and reset need the optimizer)", "paper")
    overlap_steps: int | str = _setting(0, "k: apply each exchange k steps after its sync, while training "
                                           "goes on (0: blocking; 1..E; 'auto': the smallest k that hides "
                                           "the exchange, measured on the first syncs)", "Streaming DiLoCo",
                                        flag={"type": parse_overlap_steps},
                                        also={"--overlap": {"action": "store_const", "const": AUTO,
                                                            "help": "overlap the exchanges with compute: "
                                                                    "--overlap-steps auto"}})
    fragments: int = _setting(1, "K, dividing E: sync 1/K of the shard every E/K steps", "Streaming DiLoCo",
                              resume=1)
    sync_period_s: float | None = _setting(None, "T: sync on the wall clock every T seconds instead of every E "
                                                 "steps; each federation group runs the steps that fit and its "
                                                 "delta is weighted by its tokens, so no group waits for a slow "
                                                 "one (flcomm.federated.pacing; docs/stragglers.md)")
    bucket_cap_mb: float = _setting(25.0, "bucket size of the exchange, in MiB (DDP's name; bucket_mb before)",
                                    also={"--bucket-mb": {"type": float, "help": argparse.SUPPRESS}})
    offload: str | None = _setting(None, "'cpu': keep the anchor, local-at-sync copy, momentum and residuals in host "
                                         "memory (page-locked on CUDA)")
    residual_dtype: str = _setting("fp32", f"dtype of the error-feedback residuals: {', '.join(RESIDUAL_DTYPES)}")
    sharded_exchange: bool | None = _setting(None, "FL+HSDP: each of the R replicas exchanges 1/R of the "
                                                   "shard, then they all-gather (None: on when R > 1)")
    verify: bool = _setting(False, "after every sync, compare 64-bit hashes of what the shard peers and the "
                                   "replicas must hold equal; a mismatch raises, naming the group, its ranks "
                                   "and the step")

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        # NOTE: a Codec object is kept as given (a custom codec, or one with its own options); the
        # field then holds its name, and block_size its block size
        codec_obj = self.codec if isinstance(self.codec, Codec) else None
        if codec_obj is not None:
            if self.block_size is not None:
                raise ValueError(f"block_size={self.block_size!r} given with a codec object {codec_obj!r}: "
                                 "set the block size on the codec")
            set_(self, "codec", codec_obj.spec)
            set_(self, "block_size", getattr(codec_obj, "block_size", None))
        elif not isinstance(self.codec, str):
            raise ValueError(f"codec must be a name ({', '.join(CODECS)}) or a Codec, got {self.codec!r}")
        else:
            set_(self, "codec", self.codec.strip().lower())
            if self.block_size is not None:
                integer("block_size", self.block_size, 1)
                if getattr(get_codec(self.codec), "fmt", None) not in BLOCKED_FORMATS:
                    raise ValueError(f"block_size applies to the blockwise codecs (int8, fp8), got "
                                     f"block_size={self.block_size!r} with codec {self.codec!r}")
            codec_obj = get_codec(self.codec, **({} if self.block_size is None else {"block_size": self.block_size}))
        set_(self, "_codec", codec_obj)
        integer("sync_every (E, local steps between syncs)", self.sync_every, 1)
        set_(self, "outer", Outer.parse(self.outer).value)
        set_(self, "inner_state", InnerState.parse(self.inner_state).value)
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {self.error_feedback!r}")
        number("outer_lr", self.outer_lr, 0, lo_open=True)
        number("outer_momentum", self.outer_momentum, 0, 1, hi_open=True)
        integer("fragments (K)", self.fragments, 1)
        if self.sync_every % self.fragments:
            raise ValueError(f"fragments (K) must divide sync_every={self.sync_every}, got {self.fragments!r}")
        if self.overlap_steps != AUTO:
            integer("overlap_steps (k, steps between a sync and its apply; 0: blocking)", self.overlap_steps, 0,
                    self.sync_every, also=f" (at most sync_every) or {AUTO!r}")
        if self.fragments > 1 and self.inner_state != InnerState.KEEP.value:
            raise ValueError(f"inner_state={self.inner_state!r} is not supported with fragments > 1 (only 'keep')")
        if self.sync_period_s is not None:
            set_(self, "sync_period_s", number("sync_period_s (T, seconds between syncs)", self.sync_period_s, 0,
                                               lo_open=True))
            if self.overlap_steps == AUTO:
                raise ValueError(f"overlap_steps={AUTO!r} measures against E / K steps, which sync_period_s="
                                 f"{self.sync_period_s:g} replaces: give overlap_steps as an integer k")
        number("bucket_cap_mb", self.bucket_cap_mb, 0, lo_open=True)
        if self.offload not in (None, "cpu"):
            raise ValueError(f"offload must be None or 'cpu', got {self.offload!r}")
        if self.residual_dtype not in RESIDUAL_DTYPES:
            raise ValueError(f"residual_dtype must be one of {', '.join(RESIDUAL_DTYPES)}, got "
                             f"{self.residual_dtype!r}")
        if not isinstance(self.verify, bool):
            raise ValueError(f"verify must be True or False, got {self.verify!r}")
        if self.sharded_exchange is not None and not isinstance(self.sharded_exchange, bool):
            raise ValueError(f"sharded_exchange must be None, True or False, got {self.sharded_exchange!r}")

    # ------------------------------------------------------------------ derived
    @property
    def overlap(self) -> bool:
        """The exchanges are applied later, while training goes on (``overlap_steps`` != 0)."""
        return self.overlap_steps != 0

    @property
    def timed(self) -> bool:
        """The syncs follow the wall clock (``sync_period_s``), not the step count."""
        return self.sync_period_s is not None

    @property
    def in_place(self) -> bool:
        """The paper's mode (codec none, plain average, blocking, no error feedback): the shards
        themselves are averaged in place, and FedAvg keeps no anchor."""
        return self.codec == "none" and self.outer == "avg" and not self.overlap and not self.error_feedback

    @property
    def codec_obj(self) -> Codec:
        """The codec object (the one given, or the named codec with ``block_size``)."""
        return self._codec  # type: ignore[attr-defined]

    @property
    def outer_kind(self) -> Outer:
        return Outer.parse(self.outer)

    @property
    def inner_kind(self) -> InnerState:
        return InnerState.parse(self.inner_state)

    @property
    def residual_torch_dtype(self) -> torch.dtype:
        return RESIDUAL_DTYPES[self.residual_dtype]

    def check_elastic(self) -> None:
        """ValueError for the settings an elastic federation (:mod:`flcomm.federated.elastic`)
        does not support."""
        if self.timed:
            raise ValueError(f"sync_period_s={self.sync_period_s:g} is not supported by an elastic federation yet (its "
                             "rounds are named and rejoined by step, which differs between groups here): use "
                             "sync_every, or run without --elastic")
        if self.fragments > 1 and self.overlap:
            raise ValueError("an elastic federation does not support overlap with fragments > 1 (a membership "
                             "change would meet another fragment's round in flight); use one of them")
        if self.inner_state != InnerState.KEEP.value:
            raise ValueError(f"inner_state={self.inner_state!r} is not supported by an elastic federation (only "
                             "'keep': a redone round cannot undo an averaged or reset optimizer state)")

    # ------------------------------------------------------------------ records
    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON values, plus ``in_place`` (what a checkpoint records)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "in_place": self.in_place}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FedAvgConfig:
        """The config a :meth:`to_dict` record describes (derived entries are ignored); ValueError
        naming unknown keys."""
        names = {f.name for f in fields(cls)}
        d = {RENAMED.get(k, k): v for k, v in d.items()}  # NOTE: a record made before a rename
        unknown = sorted(set(d) - names - {"in_place"})
        if unknown:
            raise ValueError(f"unknown FedAvg settings {unknown}; known: {', '.join(sorted(names))}")
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def make(cls, config: FedAvgConfig | None = None, **settings: Any) -> FedAvgConfig:
        """``config`` with ``settings`` replaced (a new default config when None); TypeError naming
        an unknown setting."""
        names = [f.name for f in fields(cls)]
        for old, new in RENAMED.items():
            if old in settings:
                settings[new] = renamed(settings, old, new, settings.get(new, _UNSET), _UNSET)
        unknown = sorted(set(settings) - set(names))
        if unknown:
            hint = " (overlap is overlap_steps: 0, k >= 1 or 'auto')" if "overlap" in unknown else ""
            raise TypeError(f"unknown FedAvg setting(s) {unknown}{hint}; the settings are: {', '.join(names)}")
        if config is None:
            return cls(**settings)
        if not isinstance(config, cls):
            raise TypeError(f"config must be a FedAvgConfig, got {type(config).__name__}")
        if not settings:
            return config
        if "codec" not in settings and "block_size" not in settings:
            # NOTE: a codec object given to the first config stays the codec
            settings = {**settings, "codec": config.codec_obj, "block_size": None}
        return dataclasses.replace(config, **settings)

    # ------------------------------------------------------------------ command line
    @classmethod
    def add_arguments(cls, group: Any, defaults: FedAvgConfig | None = None) -> None:
        """One flag per field on ``group`` (an argparse parser or group), ``--sync-every`` for
        ``sync_every``, with the field's help and default (:func:`add_field_arguments`);
        ``--overlap`` alone means ``--overlap-steps auto``. :meth:`from_args` reads them back."""
        add_field_arguments(group, defaults or cls())

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FedAvgConfig:
        """The config of the flags :meth:`add_arguments` made."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def renamed(settings: dict[str, Any], old: str, new: str, value: Any, default: Any, owner: str = "FedAvg") -> Any:
    """``settings.pop(old)`` with a DeprecationWarning when given (``owner``'s keyword ``old`` is
    ``new`` now, as PyTorch names it), else ``value``; TypeError when both are."""
    if old not in settings:
        return value
    if value is not default:
        raise TypeError(f"{owner} got both {new}= and its deprecated name {old}=")
    warnings.warn(f"{owner}({old}=) is deprecated: use {new}=", DeprecationWarning, stacklevel=3)
    return settings.pop(old)


def check_inputs(mesh: Any, optimizer: Any, inner_state: InnerState) -> None:
    """TypeError or ValueError unless ``mesh`` is a FedMesh and ``optimizer`` a torch optimizer
    (or None where ``inner_state`` needs none)."""
    if inner_state is not InnerState.KEEP and optimizer is None:
        raise ValueError(f"inner_state={inner_state.value!r} needs the inner optimizer: pass optimizer=...")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not hasattr(mesh, "topology") or not hasattr(mesh, "transport"):
        raise TypeError(f"mesh must be a flcomm FedMesh (init_fed_mesh(topology)), got {type(mesh).__name__}")


def one_device(tensors: list[torch.Tensor]) -> torch.device:
    """The device of all ``tensors`` (the CPU when there are none); ValueError when they are on
    several."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"all averaged tensors must be on one device, got {sorted(map(str, devices))}")
    return devices.pop() if devices else torch.device("cpu")
