"""What the GPU tests and probes share: the figures they record for tools/gpu_check.sh, the
clock rate torch.cuda._sleep is sized from, and :class:`SlowWire`, the two-rank double whose
peer is this rank's mirror (a lossy codec's int8 + error-feedback path runs on it with one GPU,
where a one-rank transport takes the lossless path)."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import torch
from torch import Tensor

from flcomm.comm.base import CommStats, LinkTier, ReduceOp, Transport


def figure(test: str, **values) -> None:
    """Record a probe's figures for tools/gpu_check.sh (one JSON line per call to the file named
    by FLCOMM_GPU_FIGURES; nothing without it)."""
    path = os.environ.get("FLCOMM_GPU_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **values}) + "\n")


# NOTE: torch.cuda._sleep spins for a number of GPU clock cycles; ~2e9 per second on an H200
# (1.98 GHz boost). The probes size their sleeps from this and measure what they rely on.
CYCLES_PER_S = 2_000_000_000


class SlowWire(Transport):
    """Rank 0 of a two-rank transport whose peer is its mirror (it sends exactly what this rank
    sends), run locally: each collective does the copies / reduction a two-rank NCCL collective
    would leave on this rank, then (CUDA) sleeps ``delay_s`` on the current stream, the wire.
    Each collective's wire time is kept as a pair of events (``intervals``), grouped per exchange:
    an int32 all-reduce (FedAvg's non-finite flags) opens a new group. ``host_wait``: each
    collective also blocks the host until its wire time is over (a transport with blocking
    waits, as gloo or ``NcclTransport(blocking_wait=True)``), so a job of the progress engine on
    it ends on the host when its collectives end on the device.

    NOTE: the average of two mirrors is the rank's own delta, for the exact collectives and for a
    lossy codec's one all-gather on two ranks alike (the two-hop path, which reduces chunks, would
    need the peer's pipeline; it takes three ranks or more)."""

    def __init__(self, device: torch.device, delay_s: float = 0.0, host_wait: bool = False) -> None:
        super().__init__(0, 2, LinkTier.INTER_GROUP, CommStats(), timedelta(seconds=60))
        self._device = device
        self.cycles = int(delay_s * CYCLES_PER_S)
        self.host_wait = host_wait
        self.intervals: list[list[tuple]] = []

    @property
    def device(self) -> torch.device:
        return self._device

    def _wire(self) -> None:
        if self._device.type != "cuda" or not self.cycles:
            return
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        torch.cuda._sleep(self.cycles)
        e1.record()
        if not self.intervals:
            self.intervals.append([])
        self.intervals[-1].append((e0, e1))
        if self.host_wait:
            e1.synchronize()

    def _all_reduce(self, t: Tensor, op: ReduceOp) -> None:
        if t.dtype == torch.int32:
            self.intervals.append([])
        if op is ReduceOp.SUM:
            t.mul_(2)
        self._wire()

    def _reduce_scatter(self, out: Tensor, inp: Tensor, op: ReduceOp) -> None:
        mine = inp[: out.numel()]
        if op is ReduceOp.SUM:
            torch.mul(mine, 2, out=out)
        else:
            out.copy_(mine)
        self._wire()

    def _all_gather(self, out: Tensor, inp: Tensor) -> None:
        out.view(2, -1).copy_(inp.view(1, -1).expand(2, -1))
        self._wire()

    def _all_to_all(self, out: Tensor, inp: Tensor) -> None:
        mine = inp.view(2, -1)[:1]  # NOTE: both ranks send me their chunk 0, which is mine
        out.view(2, -1).copy_(mine.expand(2, -1))
        self._wire()

    def _broadcast(self, t: Tensor, src: int) -> None:
        self._wire()
