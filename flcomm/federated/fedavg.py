"""The FedAvg synchronizer of FL+FSDP / FL+HSDP.

Each federation group trains on its own with FSDP/HSDP; every ``sync_every`` (E) local steps a
rank averages its local shard with the ranks holding the same shard in the other groups (the
"fed" mesh dim), so only one shard-sized exchange per rank crosses the slow links::

    fed = FedAvg(model, fed_mesh, sync_every=E, codec="int8", overlap=True)
    for batch in data:
        loss(model, batch).backward(); optimizer.step(); optimizer.zero_grad()
        fed.step()
    fed.finish()

(or ``fed.attach(optimizer)`` once, instead of calling ``fed.step()``).

Algorithm of one sync (at local steps E, 2E, ...):

1. ``delta = local - anchor`` for every averaged tensor (fp32), where ``anchor`` is the tensor
   as of the last sync (deltas compress far better than weights, and give the same average).
2. Inner optimizer state: ``keep`` (the paper), ``average`` (its floating tensors averaged over
   the fed group, uncompressed, blocking) or ``reset`` (cleared, as if new).
3. Start the exchange: ``mean(delta)`` over the fed group, bucketed and compressed with the
   codec (error feedback keeps what compression dropped for the next round).
4. Outer update of the anchor: ``avg``: ``anchor += mean(delta)``; ``nesterov`` (DiLoCo):
   ``-mean(delta)`` is a pseudo-gradient for SGD with Nesterov momentum
   (:mod:`flcomm.federated.outer`). Buffers always take the plain average.
5. Apply: without overlap the exchange is waited for at once and ``local = anchor``. With
   ``overlap=True`` it runs while the next local step computes and is applied at the next
   ``step()`` (or ``finish()``)::

       local += (new_anchor - old_anchor) - own_delta        # avg: mean(delta) - own_delta

   i.e. the model becomes the average as of the sync step plus the local update made while the
   exchange was in flight (a one-step delay); that update is part of the next round's delta,
   since the anchor is the sync-step average.

An average with NaN/Inf, or built from a non-finite delta (which a lossy codec may hide), is
refused: local weights and anchor are kept (non-finite error-feedback residuals are zeroed),
and :class:`NonFiniteAverageError` names the fed group's ranks and which of them sent
non-finite deltas. The refusal is per fed group: peers holding other shards may have applied
their (finite) averages, so treat the error as fatal or restore a checkpoint. Only floating tensors are averaged (see :mod:`flcomm.federated.shards` for buffers).
"""

from __future__ import annotations

import time
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flcomm.federated.exchange import DeltaExchange, check_codec, flat_views
from flcomm.federated.outer import Outer, OuterOptimizer
from flcomm.federated.shards import collect_slots, fingerprint

if TYPE_CHECKING:
    from flcomm.federated.topology import FedMesh

STATE_VERSION = 1


class InnerState(str, Enum):
    """What happens to the inner (per-group) optimizer state at a sync."""

    KEEP = "keep"
    AVERAGE = "average"
    RESET = "reset"

    @classmethod
    def parse(cls, v: "InnerState | str") -> "InnerState":
        try:
            return cls(v.lower() if isinstance(v, str) else v)
        except ValueError:
            raise ValueError(f"inner_state must be one of {[o.value for o in cls]}, got {v!r}") from None


class NonFiniteAverageError(FloatingPointError):
    """The averaged delta received from the fed group had NaN/Inf; it was not applied."""

    def __init__(self, message: str, fed_ranks: list[int], bad_ranks: list[int]) -> None:
        super().__init__(message)
        self.fed_ranks = fed_ranks
        self.bad_ranks = bad_ranks


class FedAvg:
    """Periodic averaging of the local shards across federation groups.

    Args:
        model: an FSDP2 model (sharded with a mesh inside the federation group), an FSDP1 model
            (``FullyShardedDataParallel`` at the root, process groups inside the federation
            group) or a plain module replicated inside the group.
        mesh: the :class:`~flcomm.federated.topology.FedMesh` of this rank.
        sync_every: E >= 1, local steps between syncs.
        codec: wire codec of the exchange (``flcomm.codecs.CODECS``: none, bf16, fp16, int8, fp8).
        error_feedback: keep the compression error for the next round.
        outer: ``avg`` (the paper) or ``nesterov`` (DiLoCo: SGD, Nesterov momentum).
        outer_lr, outer_momentum: the nesterov outer optimizer's hyper-parameters.
        inner_state: ``keep`` (the paper), ``average`` or ``reset``; the last two need
            ``optimizer``. ``average`` is always blocking (also with ``overlap``).
        overlap: apply the exchange one step later, while the next step computes (module doc).
        bucket_mb: bucket size of the exchange.
        optimizer: the inner optimizer (needed by ``inner_state`` average / reset).
        sync_init: broadcast the model from federation group 0 at construction, so all groups
            start from one point (the algorithm assumes it).

    Attributes:
        exposed_comm_s: cumulative seconds this rank was blocked on the exchange (starting it,
            waiting for it, averaging optimizer state); with ``overlap`` only the part the next
            step's compute did not hide.
        num_syncs: exchanges applied so far.
        steps: ``step()`` calls so far.
    """

    def __init__(self, model: nn.Module, mesh: "FedMesh", *, sync_every: int, codec: str = "none",
                 error_feedback: bool = False, outer: str = "avg", outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, inner_state: str = "keep", overlap: bool = False,
                 bucket_mb: float = 25.0, optimizer: torch.optim.Optimizer | None = None,
                 sync_init: bool = True) -> None:
        if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
            raise ValueError(f"sync_every (E, local steps between syncs) must be an integer >= 1, "
                             f"got {sync_every!r}")
        if not isinstance(bucket_mb, (int, float)) or bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be a positive number, got {bucket_mb!r}")
        self.codec = check_codec(codec)
        self.outer_kind = Outer.parse(outer)
        self.inner_state = InnerState.parse(inner_state)
        if self.inner_state is not InnerState.KEEP and optimizer is None:
            raise ValueError(f"inner_state={self.inner_state.value!r} needs the inner optimizer: "
                             "pass optimizer=...")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not hasattr(mesh, "topology") or not hasattr(mesh, "transport"):
            raise TypeError(f"mesh must be a flcomm FedMesh (Topology.build()), got {type(mesh).__name__}")
        self.model, self.mesh, self.optimizer = model, mesh, optimizer
        self.sync_every = sync_every
        self.error_feedback = bool(error_feedback)
        self.overlap = bool(overlap)
        self.bucket_mb = float(bucket_mb)
        self.topology = mesh.topology
        self.federated = self.topology.federated
        self.rank = mesh.rank
        self.steps = 0
        self.num_syncs = 0
        self.exposed_comm_s = 0.0
        self._inflight: Any = None
        self._outer = OuterOptimizer(self.outer_kind, outer_lr, outer_momentum)
        self.kind, self.slots = collect_slots(model, mesh)
        if not self.federated:
            return  # NOTE: F = 1 is plain FSDP/HSDP: step() only counts.
        self.fed_ranks: list[int] = list(mesh.group_ranks["fed"])
        self.transport = mesh.transport("fed")
        self._check_peers()
        locals_ = [s.local for s in self.slots]
        devices = {t.device for t in locals_}
        if len(devices) > 1:
            raise ValueError(f"all averaged tensors must be on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.is_param = [s.is_param for s in self.slots]
        shapes = [t.shape for t in locals_]
        total = sum(t.numel() for t in locals_)
        self._flat = torch.zeros(total, dtype=torch.float32, device=self.device)
        self._delta = flat_views(self._flat, shapes)
        self._own = torch.zeros_like(self._flat) if self.overlap else None
        # NOTE: who sent a non-finite delta travels in its own tiny uncompressed all-reduce (a
        # one-hot int32 vector over the fed group): a lossy codec may turn NaN/Inf into finite
        # garbage, so the averaged delta alone cannot be trusted to show it.
        self._fed_index = self.fed_ranks.index(self.rank)
        self._flags = torch.zeros(len(self.fed_ranks), dtype=torch.int32, device=self.device)
        self._flag_work: Any = None
        if sync_init:
            self._broadcast_from_group0()
        self._anchor = [t.detach().to(torch.float32, copy=True).contiguous() for t in (s.local for s in self.slots)]
        self._outer.allocate([a for a, p in zip(self._anchor, self.is_param) if p])
        # NOTE: empty shards (FSDP uneven sharding) are left out of the exchange; the fed peers
        # hold the same shard coordinates, so they leave out the same ones.
        exchanged = [d for d in self._delta if d.numel() > 0]
        self._exchange = DeltaExchange(self.transport, self._flat, exchanged, self.codec,
                                       self.bucket_mb, self.error_feedback) if exchanged else None

    # ---------------------------------------------------------------- public API
    def step(self) -> bool:
        """Call once after every ``optimizer.step()``. Applies an exchange in flight (overlap),
        and starts one every ``sync_every`` steps. Returns True when a sync was started or
        applied."""
        self.steps += 1
        if not self.federated:
            return False
        did = False
        if self._inflight is not None:
            self._apply()
            did = True
        if self.steps % self.sync_every == 0:
            self._start()
            if not self.overlap:
                self._apply()
            did = True
        return did

    def attach(self, optimizer: torch.optim.Optimizer) -> Any:
        """Call :meth:`step` after every ``optimizer.step()`` through a step post-hook, instead of
        calling it by hand. Returns the hook's handle (``.remove()`` detaches)."""
        return optimizer.register_step_post_hook(lambda *_: self.step())

    def finish(self) -> None:
        """Wait for and apply an exchange in flight (before evaluation, checkpoints, the end)."""
        if self.federated and self._inflight is not None:
            self._apply()

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    def state_dict(self) -> dict:
        """Counters, and this rank's anchor shards, outer momentum and error-feedback residuals.

        The tensors are local shards under the key ``f"rank{rank}"``, so each rank saves its own
        entries with torch.distributed.checkpoint (entries with one key on every rank are
        deduplicated as replicated). ``topology`` and ``config`` let a load check compatibility
        first (see :meth:`check_compatible`). Call :meth:`finish` first when overlapping.
        """
        if self._inflight is not None:
            raise RuntimeError("FedAvg.state_dict() with an exchange in flight: call finish() first")
        sd: dict[str, Any] = {
            "version": STATE_VERSION,
            "topology": self._topology_meta(),
            "config": {"sync_every": self.sync_every, "codec": self.codec, "outer": self.outer_kind.value,
                       "error_feedback": self.error_feedback, "inner_state": self.inner_state.value},
            "steps": self.steps,
            "num_syncs": self.num_syncs,
        }
        if self.federated:
            names = [s.name for s in self.slots]
            outer = self._outer.state_dict()
            # NOTE: momentum buffers keyed by parameter name (not a list), for readable checkpoints
            outer["buffers"] = dict(zip([n for n, p in zip(names, self.is_param) if p], outer["buffers"]))
            sd[f"rank{self.rank}"] = {
                "anchor": dict(zip(names, self._anchor)),
                "outer": outer,
                "exchange": self._exchange.state_dict() if self._exchange is not None else {},
                "exposed_comm_s": self.exposed_comm_s,
            }
        return sd

    def check_compatible(self, sd: dict) -> None:
        """Raise ValueError when ``sd`` (or just its ``version``/``topology``/``config``
        entries) comes from another topology or configuration."""
        if sd.get("version") != STATE_VERSION:
            raise ValueError(f"FedAvg state version {sd.get('version')!r}, expected {STATE_VERSION}")
        mine, theirs = self._topology_meta(), sd.get("topology")
        if theirs != mine:
            raise ValueError(f"FedAvg state is from another topology: saved {theirs}, this run has {mine}")
        cfg = sd.get("config", {})
        for key, want in (("outer", self.outer_kind.value), ("error_feedback", self.error_feedback)):
            if cfg.get(key) != want:
                raise ValueError(f"FedAvg state was saved with {key}={cfg.get(key)!r}, this run has {key}={want!r}")

    def load_state_dict(self, sd: dict) -> None:
        """Restore what :meth:`state_dict` saved (same topology, model and outer/error-feedback
        configuration); clear errors otherwise."""
        if self._inflight is not None:
            raise RuntimeError("FedAvg.load_state_dict() with an exchange in flight: call finish() first")
        self.check_compatible(sd)
        if self.federated:
            key = f"rank{self.rank}"
            if key not in sd:
                have = sorted(k for k in sd if k.startswith("rank"))
                raise ValueError(f"FedAvg state has no entry {key!r} for this rank (has {have})")
            mine = sd[key]
            names = [s.name for s in self.slots]
            anchor = mine["anchor"]
            if list(anchor) != names:
                raise ValueError(f"FedAvg state holds anchors for {list(anchor)}, this model has {names}")
            for n, dst, src in zip(names, self._anchor, anchor.values()):
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(f"FedAvg anchor {n!r} has shape {tuple(src.shape)} in the state, "
                                     f"{tuple(dst.shape)} here (another topology or model)")
            outer = dict(mine["outer"])
            bufs = outer.get("buffers") or {}
            outer["buffers"] = list(bufs.values())
            self._outer.load_state_dict(outer, [tuple(a.shape) for a, p in zip(self._anchor, self.is_param) if p])
            if self._exchange is not None:
                self._exchange.load_state_dict(mine.get("exchange", {}))
            with torch.no_grad():
                for dst, src in zip(self._anchor, anchor.values()):
                    if dst is not src:
                        dst.copy_(src)
            self.exposed_comm_s = float(mine.get("exposed_comm_s", 0.0))
        self.steps = int(sd["steps"])
        self.num_syncs = int(sd["num_syncs"])

    # ---------------------------------------------------------------- internals
    def _topology_meta(self) -> dict:
        return self.topology.to_dict()

    def _check_peers(self) -> None:
        """All ranks of the fed group must hold the same shards of the same model."""
        # NOTE: on the transport's device: NCCL groups cannot gather CPU tensors
        fp = fingerprint(self.slots).to(self.transport.device)
        group = self.mesh.groups["fed"]
        got = [torch.zeros_like(fp) for _ in self.fed_ranks]
        dist.all_gather(got, fp, group=group)
        if any(not torch.equal(g, got[0]) for g in got):
            rows = ", ".join(f"rank {r}: {int(g[0])} tensors / {int(g[1])} elements / layout {int(g[2]):08x}"
                             for r, g in zip(self.fed_ranks, got))
            raise ValueError("the ranks of fed group "
                             f"{self.fed_ranks} do not hold the same shards of one model ({rows}); "
                             "every federation group must build the same model and shard it the same "
                             "way inside the group")

    @torch.no_grad()
    def _broadcast_from_group0(self) -> None:
        locals_ = [s.local for s in self.slots]
        if not locals_ or self._flat.numel() == 0:
            return
        for d, t in zip(self._delta, locals_):
            d.copy_(t)
        self.transport.broadcast(self._flat, src=0)
        for d, t in zip(self._delta, locals_):
            t.copy_(d)

    @torch.no_grad()
    def _start(self) -> None:
        """Steps 1-3 of the module docstring."""
        for d, t, a in zip(self._delta, (s.local for s in self.slots), self._anchor):
            d.copy_(t)
            d.sub_(a)
        self._flags.zero_()
        # NOTE: a tensor op, no device sync here
        self._flags[self._fed_index] = (~torch.isfinite(self._flat).all()).to(torch.int32)
        if self._own is not None:
            self._own.copy_(self._flat)
        if self.inner_state is InnerState.AVERAGE:
            self._average_inner_state()
        elif self.inner_state is InnerState.RESET:
            self.optimizer.state.clear()
        t0 = time.perf_counter()
        self._inflight = self._exchange.start() if self._exchange is not None else _Done()
        self._flag_work = self.transport.all_reduce(self._flags, op="sum", async_op=True)
        self.exposed_comm_s += time.perf_counter() - t0

    @torch.no_grad()
    def _apply(self) -> None:
        """Steps 4-5 of the module docstring."""
        work, self._inflight = self._inflight, None
        t0 = time.perf_counter()
        work.wait(self.mesh.timeout)
        self._flag_work.wait(self.mesh.timeout)
        self._flag_work = None
        self.exposed_comm_s += time.perf_counter() - t0
        if bool(self._flags.any()) or (self._flat.numel() and not bool(torch.isfinite(self._flat).all())):
            if self._exchange is not None:
                self._exchange.sanitize()
            self._refuse()
        disp = self._outer.displacement_(self._delta, self.is_param)
        for a, d in zip(self._anchor, disp):
            a.add_(d)
        locals_ = [s.local for s in self.slots]
        if self._own is None:
            for t, a in zip(locals_, self._anchor):
                t.copy_(a)
        else:
            own = flat_views(self._own, [d.shape for d in disp])
            for t, d, o in zip(locals_, disp, own):
                d.sub_(o)
                t.add_(d.to(t.dtype) if t.dtype != torch.float32 else d)
        self.num_syncs += 1

    def _refuse(self) -> None:
        bad = [r for r, f in zip(self.fed_ranks, self._flags.tolist()) if f]
        groups = [self.topology.coords(r).group for r in bad]
        origin = (f"non-finite deltas came from ranks {bad} (federation groups {groups})" if bad else
                  "no rank sent a non-finite delta (the reduction or the codec overflowed)")
        raise NonFiniteAverageError(
            f"rank {self.rank}: the average exchanged over fed group ranks {self.fed_ranks} at step "
            f"{self.steps} is not finite (NaN/Inf); {origin}. It was refused: local weights and the anchor "
            "are unchanged.", list(self.fed_ranks), bad)

    def _average_inner_state(self) -> None:
        """Average the floating inner-optimizer state (all but ``step``) over the fed group."""
        from flcomm.federated.shards import _is_dtensor

        tensors: list[Tensor] = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                st = self.optimizer.state.get(p, {})
                for k in sorted(st):
                    v = st[k]
                    if k == "step" or not isinstance(v, Tensor) or not v.is_floating_point():
                        continue
                    v = v.to_local() if _is_dtensor(v) else v
                    if v.numel():
                        tensors.append(v)
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
        t0 = time.perf_counter()
        self.transport.all_reduce(flat, op="avg")
        self.exposed_comm_s += time.perf_counter() - t0
        for t, v in zip(tensors, flat_views(flat, [t.shape for t in tensors])):
            t.copy_(v)


class _Done:
    """A completed handle (a rank whose shards are all empty exchanges nothing)."""

    def wait(self, timeout: Any = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True
