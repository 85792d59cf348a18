"""Bucketed all-reduce: many tensors reduced bucket by bucket through a codec, asynchronously, in
the progress engine (:mod:`flcomm.comm.engine`).

Layout: the tensors are concatenated (in order) into one virtual flat space that is cut into
buckets of ``bucket_mb`` MB; a tensor may span buckets, so one huge flat shard still pipelines.
A bucket holds one dtype (fp32, or fp64 for fp64 tensors, or with ``keep_dtype`` each tensor's
own dtype), so a change of dtype starts a new bucket. Each bucket is padded to a multiple of
``world * align`` so the two-hop exchange needs no copy.

Memory: buckets share ``slots`` (2) staging buffers (and two-hop plans) of a :class:`StagingPool`
(:mod:`flcomm.collectives.staging`); only the error-feedback residuals (one per bucket, views of
one allocation: :func:`~flcomm.collectives.staging.arena`) persist at full size.

Offload (``offload=True``: the residuals, and the caller's full-size state, live in host memory):
the device holds at most two buckets (``2 * bucket_mb``) of exchange buffers, all counted by
:meth:`BucketedAllReduce.memory_bytes`:

1. the pipeline runs single-buffered (issue, middle and finish of bucket k before bucket k+1), so
   one slot is used;
2. that slot's staging buffer, plus one scratch buffer of the same size (:meth:`~BucketedAllReduce.scratch`)
   through which ``pack`` / ``unpack`` stage their host pieces and the exchange its residual (one
   bucket's pack, residual and unpack never overlap in time);
3. the codec's plan (in two hops also hop 2's error, a temporary, with error feedback);
4. buckets are cut to the largest size for which 2 + 3 fit in ``2 * bucket_mb``: codec none keeps
   about ``bucket_mb`` (less the padding), int8 + EF 72% of it on 2 ranks, about 2/3 on more. The
   wire then carries smaller messages, one at a time: ``bench/memory.py`` reports what that costs.

A subclass may stage through buffers of a bucket's slot (:meth:`BucketedAllReduce.slot_buffer`);
:meth:`~BucketedAllReduce.memory_bytes` counts them, and the pool's named buffers, all.

Pipeline of one exchange (one engine job; ``start()`` returns its :class:`~flcomm.comm.engine.Job`)::

    for k in 0 .. B-1:
        finish bucket k-2    (wait its all-gather, decode, unpack: frees its slot)
        issue bucket k       (pack, quantize, all-to-all; codec none: all-reduce)
        middle of bucket k-1 (wait its all-to-all, reduce, re-quantize, all-gather)
    then the last middle and finishes.

Bucket k is on the wire while bucket k+1 is packed and compressed and bucket k-1 is reduced.

Sharded across replicas (``replicate``, R ranks holding the same tensors, FL+HSDP): each bucket is
padded to R equal slices (each a multiple of ``world * align``); replica r packs and reduces only
slice r over ``transport`` (its error-feedback residual is the slice's), and the finish step
all-gathers the R reduced slices over ``replicate`` before the unpack sees the whole bucket
(:meth:`~BucketedAllReduce.gather_slices`, in the bucket's dtype; a subclass may gather another
encoding). The reducing transport then carries 1/R of the bytes; the all-gather adds (R-1)/R of
the bucket.
``pack(segments, flat)`` / ``unpack(segments, flat)`` may replace the default copies (FedAvg
computes its deltas and applies its outer update there, bucket by bucket).

NOTE: every collective of an exchange is issued by the engine, in the same order on every rank;
nothing else may issue on the transport while an exchange is in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from flcomm.codecs import Codec, get_codec
from flcomm.collectives.compressed import (
    GatherPlan,
    TwoHopPlan,
    gathers,
    lossless_all_reduce,
    make_plan,
    parse_sum_avg,
    wire_numel,
)
from flcomm.collectives.staging import StagingPool, _grow, arena, bucket_dtype
from flcomm.comm.base import ReduceOp, Transport
from flcomm.comm.engine import Job, ProgressEngine, get_engine

if TYPE_CHECKING:
    from flcomm.collectives.staging import _StageBuffers

__all__ = ["BucketedAllReduce", "Segment"]

PackFn = Callable[[list["Segment"], Tensor], None]


@dataclass(frozen=True)
class Segment:
    """Elements ``[tensor_offset, tensor_offset + length)`` of tensor ``index`` live at
    ``[bucket_offset, bucket_offset + length)`` of their bucket."""

    index: int
    tensor_offset: int
    bucket_offset: int
    length: int


@dataclass
class _Bucket:
    numel: int
    padded: int
    dtype: torch.dtype
    segments: list[Segment]
    residual: Tensor | None = None
    wire: int = 0  # elements this rank reduces: the bucket, or its replica's slice
    mine: list[Segment] | None = None  # sharded: the segments of that slice (slice offsets)


def _clip(segs: list[Segment], lo: int, n: int) -> list[Segment]:
    """The parts of ``segs`` inside bucket elements ``[lo, lo + n)``, with offsets from ``lo``."""
    out = []
    for s in segs:
        a, b = max(s.bucket_offset, lo), min(s.bucket_offset + s.length, lo + n)
        if a < b:
            out.append(Segment(s.index, s.tensor_offset + a - s.bucket_offset, a - lo, b - a))
    return out


class BucketedAllReduce:
    """All-reduce of a fixed list of tensors, bucket by bucket, in the progress engine.

    Args:
        transport: the group to reduce over.
        tensors: the tensors whose shapes, dtypes and order define the layout (floating,
            contiguous, one device); also the default target of :meth:`start`.
        codec: name or :class:`~flcomm.codecs.Codec` (``none``, ``bf16``, ``fp16``, ``int8``,
            ``fp8``); an object is used as given (block size included).
        bucket_mb: bucket size in MB (2**20 bytes) of fp32.
        error_feedback: keep a per-bucket fp32 residual of what compression dropped and add it to
            the next round's input (see :mod:`flcomm.collectives.compressed`).
        op: ``"avg"`` or ``"sum"``.
        keep_dtype: buckets in each tensor's own dtype (codec ``none`` only): a bf16 model puts
            bf16 on the wire. Otherwise fp32 (fp64 tensors: fp64, codec ``none`` only).
        engine: the progress engine (default: the process's ``"exchange"`` lane of the device).
        offload: keep the residuals in host memory (pinned on CUDA) and stage each bucket's
            through the device while it is exchanged; the device holds at most two buckets of
            exchange buffers (module docstring), ``pack`` / ``unpack`` stage their host pieces
            through :meth:`scratch`.
        residual_dtype: dtype the residuals are kept in (fp32, or bf16 to halve them; staged in
            fp32 while a bucket is exchanged).
        staging: a :class:`StagingPool` to share with other all-reduces whose exchanges never
            overlap (the same engine lane runs them one after another).
        replicate: ranks holding identical tensors (HSDP or DDP replicas): each reduces one slice
            of every bucket and the slices are all-gathered over it (module docstring). It must be
            a group no one else issues on while an exchange is in flight.
    """

    def __init__(self, transport: Transport, tensors: list[Tensor], codec: str | Codec = "none",
                 bucket_mb: float = 25.0, error_feedback: bool = False, op: Any = "avg",
                 keep_dtype: bool = False, engine: ProgressEngine | None = None,
                 offload: bool = False, residual_dtype: torch.dtype = torch.float32,
                 staging: StagingPool | None = None, replicate: Transport | None = None) -> None:
        if not isinstance(transport, Transport):
            raise TypeError(f"transport must be a flcomm Transport, got {type(transport).__name__}")
        if replicate is not None and not isinstance(replicate, Transport):
            raise TypeError(f"replicate must be a flcomm Transport or None, got {type(replicate).__name__}")
        self.transport = transport
        self.replicate = replicate if replicate is not None and replicate.size > 1 else None
        self.replicas = self.replicate.size if self.replicate is not None else 1
        self.codec = get_codec(codec)
        self.op: ReduceOp = parse_sum_avg(op)
        if not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be a positive number, got {bucket_mb!r}")
        self.bucket_mb = float(bucket_mb)
        self.error_feedback = bool(error_feedback)
        self.keep_dtype = bool(keep_dtype)
        self.offload = bool(offload)
        if residual_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"residual_dtype must be torch.float32 or torch.bfloat16, got {residual_dtype}")
        self.residual_dtype = residual_dtype
        tensors = list(tensors)
        if not tensors:
            raise ValueError("BucketedAllReduce needs at least one tensor")
        self._check(tensors, "tensors")
        self.device = tensors[0].device
        if self.device.type != transport.device.type:
            raise ValueError(f"tensors must be on the transport's device type ({transport.device.type}), "
                             f"got {self.device}")
        if self.replicate is not None and self.replicate.device.type != transport.device.type:
            raise ValueError(f"replicate must be on the transport's device type ({transport.device.type}), "
                             f"got {self.replicate.device.type}")
        self.shapes = [tuple(t.shape) for t in tensors]
        self.dtypes = [t.dtype for t in tensors]
        self._check_precision()
        self._tensors = tensors
        self._buckets = self._layout([t.numel() for t in tensors])
        self.staging = staging if staging is not None else StagingPool()
        self._slots = self.staging.slots
        self._inflight: Job | None = None
        self.engine = engine if engine is not None else get_engine(self.device, "exchange")

    def _check_precision(self) -> None:
        wire = {bucket_dtype(d, self.keep_dtype) for d in self.dtypes}
        if self.codec.lossless and self.codec.name == "none":
            return
        if self.keep_dtype:
            raise ValueError(f"keep_dtype needs codec 'none' (codec {self.codec.name!r} encodes fp32)")
        if torch.float64 in wire:
            raise ValueError(f"codec {self.codec.name!r} encodes fp32 and would cut the precision of the "
                             f"fp64 tensors (at {[i for i, d in enumerate(self.dtypes) if d == torch.float64]}): "
                             "use codec 'none' for fp64, or cast the model")

    # ---- layout ----
    def _layout(self, numels: list[int]) -> list[_Bucket]:
        world = self.transport.size
        buckets: list[_Bucket] = []
        segs: list[Segment] = []
        fill, cur = 0, None

        R = self.replicas

        def close() -> None:
            nonlocal segs, fill
            if fill:
                # NOTE: R slices, each a multiple of world * align (a sparse codec's: of align):
                # the plan needs no padded copy, and the R slices are equal for the all-gather
                wire = wire_numel(-(-fill // R), world, self.codec)
                b = _Bucket(fill, wire * R, cur, segs, wire=wire)
                if R > 1:
                    b.mine = _clip(segs, self.replicate.rank * wire, wire)
                buckets.append(b)
            segs, fill = [], 0

        for i, n in enumerate(numels):
            dt = bucket_dtype(self.dtypes[i], self.keep_dtype)
            if dt != cur:
                close()
                cur = dt
            cap = self._cap(dt)
            off = 0
            while off < n:
                take = min(n - off, cap - fill)
                segs.append(Segment(i, off, fill, take))
                off += take
                fill += take
                if fill == cap:
                    close()
        close()
        if self.error_feedback:
            home = torch.device("cpu") if self.offload else self.device
            pin = self.offload and self.device.type == "cuda"
            res = arena([((b.wire,), self.residual_dtype) for b in buckets], home, pin)
            for b, r in zip(buckets, res):
                b.residual = r
        return buckets

    def _cap(self, dtype: torch.dtype) -> int:
        """Elements per bucket: ``bucket_mb`` of fp32; with offload the largest bucket whose
        device buffers fit in two buckets (module docstring, step 4)."""
        cap = max(1, int(self.bucket_mb * 2**20) // 4)
        budget = 2 * int(self.bucket_mb * 2**20)
        if not self.offload or self._device_bytes(cap, dtype) <= budget:
            return cap
        if self._device_bytes(1, dtype) > budget:
            return cap  # NOTE: a tiny bucket is all padding (the codec's alignment): none fits
        lo, hi = 1, cap  # NOTE: the bytes grow with the size: the largest that fits, by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._device_bytes(mid, dtype) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _device_bytes(self, fill: int, dtype: torch.dtype) -> int:
        """Device bytes an offloaded exchange of one bucket of ``fill`` elements needs: staging
        buffer, scratch and the plan (two hops: send, receive, accumulator, hop 2's error; one:
        send, gathered), as :meth:`_slot_flat`, :meth:`scratch` and the plans size them."""
        world, R = self.transport.size, self.replicas
        wire = wire_numel(-(-fill // R), world, self.codec)
        nbytes = 2 * wire * R * torch.empty((), dtype=dtype).element_size()
        if gathers(self.codec, world, R):
            # NOTE: GatherPlan: one encoding sent, world gathered, the result decoded in place
            return nbytes + (world + 1) * self.codec.encoded_nbytes(wire)
        if not self.codec.lossless and world > 1:
            c = wire // world
            nbytes += 2 * world * self.codec.encoded_nbytes(c) + 4 * c
            if self.error_feedback:
                nbytes += 4 * c
        return nbytes

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def bucket_numels(self) -> list[int]:
        """Elements of each bucket (without padding)."""
        return [b.numel for b in self._buckets]

    def layout(self) -> list[list[Segment]]:
        """The segments of each bucket."""
        return [list(b.segments) for b in self._buckets]

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held: ``staging`` (on the device: the slots' buffers, the offload scratch, staged
        residuals and two-hop plans, and the pool's named buffers; the staging pool's, shared
        with the all-reduces that share it), ``residual`` (the error-feedback residuals, in host
        memory with offload), and ``transient``: the largest temporary an exchange allocates on
        the device besides those (hop 2's error with error feedback, where the codec reduces in
        two hops: one chunk of fp32; a gathering plan, ``compressed.gathers``, has no hop 2)."""
        staging = self.staging.nbytes()
        res = sum(b.residual.numel() * b.residual.element_size() for b in self._buckets if b.residual is not None)
        W = self.transport.size
        hop2 = W > 1 and not self.codec.lossless and not gathers(self.codec, W, self.replicas)
        transient = max((4 * b.wire // W for b in self._buckets), default=0)
        return {"staging": staging, "residual": res,
                "transient": transient if hop2 and self.error_feedback else 0}

    def _check(self, tensors: list[Tensor], what: str) -> None:
        dev = None
        for i, t in enumerate(tensors):
            if not isinstance(t, Tensor):
                raise TypeError(f"{what}[{i}] must be a torch.Tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise TypeError(f"{what}[{i}] must have a floating dtype, got {t.dtype}")
            if not t.is_contiguous():
                raise ValueError(f"{what}[{i}] must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")
            if dev is None:
                dev = t.device
            elif t.device != dev:
                raise ValueError(f"{what} must all be on one device, got {dev} and {t.device} (at {i})")

    # ---- exchange ----
    def start(self, tensors: list[Tensor] | None = None, *, pack: PackFn | None = None,
              unpack: PackFn | None = None, name: str = "bucketed all-reduce") -> Job:
        """Start reducing ``tensors`` (default: the constructor's; same shapes and order) in the
        engine; returns the job, whose ``wait()`` returns the tensors holding the results. The
        tensors must not be touched before that. ``pack`` / ``unpack`` replace the default
        copies between the tensors and a bucket's flat buffer."""
        if self._inflight is not None and not self._inflight.waited:
            raise RuntimeError("a previous start() is still in flight: wait() on its job first")
        if tensors is None:
            tensors = self._tensors
        else:
            tensors = list(tensors)
            self._check(tensors, "tensors")
            shapes = [tuple(t.shape) for t in tensors]
            if shapes != self.shapes:
                raise ValueError(f"tensors must have the layout's shapes {self.shapes}, got {shapes}")
            if tensors[0].device != self.device:
                raise ValueError(f"tensors must be on {self.device}, got {tensors[0].device}")
        if self.engine.stream is not None:
            for t in tensors:
                t.record_stream(self.engine.stream)  # NOTE: used on the comm stream: keep alive
        pk = pack or (lambda segs, flat: self._copy(tensors, segs, flat, into_bucket=True))
        up = unpack or (lambda segs, flat: self._copy(tensors, segs, flat, into_bucket=False))

        def run(job: Job) -> list[Tensor]:
            self.run_pipeline(job, pk, up)
            return tensors

        self._inflight = self.engine.submit(run, name)
        return self._inflight

    @staticmethod
    def _copy(tensors: list[Tensor], segs: list[Segment], flat: Tensor, into_bucket: bool) -> None:
        for s in segs:
            t = tensors[s.index].view(-1)[s.tensor_offset: s.tensor_offset + s.length]
            b = flat[s.bucket_offset: s.bucket_offset + s.length]
            if into_bucket:
                b.copy_(t)
            else:
                t.copy_(b)

    def run_pipeline(self, job: Job, pack: PackFn, unpack: PackFn) -> None:
        """The pipeline of the module docstring, on the calling thread (the engine's);
        single-buffered with offload."""
        nb = len(self._buckets)
        if self.offload:
            # NOTE: one bucket at a time: its pack, residual and unpack share the one scratch
            for k in range(nb):
                self._issue(job, k, pack)
                self._middle(job, k)
                self._finish(job, k, unpack)
            return
        for k in range(nb):
            if k >= 2:
                self._finish(job, k - 2, unpack)
            self._issue(job, k, pack)
            if k >= 1:
                self._middle(job, k - 1)
        if nb:
            self._middle(job, nb - 1)
        for k in range(max(0, nb - 2), nb):
            self._finish(job, k, unpack)

    def _slot(self, k: int) -> _StageBuffers:
        return self._slots[0 if self.offload else k % 2]

    def scratch(self, numel: int, dtype: torch.dtype) -> Tensor:
        """Offload: a device buffer of ``numel`` elements of ``dtype`` (at most a bucket's), for
        staging host pieces at their segments' offsets. It is free outside a bucket's pack and
        unpack (the pipeline is single-buffered and the bucket's residual is back home by then)
        and once the exchange's job was waited, unless another exchange of the staging pool is
        in flight."""
        if not self.offload:
            raise RuntimeError("scratch() is for offloaded exchanges (offload=True)")
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self._grow(self._slots[0], "scratch", nbytes)[:nbytes].view(dtype)

    def slot_buffer(self, k: int, name: str, nbytes: int) -> Tensor:
        """A byte buffer ``name`` of bucket ``k``'s staging slot, grown to at least ``nbytes``,
        for a subclass's :meth:`gather_slices`; the next bucket of that slot may reuse it."""
        return self._grow(self._slot(k), name, nbytes)

    def _grow(self, slot: _StageBuffers, name: str, nbytes: int) -> Tensor:
        return _grow(slot.bufs, name, nbytes, self.device)

    def _slot_flat(self, slot: _StageBuffers, b: _Bucket) -> Tensor:
        nbytes = b.padded * torch.empty((), dtype=b.dtype).element_size()
        flat = self._grow(slot, "flat", nbytes)[:nbytes].view(b.dtype)
        if b.padded > b.numel:
            flat[b.numel:].zero_()
        return flat

    def _mine(self, flat: Tensor, b: _Bucket) -> Tensor:
        """The part of the bucket's ``flat`` (padded) this rank reduces: all, or its slice."""
        if b.mine is None:
            return flat
        lo = self.replicate.rank * b.wire
        return flat[lo: lo + b.wire]

    def _issue(self, job: Job, k: int, pack: PackFn) -> None:
        b, slot = self._buckets[k], self._slot(k)
        job.stage = f"bucket {k}/{len(self._buckets)}: pack, encode, hop 1"
        flat = self._mine(self._slot_flat(slot, b), b)
        if b.mine is None:
            pack(b.segments, flat[: b.numel])
        else:
            pack(b.mine, flat[: sum(s.length for s in b.mine)])
        res = self._stage_residual(slot, b)
        if self.codec.lossless or self.transport.size == 1:
            slot.work = lossless_all_reduce(self.transport, flat, res, self.op)
            slot.plan = None
            self._unstage_residual(slot, b)
            return
        key = (b.wire, b.dtype)
        if key not in slot.plans:
            if self.offload:
                slot.plans.clear()  # NOTE: one plan on the device (the last bucket may be smaller)
            slot.plans[key] = make_plan(self.transport, b.wire, self.codec, self.op, self.device, self.replicas)
        slot.plan = slot.plans[key]
        slot.plan.encode_scatter(flat, res)

    def _stage_residual(self, slot: _StageBuffers, b: _Bucket) -> Tensor | None:
        """The bucket's fp32 residual on the device: itself, or staged (offload: in the scratch,
        free between the pack and the unpack; a bf16 residual: in the slot's fp32 buffer)."""
        slot.staged = None
        if b.residual is None or (not self.offload and b.residual.dtype == torch.float32):
            return b.residual
        if self.offload:
            buf = self._grow(slot, "scratch", 4 * b.wire)[: 4 * b.wire].view(torch.float32)
        else:
            buf = self._grow(slot, "residual", 4 * b.wire)[: 4 * b.wire].view(torch.float32)
        slot.staged = buf[: b.wire]
        slot.staged.copy_(b.residual, non_blocking=True)
        return slot.staged

    def _unstage_residual(self, slot: _StageBuffers, b: _Bucket) -> None:
        # NOTE: the residual is final once the reduced chunk was re-encoded (hop 2 issued);
        # a blocking copy to host memory, so the scratch is free for the unpack
        if slot.staged is not None:
            b.residual.copy_(slot.staged)
            slot.staged = None

    def _middle(self, job: Job, k: int) -> None:
        slot = self._slot(k)
        if slot.plan is not None:
            job.stage = f"bucket {k}/{len(self._buckets)}: {slot.plan.middle_stage}"
            slot.plan.reduce_gather()
            self._unstage_residual(slot, self._buckets[k])

    def _finish(self, job: Job, k: int, unpack: PackFn) -> None:
        b, slot = self._buckets[k], self._slot(k)
        job.stage = f"bucket {k}/{len(self._buckets)}: wait, decode, unpack"
        flat = slot.bufs["flat"][: b.padded * torch.empty((), dtype=b.dtype).element_size()].view(b.dtype)
        try:
            if slot.plan is not None:
                slot.plan.finish()
            elif slot.work is not None:
                slot.work.wait()
            if b.mine is not None:
                job.stage = f"bucket {k}/{len(self._buckets)}: all-gather of the {self.replicas} replicas' slices"
                self.gather_slices(k, flat, slot.plan)
        except BaseException:
            for s in self._slots:
                if s.plan is not None:
                    s.plan.abort()
                s.work = s.plan = None
            raise
        slot.work = None
        unpack(b.segments, flat[: b.numel])

    def gather_slices(self, k: int, flat: Tensor, plan: TwoHopPlan | GatherPlan | None) -> None:
        """Sharded: all-gather the replicas' reduced slices of bucket ``k`` over ``replicate``
        into ``flat`` (the padded bucket, R equal slices; this rank's holds its result), in the
        bucket's dtype. A subclass may gather another encoding; ``plan`` is the two-hop plan that
        reduced this rank's slice (its hop 2 gathered the codec's encoding), None when lossless."""
        # NOTE: in place (the input is this rank's slice of the output), as FSDP gathers
        self.replicate.all_gather(flat, self._mine(flat, self._buckets[k]))

    # ---- error-feedback state ----
    def residuals(self) -> list[Tensor | None]:
        """The error-feedback residual of each bucket (padded; the replica's slice when sharded;
        None without error feedback)."""
        return [b.residual for b in self._buckets]

    def state_dict(self) -> dict[str, Any]:
        """The error-feedback residuals (one fp32 tensor per bucket) and the layout they belong to."""
        return {
            "codec": self.codec.spec,
            "world": self.transport.size,
            "replicas": self.replicas,
            "bucket_numels": self.bucket_numels,
            "residuals": [None if b.residual is None else b.residual.clone() for b in self._buckets],
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore residuals saved by :meth:`state_dict` for the same layout and world."""
        for key in ("bucket_numels", "residuals", "world"):
            if key not in sd:
                raise KeyError(f"state dict lacks {key!r} (has {sorted(sd)})")
        saved = (list(sd["bucket_numels"]), sd["world"], sd.get("replicas", 1))
        if saved != (self.bucket_numels, self.transport.size, self.replicas):
            raise ValueError(f"state dict is for buckets {saved[0]} on {saved[1]} ranks x {saved[2]} replicas "
                             f"(sharded exchange when > 1), this layout has {self.bucket_numels} on "
                             f"{self.transport.size} ranks x {self.replicas} replicas")
        res = sd["residuals"]
        if len(res) != len(self._buckets):
            raise ValueError(f"state dict has {len(res)} residuals, expected {len(self._buckets)}")
        for i, (b, r) in enumerate(zip(self._buckets, res)):
            if r is None:
                if b.residual is not None:
                    b.residual.zero_()
                continue
            if b.residual is None:
                raise ValueError("state dict holds residuals but error_feedback is off")
            if r.shape != b.residual.shape or r.dtype != b.residual.dtype:
                raise ValueError(f"residual {i} is {tuple(r.shape)} {r.dtype}, expected "
                                 f"{tuple(b.residual.shape)} {b.residual.dtype}")
            b.residual.copy_(r)
