"""FedAvg's checkpoint: what one rank saves, the checks before a load, and the load.

A state dict (:meth:`FedAvgCheckpoint.save`) holds:

* ``version``, ``topology`` (:meth:`Topology.to_dict`) and ``config`` (the settings a resume
  must share), so a load checks compatibility first (:meth:`FedAvgCheckpoint.check_compatible`);
* the counters ``steps`` and ``num_syncs``;
* under ``f"rank{rank}"`` (federated runs), this rank's local shards of the anchor, keyed by
  tensor name (none in the paper's in-place mode), the outer optimizer's state with its momentum
  buffers keyed by parameter name, the exchanges' error-feedback residuals (one fragment's
  state, or ``{"fragments": [...]}``) and ``exposed_comm_s``. Each rank saves its own entries
  with torch.distributed.checkpoint; entries with one key on every rank are deduplicated as
  replicated.

An elastic federation accepts a state saved with another number of groups (the same group
shape); a load may then take a shard peer's entry (``source``: same anchor and momentum), whose
residuals are dropped, and residuals saved with another bucket padding restart at zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from flcomm.federated.config import must_match_on_resume

if TYPE_CHECKING:
    from flcomm.federated.exchange import DeltaExchange
    from flcomm.federated.outer import OuterOptimizer
    from flcomm.federated.topology import Topology

__all__ = ["STATE_VERSION", "FedAvgCheckpoint", "config_mismatch"]

STATE_VERSION = 1


def config_mismatch(saved: dict[str, Any], run: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """The first setting that keeps a state saved with config ``saved`` from loading into a run
    of config ``run`` (both :meth:`FedAvgConfig.to_dict <flcomm.federated.config.FedAvgConfig.to_dict>`
    records), as ``(key, saved value, run value)``;
    None when it loads. The fields compared are those the config marks
    (:func:`~flcomm.federated.config.must_match_on_resume`). ``in_place``: a state of the paper's
    in-place mode keeps no anchor, so a run that needs one cannot load it (the other way round
    loads: anchors are ignored)."""
    for key, missing in must_match_on_resume().items():
        if saved.get(key, missing) != run[key]:
            return key, saved.get(key), run[key]
    if saved.get("in_place", False) and not run["in_place"]:
        return "in_place", True, False
    return None


class FedAvgCheckpoint:
    """Save and load of one rank's FedAvg state (module docstring).

    Args:
        topology: the run's topology.
        config: the settings saved with the state (:meth:`FedAvgConfig.to_dict
            <flcomm.federated.config.FedAvgConfig.to_dict>`).
        rank: this rank's global rank.
        elastic: the run has an elastic federation.
        names, is_param: each averaged tensor's name, and whether it is a parameter.
        anchors: the anchors (empty in the in-place mode; None without a federation: then only
            the counters are saved), written in place, never replaced.
        outer: the outer optimizer (its buffers written in place).
        exchanges: each fragment's exchange, now (they are rebuilt after a membership change).
    """

    def __init__(self, topology: Topology, config: dict[str, Any], *, rank: int, elastic: bool,
                 names: list[str], is_param: list[bool], anchors: list[Tensor] | None,
                 outer: OuterOptimizer, exchanges: Callable[[], list[DeltaExchange | None]]) -> None:
        self.topology, self.config, self.rank = topology, dict(config), rank
        self.elastic = elastic
        self.names, self.is_param, self.anchors = names, is_param, anchors
        self.outer, self.exchanges = outer, exchanges

    @property
    def fragments(self) -> int:
        return self.config["fragments"]

    def save(self, steps: int, num_syncs: int, exposed_comm_s: float) -> dict:
        """The state dict of the module docstring."""
        sd: dict[str, Any] = {"version": STATE_VERSION, "topology": self.topology.to_dict(),
                              "config": dict(self.config), "steps": steps, "num_syncs": num_syncs}
        if self.anchors is not None:
            outer = self.outer.state_dict()
            # NOTE: momentum buffers keyed by parameter name (not a list), for readable checkpoints
            outer["buffers"] = dict(zip([n for n, p in zip(self.names, self.is_param) if p], outer["buffers"]))
            sd[f"rank{self.rank}"] = {
                "anchor": dict(zip(self.names, self.anchors)),
                "outer": outer,
                "exchange": self._exchange_state(),
                "exposed_comm_s": exposed_comm_s,
            }
        return sd

    def check_compatible(self, sd: dict) -> None:
        """Raise ValueError when ``sd`` (or just its ``version``/``topology``/``config``
        entries) comes from another topology or configuration. An elastic federation accepts
        another number of groups (the same group shape)."""
        if sd.get("version") != STATE_VERSION:
            raise ValueError(f"FedAvg state version {sd.get('version')!r}, expected {STATE_VERSION}")
        mine, theirs = self.topology.to_dict(), sd.get("topology")
        if self.elastic and isinstance(theirs, dict):
            keys = ("ranks_per_node", "group_size", "shard_size")
            mine, theirs = {k: mine[k] for k in keys}, {k: theirs.get(k) for k in keys}
        if theirs != mine:
            raise ValueError(f"FedAvg state is from another topology: saved {theirs}, this run has {mine}")
        bad = config_mismatch(sd.get("config", {}), self.config)
        if bad is not None and bad[0] == "in_place":
            run = f"codec={self.config['codec']!r}, overlap_steps={self.config['overlap_steps']!r}"
            raise ValueError("FedAvg state was saved in the paper's in-place mode, which keeps no anchor; this "
                             f"run ({run}) needs one: resume in the same mode")
        if bad is not None:
            key, have, want = bad
            raise ValueError(f"FedAvg state was saved with {key}={have!r}, this run has {key}={want!r}")

    def load(self, sd: dict, source: int | None = None) -> tuple[int, int, float | None]:
        """Check ``sd`` (:meth:`check_compatible`) and restore this rank's tensors from the entry
        of rank ``source`` (default this rank's). Returns the counters to resume from:
        ``steps``, ``num_syncs`` and ``exposed_comm_s`` (None without a rank entry)."""
        self.check_compatible(sd)
        exposed = None
        if self.anchors is not None:
            exposed = self._load_rank_state(sd, self.rank if source is None else source)
        return int(sd["steps"]), int(sd["num_syncs"]), exposed

    def _load_rank_state(self, sd: dict, source: int) -> float:
        key = f"rank{source}"
        if key not in sd:
            have = sorted(k for k in sd if k.startswith("rank"))
            raise ValueError(f"FedAvg state has no entry {key!r} for this rank (has {have})")
        mine, anchors = sd[key], self.anchors
        assert anchors is not None
        # NOTE: the in-place mode keeps no anchor and ignores saved ones (the model is the state)
        in_place = self.config["in_place"]
        anchor = {} if in_place else mine["anchor"]
        want = [] if in_place else self.names
        if list(anchor) != want:
            raise ValueError(f"FedAvg state holds anchors for {list(anchor)}, this model has {want}")
        for n, dst, src in zip(self.names, anchors, anchor.values()):
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"FedAvg anchor {n!r} has shape {tuple(src.shape)} in the state, "
                                 f"{tuple(dst.shape)} here (another topology or model)")
        outer = dict(mine["outer"])
        bufs = outer.get("buffers") or {}
        outer["buffers"] = list(bufs.values())
        self.outer.load_state_dict(outer, [tuple(a.shape) for a, p in zip(anchors, self.is_param) if p])
        if source == self.rank:
            self._load_exchange_state(mine.get("exchange", {}))
        with torch.no_grad():
            for dst, src in zip(anchors, anchor.values()):
                if dst is not src:
                    dst.copy_(src)
        return float(mine.get("exposed_comm_s", 0.0))

    def _exchange_state(self) -> dict:
        """The exchanges' residuals: one fragment's state, or ``{"fragments": [...]}``."""
        sds = [ex.state_dict() if ex is not None else {} for ex in self.exchanges()]
        return sds[0] if self.fragments == 1 else {"fragments": sds}

    def _load_exchange_state(self, sd: dict) -> None:
        exchanges = self.exchanges()
        sds = [sd] if self.fragments == 1 else list(sd.get("fragments", []))
        if len(sds) != len(exchanges):
            raise ValueError(f"FedAvg state holds {len(sds)} fragment exchanges, this run has {len(exchanges)}")
        for ex, s in zip(exchanges, sds):
            if ex is not None:
                try:
                    ex.load_state_dict(s)
                except ValueError:
                    if not self.elastic:
                        raise
                    # NOTE: elastic: saved with another number of groups (another bucket padding);
                    # the residuals restart at 0
