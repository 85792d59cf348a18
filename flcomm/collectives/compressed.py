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

A sparse codec (``Codec.sparse``: top-k) is not reduced in two hops, since a sum of sparse
encodings is not sparse: :class:`GatherPlan` encodes the whole tensor once, all-gathers the W
encodings, and every rank decodes and adds them in rank order (divided by W for AVG), so every
rank ends bit-identical; its error feedback is the one encoding's. On the wire each rank sends
``(W-1)/W * W * E(n)``: with top-k at 2% and 2 bits on 4 ranks, 0.024x of an fp32 ring all-reduce.

On two ranks a dense codec takes that path too (:func:`gathers`): one all-gather sends the same
bytes as the two hops (``E(n)`` per rank either way, to the 16-byte rounding of the scales), in
one collective instead of two, and each value is quantized once instead of twice; the reduce,
the re-encode and hop 2's error go away (about a quarter of the exchange's host work on two CPU
ranks: bench/results/). Where the replicas of a sharded exchange gather the result
(``replicas`` > 1), two hops stay: hop 2's one encoding of the slice is half of the two
encodings.

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
from flcomm.ops.quant import check_fp32

__all__ = ["CompressedWork", "GatherPlan", "TwoHopPlan", "chunk_numel", "compressed_all_reduce",
           "compressed_wire_bytes", "gathers", "lossless_all_reduce", "make_plan", "parse_sum_avg", "wire_numel"]


def chunk_numel(numel: int, world: int, codec: Codec) -> int:
    """Per-rank chunk: ceil(numel / world) rounded up to the codec's alignment."""
    c = -(-numel // world)
    a = max(1, codec.align_numel)
    return -(-c // a) * a


def wire_numel(numel: int, world: int, codec: Codec) -> int:
    """Elements a plan of ``numel`` elements over ``world`` ranks encodes: ``world`` chunks
    (:func:`chunk_numel`) in two hops, whole blocks for a sparse codec, ``numel`` on one rank."""
    if world == 1:
        return numel
    if codec.sparse:
        a = max(1, codec.align_numel)
        return -(-numel // a) * a
    return chunk_numel(numel, world, codec) * world


def gathers(codec: Codec, world: int, replicas: int = 1) -> bool:
    """Whether a lossy all-reduce through ``codec`` on ``world`` ranks all-gathers the encodings
    (:class:`GatherPlan`) instead of reducing them in two hops (:class:`TwoHopPlan`): a sparse
    codec always, a dense one on two ranks unless ``replicas`` > 1 gather its result (module
    docstring). False for a lossless codec or one rank (no plan)."""
    if codec.lossless or world < 2:
        return False
    return codec.sparse or (world == 2 and replicas == 1)


def compressed_wire_bytes(numel: int, world: int, codec: str | Codec = "int8") -> int:
    """Bytes one rank sends in :func:`compressed_all_reduce` (all-to-all plus all-gather), in the
    transports' convention (``(W-1)/W`` of the buffer for each)."""
    codec = get_codec(codec)
    if codec.lossless:
        return wire_bytes("all_reduce", 4 * numel, world)
    if gathers(codec, world):
        return wire_bytes("all_gather", world * codec.encoded_nbytes(wire_numel(numel, world, codec)), world)
    # NOTE: hop 1 all-to-all and hop 2 all-gather, each of `world` encoded chunks
    e = world * codec.encoded_nbytes(chunk_numel(numel, world, codec))
    return wire_bytes("all_to_all", e, world) + wire_bytes("all_gather", e, world)


def parse_sum_avg(op: Any) -> ReduceOp:
    """The ReduceOp of ``op``; ValueError unless it is sum or avg."""
    rop = ReduceOp.parse(op)
    if rop not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"compressed all-reduce supports only sum and avg, got {rop.value}")
    return rop


class _Plan:
    """What the plans of a lossy all-reduce share: the state of the exchange in flight, the
    zero-padded copies of a tensor whose size is not the plan's, and their bytes."""

    _pad_x: Tensor | None = None
    _pad_r: Tensor | None = None
    _state = "idle"
    _issues_gather = "reduce_gather"  # NOTE: the stage that issues the last hop's all-gather
    padded_numel: int
    numel: int

    def __init__(self, transport: Transport, numel: int, codec: Codec, op: ReduceOp) -> None:
        self.transport, self.codec, self.op = transport, codec, op
        self.world, self.rank = transport.size, transport.rank
        self.numel = numel

    def _buffers(self) -> list[Tensor | None]:
        return [self._pad_x, self._pad_r]

    def nbytes(self) -> int:
        """Bytes of the plan's own buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers() if b is not None)

    @property
    def stage(self) -> str:
        """``"idle"``, ``"all_to_all"`` (hop 1 in flight) or ``"all_gather"`` (the last hop in flight)."""
        return self._state

    def _padded(self, attr: str, src: Tensor) -> Tensor:
        buf = getattr(self, attr)
        if buf is None:
            buf = torch.zeros(self.padded_numel, dtype=torch.float32, device=src.device)
            setattr(self, attr, buf)
        buf[: self.numel].copy_(src)
        buf[self.numel:].zero_()
        return buf

    def abort(self) -> None:
        self._state = "idle"

    def _begin(self, flat: Tensor, residual: Tensor | None) -> None:
        """Take the tensor and residual of a new exchange (``work_x``, ``work_r``: themselves, or
        zero-padded copies when their size is not the plan's)."""
        if self._state != "idle":
            raise RuntimeError(f"an exchange is already in flight on this plan ({self._state})")
        self.flat, self.residual = flat, residual
        # NOTE: zeros encode exactly, so the padding adds no error; buckets are laid out padded
        # to avoid the copy
        self.work_x = flat if self.padded_numel == self.numel else self._padded("_pad_x", flat)
        self.work_r = None
        if residual is not None:
            self.work_r = residual if self.padded_numel == self.numel else self._padded("_pad_r", residual)

    def finish(self, timeout: timedelta | float | None = None) -> None:
        """Run the stages still to run (:meth:`reduce_gather` if needed, then :meth:`decode_result`)."""
        if self._state == "all_to_all":
            self.reduce_gather(timeout)
        if self._state == "all_gather":
            self.decode_result(timeout)

    def _decode_gathered(self, encoded: Tensor, work: Tensor) -> None:
        """The result, from the ``world`` encodings the last hop gathered, into ``work``
        (``padded_numel`` elements)."""
        raise NotImplementedError

    def decode_result(self, timeout: timedelta | float | None = None) -> None:
        """Wait for the last hop's all-gather and decode the result into the tensor."""
        if self._state != "all_gather":
            raise RuntimeError(f"decode_result() needs {self._issues_gather}() to have run, state is {self._state}")
        self.ag.wait(timeout)
        self._decode_gathered(self.gathered, self.work_x)
        if self.work_x is not self.flat:
            self.flat.copy_(self.work_x[: self.numel])
        if self.residual is not None and self.work_r is not self.residual:
            self.residual.copy_(self.work_r[: self.numel])
        self.flat = self.residual = self.work_x = self.work_r = None  # type: ignore[assignment]
        self._state = "idle"

    def decode(self, encoded: Tensor, out: Tensor) -> None:
        """Decode a result as the last hop's all-gather leaves it (``world`` encodings, e.g.
        another replica's :attr:`gathered`) into ``out`` (``numel`` elements): bit for bit what
        that plan's :meth:`decode_result` wrote."""
        if self._state != "idle":
            raise RuntimeError(f"decode() needs an idle plan, state is {self._state}")
        if encoded.numel() != self.world * self.enc:
            raise ValueError(f"encoded must hold {self.world} encodings of {self.enc} bytes, "
                             f"got {encoded.numel()} bytes")
        work = out
        if self.padded_numel != self.numel:
            if self._pad_x is None:
                self._pad_x = torch.zeros(self.padded_numel, dtype=torch.float32, device=out.device)
            work = self._pad_x
        self._decode_gathered(encoded, work)
        if work is not out:
            out.copy_(work[: self.numel])


class TwoHopPlan(_Plan):
    """The buffers and stages of one two-hop all-reduce of ``numel`` fp32 elements.

    A plan is reusable (buckets keep one each, so their buffers persist) but runs one exchange
    at a time, in three stages: :meth:`encode_scatter` (steps 1-2 of the module docstring),
    :meth:`reduce_gather` (steps 3-5), :meth:`decode_result` (step 6).
    """

    middle_stage = "reduce, re-encode, hop 2"

    def __init__(self, transport: Transport, numel: int, codec: Codec, op: ReduceOp,
                 device: torch.device) -> None:
        super().__init__(transport, numel, codec, op)
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

    def _buffers(self) -> list[Tensor | None]:
        return [self.send, self.recv, self.acc, *super()._buffers()]

    def _slot(self, buf: Tensor, j: int) -> Tensor:
        return buf[j * self.enc: (j + 1) * self.enc]

    def _chunk(self, flat: Tensor, j: int) -> Tensor:
        return flat[j * self.chunk: (j + 1) * self.chunk]

    def encode_scatter(self, flat: Tensor, residual: Tensor | None) -> None:
        """Quantize every chunk (with error feedback when ``residual`` is given) and issue the
        all-to-all asynchronously."""
        self._begin(flat, residual)
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

    def _decode_gathered(self, encoded: Tensor, work: Tensor) -> None:
        for j in range(self.world):
            self.codec.decode(self._slot(encoded, j), self.chunk, self._chunk(work, j))


class GatherPlan(_Plan):
    """The buffers and stages of one all-gather all-reduce of ``numel`` fp32 elements through a
    sparse codec, or a dense one on two ranks (module docstring), with the stages of :class:`TwoHopPlan`:
    :meth:`encode_scatter` encodes and issues the all-gather, :meth:`reduce_gather` has nothing
    left to do (the one hop is in flight), :meth:`decode_result` decodes the ``world``
    encodings into the tensor. Reusable, one exchange at a time."""

    _issues_gather = "encode_scatter"
    middle_stage = "all-gather in flight"  # NOTE: the bucketed pipeline's name of its middle stage

    def __init__(self, transport: Transport, numel: int, codec: Codec, op: ReduceOp,
                 device: torch.device) -> None:
        super().__init__(transport, numel, codec, op)
        self.padded_numel = wire_numel(numel, self.world, codec)
        self.enc = codec.encoded_nbytes(self.padded_numel)
        self.send = torch.empty(self.enc, dtype=torch.uint8, device=device)
        #: every rank's encoding, in rank order (what :meth:`decode` takes)
        self.gathered = torch.empty(self.world * self.enc, dtype=torch.uint8, device=device)

    def _buffers(self) -> list[Tensor | None]:
        # NOTE: no accumulator: the encodings are decoded and added into the tensor itself
        return [self.send, self.gathered, *super()._buffers()]

    def encode_scatter(self, flat: Tensor, residual: Tensor | None) -> None:
        """Encode the tensor (with error feedback when ``residual`` is given) and issue the
        all-gather asynchronously."""
        self._begin(flat, residual)
        if self.work_r is None:
            self.codec.encode(self.work_x, self.send)
        else:
            self.codec.encode_error_feedback(self.work_x, self.work_r, self.send)
        self.ag = self.transport.all_gather(self.gathered, self.send, async_op=True)
        self._state = "all_gather"

    def reduce_gather(self, timeout: timedelta | float | None = None) -> None:
        """Nothing: the one hop was issued by :meth:`encode_scatter` (the residual is final)."""
        if self._state != "all_gather":
            raise RuntimeError(f"reduce_gather() needs encode_scatter() to have run, state is {self._state}")

    def _decode_gathered(self, encoded: Tensor, work: Tensor) -> None:
        # NOTE: the first encoding decoded into the tensor, the others added in rank order: the
        # sum's bits of accumulating into zeros (but a -0.0 the first one decodes stays -0.0)
        for i in range(self.world):
            enc = encoded[i * self.enc: (i + 1) * self.enc]
            if i == 0:
                self.codec.decode(enc, self.padded_numel, work)
            else:
                self.codec.decode_accumulate(enc, self.padded_numel, work)
        if self.op is ReduceOp.AVG:
            work.div_(self.world)


def make_plan(transport: Transport, numel: int, codec: Codec, op: ReduceOp,
              device: torch.device, replicas: int = 1) -> TwoHopPlan | GatherPlan:
    """The plan of a lossy all-reduce of ``numel`` elements through ``codec``: all-gather where
    :func:`gathers` says so, two hops otherwise."""
    cls = GatherPlan if gathers(codec, transport.size, replicas) else TwoHopPlan
    return cls(transport, numel, codec, op, device)


class CompressedWork:
    """Handle of an asynchronous :func:`compressed_all_reduce`: ``wait(timeout)`` finishes the
    remaining stages and returns the tensor."""

    def __init__(self, plan: TwoHopPlan | GatherPlan | None, result: Tensor, inner: Work | None = None) -> None:
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
    """All-reduce contiguous fp32 ``tensor`` in place through ``codec`` in two hops, or one
    all-gather (:func:`gathers`; module docstring). ``residual`` (fp32, same shape) is the
    error-feedback state, updated in place. With ``async_op`` returns a :class:`CompressedWork`:
    on CPU the quantization and the first hop are issued now and the rest runs in ``wait()``; on
    CUDA every stage is enqueued now on the current stream.

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
    plan = make_plan(transport, tensor.numel(), codec, rop, tensor.device)
    plan.encode_scatter(tensor.view(-1), None if residual is None else residual.view(-1))
    work = CompressedWork(plan, tensor)
    if tensor.is_cuda:
        plan.reduce_gather()
    return work if async_op else work.wait()
