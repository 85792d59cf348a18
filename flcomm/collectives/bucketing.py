"""Bucketed all-reduce: many tensors packed into persistent flat fp32 buckets, reduced bucket by
bucket through a codec, asynchronously.

Layout: the tensors are concatenated (in order) into one virtual flat space that is cut into
buckets of ``bucket_mb`` MB; a tensor may span buckets, so one huge flat shard still pipelines.
Each bucket is padded to a multiple of ``world * align`` so the two-hop exchange needs no copy.

Pipeline of :meth:`BucketedAllReduce.start` / :meth:`BucketWork.wait`:

1. (start) for each bucket k: pack the tensors' slices into bucket k, quantize it and issue its
   all-to-all asynchronously, so bucket k is on the wire while bucket k+1 is packed and
   compressed (codec ``none``: issue its fp32 all-reduce);
2. (wait) for each bucket k: wait its all-to-all, reduce and re-quantize, issue its all-gather
   (bucket k's reduce overlaps bucket k+1's all-to-all);
3. (wait) for each bucket k: wait its all-gather, dequantize, and write the slices back into the
   tensors.

On CUDA every stage is enqueued in ``start`` on a side stream that first waits for the caller's
stream; ``wait`` makes the caller's stream wait on an event and writes back on it (the inputs are
``record_stream``-ed on the side stream). On CPU the first hop runs under the caller's compute
(gloo works asynchronously) and the rest in ``wait``.

NOTE: every collective is issued from the caller's thread, in the same order on every rank, so
interleaving with the caller's other collectives cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from flcomm.codecs import Codec, get_codec
from flcomm.collectives.compressed import TwoHopPlan, _chunk_numel, _parse_op
from flcomm.comm.base import ReduceOp, Transport, Work

__all__ = ["BucketWork", "BucketedAllReduce", "Segment"]


@dataclass(frozen=True)
class Segment:
    """Elements ``[tensor_offset, tensor_offset + length)`` of tensor ``index`` live at
    ``[bucket_offset, bucket_offset + length)`` of their bucket."""

    index: int
    tensor_offset: int
    bucket_offset: int
    length: int


class _Bucket:
    def __init__(self, numel: int, padded: int, segments: list[Segment], device: torch.device) -> None:
        self.numel, self.padded, self.segments = numel, padded, segments
        self.flat = torch.zeros(padded, dtype=torch.float32, device=device)
        self.residual: Tensor | None = None
        self.plan: TwoHopPlan | None = None
        self.work: Work | None = None


class BucketWork:
    """Handle of one :meth:`BucketedAllReduce.start`. ``wait(timeout)`` completes the exchange
    and writes the reduced values back into the tensors; ``is_completed()`` polls."""

    def __init__(self, owner: "BucketedAllReduce", tensors: list[Tensor], event: Any = None) -> None:
        self._owner, self._tensors, self._event = owner, tensors, event
        self._done = False

    def is_completed(self) -> bool:
        if self._done:
            return True
        if self._event is not None:
            return bool(self._event.query())
        b = self._owner._buckets
        if self._owner.codec.lossless:
            return all(x.work is None or x.work.is_completed() for x in b)
        return False  # NOTE: on CPU the second hop only runs inside wait()

    def wait(self, timeout: timedelta | float | None = None) -> list[Tensor]:
        """Finish the exchange; returns the tensors (now holding the reduced values)."""
        if self._done:
            return self._tensors
        try:
            self._owner._finish(self, timeout)
        finally:
            self._owner._inflight = None
        self._done = True
        return self._tensors


class BucketedAllReduce:
    """All-reduce of a fixed list of tensors through persistent flat buckets.

    Args:
        transport: the group to reduce over.
        tensors: the tensors whose shapes and order define the layout (floating dtypes,
            contiguous, one device); they are also the default target of :meth:`start`.
        codec: name or :class:`~flcomm.codecs.Codec` (``none``, ``bf16``, ``fp16``, ``int8``,
            ``fp8``).
        bucket_mb: bucket size in MB (2**20 bytes) of fp32.
        error_feedback: keep a per-bucket residual of what compression dropped and add it to
            the next round's input (see :mod:`flcomm.collectives.compressed`).
        op: ``"avg"`` or ``"sum"``.
    """

    def __init__(self, transport: Transport, tensors: list[Tensor], codec: str | Codec = "none",
                 bucket_mb: float = 25.0, error_feedback: bool = False, op: Any = "avg") -> None:
        if not isinstance(transport, Transport):
            raise TypeError(f"transport must be a flcomm Transport, got {type(transport).__name__}")
        self.transport = transport
        self.codec = get_codec(codec)
        self.op: ReduceOp = _parse_op(op)
        if not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be a positive number, got {bucket_mb!r}")
        self.bucket_mb = float(bucket_mb)
        self.error_feedback = bool(error_feedback)
        tensors = list(tensors)
        if not tensors:
            raise ValueError("BucketedAllReduce needs at least one tensor")
        self._check(tensors, "tensors")
        self.device = tensors[0].device
        if self.device.type != transport.device.type:
            raise ValueError(f"tensors must be on the transport's device type ({transport.device.type}), "
                             f"got {self.device}")
        self.shapes = [tuple(t.shape) for t in tensors]
        self.dtypes = [t.dtype for t in tensors]
        self._tensors = tensors
        self._buckets = self._layout([t.numel() for t in tensors])
        self._inflight: BucketWork | None = None
        self._stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None

    # ---- layout ----
    def _layout(self, numels: list[int]) -> list[_Bucket]:
        cap = max(1, int(self.bucket_mb * 2**20) // 4)
        world = self.transport.size
        buckets: list[_Bucket] = []
        segs: list[Segment] = []
        fill = 0

        def close() -> None:
            nonlocal segs, fill
            if fill:
                # NOTE: a multiple of world * align: the two-hop chunks need no padded copy
                padded = _chunk_numel(fill, world, self.codec) * world if world > 1 else fill
                buckets.append(_Bucket(fill, padded, segs, self.device))
            segs, fill = [], 0

        for i, n in enumerate(numels):
            off = 0
            while off < n:
                take = min(n - off, cap - fill)
                segs.append(Segment(i, off, fill, take))
                off += take
                fill += take
                if fill == cap:
                    close()
        close()
        for b in buckets:
            if self.error_feedback:
                b.residual = torch.zeros(b.padded, dtype=torch.float32, device=self.device)
            if not self.codec.lossless and world > 1:
                b.plan = TwoHopPlan(self.transport, b.padded, self.codec, self.op, self.device)
        return buckets

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
    def start(self, tensors: list[Tensor] | None = None) -> BucketWork:
        """Start reducing ``tensors`` (default: the constructor's; same shapes and order);
        returns a :class:`BucketWork` whose ``wait()`` writes the results back into them."""
        if self._inflight is not None:
            raise RuntimeError("a previous start() is still in flight: wait() on its BucketWork first")
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
        event = None
        if self._stream is not None:
            caller = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(caller)
            for t in tensors:
                t.record_stream(self._stream)  # NOTE: read on the side stream: keep them alive
            with torch.cuda.stream(self._stream):
                self._issue(tensors)
                self._hop2()
                for b in self._buckets:
                    self._hop3(b, None)
                event = torch.cuda.Event()
                event.record(self._stream)
        else:
            self._issue(tensors)
        work = BucketWork(self, tensors, event)
        self._inflight = work
        return work

    def _pack(self, b: _Bucket, tensors: list[Tensor]) -> None:
        for s in b.segments:
            src = tensors[s.index].view(-1)[s.tensor_offset: s.tensor_offset + s.length]
            b.flat[s.bucket_offset: s.bucket_offset + s.length].copy_(src)

    def _unpack(self, b: _Bucket, tensors: list[Tensor]) -> None:
        for s in b.segments:
            dst = tensors[s.index].view(-1)[s.tensor_offset: s.tensor_offset + s.length]
            dst.copy_(b.flat[s.bucket_offset: s.bucket_offset + s.length])

    def _issue(self, tensors: list[Tensor]) -> None:
        world = self.transport.size
        for b in self._buckets:
            self._pack(b, tensors)
            if world == 1:
                continue
            if b.plan is None:  # lossless: the transport's own fp32 all-reduce
                if b.residual is not None:
                    b.flat.add_(b.residual)
                    b.residual.zero_()
                w = self.transport.all_reduce(b.flat, self.op, async_op=True)
                assert isinstance(w, Work)
                b.work = w
            else:
                b.plan.first(b.flat, b.residual)

    def _hop2(self, timeout: timedelta | float | None = None) -> None:
        for b in self._buckets:
            if b.plan is not None and b.plan._state == "first":
                b.plan.second(timeout)

    def _hop3(self, b: _Bucket, timeout: timedelta | float | None) -> None:
        if b.plan is not None and b.plan._state == "second":
            b.plan.third(timeout)
        elif b.work is not None:
            b.work.wait(timeout)
            b.work = None

    def _finish(self, work: BucketWork, timeout: timedelta | float | None) -> None:
        try:
            if work._event is not None:
                caller = torch.cuda.current_stream(self.device)
                caller.wait_event(work._event)
            else:
                self._hop2(timeout)
                for b in self._buckets:
                    self._hop3(b, timeout)
            for b in self._buckets:
                self._unpack(b, work._tensors)
        except BaseException:
            for b in self._buckets:
                if b.plan is not None:
                    b.plan.abort()
                b.work = None
            raise

    # ---- error-feedback state ----
    def state_dict(self) -> dict[str, Any]:
        """The error-feedback residuals (one fp32 tensor per bucket) and the layout they belong to."""
        return {
            "codec": self.codec.name,
            "world": self.transport.size,
            "bucket_numels": self.bucket_numels,
            "residuals": [None if b.residual is None else b.residual.clone() for b in self._buckets],
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore residuals saved by :meth:`state_dict` for the same layout and world."""
        for key in ("bucket_numels", "residuals", "world"):
            if key not in sd:
                raise KeyError(f"state dict lacks {key!r} (has {sorted(sd)})")
        if list(sd["bucket_numels"]) != self.bucket_numels or sd["world"] != self.transport.size:
            raise ValueError(f"state dict is for buckets {sd['bucket_numels']} on {sd['world']} ranks, this "
                             f"layout has {self.bucket_numels} on {self.transport.size}")
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
            if r.shape != b.residual.shape:
                raise ValueError(f"residual {i} has shape {tuple(r.shape)}, expected {tuple(b.residual.shape)}")
            b.residual.copy_(r)
