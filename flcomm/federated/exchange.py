"""The inter-group exchange of the FedAvg synchronizer, bucket by bucket, in the progress engine.

The buffers a sync needs at full size are only those the algorithm keeps across steps (the
anchor, the outer momentum, the error-feedback residual, and under overlap the local shard's
copy as of the sync, ``local_at_sync``); the deltas are computed and the average applied per bucket, in the bucket's
staging buffer (:class:`~flcomm.collectives.bucketing.BucketedAllReduce`).

Modes (what a bucket's ``pack`` writes and its ``unpack`` does with the average):

* ``in_place`` (the paper's mode: codec none, plain average, no overlap, no error feedback):
  pack the local shard itself, in its own dtype; unpack writes the average back. No anchor.
* delta, no overlap: pack ``local - anchor``; unpack ``disp = outer(mean)``, ``anchor += disp``,
  ``local = anchor``.
* delta, overlap: ``local_at_sync`` holds the local shard as of the sync (copied when the sync
  starts: the local shard keeps training meanwhile); pack ``local_at_sync - anchor``, the delta;
  unpack ``anchor += disp`` and, in the same buffer, ``correction = anchor - local_at_sync``, the
  new anchor less the local shard as of the sync: what the apply step adds to the local shard
  (:meth:`DeltaExchange.add_correction`), which keeps the local updates made while the exchange
  ran.

A piece's unpack is one fused kernel (:func:`flcomm.ops.apply.apply_average`) where nothing is
offloaded, the anchor moves by the step itself (avg; nesterov under overlap, whose step is
scaled first) and the target (``local_at_sync``, or the local shard) has the anchor's dtype.

A bucket whose average is not finite is not applied; :attr:`ExchangeResult.bad` marks it. Nothing
is read on the host during an exchange: each bucket's finite flag stays on the device and
selects, on the device, whether its unpack changes anything (a bucket not applied leaves the
local shard, anchor, momentum and local-at-sync copy as they were); the caller reads the flags once.

Sharded across replicas (FL+HSDP, R > 1 replicas of each shard inside a group): replica r
exchanges only slice r (1/R) of every bucket over the shard peers, with the codec and the error
feedback of that slice, and the averaged slices are all-gathered over a private replicate group
(:meth:`FedMesh.exchange_replicate_transport`) before the unpack; every replica then applies the same whole
bucket. Inter-group bytes per rank drop by R; the all-gather adds (R-1)/R of the bucket inside
the group, in the codec's encoding when the reduction was lossy (:class:`SlicedAllReduce`: the
replicas gather what hop 2 gathered and decode it themselves, bit for bit what its owner
decoded), in the bucket's dtype otherwise.

Offload: the anchors, local-at-sync copies, momentum and residuals may live in host memory (pinned on
CUDA); each bucket's pieces are then staged, one at a time, through the one device scratch
bucket of the offloaded pipeline (:meth:`BucketedAllReduce.scratch`, at the segment's offset;
also on CPU, where host and device are one memory, so the same path runs in the tests). With
the bucket's staging buffer and the codec's plan the device holds at most two buckets beyond
the model (:mod:`flcomm.collectives.bucketing`). The apply step (:meth:`DeltaExchange.add_correction`)
stages through that scratch too, or, with ``apply_scratch`` (an apply while another exchange of
the staging pool may be in flight, whose job writes the pool's scratch: FedAvg's overlapping
fragments), through a scratch bucket of its own in the pool (up to one more bucket).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from flcomm.collectives.bucketing import BucketedAllReduce, Segment
from flcomm.collectives.staging import StagingPool, bucket_dtype
from flcomm.federated.shards import nonfinite
from flcomm.ops.apply import apply_function

if TYPE_CHECKING:
    from flcomm.collectives.compressed import GatherPlan, TwoHopPlan
    from flcomm.comm.base import Transport
    from flcomm.comm.engine import Job
    from flcomm.federated.config import FedAvgConfig
    from flcomm.federated.outer import OuterOptimizer

__all__ = ["DeltaExchange", "ExchangeBuffers", "ExchangeResult", "SlicedAllReduce"]


@dataclass
class ExchangeResult:
    """What one exchange did: ``bad`` (on the device, a bool per bucket) marks the buckets whose
    average was not finite and was not applied; None when nothing was exchanged."""

    bad: Tensor | None = None

    @property
    def bad_buckets(self) -> list[int]:
        """The indices of the buckets marked in ``bad`` (read on the host: a device sync)."""
        return [] if self.bad is None else self.bad.nonzero().flatten().tolist()


class SlicedAllReduce(BucketedAllReduce):
    """The exchange's bucketed all-reduce. Sharded with a lossy codec, the replicas all-gather
    their slices' averages in the codec's encoding (what hop 2 gathered, a quarter of fp32 with
    int8; a sparse codec's F gathered encodings) and decode the others' (the plan's ``decode``:
    bit for bit what their owners decoded)."""

    def gather_slices(self, k: int, flat: Tensor, plan: TwoHopPlan | GatherPlan | None) -> None:
        if plan is None:
            super().gather_slices(k, flat, plan)
            return
        assert self.replicate is not None
        R, n = self.replicas, plan.world * plan.enc
        buf = self.slot_buffer(k, "gather", R * n)[: R * n]
        self.replicate.all_gather(buf, plan.gathered[:n])
        for q, out in enumerate(flat.view(R, -1)):
            if q != self.replicate.rank:
                plan.decode(buf[q * n: (q + 1) * n], out)


@dataclass
class ExchangeBuffers:
    """What an exchange updates beside the local shards, per tensor: ``anchors`` (None: the
    paper's in-place mode, no anchor), ``local_at_sync`` (overlap: the local shard as of the sync
    when an exchange starts, which the exchange turns into the pending correction; else None), the
    ``outer`` optimizer and ``momentum_index[i]``, tensor i's momentum buffer (None: buffers and
    non-parameters take the plain average)."""

    anchors: list[Tensor] | None = None
    local_at_sync: list[Tensor] | None = None
    outer: OuterOptimizer | None = None
    momentum_index: list[int | None] | None = None


class DeltaExchange:
    """Averages a rank's shards over ``transport`` (module docstring).

    Args:
        transport: the shard peers (the fed dim's group).
        tensors: the local shards (their shapes and dtypes define the layout).
        config: the settings (:class:`~flcomm.federated.config.FedAvgConfig`): its codec,
            ``bucket_cap_mb``, ``error_feedback``, ``offload`` (the anchors, local-at-sync copies,
            momentum and residuals live in host memory and are staged through the device, module docstring;
            nothing to offload in place) and ``residual_dtype``.
        buffers: the :class:`ExchangeBuffers`; no anchors is the paper's mode (buckets in the
            tensors' own dtypes).
        staging: of the :class:`BucketedAllReduce`.
        replicate: the replicas' private group (:meth:`FedMesh.exchange_replicate_transport`):
            exchange one slice per replica and all-gather (module docstring); None exchanges
            everything.
        apply_scratch: offload: :meth:`add_correction` stages through a scratch bucket of its own in the
            staging pool (module docstring), not through the exchange's scratch.
    """

    def __init__(self, transport: Transport, tensors: list[Tensor], config: FedAvgConfig,
                 buffers: ExchangeBuffers | None = None, *, staging: StagingPool | None = None,
                 replicate: Transport | None = None, apply_scratch: bool = False) -> None:
        buffers = buffers or ExchangeBuffers()
        in_place = buffers.anchors is None
        # NOTE: the in-place mode keeps nothing at full size: nothing to offload, so it keeps
        # the double-buffered pipeline
        self.codec, self.in_place = config.codec_obj, in_place
        self.offload = config.offload is not None and not in_place
        self.anchors, self.local_at_sync, self.outer = buffers.anchors, buffers.local_at_sync, buffers.outer
        self.momentum_index = buffers.momentum_index or [None] * len(tensors)
        self.apply_scratch = apply_scratch
        self.bar = SlicedAllReduce(transport, tensors, codec=self.codec, bucket_mb=config.bucket_cap_mb,
                                   error_feedback=config.error_feedback, op="avg", keep_dtype=in_place,
                                   offload=self.offload, residual_dtype=config.residual_torch_dtype, staging=staging,
                                   replicate=replicate)
        self._apply = apply_function(self.bar.device)  # NOTE: decided once, not per piece

    @property
    def work_dtypes(self) -> list[torch.dtype]:
        return [bucket_dtype(d, self.in_place) for d in self.bar.dtypes]

    def run(self, job: Job, locals_: list[Tensor], skip: Tensor | None = None,
            weight: Tensor | None = None) -> ExchangeResult:
        """One exchange on the engine's thread (``job`` names the stages); ``locals_`` are the
        local shards as of the sync (read unless overlapping, written unless overlapping).
        ``skip``: a 0-dim bool on the device, the same on every rank of the group; when True no
        bucket is applied (the collectives still run, so nothing is read on the host).
        ``weight``: a 0-dim float64 on the device that multiplies what is packed, before the codec
        (the timed mode's ``F t_g / sum(t)``, :mod:`flcomm.federated.pacing`); None: 1."""
        bad = torch.zeros(self.bar.num_buckets, dtype=torch.bool, device=self.bar.device)
        bucket = [0]

        def unpack(segs: list[Segment], flat: Tensor) -> None:
            k = bucket[0]
            bucket[0] += 1
            # NOTE: no bucket-sized temporary, so an offloaded exchange stays within its two
            # buckets on the device
            nf = nonfinite([flat])
            bad[k] = nf
            ok = ~nf if skip is None else ~(nf | skip)
            self._unpack(segs, flat, locals_, ok)

        def pack(segs: list[Segment], flat: Tensor) -> None:
            self._pack(segs, flat, locals_)
            if weight is not None:
                for s in segs:
                    flat[s.bucket_offset: s.bucket_offset + s.length].mul_(weight)

        self.bar.run_pipeline(job, pack, unpack)
        return ExchangeResult(bad)

    @staticmethod
    def _piece(t: Tensor, s: Segment) -> Tensor:
        return t.view(-1)[s.tensor_offset: s.tensor_offset + s.length]

    def _stage(self, home: Tensor, s: Segment, flat: Tensor) -> Tensor:
        """Segment ``s``'s piece of ``home`` on the device: the piece itself, or with offload a
        copy in the scratch bucket (free again once :meth:`_back` returned)."""
        piece = self._piece(home, s)
        if not self.offload:
            return piece
        dev = self.bar.scratch(flat.numel(), flat.dtype)[s.bucket_offset: s.bucket_offset + s.length]
        # NOTE: non-blocking from pinned memory: the host writes this piece only by _back's
        # blocking copy, which the stream orders after this one
        dev.copy_(piece, non_blocking=True)
        return dev

    @staticmethod
    def _back(home: Tensor, staged: Tensor) -> None:
        if staged is not home:
            home.copy_(staged)  # NOTE: blocking: the scratch is reused by the next piece

    def _pack(self, segs: list[Segment], flat: Tensor, locals_: list[Tensor]) -> None:
        """The bucket's pieces of what is averaged: the shards themselves (in place), else the
        delta from the anchor of ``local_at_sync`` (overlap: the local shard as of the sync) or of
        the local shard, in one pass unless offloaded (the anchor staged through the scratch)."""
        src = self.local_at_sync if self.local_at_sync is not None else locals_
        for s in segs:
            out = flat[s.bucket_offset: s.bucket_offset + s.length]
            piece = self._piece(src[s.index], s)
            if self.in_place:
                out.copy_(piece)
            elif self.offload:
                # NOTE: non-blocking from pinned memory: the host writes local_at_sync only by _back's
                # blocking copy, or by the sync's copies, which the job waited for
                out.copy_(piece, non_blocking=True)
                out.sub_(self._stage(self.anchors[s.index], s, flat))
            else:
                torch.sub(piece, self._piece(self.anchors[s.index], s), out=out)

    def _unpack(self, segs: list[Segment], flat: Tensor, locals_: list[Tensor], ok: Tensor) -> None:
        """Apply the bucket's average (``flat``) where the 0-dim device bool ``ok`` holds, on the
        device, without reading ``ok`` on the host. Where the module docstring says, the
        anchor's step and the target's update are one fused kernel, which writes nothing where
        ``ok`` does not hold. Else the step is zeroed there first, and every update below leaves
        its target as it was in value (``anchor + 0``, which turns a -0.0 into +0.0; the locals
        and local_at_sync selected); the momentum stays as it was as well (``buf * 1 + -0``: the mean is
        zeroed before the outer step)."""
        for s in segs:
            mean = flat[s.bucket_offset: s.bucket_offset + s.length]
            local = self._piece(locals_[s.index], s)
            if self.in_place:
                torch.where(ok, mean, local, out=local)
                continue
            m = self.momentum_index[s.index]
            step, alpha = mean, 1.0  # NOTE: the outer update works in place in the bucket
            if m is not None:
                mean.masked_fill_(~ok, 0.0)
                buf = self._stage(self.outer.buffers[m], s, flat)
                step, alpha = self.outer.piece_(mean, buf, ok), self.outer.scale
                self._back(self._piece(self.outer.buffers[m], s), buf)
                if self.local_at_sync is not None:
                    step.mul_(alpha)  # NOTE: the displacement, which the fused apply takes
                    alpha = 1.0
            anchor_home = self.anchors[s.index]
            at_sync = self.local_at_sync
            target = self._piece(at_sync[s.index], s) if at_sync is not None else local
            if alpha == 1.0 and not self.offload and target.dtype == anchor_home.dtype == step.dtype:
                self._apply(step, self._piece(anchor_home, s), target, ok, at_sync is not None)
                continue
            step.masked_fill_(~ok, 0.0)  # NOTE: not applied: no displacement
            anchor = self._stage(anchor_home, s, flat)
            anchor.add_(step, alpha=alpha)  # NOTE: SGD's p.add_(d_p, alpha=-lr): the same rounding
            if at_sync is None:
                # NOTE: local = anchor where ok, selected in the bucket (its step is used up):
                # no temporary, and local's rounding is copy_'s
                torch.where(ok, anchor, local, out=step)
                local.copy_(step)
            else:
                step.copy_(anchor)  # NOTE: the new anchor, kept in the bucket: the copy's staging reuses the scratch
            self._back(self._piece(anchor_home, s), anchor)
            if at_sync is not None:
                staged = self._stage(at_sync[s.index], s, flat)
                torch.sub(step, staged, out=step)  # NOTE: the correction, new anchor - local_at_sync
                torch.where(ok, step, staged, out=staged)
                self._back(self._piece(at_sync[s.index], s), staged)

    @torch.no_grad()
    def add_correction(self, locals_: list[Tensor]) -> None:
        """The apply step of overlap, ``local += correction`` (the correction the unpack left in
        ``local_at_sync``'s buffer, rounded to the local's dtype first), piece by piece along the
        buckets, so no full-size copy reaches the device; with offload each piece passes through
        the scratch (converted on the host). Call on the training loop's stream once the
        exchange's job was waited (that stream is then ordered after the job). With
        ``apply_scratch`` the pieces pass through a scratch of their own in the staging pool:
        needed when another exchange of the pool may be in flight, whose job writes the pool's
        scratch."""
        if self.local_at_sync is None:
            raise RuntimeError("add_correction() needs the local-at-sync copies (overlap)")
        for segs in self.bar.layout():
            for s in segs:
                local, correction = self._piece(locals_[s.index], s), self._piece(self.local_at_sync[s.index], s)
                if self.offload:
                    buf = self._apply_scratch(s.bucket_offset + s.length, local.dtype)
                    if buf.is_cuda:
                        buf.record_stream(torch.cuda.current_stream(buf.device))  # NOTE: used off the engine's stream
                    dev = buf[s.bucket_offset:]
                    dev.copy_(correction, non_blocking=True)  # NOTE: rewritten only after a sync of this stream
                    local.add_(dev)
                else:
                    local.add_(correction if correction.dtype == local.dtype else correction.to(local.dtype))

    def add_own(self, locals_: list[Tensor]) -> None:
        """Deprecated (for one release): :meth:`add_correction`."""
        warnings.warn("DeltaExchange.add_own() is deprecated: use add_correction()", DeprecationWarning, stacklevel=2)
        self.add_correction(locals_)

    def _apply_scratch(self, numel: int, dtype: torch.dtype) -> Tensor:
        """Offload: the device buffer :meth:`add_correction` stages through (module docstring)."""
        if not self.apply_scratch:
            return self.bar.scratch(numel, dtype)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self.bar.staging.buffer("apply scratch", nbytes, self.bar.device)[:nbytes].view(dtype)

    def mutated(self, locals_: list[Tensor]) -> list[Tensor]:
        """What :meth:`run` with ``locals_`` writes: the local shards
        (unless overlapping), anchors, local-at-sync copies, outer momentum and residuals."""
        ts = list(locals_) if self.local_at_sync is None else []
        ts += [*(self.anchors or []), *(self.local_at_sync or [])]
        ts += [self.outer.buffers[m] for m in self.momentum_index if m is not None]
        return ts + [r for r in self.bar.residuals() if r is not None]

    # ---- state ----
    def state_dict(self) -> dict:
        return self.bar.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.bar.load_state_dict(sd)

    def memory_bytes(self) -> dict[str, int]:
        return self.bar.memory_bytes()

    @torch.no_grad()
    def sanitize(self) -> bool:
        """Zero the non-finite entries of the error-feedback residuals (after a refused round,
        whose NaN/Inf they would otherwise carry into every later round); True if any."""
        found = False
        for r in self.bar.residuals():
            if r is not None and not bool(torch.isfinite(r).all()):
                r.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
                found = True
        return found
