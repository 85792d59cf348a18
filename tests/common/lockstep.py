"""W flcomm transports in one process, driven in lockstep by one thread: every rank issues a
collective, then every rank waits for it (how a single-process test runs W ranks of a plan stage
by stage, e.g. ``encode_scatter`` on all, then ``reduce_gather`` on all).

A collective completes when the last rank issues it, with the data every rank had at its issue
(what a real transport delivers). A ``wait`` before every rank issued raises: on a real
transport that wait would block for ever, so the test double fails loudly instead.
Only all-to-all and all-gather exist; the other collectives raise.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from flcomm.comm.base import Done, LinkTier, Transport


class _Pending:
    def __init__(self, world: LockstepWorld, key: tuple) -> None:
        self.world, self.key = world, key

    def wait(self, timeout: Any = None) -> None:
        missing = self.world.missing(self.key)
        if missing:
            raise RuntimeError(f"{self.key[0]} #{self.key[1]} waited for before ranks {missing} issued it "
                               "(a real transport would block here)")

    def is_completed(self) -> bool:
        return not self.world.missing(self.key)


class LockstepWorld:
    """The shared state of ``size`` :class:`LockstepTransport` s (``.ranks``)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.issued: dict[tuple, dict[int, tuple[Tensor, Tensor]]] = {}
        self.seq = [0] * size
        self.ranks = [LockstepTransport(self, r) for r in range(size)]

    def missing(self, key: tuple) -> list[int]:
        return sorted(set(range(self.size)) - set(self.issued.get(key, {})))

    def issue(self, rank: int, name: str, output: Tensor, input: Tensor) -> _Pending:
        key = (name, self.seq[rank])
        self.seq[rank] += 1
        calls = self.issued.setdefault(key, {})
        if calls and next(iter(calls.values()))[1].numel() != input.numel():
            raise ValueError(f"{name} #{key[1]}: ranks issued inputs of different sizes")
        calls[rank] = (output, input.clone())  # NOTE: the data at the issue, as the wire takes it
        if len(calls) == self.size:
            for r, (out, _) in calls.items():
                chunks = out.view(self.size, -1)
                for src, (_, inp) in calls.items():
                    chunks[src].copy_(inp.view(self.size, -1)[r] if name == "all_to_all" else inp)
        return _Pending(self, key)


class LockstepTransport(Transport):
    name = "lockstep"

    def __init__(self, world: LockstepWorld, rank: int) -> None:
        super().__init__(rank, world.size, LinkTier.INTER_GROUP)
        self.world = world

    def _all_to_all(self, output: Tensor, input: Tensor) -> Any:
        return self.world.issue(self.rank, "all_to_all", output, input)

    def _all_gather(self, output: Tensor, input: Tensor) -> Any:
        return self.world.issue(self.rank, "all_gather", output, input)

    def _unsupported(self, *_: Any) -> Done:
        raise NotImplementedError("LockstepTransport has only all_to_all and all_gather")

    _all_reduce = _reduce_scatter = _broadcast = _unsupported

