"""The refusal of a non-finite average: who sent a non-finite delta, agreed over the federation
group, and the one error every rank raises (:class:`NonFiniteAverageError`).

The rule: a rank's delta is non-finite exactly when its local shard is (the anchor is finite: a
refused average is never applied). Who sent one travels in its own tiny uncompressed all-reduce
over the shard peers (:func:`own_flags`), since a lossy codec may turn NaN/Inf into finite
garbage; the shard peers' flags and an overflow bit per exchange are then OR-ed over the
federation group (:func:`or_flags`), read on the host once at the apply (:func:`read_refusal`),
and a refusal raises :func:`non_finite_error` on every rank of every group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from flcomm.comm.base import Transport
    from flcomm.federated.exchange import ExchangeResult
    from flcomm.federated.topology import Topology

__all__ = ["NonFiniteAverageError", "non_finite_error", "or_flags", "own_flags", "read_refusal"]


class NonFiniteAverageError(FloatingPointError):
    """The averaged delta received from the shard peers had NaN/Inf; it was not applied."""

    def __init__(self, message: str, fed_ranks: list[int], bad_ranks: list[int]) -> None:
        super().__init__(message)
        self.fed_ranks = fed_ranks
        self.bad_ranks = bad_ranks



def or_flags(wf: Tensor, index: Tensor, flags: Tensor, res: ExchangeResult, transport: Transport) -> None:
    """``wf`` = the shard peers' bad ranks (``flags``, one per shard peer; ``index``:
    their global ranks) and a last bit for a bucket whose average overflowed (``res.bad``),
    OR-ed over the federation group by ``transport``: what :func:`non_finite_error` reads. On
    the device (no host read)."""
    wf.zero_()
    wf.index_copy_(0, index, flags.clamp(max=1))
    if res.bad is not None:
        wf[-1] = res.bad.any()
    transport.all_reduce(wf, op="max")


def own_flags(n: int, index: int, own: Tensor | None, device: torch.device) -> Tensor:
    """The shard peers' refusal flags (``n`` ranks) before their all-reduce: zeros, but this rank's
    own non-finite flag ``own`` (None: finite) at ``index``. An elastic redo starts from it, so
    the redone round still refuses this rank's non-finite delta (N5).

    NOTE: who sent a non-finite delta travels in its own tiny uncompressed all-reduce (a one-hot
    int32 vector over the shard peers): a lossy codec may turn NaN/Inf into finite garbage, so the
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
                  "was refused: local weights and anchors are unchanged where their shard peers saw them")
    else:
        origin = ("no rank sent a non-finite delta: the reduction or the codec overflowed in some "
                  "buckets, whose average was not applied (other buckets were)")
    return NonFiniteAverageError(
        f"{what}: the average exchanged between federation groups is not finite (NaN/Inf); {origin}. "
        "Every rank stops with this error: restore a checkpoint.", list(fed_ranks), bad)
