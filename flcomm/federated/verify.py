"""``FedAvg(verify=True)``: after each applied sync the shard peers (the fed dim) compare a 64-bit
hash of what must be equal there (:func:`tensor_hash`); the replicas of a shard (R > 1) and, for
plain parameters, the whole federation group compare theirs as of the sync's start (replicas
must be equal at all times, and a sharded exchange makes them equal again, which would hide a
drift after it). A mismatch raises :class:`ReplicaMismatchError` on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from flcomm.comm.base import Transport
    from flcomm.federated.topology import Topology

__all__ = ["ReplicaCheck", "ReplicaMismatchError", "tensor_hash"]


class ReplicaMismatchError(RuntimeError):
    """``verify=True``: ranks that must hold equal tensors do not. ``group``: ``"fed"``,
    ``"replicate"`` or ``"group"`` (the plain parameters of a federation group); ``ranks``: its
    ranks; ``step``: the sync's local step."""

    def __init__(self, message: str, group: str, ranks: list[int], step: int) -> None:
        super().__init__(message)
        self.group, self.ranks, self.step = group, ranks, step


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
    """Compare hashes of what must be equal (module docstring). :meth:`at_start` hashes a
    fragment's parameters as its sync starts (on the device, no host read); :meth:`after_apply`
    compares, after the sync was applied, in three all-gathers of a few int64 each, so that every
    rank raises when any group differs: the start hashes over the federation group (``group``:
    the replicas of each shard; the plain parameters over the whole group), then over the fed
    group the hash of what the sync made equal there with the first verdict, then the fed verdict
    over the federation group. ``over_fed(name, fn)`` runs ``fn(fed transport)`` as a job of the
    exchange's engine lane (an elastic federation's: an agreed round), so with overlapping
    fragments it waits for the other fragment's exchange in flight: a debug setting, not a free
    one."""

    def __init__(self, topology: Topology, rank: int, device: torch.device, group: Transport,
                 over_fed: Callable[[str, Callable[[Transport], Any]], Any]) -> None:
        self.topology, self.rank, self.device = topology, rank, device
        self.group, self.over_fed = group, over_fed
        self._start: dict[int, Tensor] = {}

    def at_start(self, key: int, sharded: list[Tensor], plain: list[Tensor]) -> None:
        """The hashes of a sync's ``sharded`` parameters (equal over their replicas) and ``plain``
        ones (equal over the federation group), as the sync ``key`` starts."""
        self._start[key] = torch.stack([_combine(sharded, self.device), _combine(plain, self.device)])

    def after_apply(self, key: int, sync: str, step: int, synced: list[Tensor], what: str) -> None:
        """Raise :class:`ReplicaMismatchError` on every rank when the start hashes of sync ``key``
        (``sync`` names it, ``step`` its local step) differed inside a federation group, or
        ``synced`` (``what`` they are) differs over the shard peers."""
        topo, gt, rank, dev = self.topology, self.group, self.rank, self.device
        sync = f"the sync of {sync}"
        mine = _replica_error(topo, sync, step, *_gather(gt, rank, self._start.pop(key)))
        row = torch.stack([_combine(synced, dev), torch.tensor(int(mine is not None), dtype=torch.int64, device=dev)])
        fed_ranks, fed_rows = self.over_fed(f"FedAvg replica check of step {step}", lambda t: _gather(t, rank, row))
        hashes = [r[0] for r in fed_rows]
        ours = len(set(hashes)) > 1
        group, flags = _gather(gt, rank, torch.tensor([int(ours)], dtype=torch.int64, device=dev))
        if ours:
            raise ReplicaMismatchError(
                f"FedAvg replica check after {sync}: the shard peers {fed_ranks} hold different {what} "
                f"({_table(fed_ranks, hashes)}), which shard peers hold equal after a sync: the "
                "exchange went wrong (or sync_module_states=False left the groups' anchors apart)", "fed",
                fed_ranks, step)
        elsewhere = [r for r, f in zip(group, flags) if f[0]]
        if elsewhere:
            ranks = _shard_peers(topo, elsewhere[0])
            raise ReplicaMismatchError(
                f"FedAvg replica check after {sync}: the shard peers {ranks} hold different {what} "
                "(their own error names the hashes)", "fed", ranks, step)
        if mine is not None:
            raise mine
        bad = [r for r, row in zip(fed_ranks, fed_rows) if row[1]]
        if bad:
            g = topo.coords(bad[0]).group
            raise ReplicaMismatchError(
                f"FedAvg replica check at {sync}: federation group {g} (ranks {list(topo.group_ranks(g))}) holds "
                "replicas that differ (its own error names them)", "group", list(topo.group_ranks(g)), step)


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


def _shard_peers(topo: Topology, rank: int) -> list[int]:
    return next(g for g in topo.dim_groups("fed") if rank in g)
