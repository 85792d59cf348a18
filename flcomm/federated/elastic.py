"""Elastic federation: losing a federation group costs that group, not the job.

In FL+FSDP / FL+HSDP the federation groups meet only in the FedAvg exchange. With a
:class:`Federation`, the exchange runs over process groups that flcomm makes from the job's
TCPStore under a *generation* prefix (:func:`flcomm.comm.torch_pg.store_group`), one per shard
coordinate, over the ranks of the live groups; each federation group is its own
torch.distributed world, so the intra-group FSDP/HSDP groups never include a rank of another
group and a dead group cannot hang them. Nothing re-initializes a default group.

Every cross-group round ends with an agreement through the store (:meth:`Federation.commit`):

1. each rank adds itself to the round's ``ok`` (or ``fail``) counter once its part finished;
2. the first rank to see every live rank ok proposes *commit*; the first to see a failure,
   or to wait ``grace_s`` without the full count, proposes *abort*; ``compare_set`` keeps the
   first proposal, so every rank follows the same outcome. A commit also admits the groups
   whose every rank has asked to rejoin (:meth:`Federation.rejoin`).

After an abort, the membership round (:meth:`Federation.reform`):

3. every rank that is alive announces itself under the current generation and waits until all
   live ranks did, or ``grace_s``, or every rank still silent is of a group whose every rank
   asked to rejoin (a restarted group: its previous incarnation is gone, waiting cannot bring
   it back); a group is in only if all of its ranks announced (a group whose rank failed or
   froze cannot confirm);
4. the first rank to decide writes the new membership (generation + 1) with ``compare_set``;
   ranks of groups left out raise :class:`GroupLostError`, and fewer than ``min_groups``
   groups end the job (:class:`TooFewGroupsError`);
5. the survivors build the new generation's process groups; the caller (FedAvg) restores the
   round's inputs and redoes it among them, so no partial average is ever applied.

An algorithm runs its cross-group rounds through :meth:`Federation.run_round` (as torchft's
``local_sgd.py`` asks its manager ``should_commit()``): it hands over the round's job and, as
callbacks, how to redo the round, restore its inputs, rebind its collectives to the new
generation's transport and hand its state to admitted groups; the protocol stays here, the
algorithm in :mod:`flcomm.federated.fedavg`.

Store keys live under ``flcomm/elastic/``: ``gen/<g>`` (the membership of generation g, JSON),
``g<g>/<round>/{ok,fail,outcome}``, ``g<g>/alive/<rank>``, ``rejoin/<group>/<rank>``,
``finished``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from flcomm.comm.base import EXCHANGE_MAX_CTAS, CommStats, LinkTier, Transport
from flcomm.comm.engine import EngineError, Job
from flcomm.comm.torch_pg import ProcessGroupTransport, abort_group, store_group
from flcomm.federated.mesh import MeshConfig, TransportKind, cta_policy_value

if TYPE_CHECKING:
    import torch.distributed as dist

    from flcomm.federated.topology import Topology

__all__ = ["Federation", "GroupLostError", "Membership", "Outcome", "Poller", "TooFewGroupsError", "ROOT", "snapshot"]

ROOT = "flcomm/elastic/"
_POLL_S = (0.001, 0.05)  # first and longest sleep between store polls


class GroupLostError(RuntimeError):
    """This rank's federation group was dropped from the federation (one of its ranks failed
    or did not confirm in time); the rank should exit."""

    def __init__(self, message: str, group: int, generation: int, missing: list[int]) -> None:
        super().__init__(message)
        self.group, self.generation, self.missing = group, generation, missing


class TooFewGroupsError(RuntimeError):
    """Fewer federation groups than ``min_groups`` are left: the whole job ends."""


@dataclass(frozen=True)
class Membership:
    """The live federation groups of one generation, and how it came about."""

    generation: int
    groups: tuple[int, ...]
    step: int = 0                     # the FedAvg step at which it took effect
    lost: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    missing_ranks: tuple[int, ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, s: str | bytes) -> Membership:
        d = json.loads(s)
        return cls(int(d["generation"]), tuple(d["groups"]), int(d["step"]), tuple(d["lost"]),
                   tuple(d["joined"]), tuple(d.get("missing_ranks", ())))


@dataclass(frozen=True)
class Outcome:
    """How a round ended for every rank: committed or not, and the groups admitted with it."""

    committed: bool
    admit: tuple[int, ...] = ()


@dataclass
class Poller:
    """The waits between polls of the store (or of a job), growing from 1 ms to 50 ms."""

    delay: float = _POLL_S[0]

    def next(self) -> float:
        """The next wait, in seconds."""
        d, self.delay = self.delay, min(_POLL_S[1], self.delay * 2)
        return d

    def sleep(self) -> None:
        time.sleep(self.next())


def snapshot(tensors: list[Tensor]) -> Callable[[], None]:
    """Host copies of ``tensors`` as of now (a round's inputs); the returned ``restore()``
    writes them back, before an aborted round is redone (:meth:`Federation.run_round`).

    A CUDA tensor's copy goes to pinned memory without blocking the host (review item P7): it is
    queued on the current stream, so it reads the tensor as of now and runs before the round's
    job (which the engine orders after the current stream). ``restore()`` waits for those copies
    first; a redo is rare, the snapshot is taken every round."""
    saved: list[tuple[Tensor, Tensor]] = []
    for t in tensors:
        t = t.detach()
        if t.is_cuda:
            s = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            s.copy_(t, non_blocking=True)
        else:
            s = t.clone()
        saved.append((t, s))
    copied = None
    if any(t.is_cuda for t, _ in saved):
        copied = torch.cuda.Event()
        copied.record()

    @torch.no_grad()
    def restore() -> None:
        if copied is not None:
            copied.synchronize()
        for t, s in saved:
            t.copy_(s)

    return restore


@dataclass
class Federation:
    """A rank's view of the elastic federation (module docstring).

    Args:
        store: the job's TCPStore (every rank of every group reaches it; a launcher hosts it).
        topology: the full topology (all groups, as started).
        rank: this rank's global rank in ``topology``.
        mesh: the mesh's :class:`~flcomm.federated.mesh.MeshConfig` (its ``transport``: torch's
            process groups or flcomm's NCCL communicators for the cross-group groups; its
            ``timeout``, every cross-group collective's; its ``exchange_max_ctas`` and
            ``exchange_cta_policy``, the native exchange communicators', for every generation).
        backend: torch.distributed's backend of the cross-group process groups (``gloo`` or
            ``nccl``) with ``mesh.transport="torch"``.
        grace_s: how long a membership round (and a commit) waits for a silent rank.
        min_groups: fewer live groups end the job.
        stats: where the transports count their bytes (the mesh's).
        rejoin_mode: this rank's group is restarting: call :meth:`rejoin` before any exchange.

    Attributes:
        membership: the current :class:`Membership`.
        events: membership changes seen here, as metrics records (the driver drains them).
    """

    store: dist.Store
    topology: Topology
    rank: int
    mesh: MeshConfig = field(default_factory=MeshConfig)
    backend: str = "gloo"
    grace_s: float = 15.0
    min_groups: int = 1
    stats: CommStats | None = None
    rejoin_mode: bool = False
    membership: Membership = field(init=False)
    events: list[dict[str, Any]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        import torch.distributed as dist

        if not self.grace_s > 0:
            raise ValueError(f"grace_s must be > 0, got {self.grace_s!r}")
        if self.backend not in ("gloo", "nccl"):
            native = self.backend == "native"
            hint = " (flcomm's NCCL communicators are mesh=MeshConfig(transport='native'))" if native else ""
            raise ValueError(f"backend must be 'gloo' or 'nccl' (torch's process groups), got {self.backend!r}{hint}")
        if not isinstance(self.mesh, MeshConfig):
            raise TypeError(f"mesh must be a MeshConfig (FedMesh.config), got {type(self.mesh).__name__}")
        F = self.topology.num_groups
        if not isinstance(self.min_groups, int) or not 1 <= self.min_groups <= F:
            raise ValueError(f"min_groups must be an integer in [1, {F}] (the federation groups), "
                             f"got {self.min_groups!r}")
        self.kv = dist.PrefixStore(ROOT, self.store)
        self.coords = self.topology.coords(self.rank)
        self.group = self.coords.group
        self._transport: ProcessGroupTransport | None = None
        self._retired: list[Any] = []  # aborted, not destroyed (:meth:`_retire`)
        self._roots: list[Any] = []  # native generations' root communicators (:func:`native_generation`)
        first = Membership(0, tuple(range(F)))
        if not self.rejoin_mode:
            self.membership = self._decide(first)
            self._build()
        else:
            self.membership = first

    # ---------------------------------------------------------------- views
    @property
    def timeout(self) -> timedelta:
        return self.mesh.timeout

    @property
    def generation(self) -> int:
        return self.membership.generation

    @property
    def groups(self) -> tuple[int, ...]:
        return self.membership.groups

    @property
    def joined(self) -> bool:
        """This rank has a generation's transport (a rejoining rank only once admitted)."""
        return self._transport is not None

    @property
    def transport(self) -> ProcessGroupTransport:
        """The current generation's transport over this rank's shard peers in the live groups."""
        if self._transport is None:
            raise RuntimeError(f"rank {self.rank}: the federation has no transport yet (rejoin() first)")
        return self._transport

    @property
    def fed_ranks(self) -> list[int]:
        return self.members(self.groups)

    def members(self, groups: tuple[int, ...] | list[int]) -> list[int]:
        """The global ranks with this rank's shard coordinates in ``groups``, in group order."""
        i = self.coords.index
        return [self.topology.group_ranks(f)[i] for f in sorted(groups)]

    def live_ranks(self) -> list[int]:
        return [r for f in sorted(self.groups) for r in self.topology.group_ranks(f)]

    def is_leader(self) -> bool:
        """This rank is the first rank of the lowest live group (it writes the job's metrics)."""
        return self.rank == self.topology.group_ranks(min(self.groups))[0]

    # ---------------------------------------------------------------- the round agreement
    def commit(self, round_name: str, ok: bool, admit: bool = True) -> Outcome:
        """Steps 1-2 of the module docstring for round ``round_name`` of this generation.
        Returns the :class:`Outcome` every rank of the live groups gets. ``admit``: the round
        may admit rejoining groups (FedAvg's syncs do; other rounds, e.g. an evaluation the
        newcomers would miss, do not)."""
        g = self.generation
        base = f"g{g}/{round_name}/"
        n = len(self.live_ranks())
        self.kv.add(base + ("ok" if ok else "fail"), 1)
        deadline = time.monotonic() + self.grace_s
        poll = Poller()
        while True:
            got = self._get(base + "outcome")
            if got is not None:
                d = json.loads(got)
                return Outcome(bool(d["commit"]), tuple(d["admit"]))
            oks, fails = self.kv.add(base + "ok", 0), self.kv.add(base + "fail", 0)
            if oks >= n or fails > 0 or time.monotonic() > deadline:
                commit = oks >= n and fails == 0
                proposal = json.dumps({"commit": commit, "admit": self._pending_rejoins() if commit and admit else []})
                self.kv.compare_set(base + "outcome", "", proposal)
                continue
            poll.sleep()

    def decided(self, round_name: str) -> bool:
        """Some rank already decided round ``round_name`` of this generation."""
        return self.kv.check([f"g{self.generation}/{round_name}/outcome"])

    def _asked_to_rejoin(self, f: int) -> bool:
        """Every rank of group ``f`` asked to rejoin (:meth:`rejoin`)."""
        return self.kv.check([f"rejoin/{f}/{r}" for r in self.topology.group_ranks(f)])

    def _pending_rejoins(self) -> list[int]:
        """The lost groups all of whose ranks asked to rejoin."""
        out = []
        for f in range(self.topology.num_groups):
            if f not in self.groups and self._asked_to_rejoin(f):
                out.append(f)
        return out

    # ---------------------------------------------------------------- rounds of an algorithm
    def run_round(self, name: str, job: Job, timeout_s: float, *, step: int, redo: Callable[[], Job],
                  rebind: Callable[[], None], restore: Callable[[], None] | None = None,
                  handover: Callable[[int], None] | None = None) -> Any:
        """Wait for ``job`` (the collectives of round ``name``, at most ``timeout_s``) and agree
        on it with every live rank (:meth:`commit`). After an abort: the membership round
        (:meth:`reform` at step ``step``), ``restore()`` (the round's inputs, before the
        collectives are rebuilt from them), ``rebind()`` (the algorithm's collectives over the
        new :attr:`transport`), and ``redo()``'s job in its place, until a round commits.
        ``handover``: the round may admit rejoining groups; after a commit that admitted some,
        the next generation (:meth:`advance`), ``rebind()`` and ``handover(src)`` (the algorithm
        broadcasts its state from fed index ``src``, :meth:`source_index`). Returns the job's
        result (None when it was left behind)."""
        while True:
            out, ok = self._await_round(name, job, timeout_s)
            outcome = self.commit(name, ok, admit=handover is not None)
            if outcome.committed:
                break
            self.reform(step)
            if restore is not None:
                restore()
            rebind()
            job = redo()
        if outcome.admit:
            assert handover is not None
            self.advance(outcome.admit, step)
            rebind()
            handover(self.source_index(outcome.admit))
        return out

    def _await_round(self, name: str, job: Job, timeout_s: float) -> tuple[Any, bool]:
        """Wait for ``job`` (an agreed round's collectives); ``(result, True)`` once it succeeded,
        ``(None, False)`` when it failed, timed out, or another rank decided round ``name``
        first."""
        # NOTE: a rank whose peer left a collective (after an error of its own) may wait in it
        # until the timeout: once another rank decided the round, it stops waiting and leaves
        # the job behind on the old generation's lane
        # NOTE: done means done on the device (the job's end event), not only issued: with
        # stream-ordered waits a host is done while the collectives still run, and a committed
        # generation may then be retired (aborted) under them (N1). The native transport's
        # watchdog ends a round hung on a lost peer (its transport's failure)
        deadline, poll = time.monotonic() + timeout_s, Poller()
        while (not (job.host_done(poll.next()) and job.is_completed()) and not self.decided(name)
               and time.monotonic() < deadline and self._failure() is None):
            pass
        if job.host_done() and job.is_completed() and self._failure() is None:
            try:
                return job.wait(), True
            except EngineError:
                pass
        return None, False

    def _failure(self) -> Exception | None:
        """What the watchdog saw on this generation's transport (:mod:`flcomm.comm.watchdog`)."""
        return self._transport.failure if self._transport is not None else None

    # ---------------------------------------------------------------- membership changes
    def reform(self, step: int) -> Membership:
        """Steps 3-5 of the module docstring, after an aborted round at FedAvg step ``step``.
        Returns the new membership (its transports built); raises :class:`GroupLostError` on
        the ranks of groups left out and :class:`TooFewGroupsError` below ``min_groups``."""
        t0 = time.perf_counter()
        g = self.generation
        self.kv.set(f"g{g}/alive/{self.rank}", "1")
        n = len(self.live_ranks())
        cnt = self.kv.add(f"g{g}/alive_n", 1)
        deadline = time.monotonic() + self.grace_s
        poll = Poller()
        while (self._get(f"gen/{g + 1}") is None and cnt < n and time.monotonic() < deadline
               and not self._silent_are_restarting(g)):
            poll.sleep()
            cnt = self.kv.add(f"g{g}/alive_n", 0)
        missing = self._silent(g)
        lost = tuple(f for f in self.groups if set(self.topology.group_ranks(f)) & set(missing))
        keep = tuple(f for f in self.groups if f not in lost)
        new = self._decide(Membership(g + 1, keep, step, lost, (), missing))
        self._change(new, t0)
        return new

    def _silent_are_restarting(self, g: int) -> bool:
        """Every live rank not yet announced in generation ``g`` is of a group whose every rank
        asked to rejoin: a restarted incarnation (step 3 of the module docstring)."""
        groups = {self.topology.coords(r).group for r in self._silent(g)}
        return bool(groups) and all(self._asked_to_rejoin(f) for f in groups)

    def _silent(self, g: int) -> tuple[int, ...]:
        """The live ranks that have not announced themselves in generation ``g``."""
        return tuple(r for r in self.live_ranks() if not self.kv.check([f"g{g}/alive/{r}"]))

    def advance(self, admit: tuple[int, ...], step: int) -> Membership:
        """After a committed round that admitted ``admit``: the next generation, with them."""
        t0 = time.perf_counter()
        new = self._decide(Membership(self.generation + 1, tuple(sorted(set(self.groups) | set(admit))), step,
                                      (), tuple(admit)))
        self._change(new, t0)
        return new

    def rejoin(self, timeout_s: float | None = None) -> Membership:
        """For a restarted group: ask to rejoin and wait until a committed round of the survivors
        admits this group (or the survivors finish: RuntimeError). Returns the membership
        that admitted it, its transports built."""
        t0 = time.perf_counter()
        limit = timeout_s if timeout_s is not None else max(600.0, 4 * self.timeout.total_seconds())
        # NOTE: only a generation after the last one seen before asking counts: an older one
        # may have admitted an earlier incarnation of this group
        g = seen = self._newest_generation(0)
        self.kv.set(f"rejoin/{self.group}/{self.rank}", "1")
        deadline, poll = time.monotonic() + limit, Poller()
        while True:
            g = self._newest_generation(g)
            got = self._get(f"gen/{g}") if g > seen else None
            m = Membership.from_json(got) if got is not None else None
            if m is not None and self.group in m.joined:
                break
            if self._get("finished") is not None:
                raise RuntimeError(f"rank {self.rank}: the federation finished before group {self.group} could rejoin")
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: group {self.group} was not admitted within {limit:.0f} s "
                                   f"(the survivors admit a group at their next sync)")
            poll.sleep()
        self.kv.delete_key(f"rejoin/{self.group}/{self.rank}")
        self._change(m, t0)
        return m

    def finish(self) -> None:
        """The survivors are done: a group still waiting to rejoin gives up."""
        self.kv.set("finished", "1")

    def source_index(self, joined: tuple[int, ...]) -> int:
        """Index in the fed transport of the rank a handover broadcasts from: the member of the
        lowest group that was already live before ``joined``."""
        groups = sorted(self.groups)
        return groups.index(min(f for f in groups if f not in joined))

    # ---------------------------------------------------------------- internals
    def _newest_generation(self, g: int) -> int:
        """The newest generation decided in the store, from generation ``g`` on."""
        while self._get(f"gen/{g + 1}") is not None:
            g += 1
        return g

    def _decide(self, proposal: Membership) -> Membership:
        """The first proposal for generation ``proposal.generation`` wins (compare_set)."""
        got = self.kv.compare_set(f"gen/{proposal.generation}", "", proposal.to_json())
        return Membership.from_json(got)

    def _change(self, new: Membership, t0: float) -> None:
        old = self.membership
        self.membership = new
        if self.group not in new.groups:
            silent = sorted(set(new.missing_ranks) & set(self.topology.group_ranks(self.group)))
            raise GroupLostError(
                f"rank {self.rank}: federation group {self.group} is out of the federation at generation "
                f"{new.generation} (step {new.step}): its rank(s) {silent} did not confirm within "
                f"--elastic-grace-s {self.grace_s:g} s; groups {list(new.groups)} go on",
                self.group, new.generation, list(new.missing_ranks))
        if len(new.groups) < self.min_groups:
            raise TooFewGroupsError(
                f"rank {self.rank}: only {len(new.groups)} federation group(s) {list(new.groups)} left at "
                f"generation {new.generation} (step {new.step}), fewer than --min-groups {self.min_groups}; "
                f"lost groups {list(new.lost)} (ranks {list(new.missing_ranks)} did not confirm)")
        self._build()
        self.events.append({"step": new.step, "generation": new.generation, "groups": list(new.groups),
                            "lost": list(new.lost), "joined": list(new.joined),
                            "missing_ranks": list(new.missing_ranks), "previous_groups": list(old.groups),
                            "seconds": time.perf_counter() - t0})

    def _build(self) -> None:
        """This generation's transport over this rank's shard peers (created from the store)."""
        members = self.members(self.groups)
        g = self.generation
        self._retire()
        prefix, index = f"gen{g}/fed{self.coords.index}/", members.index(self.rank)
        if self.mesh.transport_kind is TransportKind.NATIVE:
            root, self._transport = native_generation(self.kv, prefix, index, len(members), self.stats,
                                                      self.timeout, self.mesh.exchange_max_ctas or 0,
                                                      cta_policy_value(self.mesh.exchange_cta_policy))
            self._roots.append(root)  # NOTE: kept with the split it made; aborted with it (_retire)
            return
        pg = store_group(self.kv, prefix, index, len(members), self.backend, self.timeout)
        self._transport = ProcessGroupTransport(pg, members, self.backend, LinkTier.INTER_GROUP, self.stats,
                                                self.timeout)

    def _retire(self) -> None:
        """Abort the previous generation's group before the next is built: on NCCL its
        collectives may still be hung on a lost peer, holding SMs and the exchange job that
        waits on them. It is kept (not destroyed): destroying a group with a dead peer may
        block."""
        if self._transport is None:
            return
        if isinstance(self._transport, ProcessGroupTransport):
            abort_group(self._transport.group)
        else:  # NOTE: flcomm's communicators: ncclCommAbort ends their kernels, the root's too (N6)
            self._transport.abort()
            if self._roots:
                self._roots[-1].abort()
        self._retired.append(self._transport)
        self._transport = None

    def _get(self, key: str) -> str | None:
        if not self.kv.check([key]):
            return None
        v = self.kv.get(key)
        return v.decode() if isinstance(v, bytes) else v


def native_generation(kv: dist.Store, prefix: str, index: int, size: int, stats: CommStats | None,
                      timeout: timedelta, max_ctas: int = EXCHANGE_MAX_CTAS,
                      cta_policy: int | None = None) -> tuple[Transport, Transport]:
    """A generation's fed transport on flcomm's NCCL communicators: only the live members take
    part. Member 0 publishes a fresh unique id under ``prefix``; every member initializes a
    communicator from it and splits the exchange's (with its CTA cap) off it. Returns (the root,
    the exchange's).

    NOTE: a fresh communicator, not a split of the last generation's: a split is collective over
    the parent, whose lost members will never call it (NCCL's ncclCommShrink would allow it)."""
    from flcomm.comm import nccl

    lib = nccl.library()
    key = f"{prefix}nccl_unique_id"
    if index == 0:
        kv.set(key, lib.nccl_unique_id())
    else:
        kv.wait([key], timeout)
    uid = kv.get(key)
    device = 0 if nccl.device_type() != "cuda" else nccl.default_device()
    root = nccl.NcclTransport(nccl.new_comm(uid, size, index, device, timeout), LinkTier.INTER_GROUP, stats,
                              timeout)
    return root, root.split(0, index, max_ctas=max_ctas, cta_policy=cta_policy)
