"""One fragment of FedAvg's averaged tensors, the unit of a sync (all of them when ``fragments=1``).

A :class:`Fragment` owns its averaged tensors, its views of the anchor and local-at-sync arenas, its
:class:`~flcomm.federated.exchange.DeltaExchange`, its refusal flags and the job in flight, and
runs steps 1, 3-5 of :mod:`flcomm.federated.fedavg`'s algorithm on them: :meth:`Fragment.start`
(the flags, the local-at-sync copy), :meth:`Fragment.submit` (the job of the progress engine) and
:meth:`Fragment.apply` (wait, agree on a refusal, the overlap correction). FedAvg keeps the
schedule (which fragment starts and applies at which step), the arenas and the persistence; a
fragment reaches the rest through its :class:`Links` (the transports and engine lane, which an
elastic membership change rebinds) and two callbacks: ``on_measured`` (an exchange applied on
time, for ``overlap_steps="auto"``) and, in an elastic federation, ``settle`` (the round
protocol's wait). Exchanges that keep running past their apply make it warn, once per FedAvg.
In the timed mode (:mod:`flcomm.federated.pacing`) FedAvg sets the group's ``counts`` before
:meth:`Fragment.submit`; the job sums them over the fed dim first and weighs the delta by them.

Memory (:func:`memory_stats`): the paper's mode keeps nothing but two staging buckets; the other
modes keep the anchor, plus the residual (error feedback, fp32 or ``residual_dtype="bf16"``), the
local-at-sync copy (overlap: the local shard at the sync, then the correction) and the momentum
(nesterov), each kind one allocation (:func:`~flcomm.collectives.staging.arena`);
``offload="cpu"`` keeps these in host memory (page-locked on CUDA, exactly their bytes) and
streams them through the buckets (with overlapping fragments the apply step through a scratch of
its own: :mod:`flcomm.federated.exchange`). docs/memory.md has the measurements.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from flcomm.federated.elastic import snapshot
from flcomm.federated.exchange import ExchangeResult
from flcomm.federated.exposure import ExposedTime, cuda_event
from flcomm.federated.nonfinite import non_finite_error, or_flags, own_flags, read_refusal
from flcomm.federated.shards import nonfinite

if TYPE_CHECKING:
    from flcomm.comm.base import Transport
    from flcomm.comm.engine import Job, ProgressEngine
    from flcomm.federated.exchange import DeltaExchange
    from flcomm.federated.shards import AveragedTensor
    from flcomm.federated.topology import Topology

__all__ = ["AGREE_STAGE", "LATE_EXCHANGES", "Fragment", "Links", "memory_stats"]

AGREE_STAGE = "non-finite flags agreement over the group"  # the job's stage that talks over the group
LATE_EXCHANGES = 3  # overlap: this many exchanges in a row still running when due make FedAvg warn


@dataclass
class Links:
    """What a fragment's rounds run over, shared by the fragments of one FedAvg (which rebinds
    ``fed``, ``fed_ranks`` and ``engine`` after an elastic membership change, :meth:`bind`)."""

    topology: Topology
    device: torch.device
    group: Transport  # the federation group (the loop's)
    agree: Transport | None  # the job's refusal agreement (a private group transport); None: at the apply
    timeout: timedelta
    # the mesh's native transports now (private ones are made later), whose watchdog verdicts an apply reads
    natives: Callable[[], list[Transport]]
    exposure: ExposedTime
    fed: Transport | None = None  # the shard peers (None until a rejoining group is admitted)
    fed_ranks: list[int] | None = None
    engine: ProgressEngine | None = None
    rank: int = 0
    fed_index: int = field(init=False, default=0)  # this rank's index among fed_ranks
    fed_rank_index: Tensor | None = field(init=False, default=None)  # fed_ranks on the device
    warned_late: bool = field(init=False, default=False)  # the late-exchange warning was given (once)

    def bind(self, fed: Transport | None, fed_ranks: list[int], engine: ProgressEngine) -> None:
        self.fed, self.fed_ranks, self.engine = fed, fed_ranks, engine
        self.fed_index = fed_ranks.index(self.rank)
        self.fed_rank_index = torch.tensor(fed_ranks, dtype=torch.long, device=self.device)

    def on_lane(self, name: str, fn: Callable[[Transport], Any], buckets: int) -> Any:
        """``fn(fed transport)`` as a job of the exchange's engine lane, waited: another fragment's
        exchange may be in flight on the shard peers' transport, and two threads issuing there would
        interleave differently on different ranks."""
        assert self.engine is not None
        fed = self.fed
        return self.engine.submit(lambda job: fn(fed), name).wait(self.timeout * (2 * buckets + 4))


class Fragment:
    """The averaged tensors ``slots`` (:class:`~flcomm.federated.shards.AveragedTensor`, at
    ``indices`` among FedAvg's) that sync when FedAvg's schedule starts fragment ``index``;
    ``local_at_sync``: their copies as of the sync (overlap; then the correction the apply adds),
    else None; ``local_at_sync_span``: those as one view, when on the device and end to end
    (staging.span)."""

    def __init__(self, index: int, indices: list[int], slots: list[AveragedTensor],
                 local_at_sync: list[Tensor] | None, links: Links, *,
                 name_index: bool, local_at_sync_span: Tensor | None, on_measured: Callable[[Job], None],
                 settle: Callable[[Fragment, Job, int], ExchangeResult] | None = None) -> None:
        self.index, self.indices, self.slots = index, indices, slots
        self.local_at_sync = local_at_sync
        self.links = links
        # NOTE: empty shards (FSDP uneven sharding) are left out of the exchange; the shard peers hold
        # the same shard coordinates, so they leave out the same ones
        self.xindices = [i for i, s in zip(indices, slots) if s.local.numel() > 0]
        self.xslots = [s for s in slots if s.local.numel() > 0]
        self.local_at_sync_span, self._name_index = local_at_sync_span, name_index
        self.on_measured, self.settle = on_measured, settle
        self.exchange: DeltaExchange | None = None
        self.flags = torch.zeros(0, dtype=torch.int32, device=links.device)
        # the world's bad ranks and an overflow bit, OR-ed over the federation group
        self.world_flags = torch.zeros(links.topology.world_size + 1, dtype=torch.int32, device=links.device)
        self.job: Job | None = None
        self.apply_at = self.sync_step = 0
        self.restore: Callable[[], None] | None = None  # elastic: puts back what the round mutates, as of its start
        self.applied = 0  # exchanges of this fragment applied in this process
        self.late = 0  # consecutive exchanges still running when they were due (overlap)
        # offload on CUDA: an event after the copies of the local shards into local_at_sync
        self.local_at_sync_ready: Any = None
        self.own_bad: Tensor | None = None  # this rank's non-finite flag at the sync (kept for an elastic redo)
        # the timed mode (flcomm.federated.pacing): the group's (tokens, steps) in this round, set
        # before submit; then the fed dim's, on the device (2 x F), once its job all-reduced them
        self.counts: tuple[int, int] | None = None
        self.tallies: Tensor | None = None
        self.round = 0  # the timed mode's sync event of the exchange in flight (or last applied)

    @property
    def name(self) -> str:
        """``step N`` of the sync, and the fragment when there are several."""
        return f"step {self.sync_step}" + (f" (fragment {self.index})" if self._name_index else "")

    def bind(self, exchange: DeltaExchange | None) -> None:
        """A new exchange (over the links' current shard peers); the flags keep this rank's own."""
        self.exchange = exchange
        links = self.links
        self.flags = own_flags(len(links.fed_ranks), links.fed_index, self.own_bad, links.device)

    def start(self, step: int, apply_at: int, offload_cuda: bool) -> None:
        """Step 1 on the caller's thread: the flags and (overlap) the copy of the local shards."""
        locals_ = [s.local for s in self.slots]
        self.flags.zero_()
        if self.local_at_sync is not None:
            for o, t in zip(self.local_at_sync, locals_):
                # NOTE: the local shard as of the sync, from which the job packs the delta;
                # offloaded on CUDA an asynchronous copy into page-locked memory, ordered on this
                # stream before the next step writes the shard and before the job reads the copy
                o.copy_(t, non_blocking=True)
            copying = offload_cuda and self.exchange is not None
            self.local_at_sync_ready = cuda_event(self.links.device) if copying else None
        if locals_:
            # NOTE: no device sync; the anchor is finite (a refused average is never applied), so
            # the delta is finite exactly when the local shard (or its local-at-sync copy, in one
            # pass) is
            bad = nonfinite(locals_, self.local_at_sync_span).to(torch.int32)
            self.flags[self.links.fed_index] = self.own_bad = bad
        self.sync_step, self.apply_at = step, apply_at

    def submit(self) -> None:
        """Steps 3-4 as one job of the progress engine (elastic: after a snapshot of what it mutates)."""
        if self.settle is not None:
            if self.local_at_sync_ready is not None:
                self.local_at_sync_ready.synchronize()  # NOTE: being written by asynchronous copies
            xlocals = [s.local for s in self.xslots]
            self.restore = snapshot(self.exchange.mutated(xlocals) if self.exchange is not None else [])
        self.job = self.make_job()

    def make_job(self) -> Job:
        """Queue the exchange (again, for an elastic redo) and return its job."""
        links = self.links
        xlocals = [s.local for s in self.xslots]
        assert links.engine is not None and links.fed is not None
        tallies = self.tallies = self._tallies()
        if links.engine.stream is not None:
            for t in [self.flags, self.world_flags, *xlocals, *([] if tallies is None else [tallies])]:
                t.record_stream(links.engine.stream)
        exchange, flags, transport, ready = self.exchange, self.flags, links.fed, self.local_at_sync_ready
        agree, wf, index, me = links.agree, self.world_flags, links.fed_rank_index, links.fed_index

        def run(job: Job) -> ExchangeResult:
            job.stage = "non-finite flags all-reduce"
            transport.all_reduce(flags, op="sum")
            weight = None
            if tallies is not None:
                job.stage = "tokens all-reduce"
                transport.all_reduce(tallies, op="sum")
                # NOTE: F t_g / sum(t), on the device: the average becomes the token-weighted mean
                weight = tallies[0, me].double() * tallies.shape[1] / tallies[0].sum()
            res = ExchangeResult()
            if exchange is not None:
                if ready is not None:  # NOTE: offloaded on CUDA: local_at_sync is written by asynchronous copies
                    job.stage = "copy of the local shards into local_at_sync"
                    ready.synchronize()
                # NOTE: all shard peers see the same flags: none applies a bucket; on
                # the device, so the job never waits on the host between its collectives
                res = exchange.run(job, xlocals, skip=flags.any(), weight=weight)
            if agree is not None:
                job.stage, job.stage_group = AGREE_STAGE, "group"
                or_flags(wf, index, flags, res, agree)
            return res

        return links.engine.submit(run, f"FedAvg exchange of {self.name}")

    def _tallies(self) -> Tensor | None:
        """The timed mode: this group's (tokens, steps) at its fed index of a 2 x F int64, which
        the job sums over the fed dim; None by steps."""
        if self.counts is None:
            return None
        links = self.links
        t = torch.zeros(2, len(links.fed_ranks), dtype=torch.int64, device=links.device)
        t[:, links.fed_index] = torch.tensor(self.counts, dtype=torch.int64)
        return t

    @torch.no_grad()
    def apply(self, on_time: bool) -> None:
        """Steps 4-5 (the outer update ran in the engine, bucket by bucket): wait, agree on a
        refusal over the federation group, add the overlap correction. ``on_time``: applied
        ``overlap_steps`` after its start (not early by ``FedAvg.finish``)."""
        links = self.links
        job, self.job = self.job, None
        assert job is not None
        # NOTE: not judged on a fragment's first exchange, which allocates its staging and plans,
        # and a single late one is jitter
        if on_time and self.local_at_sync is not None and self.applied:
            self.late = self.late + 1 if not job.is_completed() else 0
            if self.late == LATE_EXCHANGES and not links.warned_late:
                links.warned_late = True  # NOTE: once per FedAvg
                warnings.warn(f"FedAvg: the exchanges up to step {self.sync_step} were still running "
                              f"{self.apply_at - self.sync_step} step(s) after they started ({LATE_EXCHANGES} in a "
                              "row), so the loop waits for them; raise overlap_steps (<= sync_every), use fragments "
                              "or a faster codec", stacklevel=6)  # NOTE: the loop's line, past two no_grad wrappers
        window = links.exposure.begin()
        nb = self.exchange.bar.num_buckets if self.exchange is not None else 0
        if self.settle is None:
            # NOTE: stream-ordered, the job's host part ends at issue: the watchdog bounds the wire
            res: ExchangeResult = job.wait(None if links.fed.stream_ordered else links.timeout * (2 * nb + 3))
        else:
            res = self.settle(self, job, nb)
            self.restore = None
            if res.bad is not None and res.bad.is_cuda:
                res.bad.record_stream(torch.cuda.current_stream(res.bad.device))  # NOTE: made on the engine's stream
            or_flags(self.world_flags, links.fed_rank_index, self.flags, res, links.group)
        self.applied += 1
        wf = self.world_flags  # NOTE: on the device until this one host read (after the window)
        links.exposure.end(window)
        if read_refusal(wf, [links.fed, *links.natives()], f"FedAvg {self.name}"):
            if self.exchange is not None:
                self.exchange.sanitize()
            raise non_finite_error(wf, links.topology, links.fed_ranks, f"FedAvg sync of {self.name}")
        if self.local_at_sync is not None and self.exchange is not None:
            # NOTE: piece by piece along the buckets: no full-size copy of an offloaded correction
            self.exchange.add_correction([s.local for s in self.xslots])
        if on_time:
            self.on_measured(job)

    def memory_bytes(self) -> dict[str, int]:
        """Its exchange's bytes (:meth:`BucketedAllReduce.memory_bytes`) and its flags'."""
        mem = dict(self.exchange.memory_bytes()) if self.exchange is not None else {}
        mem["flags"] = _nbytes([self.flags, self.world_flags])
        return mem

    def state_dict(self) -> dict:
        """Its exchange's state (the error-feedback residuals); empty without one."""
        return self.exchange.state_dict() if self.exchange is not None else {}


def _nbytes(ts: list[Tensor] | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts or [])


def memory_stats(fragments: list[Fragment], kept: dict[str, list[Tensor] | None], slots: list[AveragedTensor],
                 offloaded: bool, device: torch.device | None) -> dict[str, int]:
    """Bytes a FedAvg holds, per buffer kind (``anchor``, ``own``: the local-at-sync copies,
    ``momentum``: ``kept``, the arenas; ``residual``, ``staging``: the exchange's device pool of
    bucket buffers, offload scratch (and apply scratch) and two-hop plans, ``flags``: the
    fragments'), their ``total``, ``offloaded`` (the part of the total in host memory with
    ``offload``), ``device`` (the rest: on the device), ``transient`` (the largest temporary an
    exchange adds on the device, :meth:`BucketedAllReduce.memory_bytes`) and ``shard_fp32``: the
    bytes of this rank's averaged tensors (``slots``) in fp32 (the unit of the memory targets). On
    CUDA also ``device_peak`` (torch's peak allocation). No fragments: not federated, nothing
    held."""
    out = {k: _nbytes(kept.get(k)) for k in ("anchor", "own", "momentum")}
    out.update(residual=0, staging=0, flags=0)
    transient, pooled = 0, False
    for fr in fragments:
        mem = fr.memory_bytes()
        out["flags"] += mem["flags"]
        out["residual"] += mem.get("residual", 0)
        if "staging" in mem and not pooled:  # NOTE: one shared pool
            out["staging"], pooled = mem["staging"], True
        transient = max(transient, mem.get("transient", 0))
    out = {k: out[k] for k in ("anchor", "own", "momentum", "residual", "staging", "flags")}
    out["total"] = sum(out.values())
    held = out["anchor"] + out["own"] + out["momentum"] + out["residual"]
    out["offloaded"] = held if offloaded and fragments else 0
    out["device"] = out["total"] - out["offloaded"]
    out["transient"] = transient
    out["shard_fp32"] = sum(s.local.numel() * 4 for s in slots)
    if fragments and device is not None and device.type == "cuda":
        out["device_peak"] = int(torch.cuda.max_memory_allocated(device))
    return out
