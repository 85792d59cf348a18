"""The FedAvg synchronizer of FL+FSDP / FL+HSDP.

Each federation group trains on its own with FSDP/HSDP; every ``sync_every`` (E) local steps a
rank averages its local shard with the ranks holding the same shard in the other groups (the
"fed" mesh dim), so only one shard-sized exchange per rank crosses the slow links::

    fed = FedAvg(model, fed_mesh, sync_every=E, codec="int8", overlap_steps="auto")
    for batch in data:
        loss(model, batch).backward(); optimizer.step(); optimizer.zero_grad()
        fed.step()
    fed.finish()

(or ``fed.attach(optimizer)`` once, instead of calling ``fed.step()``).

Algorithm of one sync (at local steps E, 2E, ...); steps 1-2 on the caller's thread, 3-5 as one
job of the progress engine (:mod:`flcomm.comm.engine`), bucket by bucket
(:mod:`flcomm.federated.exchange`):

1. Flag whether this rank's shard is finite. With overlap, copy ``local_at_sync = local`` (the
   local shard keeps training while the exchange runs; the job packs ``local_at_sync - anchor``,
   off this thread: on the engine's stream, or offloaded on its thread).
2. Inner optimizer state (:mod:`flcomm.federated.inner`): ``keep`` (the paper), ``average``
   (averaged over the shard peers, uncompressed, blocking) or ``reset`` (cleared, as if new).
3. All-reduce the flags over the shard peers; if any rank's shard is not finite, none of the
   shard peers applies any bucket (the flags stay on the device: the buckets are exchanged and
   left unapplied, so the job reads nothing on the host). After the buckets, the job ORs the
   shard peers' flags and an overflow bit over the federation group (the refusal below).
4. Per bucket: pack ``delta = local - anchor`` (or ``local_at_sync``), average it over the shard peers through
   the codec (error feedback keeps what compression dropped for the next round), and apply the
   outer update to the anchor: ``avg``: ``anchor += mean(delta)``; ``nesterov`` (DiLoCo):
   ``-mean(delta)`` is a pseudo-gradient for SGD with Nesterov momentum
   (:mod:`flcomm.federated.outer`). Buffers always take the plain average. Without overlap,
   ``local = anchor``; with overlap, ``correction = new_anchor - local_at_sync`` (in its buffer).
   The paper's mode (codec none, ``avg``, no overlap, no error feedback) averages the shards
   themselves, in place, in their own dtype: no anchor, no delta.
5. Apply, on the caller's thread, reading the flags on the host once: without overlap at once;
   with ``overlap_steps`` = k >= 1, k steps later (Streaming DiLoCo's tau; ``"auto"``: measured,
   :mod:`flcomm.federated.autotune`), ``local += correction``, i.e.::

       local += correction = new_anchor - local_at_sync     # = (new_anchor - old_anchor) - delta

   the model becomes the average as of the sync step plus the local updates made while the
   exchange was in flight; those updates are part of the next round's delta, since the anchor
   is the sync-step average. ``k <= E``, so at most one exchange is in flight.

Streaming fragments (``fragments=K``, K dividing E): the tensors are cut into K fragments of
about equal size (:func:`~flcomm.federated.shards.partition`); fragment k runs steps 1-5 on its
tensors at the steps with ``(step - k E / K) % E == 0``, so each sync moves 1/K of the shard
(Streaming DiLoCo).
By time (``sync_period_s`` = T, for stragglers) fragments sync on the wall clock instead; each group
runs the steps that fit and its delta weighs by its tokens (the rule: :mod:`flcomm.federated.pacing`).
With ``overlap_steps > E / K`` a fragment's apply meets another fragment's exchange in flight.

Each fragment is a :class:`~flcomm.federated.fragment.Fragment` (its tensors, exchange, flags and
job); FedAvg keeps the schedule, the arenas and the state. Memory: :meth:`FedAvg.memory_stats`.

An average with NaN/Inf, or built from a non-finite delta (which a lossy codec may hide), is
refused: the bad ranks (and a bit for buckets whose average overflowed) are OR-ed over the
federation group (by the job, on a private group transport, so the loop runs no collective at
the apply; an elastic federation's redone rounds OR them at the apply), so every rank of every
group raises the same
:class:`~flcomm.federated.nonfinite.NonFiniteAverageError`; non-finite error-feedback residuals are
zeroed. Shard peers that saw a non-finite delta leave their weights and anchor unchanged; other shard peers may have
applied theirs, so the error is fatal (restore a checkpoint). Only floating tensors are averaged
(see :mod:`flcomm.federated.shards` for buffers). Precision is never cut: fp64 tensors travel in
fp64 (codec none; a lossy codec refuses them).

Around it: the settings are a :class:`~flcomm.federated.config.FedAvgConfig`; the model's
sharding against the topology and the step order are in :mod:`flcomm.federated.sharding`, the
replica check (``verify``) in :mod:`flcomm.federated.verify`; checkpoints live in
:mod:`flcomm.federated.persist`; an elastic federation agrees on each round in the protocol,
:meth:`Federation.run_round <flcomm.federated.elastic.Federation.run_round>`, with FedAvg's
redo / restore / rebind / handover as callbacks.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flcomm.collectives.staging import StagingPool, arena, bucket_dtype, span
from flcomm.comm.engine import Job, get_engine
from flcomm.federated.autotune import AutoOverlap
from flcomm.federated.config import AUTO, FedAvgConfig, check_inputs, one_device, renamed
from flcomm.federated.exchange import DeltaExchange, ExchangeBuffers, ExchangeResult
from flcomm.federated.exposure import ExposedTime, cuda_event
from flcomm.federated.fragment import Fragment, Links, memory_stats
from flcomm.federated.inner import InnerState, sync_inner_state
from flcomm.federated.outer import Outer, OuterOptimizer
from flcomm.federated.pacing import StepSchedule, TimedSchedule
from flcomm.federated.persist import FedAvgCheckpoint
from flcomm.federated.sharding import StepOrder, check_sharding
from flcomm.federated.shards import broadcast, check_same_shards, collect_slots, partition
from flcomm.federated.verify import ReplicaCheck
from flcomm.validate import integer

if TYPE_CHECKING:
    from flcomm.comm.base import Transport
    from flcomm.federated.elastic import Federation
    from flcomm.federated.mesh import FedMesh


class FedAvg:
    """Periodic averaging of the local shards across federation groups.

    Args:
        model: an FSDP2 model (sharded with a mesh inside the federation group), an FSDP1 model
            (``FullyShardedDataParallel`` at the root, process groups inside the federation
            group) or a plain module replicated inside the group; the sharding must match the
            topology (:func:`~flcomm.federated.sharding.check_sharding`).
        mesh: the :class:`~flcomm.federated.topology.FedMesh` of this rank.
        config: the settings, a :class:`~flcomm.federated.config.FedAvgConfig` (its fields say
            what each one does); keyword ``settings`` replace fields of it (or of the default
            config): ``FedAvg(model, mesh, sync_every=8, codec="int8", overlap_steps="auto")``.
        inner_optimizer: the inner optimizer (needed by ``inner_state`` average / reset; its
            deprecated name is ``optimizer``). :meth:`step` must follow ``optimizer.step()``,
            checked with or without it (:class:`StepOrder`).
        replicated: plain (not FSDP) parameters in a group of more than one rank are kept equal
            over the group by other means (e.g. your own gradient all-reduce); else refused.
            DistributedDataParallel over the group is recognized without it.
        federation: an elastic :class:`~flcomm.federated.elastic.Federation`: the exchange runs
            over its replaceable process groups, every round is agreed through the store, and a
            round that failed is redone among the surviving groups (:meth:`_settle`); ``mesh``
            is then a group's own world (``init_fed_mesh(topology, group_rank=...)``).
        sync_module_states: broadcast the model from federation group 0 at construction, so all
            groups start from one point (the algorithm assumes it; FSDP's name, deprecated
            ``sync_init``).
        clock: the seconds ``sync_period_s`` follows (:class:`~flcomm.federated.pacing.TimedSchedule`;
            default ``time.time``); a simulation passes its own.

    Attributes:
        config: the :class:`~flcomm.federated.config.FedAvgConfig` in use.
        overlap_steps: k now (with ``overlap_steps="auto"`` the measured choice once made).
        auto_overlap: the :class:`~flcomm.federated.autotune.AutoOverlap` measurement of
            ``overlap_steps="auto"`` (its ``chosen`` k, and what it was measured on), else None.
        exposed_comm_s: cumulative seconds the training loop was blocked on the exchange (see
            the property); with overlap only the part the compute did not hide.
        num_syncs: exchanges applied so far.
        schedule: when syncs start (:mod:`flcomm.federated.pacing`): ``events``, the syncs started;
            ``rounds``, the timed mode's applied rounds (RoundRecord; the caller may clear it).
        steps: ``step()`` calls so far.
        sharded_exchange: each replica exchanges 1/R of the shard (see the property).
    """

    def __init__(self, model: nn.Module, mesh: FedMesh, config: FedAvgConfig | None = None, *,
                 inner_optimizer: torch.optim.Optimizer | None = None, federation: Federation | None = None,
                 sync_module_states: bool = True, replicated: bool = False,
                 clock: Callable[[], float] | None = None, **settings: Any) -> None:
        optimizer = renamed(settings, "optimizer", "inner_optimizer", inner_optimizer, None)
        sync_init = renamed(settings, "sync_init", "sync_module_states", sync_module_states, True)
        cfg = self.config = FedAvgConfig.make(config, **settings)
        if federation is not None:
            cfg.check_elastic()
        check_inputs(mesh, optimizer, cfg.inner_kind)
        self.model, self.mesh, self.optimizer, self.federation = model, mesh, optimizer, federation
        # NOTE: "auto" measures with the largest k that keeps fragments apart, then settles
        self.auto_overlap = AutoOverlap(cfg.sync_every // cfg.fragments) if cfg.overlap_steps == AUTO else None
        self.topology, self.federated, self.rank = mesh.topology, mesh.topology.federated, mesh.rank
        self.steps = self.num_syncs = 0
        self._exposure = ExposedTime(events=False)
        self._frags: list[Fragment] = []
        self.schedule = (TimedSchedule(cfg.sync_period_s, cfg.fragments, clock) if cfg.timed
                         else StepSchedule(cfg.sync_every, cfg.fragments))
        self._outer = OuterOptimizer(cfg.outer_kind, cfg.outer_lr, cfg.outer_momentum)
        self._kind, self.slots = collect_slots(model)
        check_sharding(model, mesh, self._kind, replicated)
        self._order = StepOrder(optimizer, model)
        self._anchor: list = []
        self._local_at_sync: list | None = None
        self._replicate: Transport | None = None
        self._verify: ReplicaCheck | None = None  # verify=True
        if self.federated:
            self._init_federated(sync_init)
        self._checkpoint = FedAvgCheckpoint(
            self.topology, cfg.to_dict(), rank=self.rank, elastic=federation is not None,
            names=[s.name for s in self.slots], is_param=[s.is_param for s in self.slots],
            anchors=self._anchor if self.federated else None, outer=self._outer,
            exchanges=lambda: [fr.exchange for fr in self._frags])
        self._align_first = self.federated and sync_init and federation is None  # NOTE: see step()
        if self._align_first and not cfg.in_place and cfg.inner_kind is InnerState.KEEP:
            self._warm_up()

    def _align(self) -> None:
        """A barrier over the group, then the shard peers: every rank leaves together (counts no bytes)."""
        self._links.group.barrier()
        self._links.fed.barrier()

    @torch.no_grad()
    def _warm_up(self) -> None:
        """One exchange of every fragment at construction, of zero deltas (the anchors are the
        local shards): it allocates the staging buckets and codec plans and carries the first
        traffic of each transport's connections (a slow shaped link cost seconds there), so the
        first sync costs what a later one does. It changes nothing: zero averages through every
        codec, zero residuals and momentum; the counters are reset."""
        for fr in self._frags:
            self._start(fr)
            self._apply(fr)
            fr.applied = fr.late = 0
        self.num_syncs = 0
        self._exposure.reset(0.0)

    def _init_federated(self, sync_init: bool) -> None:
        mesh, cfg, elastic = self.mesh, self.config, self.federation is not None
        if self.federation is not None:
            fed_ranks: list[int] = self.federation.fed_ranks
            # NOTE: none until a rejoining group is admitted (rejoin())
            fed = self.federation.transport if self.federation.joined else None
        else:
            fed_ranks, fed = list(mesh.group_ranks["fed"]), mesh.transport("fed")
        if fed is not None:
            check_same_shards(self.slots, fed, fed_ranks)
        locals_ = [s.local for s in self.slots]
        device = one_device(locals_)
        # NOTE: the job's refusal flags agreement (not the loop's group: it issues from the engine's
        # thread); an elastic federation's rounds may be redone, so they agree at the apply instead
        self._links = links = Links(
            self.topology, device, mesh.transport("group"),
            mesh.private_transport("flags_agree", "group") if not elastic else None, mesh.timeout,
            mesh.native_transports, ExposedTime(events=device.type == "cuda", new_event=lambda: cuda_event(device)),
            rank=self.rank)
        self._exposure = links.exposure
        links.bind(fed, fed_ranks, get_engine(device, "exchange"))
        if cfg.verify:
            self._verify = ReplicaCheck(self.topology, self.rank, device, links.group, self._over_fed)
        if sync_init and fed is not None:
            broadcast(fed, locals_, 0)  # NOTE: all start from group 0's model
            # NOTE: a one-to-all broadcast ends at different times on different groups (seconds on a
            # slow link): the wait is paid now, not by the first sync's step
            self._align()
        if isinstance(self.schedule, TimedSchedule):
            self.schedule.agree_start(links.group, fed, device)
        work = [bucket_dtype(t.dtype, cfg.in_place) for t in locals_]
        home = torch.device("cpu") if cfg.offload else device
        pin = cfg.offload is not None and device.type == "cuda"
        specs = [(tuple(t.shape), d) for t, d in zip(locals_, work)]
        # NOTE: one allocation per kind (arena): pinned memory is what memory_stats counts
        self._anchor[:] = [] if cfg.in_place else arena(specs, home, pin)
        with torch.no_grad():
            for a, t in zip(self._anchor, locals_):
                a.copy_(t)
        self._local_at_sync = arena(specs, home, pin) if cfg.overlap else None
        is_param = [s.is_param for s in self.slots]
        nesterov = cfg.outer_kind is Outer.NESTEROV
        params = [(tuple(a.shape), a.dtype) for a, p in zip(self._anchor, is_param) if p]
        self._outer.buffers = arena(params, home, pin) if nesterov else []
        self._mom = [n if p and nesterov else None for p, n in zip(is_param, accumulate(is_param, initial=0))]
        # NOTE: the partition uses the tensors' global sizes, so every rank cuts the same fragments
        parts = partition([s.numel for s in self.slots], cfg.fragments) if self.slots else [[]]
        self._replicate = mesh.exchange_replicate_transport(cfg.sharded_exchange, elastic)
        for f, part in enumerate(parts):
            at_sync = [self._local_at_sync[i] for i in part] if self._local_at_sync is not None else None
            self._frags.append(Fragment(
                f, part, [self.slots[i] for i in part], at_sync, links,
                name_index=cfg.fragments > 1,
                local_at_sync_span=span(at_sync) if at_sync is not None and cfg.offload is None else None,
                on_measured=self._measured, settle=self._settle if elastic else None))
        self._build_exchanges()

    def _build_exchanges(self) -> None:
        """Each fragment's :class:`DeltaExchange` over the current fed transport (again after an
        elastic membership change: the residuals carry over when the layout did not change)."""
        cfg, fed = self.config, self._links.fed
        # NOTE: the fragments' exchanges run one after another in the engine: one staging pool
        self._staging = StagingPool()
        # NOTE: overlapping fragments (an apply while another fragment's exchange is in flight,
        # whose job writes the pool's scratch): the apply stages through a scratch of its own
        overlapping = cfg.overlap and (cfg.timed and cfg.fragments > 1 or
                                       self.overlap_steps > cfg.sync_every // cfg.fragments)
        for fr in self._frags:
            x = fr.xindices
            old = fr.state_dict() if fr.exchange is not None else None
            at_sync = self._local_at_sync
            bufs = ExchangeBuffers(None if cfg.in_place else [self._anchor[i] for i in x],
                                   None if at_sync is None else [at_sync[i] for i in x], self._outer,
                                   [self._mom[i] for i in x])
            fr.bind(DeltaExchange(fed, [s.local for s in fr.xslots], cfg, bufs, staging=self._staging,
                                  replicate=self._replicate, apply_scratch=overlapping)
                    if x and fed is not None else None)
            if old is not None and fr.exchange is not None:
                try:
                    fr.exchange.load_state_dict(old)
                except ValueError:  # NOTE: other padding (another number of shard peers): residuals restart at 0
                    pass

    # ---------------------------------------------------------------- public API
    def step(self, skipped: bool = False, tokens: int | None = None) -> bool:
        """Call once after every ``optimizer.step()``. Applies an exchange in flight when its
        ``overlap_steps`` have passed, and starts one every ``sync_every`` steps (or when
        ``sync_period_s`` has passed: :mod:`flcomm.federated.pacing`). Returns True when a sync
        was started or applied. An exchange that failed in the engine raises here.
        ``skipped``: this step's optimizer step was left out on purpose (the order check).
        ``tokens``: what this rank trained on in the step, which weighs its group's delta in the
        timed mode (None: 1)."""
        tokens = 1 if tokens is None else integer("FedAvg.step(tokens=...), this rank's tokens in the step", tokens, 0)
        self._order.check(self.steps + 1, skipped)
        self.steps += 1
        if not self.federated:
            return False
        if self._align_first:  # NOTE: the first step's one-time costs (FSDP's lazy init, the optimizer's
            # state) differ between groups: aligned here, the first sync's step costs what a later one does
            self._align_first = False
            self._align()
        if self.auto_overlap is not None:
            self.auto_overlap.tick()
        did = False
        for fr in self._frags:
            if fr.job is not None:
                # NOTE: in an elastic federation a failed exchange is the round protocol's to
                # handle at the apply (a lost peer), not an error to raise on the step it shows
                if self.federation is None:
                    fr.job.check()
                if self.steps >= fr.apply_at:
                    self._apply(fr, on_time=True)
                    did = True
        for f in self.schedule.due(self.steps, tokens):
            fr = self._frags[f]
            if fr.job is not None:  # NOTE: timed: its next event came before its apply
                self._apply(fr)
            self.schedule.hand(fr)  # NOTE: timed: the round's counts
            self._start(fr)
            if not self.config.overlap:
                self._apply(fr)
            did = True
        self.schedule.step_ended()
        return did

    @property
    def overlap_steps(self) -> int:
        """k now: the config's, or with ``"auto"`` the measured choice (k_max until it is made)."""
        return self.auto_overlap.k if self.auto_overlap is not None else int(self.config.overlap_steps)

    def starts_sync(self, step: int) -> bool:
        """Whether step ``step`` (1-based, as :attr:`steps`) starts a fragment's sync, known before
        it runs; never with one group, nor in the timed mode (decided at the step's end)."""
        return self.federated and self.schedule.predictable(step)

    def attach(self, optimizer: torch.optim.Optimizer) -> Any:
        """Call :meth:`step` after every ``optimizer.step()`` through a step post-hook, instead of
        calling it by hand. Returns the hook's handle (``.remove()`` detaches)."""
        self._order.watch(optimizer)
        return optimizer.register_step_post_hook(lambda *_: self.step())

    def finish(self) -> None:
        """Wait for and apply an exchange in flight (before evaluation, checkpoints, the end)."""
        for fr in self._frags:
            if fr.job is not None:
                self._apply(fr)

    @property
    def sharded_exchange(self) -> bool:
        """Each replica exchanges 1/R of the shard, then they all-gather (FL+HSDP; the config's
        ``sharded_exchange`` resolved against the topology)."""
        return self._replicate is not None

    @property
    def in_flight(self) -> bool:
        return any(fr.job is not None for fr in self._frags)

    @property
    def _exchange(self) -> DeltaExchange | None:
        """The exchange of the first fragment (all tensors when ``fragments=1``)."""
        return self._frags[0].exchange if self._frags else None

    @property
    def exposed_comm_s(self) -> float:
        """Seconds the training loop was blocked on the exchange (starting it, waiting for it,
        the refusal all-reduce, averaging optimizer state): host time on CPU; on CUDA the time
        the compute stream spent there, measured with events only (:class:`ExposedTime`; read
        here, which synchronizes those events)."""
        return self._exposure.seconds

    @exposed_comm_s.setter
    def exposed_comm_s(self, value: float) -> None:
        self._exposure.reset(value)

    def memory_stats(self) -> dict[str, int]:
        """Bytes this FedAvg holds, per buffer kind (:func:`flcomm.federated.fragment.memory_stats`)."""
        kept = {"anchor": self._anchor, "own": self._local_at_sync, "momentum": self._outer.buffers}
        device = self._links.device if self.federated else None
        return memory_stats(self._frags, kept, self.slots, self.config.offload is not None, device)

    def state_dict(self) -> dict:
        """Counters, and this rank's anchor shards, outer momentum and error-feedback residuals
        (:mod:`flcomm.federated.persist`); the paper's in-place mode keeps no anchor. Call
        :meth:`finish` first when overlapping."""
        if self.in_flight:
            raise RuntimeError("FedAvg.state_dict() with an exchange in flight: call finish() first")
        sd = self._checkpoint.save(self.steps, self.num_syncs, self.exposed_comm_s)
        if isinstance(self.schedule, TimedSchedule):
            sd["pacing"] = self.schedule.state_dict()  # NOTE: the event count and the counts since each sync
        if self.auto_overlap is not None:
            sd["overlap_steps"] = self.auto_overlap.chosen  # NOTE: a resume keeps the measured choice
        return sd

    def check_compatible(self, sd: dict) -> None:
        """Raise ValueError when ``sd`` (or just its ``version``/``topology``/``config`` entries) comes
        from another topology or configuration (:meth:`.persist.FedAvgCheckpoint.check_compatible`)."""
        self._checkpoint.check_compatible(sd)

    def load_state_dict(self, sd: dict, source_rank: int | None = None) -> None:
        """Restore what :meth:`state_dict` saved (same topology, model and outer/error-feedback
        configuration); clear errors otherwise. ``source_rank``: the rank whose entry to load
        (default this rank's; an elastic resume may take a shard peer's of another group: same
        anchor and momentum, and its residuals are dropped)."""
        if self.in_flight:
            raise RuntimeError("FedAvg.load_state_dict() with an exchange in flight: call finish() first")
        self.steps, self.num_syncs, exposed = self._checkpoint.load(sd, source_rank)
        if self.auto_overlap is not None and isinstance(sd.get("overlap_steps"), int):
            self.auto_overlap.settle(sd["overlap_steps"])
        if exposed is not None:
            self.exposed_comm_s = exposed
        if isinstance(self.schedule, TimedSchedule) and "pacing" in sd:
            self.schedule.load_state_dict(sd["pacing"])

    # ---------------------------------------------------------------- elastic federation
    def _settle(self, fr: Fragment, job: Job, nb: int) -> ExchangeResult:
        """Elastic: fragment ``fr``'s round as a round of the federation
        (:meth:`Federation.run_round`): after an abort its inputs restored (``fr.restore``) and
        the round redone among the survivors; a round that admits rejoining groups hands them
        the sync's state."""
        assert self.federation is not None
        timeout_s = (self.mesh.timeout * (2 * nb + 2)).total_seconds()
        res = self.federation.run_round(f"s{fr.sync_step}f{fr.index}", job, timeout_s, step=self.steps,
                                        redo=fr.make_job, rebind=self._rebind, restore=fr.restore,
                                        handover=self._share_sync_state)
        return res if res is not None else ExchangeResult()

    def cross_group(self, name: str, fn: Callable[[Transport], Any]) -> Any:
        """Elastic: run ``fn(transport)`` (collectives over the shard peers, e.g. the evaluation's
        mean over the groups) as an agreed round named ``name``; after an abort, the membership
        round and ``fn`` again among the survivors. Without a federation, just ``fn``."""
        links = self._links
        if self.federation is None:
            return fn(links.fed)

        def submit() -> Job:
            transport = links.fed
            return links.engine.submit(lambda job: fn(transport), f"{name} over the federation")

        return self.federation.run_round(name, submit(), 2 * self.mesh.timeout.total_seconds(), step=self.steps,
                                         redo=submit, rebind=self._rebind)

    def _over_fed(self, name: str, fn: Callable[[Transport], Any]) -> Any:
        """``fn(fed transport)`` on the exchange's engine lane (the replica check's gather)."""
        if self.federation is not None:
            return self.cross_group(name, fn)
        return self._links.on_lane(name, fn, sum(fr.exchange.bar.num_buckets for fr in self._frags
                                                      if fr.exchange is not None))

    def _rebind(self) -> None:
        """The exchanges over the federation's current transport."""
        assert self.federation is not None
        # NOTE: a job of the old generation may still wait in a dead collective (until its
        # timeout) and hold its lane and staging buffers: the new generation gets its own
        self._links.bind(self.federation.transport, self.federation.fed_ranks,
                         get_engine(self._links.device, f"exchange-gen{self.federation.generation}"))
        self._build_exchanges()

    def _share_sync_state(self, src: int) -> None:
        """What a rejoining group takes from a survivor (fed index ``src``): the anchors (the
        shards themselves in the paper's in-place mode) and the outer momentum."""
        base = [s.local for s in self.slots] if self.config.in_place else list(self._anchor)
        broadcast(self._links.fed, base + list(self._outer.buffers), src)

    @torch.no_grad()
    def rejoin(self) -> int:
        """A restarted group (its Federation made with ``rejoin_mode=True``): wait until the
        survivors admit it at a sync, take the sync's state from a survivor, and start from it
        (``local = anchor``; the residuals start at zero). Returns the step it joins at."""
        if self.federation is None or not self.federation.rejoin_mode:
            raise RuntimeError("FedAvg.rejoin() needs a Federation made with rejoin_mode=True")
        m = self.federation.rejoin()
        self._rebind()
        self._share_sync_state(self.federation.source_index(m.joined))
        if not self.config.in_place:
            for s, a in zip(self.slots, self._anchor):
                s.local.copy_(a)
        for o in self._local_at_sync or []:
            o.zero_()
        self.steps = m.step
        return m.step

    @torch.no_grad()
    def _start(self, fr: Fragment) -> None:
        """Steps 1-3 of the module docstring for fragment ``fr``: flags and (overlap) the copy of
        the local shards on this thread, the rest as one job of the progress engine."""
        cfg, links = self.config, self._links
        window = links.exposure.begin()
        fr.start(self.steps, self.steps + self.overlap_steps, cfg.offload is not None and links.device.type == "cuda")
        sync_inner_state(cfg.inner_kind, self.optimizer, links.fed)
        if self._verify is not None:
            self._verify.at_start(fr.index, [s.local for s in fr.xslots if s.is_param and s.coord],
                                  [s.local for s in fr.xslots if s.is_param and not s.coord])
        fr.submit()
        links.exposure.end(window)

    @torch.no_grad()
    def _apply(self, fr: Fragment, on_time: bool = False) -> None:
        """Steps 4-5 of the module docstring (:meth:`Fragment.apply`), then the replica check.
        ``on_time``: applied ``overlap_steps`` after its start (not early by :meth:`finish`)."""
        fr.apply(on_time)
        self.num_syncs += 1
        self.schedule.record(fr, [self.topology.coords(r).group for r in self._links.fed_ranks])
        if self._verify is None:
            return
        anchors = self.config.overlap and not self.config.in_place
        synced = [self._anchor[i] for i in fr.xindices] if anchors else [s.local for s in fr.xslots]
        self._verify.after_apply(fr.index, fr.name, fr.sync_step, synced,
                                 "anchors (the sync-step averages)" if anchors else "local shards")

    def _measured(self, job: Job) -> None:
        """``overlap_steps="auto"``: an exchange applied on time (:meth:`AutoOverlap.applied`)."""
        if self.auto_overlap is not None:
            self.auto_overlap.applied(job.seconds, self._links.group, self._links.device, self.steps)
