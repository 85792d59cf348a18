"""FedAvg's checks against training wrongly without a word.

* :func:`check_sharding` (at construction): the model's sharding matches the topology. Every
  FSDP2 parameter is sharded over exactly the FedMesh's ``shard`` dim and, with R > 1 replicas
  (FL+HSDP), replicated over exactly its ``replicate`` dim; FSDP1 units shard over the
  ``shard`` group (and, R > 1, replicate over the ``replicate`` group, HYBRID_SHARD); a
  DistributedDataParallel module replicates over the whole federation group. Compared by the
  global ranks of the groups, not by object identity (a mesh of one's own over the same ranks
  is fine). A trainable plain parameter (no FSDP, no DDP) in a group of more than one rank is
  refused unless the user says it is kept equal by other means (``replicated=True``).
* :class:`StepOrder`: ``FedAvg.step()`` must follow ``optimizer.step()``; a step post-hook of
  the optimizer FedAvg is given counts its steps or, given none, a global one those of any
  torch optimizer over the model's parameters.
* :class:`ReplicaCheck` (``verify=True``): after each applied sync the ranks of the fed group
  compare a 64-bit hash of what must be equal there (:func:`tensor_hash`); the replicas of a
  shard (R > 1) and, for plain parameters, the whole federation group compare theirs as of the
  sync's start (replicas must be equal at all times, and a sharded exchange makes them equal
  again, which would hide a drift after it).
* :func:`or_flags` and :func:`non_finite_error`: the agreement on a non-finite average and its
  refusal, :class:`NonFiniteAverageError`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

if TYPE_CHECKING:
    from flcomm.comm.base import Transport
    from flcomm.federated.exchange import ExchangeResult
    from flcomm.federated.fedavg import FedAvg
    from flcomm.federated.topology import FedMesh, Topology

__all__ = ["NonFiniteAverageError", "ReplicaCheck", "ReplicaMismatchError", "StepOrder", "check_sharding",
           "non_finite_error", "or_flags", "own_flags", "read_refusal", "tensor_hash"]


class NonFiniteAverageError(FloatingPointError):
    """The averaged delta received from the fed group had NaN/Inf; it was not applied."""

    def __init__(self, message: str, fed_ranks: list[int], bad_ranks: list[int]) -> None:
        super().__init__(message)
        self.fed_ranks = fed_ranks
        self.bad_ranks = bad_ranks


class ReplicaMismatchError(RuntimeError):
    """``verify=True``: ranks that must hold equal tensors do not. ``group``: ``"fed"``,
    ``"replicate"`` or ``"group"`` (the plain parameters of a federation group); ``ranks``: its
    ranks; ``step``: the sync's local step."""

    def __init__(self, message: str, group: str, ranks: list[int], step: int) -> None:
        super().__init__(message)
        self.group, self.ranks, self.step = group, ranks, step


# ---------------------------------------------------------------- the model's sharding
def _fix(replicate: bool) -> str:
    dims = "'replicate', 'shard'" if replicate else "'shard'"
    return f"fully_shard(module, mesh=fed_mesh.device_mesh[{dims}]) for every unit and the root"


def _dims_ranks(dm: Any, dims: list[int]) -> list[int]:
    """The ranks of DeviceMesh ``dm`` that differ from this rank only along ``dims``."""
    coord = dm.get_coordinate()
    if coord is None:  # NOTE: this rank is not in the mesh: all of it is "elsewhere"
        return sorted(int(r) for r in dm.mesh.flatten().tolist())
    index = tuple(slice(None) if i in dims else c for i, c in enumerate(coord))
    return sorted(int(r) for r in dm.mesh[index].flatten().tolist())


def _expect(mesh: FedMesh) -> tuple[list[int], list[int]]:
    """The ranks a tensor of this rank must be sharded and replicated over."""
    rep = mesh.group_ranks.get("replicate", [mesh.rank]) if mesh.topology.num_replicas > 1 else [mesh.rank]
    return sorted(mesh.group_ranks["shard"]), sorted(rep)


def _compare(what: str, sharded: list[int], replicated: list[int], mesh: FedMesh, fix: str) -> None:
    """ValueError unless ``sharded`` / ``replicated`` (global ranks) are what the topology says."""
    group = mesh.group_ranks["group"]
    if not set(sharded) | set(replicated) <= set(group):
        raise ValueError(
            f"{what} is sharded or replicated over ranks {sorted(set(sharded) | set(replicated))}, which leave the "
            f"federation group of rank {mesh.rank} (ranks {group}): shard the model inside its group only "
            f"({fix}), or the groups would not train independently")
    want_s, want_r = _expect(mesh)
    if (sharded, replicated) != (want_s, want_r):
        t = mesh.topology
        hsdp = t.num_replicas > 1
        drift = (" (replicated over too few ranks, the replicas never all-reduce their gradients and drift apart)"
                 if hsdp and replicated != want_r else "")
        raise ValueError(
            f"{what} is sharded over ranks {sharded} and replicated over ranks {replicated}, but the topology "
            f"(G={t.group_size}, S={t.shard_size}, R={t.num_replicas}) expects it sharded over the FedMesh's 'shard' "
            f"dim, ranks {want_s}" + (f", and replicated over its 'replicate' dim, ranks {want_r}" if hsdp else "")
            + f"{drift}: use {fix}")


def _check_dtensor(name: str, p: Any, mesh: FedMesh, hooked: dict[int, list[int]]) -> None:
    dm = p.device_mesh
    shard = [i for i, pl in enumerate(p.placements) if pl.is_shard()]
    rep = [i for i, pl in enumerate(p.placements) if pl.is_replicate()]
    replicated = sorted(mesh.global_ranks(_dims_ranks(dm, rep)))
    if replicated == [mesh.rank] and id(p) in hooked:  # NOTE: an all-reduce hook replicates it
        replicated = hooked[id(p)]
    _compare(f"parameter {name!r}", sorted(mesh.global_ranks(_dims_ranks(dm, shard))),
             replicated, mesh, _fix(mesh.topology.num_replicas > 1))


def _hook_replicas(model: nn.Module, mesh: FedMesh) -> dict[int, list[int]]:
    """{id(parameter): global ranks} of the FSDP2 parameters whose gradients an all-reduce hook
    (``set_all_reduce_hook``, e.g. flcomm.fsdp's ReplicateAllReduceHook) reduces over a
    transport's ranks."""
    out: dict[int, list[int]] = {}
    for m in model.modules():
        state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
        groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
        for g in groups:
            ranks = getattr(getattr(getattr(g, "_all_reduce_hook", None), "transport", None), "ranks", None)
            if g is not None and ranks is not None:
                out.update({id(fp.sharded_param): sorted(mesh.global_ranks(ranks)) for fp in g.fsdp_params})
    return out


def _pg_ranks(pg: Any, mesh: FedMesh) -> list[int]:
    import torch.distributed as dist

    return sorted(mesh.global_ranks(dist.get_process_group_ranks(pg))) if pg is not None else [mesh.rank]


def _check_fsdp1(model: nn.Module, mesh: FedMesh) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy as SS

    t = mesh.topology
    hsdp = t.num_replicas > 1
    fix = ("FullyShardedDataParallel(model, process_group=(fed_mesh.groups['shard'], fed_mesh.groups['replicate']), "
           "sharding_strategy=ShardingStrategy.HYBRID_SHARD)" if hsdp else
           "FullyShardedDataParallel(model, process_group=fed_mesh.groups['shard'])")
    if hsdp and t.shard_size == 1:
        fix += (" (FSDP1 turns HYBRID_SHARD over a one-rank shard group into NO_SHARD, which drops the replicate "
                "group: with S = 1 use sharding_strategy=NO_SHARD, process_group=fed_mesh.groups['replicate'], "
                "or FSDP2)")
    for i, unit in enumerate(FSDP.fsdp_modules(model)):
        if getattr(unit, "_handle", None) is None:
            continue
        pg, strategy = _pg_ranks(unit.process_group, mesh), unit.sharding_strategy
        if strategy == SS.NO_SHARD:  # NOTE: its process group replicates
            sharded, replicated = [mesh.rank], pg
        elif strategy in (SS.HYBRID_SHARD, SS._HYBRID_SHARD_ZERO2):
            sharded, replicated = pg, _pg_ranks(getattr(unit, "_inter_node_pg", None), mesh)
        else:
            sharded, replicated = pg, [mesh.rank]
        _compare(f"FSDP1 unit {i} ({type(unit.module).__name__}, {strategy.name})", sharded, replicated, mesh, fix)


def _ddp_params(model: nn.Module, mesh: FedMesh) -> set[int]:
    """The parameters DistributedDataParallel keeps equal (checked: over the whole group)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out: set[int] = set()
    for m in model.modules():
        if isinstance(m, DDP):
            ranks, group = _pg_ranks(m.process_group, mesh), sorted(mesh.group_ranks["group"])
            if ranks != group:
                raise ValueError(f"DistributedDataParallel replicates over ranks {ranks}, but rank {mesh.rank}'s "
                                 f"federation group is ranks {group}: use DistributedDataParallel(module, "
                                 "process_group=fed_mesh.groups['group'])")
            out |= {id(p) for p in m.module.parameters()}
    return out


def check_sharding(model: nn.Module, mesh: FedMesh, kind: str, replicated: bool) -> None:
    """ValueError when the model's sharding does not match the topology of ``mesh`` (module
    docstring); ``kind``: :func:`~flcomm.federated.shards.model_kind`'s."""
    from flcomm.federated.shards import is_dtensor

    if kind == "fsdp1":
        _check_fsdp1(model, mesh)
        return
    kept = _ddp_params(model, mesh)
    plain = []
    hooked = _hook_replicas(model, mesh)
    for name, p in model.named_parameters():
        if is_dtensor(p):
            _check_dtensor(name, p, mesh, hooked)
        elif id(p) not in kept and p.is_floating_point() and p.requires_grad:  # NOTE: a frozen one cannot drift
            plain.append(name)
    group = mesh.group_ranks["group"]
    if plain and len(group) > 1 and not replicated:
        more = f" (and {len(plain) - 1} more)" if len(plain) > 1 else ""
        raise ValueError(
            f"parameter {plain[0]!r}{more} is a plain tensor (not sharded by FSDP, not in DistributedDataParallel) "
            f"in a federation group of {len(group)} ranks ({group}): nothing keeps it equal across the group, whose "
            f"ranks would train apart. Use {_fix(mesh.topology.num_replicas > 1)}, or "
            "DistributedDataParallel(module, process_group=fed_mesh.groups['group']), or pass "
            "FedAvg(..., replicated=True) if you keep it equal yourself (your own gradient all-reduce)")


# ---------------------------------------------------------------- the step order
class StepOrder:
    """``FedAvg.step()`` must come after ``optimizer.step()``: called before it, the groups end
    apart by the last local step (about 1e-2 on the README's loop), with no other sign.

    Rules (:meth:`check` runs at every ``FedAvg.step()``):

    1. An optimizer FedAvg is given (``FedAvg(optimizer=)``, :meth:`FedAvg.attach`) counts its
       steps through a step post-hook of its own; a FedAvg step with none since the previous one
       is refused (unless ``skipped=True``).
    2. Without one, a global optimizer step post-hook
       (``torch.optim.optimizer.register_optimizer_step_post_hook``) counts the steps of every
       torch optimizer that holds one of the model's parameters. From the first such step on,
       rule 1 holds. A FedAvg step before any such step, with none before it, is remembered and
       refused at the first FedAvg step after an optimizer step showed that there is one (the
       loop that calls ``fed.step()`` before ``optimizer.step()`` stops at its second step).
    3. A loop with no torch optimizer over the model's parameters is never refused.

    The global hook holds the checker weakly and goes when it does."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, model: nn.Module | None = None) -> None:
        self.pending = 0
        self._watched: set[int] = set()
        self._seen = False  # NOTE: rule 2: an optimizer over the model's parameters stepped
        self._early: int | None = None
        self._params = {id(p) for p in model.parameters()} if model is not None else set()
        self._holds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        if optimizer is not None:
            self.watch(optimizer)
        elif self._params:
            me = weakref.ref(self)

            def seen(opt: torch.optim.Optimizer, *_: Any) -> None:
                if (order := me()) is not None:
                    order._seen_step(opt)

            weakref.finalize(self, register_optimizer_step_post_hook(seen).remove)

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer``'s steps (once per optimizer; before any hook registered later)."""
        if id(optimizer) not in self._watched:
            self._watched.add(id(optimizer))
            optimizer.register_step_post_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.pending += 1

    def _seen_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Rule 2: a step of ``optimizer``, counted when it holds one of the model's parameters."""
        if id(optimizer) in self._watched:
            return  # NOTE: counted by its own hook
        holds = self._holds.get(optimizer)
        if holds is None:
            holds = self._holds[optimizer] = any(id(p) in self._params for g in optimizer.param_groups
                                                 for p in g["params"])
        if holds:
            self._seen = True
            self.pending += 1

    def check(self, step: int, skipped: bool) -> None:
        """RuntimeError when local step ``step`` came with no optimizer step (and not ``skipped``),
        or (rule 2) an earlier one did."""
        if not skipped and (self._watched or self._seen):
            if self._early is not None:
                raise RuntimeError(
                    f"FedAvg.step() for local step {self._early} came before any optimizer.step() of an "
                    "optimizer holding the model's parameters (one has stepped since): " + _ORDER_FIX)
            if not self.pending:
                raise RuntimeError(f"FedAvg.step() for local step {step} came with no optimizer.step() since the "
                                   "previous FedAvg.step(): " + _ORDER_FIX)
        elif not skipped and self._early is None:
            self._early = step
        self.pending = 0


_ORDER_FIX = ("call fed.step() once after optimizer.step() in every step (before it, the groups end apart by the "
              "last local step), or fed.attach(optimizer) once and no fed.step() by hand; a step whose optimizer "
              "step was skipped on purpose (non-finite gradients) is fed.step(skipped=True)")


# ---------------------------------------------------------------- the replica check
CHUNK = 1 << 20  # elements hashed at once: bounds the int64 temporaries
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _s64(x: int) -> int:
    """``x`` modulo 2**64 as a signed int64 (torch's scalars)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


GOLDEN, MIX1, MIX2 = _s64(0x9E3779B97F4A7C15), _s64(0xBF58476D1CE4E5B9), _s64(0x94D049BB133111EB)


def _mix(z: Tensor) -> Tensor:
    """splitmix64's finalizer, elementwise on int64 (logical shifts; products wrap around)."""
    def shr(x: Tensor, k: int) -> Tensor:
        return (x >> k) & ((1 << (64 - k)) - 1)

    z = (z ^ shr(z, 30)) * MIX1
    z = (z ^ shr(z, 27)) * MIX2
    return z ^ shr(z, 31)


_POS: dict[torch.device, Tensor] = {}


def tensor_hash(t: Tensor) -> Tensor:
    """A 64-bit hash (0-dim int64 on ``t``'s device, no host sync) of ``t``'s bytes and
    positions: its elements viewed as integers of their width, each mixed with its index,
    summed with wraparound (integer sums are exact in any order, so it is deterministic)."""
    flat = t.detach().reshape(-1).view(_INT[t.element_size()])
    if t.device not in _POS:
        _POS[t.device] = _mix(torch.arange(CHUNK, dtype=torch.int64, device=t.device) * GOLDEN)
    acc = torch.zeros((), dtype=torch.int64, device=t.device)
    for off in range(0, flat.numel(), CHUNK):
        piece = flat[off:off + CHUNK].to(torch.int64)
        acc = acc + _mix(piece + (_POS[t.device][:piece.numel()] ^ _s64(off))).sum()
    return _mix(acc ^ _s64(t.numel()))


def _combine(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """One order-dependent 64-bit hash of ``tensors``, on ``device``."""
    acc = torch.zeros((), dtype=torch.int64, device=device)
    for t in tensors:
        acc = _mix(acc * GOLDEN + tensor_hash(t).to(device))
    return acc


class ReplicaCheck:
    """``FedAvg(verify=True)``: compare hashes of what must be equal (module docstring).
    :meth:`at_start` hashes a fragment's parameters as its sync starts (on the device, no host
    read); :meth:`after_apply` compares, after the sync was applied, in three all-gathers of a
    few int64 each, so that every rank raises when any group differs: the start hashes over the
    federation group (the replicas of each shard; the plain parameters over the whole group),
    then over the fed group the hash of what the sync made equal there (the local shards after a
    blocking sync; with overlap the anchors, the sync-step average, as the local shards go on
    training) with the first verdict, then the fed verdict over the federation group. The fed
    gather is a job of the exchange's engine lane, so with overlapping fragments it waits for
    the other fragment's exchange in flight: a debug setting, not a free one."""

    def __init__(self, fed: FedAvg, enabled: bool) -> None:
        self.fed = fed
        self.enabled = enabled and fed.federated
        self._start: dict[int, Tensor] = {}

    def at_start(self, fr: Any) -> None:
        if not self.enabled:
            return
        slots = [self.fed.slots[i] for i in fr.xidx if self.fed.slots[i].is_param]
        dev = self.fed.device
        self._start[fr.index] = torch.stack([_combine([s.local for s in slots if s.coord], dev),
                                             _combine([s.local for s in slots if not s.coord], dev)])

    def after_apply(self, fr: Any) -> None:
        if not self.enabled:
            return
        fed, topo = self.fed, self.fed.topology
        sync = f"the sync of {fed._sync_name(fr)}"
        gt, rank = fed.group_transport, fed.rank
        mine = _replica_error(topo, sync, fr.sync_step, *_gather(gt, rank, self._start.pop(fr.index)))
        anchors = fed.overlap and not fed.in_place
        what = "anchors (the sync-step averages)" if anchors else "local shards"
        h = _combine([fed._anchor[i] if anchors else fed.slots[i].local for i in fr.xidx], fed.device)
        row = torch.stack([h, torch.tensor(int(mine is not None), dtype=torch.int64, device=fed.device)])
        fed_ranks, fed_rows = self._over_fed(f"FedAvg replica check of step {fr.sync_step}", row)
        hashes = [r[0] for r in fed_rows]
        ours = len(set(hashes)) > 1
        group, flags = _gather(gt, rank, torch.tensor([int(ours)], dtype=torch.int64, device=fed.device))
        if ours:
            raise ReplicaMismatchError(
                f"FedAvg replica check after {sync}: the ranks of fed group {fed_ranks} hold different {what} "
                f"({_table(fed_ranks, hashes)}), which every rank of a fed group holds equal after a sync: the "
                "exchange went wrong (or sync_init=False left the groups' anchors apart)", "fed", fed_ranks,
                fr.sync_step)
        elsewhere = [r for r, f in zip(group, flags) if f[0]]
        if elsewhere:
            ranks = _fed_group(topo, elsewhere[0])
            raise ReplicaMismatchError(
                f"FedAvg replica check after {sync}: the ranks of fed group {ranks} hold different {what} "
                "(their own error names the hashes)", "fed", ranks, fr.sync_step)
        if mine is not None:
            raise mine
        bad = [r for r, row in zip(fed_ranks, fed_rows) if row[1]]
        if bad:
            g = topo.coords(bad[0]).group
            raise ReplicaMismatchError(
                f"FedAvg replica check at {sync}: federation group {g} (ranks {list(topo.group_ranks(g))}) holds "
                "replicas that differ (its own error names them)", "group", list(topo.group_ranks(g)), fr.sync_step)


    def _over_fed(self, name: str, row: Tensor) -> tuple[list[int], list[list[int]]]:
        """:func:`_gather` over the fed group, as a job of the exchange's engine lane (an elastic
        federation's: an agreed round, :meth:`FedAvg.cross_group`)."""
        fed = self.fed
        if fed.federation is not None:
            return fed.cross_group(name, lambda t: _gather(t, fed.rank, row))
        # NOTE: another fragment's exchange may be in flight on the fed group (overlapping
        # fragments): two threads issuing there would interleave differently on different ranks
        transport, nb = fed.transport, sum(f.exchange.bar.num_buckets for f in fed._frags if f.exchange is not None)
        job = fed._engine.submit(lambda job: _gather(transport, fed.rank, row), name)
        return job.wait(fed.mesh.timeout * (2 * nb + 4))


def _gather(transport: Any, rank: int, row: Tensor) -> tuple[list[int], list[list[int]]]:
    """Every rank's ``row`` (int64) over ``transport``, read on the host: the global ranks and
    their rows, in ascending rank order (each row travels with its rank: no assumption on the
    transport's rank order)."""
    row = torch.cat([torch.tensor([rank], dtype=torch.int64, device=row.device), row.reshape(-1)])
    out = torch.zeros(transport.size * row.numel(), dtype=torch.int64, device=transport.device)
    transport.all_gather(out, row.to(transport.device))
    got = sorted(out.view(transport.size, -1).tolist())
    return [g[0] for g in got], [g[1:] for g in got]


def _table(ranks: list[int], hashes: list[int]) -> str:
    return ", ".join(f"rank {r}: {h & ((1 << 64) - 1):016x}" for r, h in zip(ranks, hashes))


def _replica_error(topo: Topology, sync: str, step: int, group: list[int],
                   rows: list[list[int]]) -> ReplicaMismatchError | None:
    """The error when the replicas of a shard (``rows[i][0]``, rank ``group[i]``'s shard hash at
    the sync's start) or the plain parameters (``rows[i][1]``) differ inside the group."""
    by_shard: dict[int, list[int]] = {}
    for i, r in enumerate(group):
        by_shard.setdefault(topo.coords(r).shard, []).append(i)
    for s, idx in by_shard.items():
        if len({rows[i][0] for i in idx}) > 1:
            ranks = [group[i] for i in idx]
            return ReplicaMismatchError(
                f"FedAvg replica check at {sync}: the replicas of shard {s} in federation group "
                f"{topo.coords(ranks[0]).group}, replicate group {ranks}, hold different local shards "
                f"({_table(ranks, [rows[i][0] for i in idx])}); replicas must be equal at all times: shard with "
                "fully_shard(..., mesh=fed_mesh.device_mesh['replicate', 'shard']) (HSDP) and start every "
                "replica from the same weights", "replicate", ranks, step)
    if len({row[1] for row in rows}) > 1:
        return ReplicaMismatchError(
            f"FedAvg replica check at {sync}: the ranks of federation group {topo.coords(group[0]).group} "
            f"({group}) hold different plain (unsharded) parameters ({_table(group, [row[1] for row in rows])}); "
            "replicated=True promised they are kept equal over the group", "group", group, step)
    return None


def _fed_group(topo: Topology, rank: int) -> list[int]:
    return next(g for g in topo.dim_groups("fed") if rank in g)


# ---------------------------------------------------------------- the non-finite refusal
def or_flags(wf: Tensor, index: Tensor, flags: Tensor, res: ExchangeResult, transport: Transport) -> None:
    """``wf`` = the fed group's bad ranks (``flags``, one per rank of the fed group; ``index``:
    their global ranks) and a last bit for a bucket whose average overflowed (``res.bad``),
    OR-ed over the federation group by ``transport``: what :func:`non_finite_error` reads. On
    the device (no host read)."""
    wf.zero_()
    wf.index_copy_(0, index, flags.clamp(max=1))
    if res.bad is not None:
        wf[-1] = res.bad.any()
    transport.all_reduce(wf, op="max")


def own_flags(n: int, index: int, own: Tensor | None, device: torch.device) -> Tensor:
    """A fed group's refusal flags (``n`` ranks) before their all-reduce: zeros, but this rank's
    own non-finite flag ``own`` (None: finite) at ``index``. An elastic redo starts from it, so
    the redone round still refuses this rank's non-finite delta (N5).

    NOTE: who sent a non-finite delta travels in its own tiny uncompressed all-reduce (a one-hot
    int32 vector over the fed group): a lossy codec may turn NaN/Inf into finite garbage, so the
    averaged delta alone cannot be trusted to show it."""
    flags = torch.zeros(n, dtype=torch.int32, device=device)
    if own is not None:
        flags[index] = own
    return flags


def read_refusal(world_flags: Tensor, transports: list[Transport], what: str) -> bool:
    """The one host read of an apply: whether ``world_flags`` refuses the average. First every
    transport's watchdog verdict (``raise_if_failed``): after an abort the flags are undefined,
    and must not be read as a refusal."""
    bad = bool(world_flags.any())  # NOTE: on a device this waits for the kernels (ended by an abort)
    for t in transports:
        t.raise_if_failed(what)
    return bad


def non_finite_error(world_flags: Tensor, topology: Topology, fed_ranks: list[int], what: str) -> NonFiniteAverageError:
    """The refusal of a non-finite average: ``world_flags`` marks the ranks (world-wide) that
    sent a non-finite delta, its last entry buckets whose average overflowed."""
    flags = world_flags.tolist()
    bad = [r for r, f in enumerate(flags[:-1]) if f]
    groups = [topology.coords(r).group for r in bad]
    if bad:
        origin = (f"non-finite deltas came from ranks {bad} (federation groups {groups}); the average "
                  "was refused: local weights and anchors are unchanged where the fed group saw them")
    else:
        origin = ("no rank sent a non-finite delta: the reduction or the codec overflowed in some "
                  "buckets, whose average was not applied (other buckets were)")
    return NonFiniteAverageError(
        f"{what}: the average exchanged between federation groups is not finite (NaN/Inf); {origin}. "
        "Every rank stops with this error: restore a checkpoint.", list(fed_ranks), bad)
