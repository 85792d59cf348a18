"""Compressed all-reduce in two hops, with optional error feedback.

Algorithm (``W`` ranks, a flat fp32 tensor of ``N`` elements padded to ``W * c``; chunk ``j`` is
owned by rank ``j``):

1. quantize: encode each chunk ``j`` of ``x (+ residual)`` into slot ``j`` of a send buffer;
2. all-to-all: rank ``j`` receives every rank's encoding of chunk ``j``;
3. reduce: decode-and-accumulate the ``W`` encodings into an fp32 chunk (divide by ``W`` for AVG);
4. quantize the reduced chunk once;
5. all-gather the encoded reduced chunks;
6. dequantize every chunk into the tensor (every rank, the owner included, decodes the same
   bytes, so all ranks end bit-identical).

NOTE: each value is quantized exactly twice whatever ``W`` is, so the error is bounded by
``sum_i err_i + err_reduced`` (int8: ``sum_i scale_i/2 + scale_reduced/2``) instead of growing with
the ``W - 1`` re-quantizations a ring reduce would do. On the wire each rank sends
``2 (W-1)/W * W * E(c)`` bytes where ``E(c)`` is the encoded size of one chunk: for int8 with block
256, 0.254x of an fp32 ring all-reduce.

Error feedback (``residual``, fp32, same shape as the tensor, kept by the caller across rounds):
hop 1 uses the fused ``y = x + residual; q = Q(y); residual = y - D(q)``; the owner of chunk ``j``
also adds the hop-2 error of chunk ``j`` (times ``W`` for AVG) to its residual. The residuals of
all ranks then hold everything a round dropped, so the sum of the results over ``K`` rounds
equals the exact sum up to one round's error (the residuals of the last round).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from flcomm.codecs import Codec, get_codec
from flcomm.comm.base import ReduceOp, Transport, Work, wire_bytes
from flcomm.kernels import check_fp32

__all__ = ["CompressedWork", "TwoHopPlan", "chunk_numel", "compressed_all_reduce", "compressed_wire_bytes",
           "lossless_all_reduce", "parse_sum_avg"]


def chunk_numel(numel: int, world: int, codec: Codec) -> int:
    """Per-rank chunk: ceil(numel / world) rounded up to the codec's alignment."""
    c = -(-numel // world)
    a = max(1, codec.align_numel)
    return -(-c // a) * a


def compressed_wire_bytes(numel: int, world: int, codec: str | Codec = "int8") -> int:
    """Bytes one rank sends in :func:`compressed_all_reduce` (all-to-all plus all-gather), in the
    transports' convention (``(W-1)/W`` of the buffer for each)."""
    codec = get_codec(codec)
    if codec.lossless:
        return wire_bytes("all_reduce", 4 * numel, world)
    # NOTE: hop 1 all-to-all and hop 2 all-gather, each of `world` encoded chunks
    e = world * codec.encoded_nbytes(chunk_numel(numel, world, codec))
    return wire_bytes("all_to_all", e, world) + wire_bytes("all_gather", e, world)


def parse_sum_avg(op: Any) -> ReduceOp:
    """The ReduceOp of ``op``; ValueError unless it is sum or avg."""
    rop = ReduceOp.parse(op)
    if rop not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"compressed all-reduce supports only sum and avg, got {rop.value}")
    return rop


class TwoHopPlan:
    """The buffers and stages of one two-hop all-reduce of ``numel`` fp32 elements.

    A plan is reusable (buckets keep one each, so their buffers persist) but runs one exchange
    at a time, in three stages: :meth:`encode_scatter` (steps 1-2 of the module docstring),
    :meth:`reduce_gather` (steps 3-5), :meth:`decode_result` (step 6).
    """

    def __init__(self, transport: Transport, numel: int, codec: Codec, op: ReduceOp,
                 device: torch.device) -> None:
        self.transport, self.codec, self.op = transport, codec, op
        self.world, self.rank = transport.size, transport.rank
        self.numel = numel
        self.chunk = chunk_numel(numel, self.world, codec)
        self.padded_numel = self.chunk * self.world
        self.enc = codec.encoded_nbytes(self.chunk)
        W, E = self.world, self.enc
        self.send = torch.empty(W * E, dtype=torch.uint8, device=device)
        self.recv = torch.empty(W * E, dtype=torch.uint8, device=device)
        # NOTE: the all-gather lands in the receive buffer: its contents are consumed (reduced
        # into ``acc``) before the all-gather is issued
        self.gathered = self.recv
        self.acc = torch.empty(self.chunk, dtype=torch.float32, device=device)
        self._pad_x: Tensor | None = None
        self._pad_r: Tensor | None = None
        self._state = "idle"

    def nbytes(self) -> int:
        """Bytes of the plan's own buffers."""
        bufs = [self.send, self.recv, self.acc, self._pad_x, self._pad_r]
        return sum(b.numel() * b.element_size() for b in bufs if b is not None)

    @property
    def stage(self) -> str:
        """``"idle"``, ``"all_to_all"`` (hop 1 in flight) or ``"all_gather"`` (hop 2 in flight)."""
        return self._state

    def finish(self, timeout: timedelta | float | None = None) -> None:
        """Run the stages still to run (:meth:`reduce_gather` if needed, then :meth:`decode_result`)."""
        if self._state == "all_to_all":
            self.reduce_gather(timeout)
        if self._state == "all_gather":
            self.decode_result(timeout)

    def _padded(self, attr: str, src: Tensor) -> Tensor:
        buf = getattr(self, attr)
        if buf is None:
            buf = torch.zeros(self.padded_numel, dtype=torch.float32, device=src.device)
            setattr(self, attr, buf)
        buf[: self.numel].copy_(src)
        buf[self.numel:].zero_()
        return buf

    def _slot(self, buf: Tensor, j: int) -> Tensor:
        return buf[j * self.enc: (j + 1) * self.enc]

    def _chunk(self, flat: Tensor, j: int) -> Tensor:
        return flat[j * self.chunk: (j + 1) * self.chunk]

    def encode_scatter(self, flat: Tensor, residual: Tensor | None) -> None:
        """Quantize every chunk (with error feedback when ``residual`` is given) and issue the
        all-to-all asynchronously."""
        if self._state != "idle":
            raise RuntimeError(f"a two-hop exchange is already in flight on this plan ({self._state})")
        self.flat, self.residual = flat, residual
        # NOTE: tensors whose size is not a multiple of W*c go through a zero-padded copy (zeros
        # encode exactly, so the padding adds no error); buckets are laid out padded to avoid it.
        self.work_x = flat if self.padded_numel == self.numel else self._padded("_pad_x", flat)
        self.work_r = None
        if residual is not None:
            self.work_r = residual if self.padded_numel == self.numel else self._padded("_pad_r", residual)
        for j in range(self.world):
            xj, out = self._chunk(self.work_x, j), self._slot(self.send, j)
            if self.work_r is None:
                self.codec.encode(xj, out)
            else:
                self.codec.encode_error_feedback(xj, self._chunk(self.work_r, j), out)
        self.a2a = self.transport.all_to_all(self.recv, self.send, async_op=True)
        self._state = "all_to_all"

    def reduce_gather(self, timeout: timedelta | float | None = None) -> None:
        """Wait for the all-to-all, reduce the own chunk in fp32, re-quantize it and issue the
        all-gather asynchronously."""
        if self._state != "all_to_all":
            raise RuntimeError(f"reduce_gather() needs encode_scatter() to have run, state is {self._state}")
        self.a2a.wait(timeout)
        acc, c = self.acc, self.chunk
        acc.zero_()
        for i in range(self.world):
            self.codec.decode_accumulate(self._slot(self.recv, i), c, acc)
        if self.op is ReduceOp.AVG:
            acc.div_(self.world)
        mine = self._slot(self.send, self.rank)  # NOTE: send slot is free once the a2a completed
        if self.work_r is None:
            self.codec.encode(acc, mine)
        else:
            err = torch.zeros_like(acc)
            self.codec.encode_error_feedback(acc, err, mine)
            # NOTE: an AVG result is sum/W, so an error e in it is W*e in the sum that the
            # residuals (added to the inputs) must carry.
            if self.op is ReduceOp.AVG:
                err.mul_(self.world)
            self._chunk(self.work_r, self.rank).add_(err)
        self.ag = self.transport.all_gather(self.gathered, mine, async_op=True)
        self._state = "all_gather"

    def decode_result(self, timeout: timedelta | float | None = None) -> None:
        """Wait for the all-gather and decode every chunk into the tensor."""
        if self._state != "all_gather":
            raise RuntimeError(f"decode_result() needs reduce_gather() to have run, state is {self._state}")
        self.ag.wait(timeout)
        for j in range(self.world):
            self.codec.decode(self._slot(self.gathered, j), self.chunk, self._chunk(self.work_x, j))
        if self.work_x is not self.flat:
            self.flat.copy_(self.work_x[: self.numel])
        if self.residual is not None and self.work_r is not self.residual:
            self.residual.copy_(self.work_r[: self.numel])
        self.flat = self.residual = self.work_x = self.work_r = None  # type: ignore[assignment]
        self._state = "idle"

    def decode(self, encoded: Tensor, out: Tensor) -> None:
        """Decode a result as hop 2's all-gather leaves it (``world`` encoded chunks, e.g. another
        replica's :attr:`gathered`) into ``out`` (``numel`` elements): bit for bit what that
        plan's :meth:`decode_result` wrote."""
        if self._state != "idle":
            raise RuntimeError(f"decode() needs an idle plan, state is {self._state}")
        if encoded.numel() != self.world * self.enc:
            raise ValueError(f"encoded must hold {self.world} chunks of {self.enc} bytes, got {encoded.numel()} bytes")
        work = out
        if self.padded_numel != self.numel:
            if self._pad_x is None:
                self._pad_x = torch.zeros(self.padded_numel, dtype=torch.float32, device=out.device)
            work = self._pad_x
        for j in range(self.world):
            self.codec.decode(self._slot(encoded, j), self.chunk, self._chunk(work, j))
        if work is not out:
            out.copy_(work[: self.numel])

    def abort(self) -> None:
        self._state = "idle"


class CompressedWork:
    """Handle of an asynchronous :func:`compressed_all_reduce`: ``wait(timeout)`` finishes the
    remaining stages and returns the tensor."""

    def __init__(self, plan: TwoHopPlan | None, result: Tensor, inner: Work | None = None) -> None:
        self._plan, self._inner, self.result = plan, inner, result
        self._done = plan is None and inner is None

    def is_completed(self) -> bool:
        if self._done:
            return True
        if self._inner is not None:
            return self._inner.is_completed()
        return False

    def wait(self, timeout: timedelta | float | None = None) -> Tensor:
        if self._done:
            return self.result
        try:
            if self._inner is not None:
                self._inner.wait(timeout)
            else:
                assert self._plan is not None
                self._plan.finish(timeout)
        except BaseException:
            if self._plan is not None:
                self._plan.abort()
            raise
        self._done = True
        return self.result


def lossless_all_reduce(transport: Transport, tensor: Tensor, residual: Tensor | None,
                        op: ReduceOp) -> Work | None:
    """The lossless path: fold the residual (if any) into ``tensor`` and zero it, then issue the
    transport's own all-reduce asynchronously (None when the group has one rank)."""
    # NOTE: nothing is lost, so the residual (if any) is folded in and becomes zero.
    if residual is not None:
        tensor.add_(residual)
        residual.zero_()
    if transport.size == 1:
        return None
    w = transport.all_reduce(tensor, op, async_op=True)
    assert isinstance(w, Work)
    return w


def _check_inputs(transport: Transport, tensor: Tensor, residual: Tensor | None) -> None:
    if not isinstance(transport, Transport):
        raise TypeError(f"transport must be a flcomm Transport, got {type(transport).__name__}")
    check_fp32("compressed_all_reduce: tensor", tensor)
    if tensor.device.type != transport.device.type:
        raise ValueError(f"tensor must be on the transport's device type ({transport.device.type}), "
                         f"got {tensor.device}")
    if residual is not None:
        if not isinstance(residual, Tensor) or residual.dtype != torch.float32:
            raise TypeError("residual must be a float32 tensor, got "
                            f"{getattr(residual, 'dtype', type(residual).__name__)}")
        if residual.shape != tensor.shape or residual.device != tensor.device:
            raise ValueError(f"residual must match the tensor's shape {tuple(tensor.shape)} and device "
                             f"{tensor.device}, got {tuple(residual.shape)} on {residual.device}")
        if not residual.is_contiguous():
            raise ValueError("residual must be contiguous")


def compressed_all_reduce(transport: Transport, tensor: Tensor, codec: str | Codec = "int8",
                          op: Any = "avg", residual: Tensor | None = None,
                          async_op: bool = False) -> Tensor | CompressedWork:
    """All-reduce contiguous fp32 ``tensor`` in place through ``codec`` in two hops (see the
    module docstring). ``residual`` (fp32, same shape) is the error-feedback state, updated in
    place. With ``async_op`` returns a :class:`CompressedWork`: on CPU the quantization and the
    all-to-all are issued now and the rest runs in ``wait()``; on CUDA every stage is enqueued
    now on the current stream.

    Codec ``none`` is the transport's own fp32 all-reduce (nothing to quantize).
    """
    codec = get_codec(codec)
    rop = parse_sum_avg(op)
    _check_inputs(transport, tensor, residual)
    if codec.lossless or transport.size == 1:
        w = lossless_all_reduce(transport, tensor, residual, rop)
        if w is None:
            return CompressedWork(None, tensor) if async_op else tensor
        return CompressedWork(None, tensor, inner=w) if async_op else w.wait()
    plan = TwoHopPlan(transport, tensor.numel(), codec, rop, tensor.device)
    plan.encode_scatter(tensor.view(-1), None if residual is None else residual.view(-1))
    work = CompressedWork(plan, tensor)
    if tensor.is_cuda:
        plan.reduce_gather()
    return work if async_op else work.wait()
