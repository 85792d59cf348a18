"""Hierarchical reduce-scatter and all-gather over a group of N nodes x L ranks per node.

The group's ranks are ordered node by node: group rank ``r = n * L + l`` is local rank ``l`` of
node ``n``. Two transports describe the hierarchy from one rank's point of view:

* ``intra``: the L ranks of the group on my node (fast links), ranked by local index ``l``;
* ``inter``: the N ranks of the group with my local index ``l``, one per node, ranked by node.

Both collectives keep the flat layout (rank ``r`` holds chunk ``r`` of the full buffer), so they
are drop-in replacements for ``reduce_scatter`` / ``all_gather`` on the whole group, but only
``1/L`` of the data crosses the inter-node links:

=================  ==============================  ==============================
                   flat, per rank                  hierarchical, per rank
reduce-scatter     (P-1)/P * B over the slowest     (L-1)/L * B intra + (N-1)/(N L) * B inter
all-gather         (P-1)/P * B over the slowest     (N-1)/(N L) * B inter + (L-1)/L * B intra
=================  ==============================  ==============================

(B is the full buffer, P = N L.) The reorder between the stages is the native
``flcomm::shard_transpose`` kernel (CPU and CUDA): view as [rows, cols, chunk], write
[cols, rows, chunk].
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flcomm.comm.base import Done, ReduceOp, Transport, Work, check_op, check_pair
from flcomm.comm.engine import Job, get_engine

__all__ = [
    "Hierarchy",
    "hierarchical_all_gather",
    "hierarchical_all_reduce",
    "hierarchical_reduce_scatter",
    "shard_transpose",
    "shard_transpose_reference",
]

_warned_fallback = False


def shard_transpose_reference(input: Tensor, rows: int, cols: int) -> Tensor:
    """Plain-torch reference of :func:`shard_transpose` (used by the tests)."""
    return input.reshape(rows, cols, -1).transpose(0, 1).contiguous().reshape(input.shape)


def _native_ops() -> Any | None:
    from flcomm import _native

    if not _native.available():
        return None
    ops = _native.ops()
    return ops if hasattr(ops, "shard_transpose_out") else None


def shard_transpose(input: Tensor, rows: int, cols: int, out: Tensor | None = None) -> Tensor:
    """View ``input`` (contiguous) as [rows, cols, chunk] and write its transpose
    [cols, rows, chunk] into ``out`` (allocated when None); returns ``out``.

    ``shard_transpose(shard_transpose(x, a, b), b, a) == x``. Runs the native kernel of
    ``input``'s device; without the native extension it falls back to a torch copy (and warns
    once, naming why).
    """
    if not isinstance(rows, int) or not isinstance(cols, int) or rows < 1 or cols < 1:
        raise ValueError(f"shard_transpose: rows and cols must be positive integers, got {rows!r}, {cols!r}")
    if input.numel() % (rows * cols):
        raise ValueError(f"shard_transpose: input of {input.numel()} elements does not split into "
                         f"rows*cols = {rows}*{cols} = {rows * cols} equal chunks")
    if out is None:
        out = torch.empty(input.shape, dtype=input.dtype, device=input.device)
    ops = _native_ops()
    if ops is not None:
        ops.shard_transpose_out(input, rows, cols, out)
        return out
    global _warned_fallback
    if not _warned_fallback:
        from flcomm import _native

        warnings.warn(f"flcomm: shard_transpose runs as a torch copy: "
                      f"{_native.unavailable_reason() or 'flcomm._C has no shard_transpose op (rebuild it)'}",
                      stacklevel=2)
        _warned_fallback = True
    out.view(cols, rows, -1).copy_(input.view(rows, cols, -1).transpose(0, 1))
    return out


def _two_stage(run: Callable[[Job], Tensor], name: str, output: Tensor, input: Tensor,
               async_op: bool, intra: Transport, inter: Transport) -> Tensor | Job:
    """Run a two-stage collective as one job of the ``"hierarchical"`` engine lane.

    NOTE: the second stage needs the first one's result and, on gloo, nothing orders two
    collectives on different process groups except the host; in the engine both stages advance
    without the caller's ``wait()``. Every hierarchical collective with two stages goes through
    the lane (also the blocking ones), so the intra/inter transports see their collectives in
    program order on every rank.

    On CUDA with stream-ordered transports (NCCL) the stream orders the stages: both are issued
    at once on the caller's stream, with no engine and no host wait (one per FSDP layer
    otherwise).
    """
    if output.is_cuda and intra._stream_wait and inter._stream_wait:
        run(_Inline())
        return Done(output) if async_op else output
    engine = get_engine(output.device, "hierarchical")
    if engine.stream is not None:
        for t in (output, input):
            t.record_stream(engine.stream)
    job = engine.submit(run, name)
    if async_op:
        return job
    job.wait(intra.timeout + inter.timeout)  # NOTE: each stage is bounded by its own
    return output


class _Inline:
    """The ``job`` of a two-stage collective issued on the caller's stream (only its stage)."""

    stage = "issued inline"


def _check_hierarchy(intra: Transport, inter: Transport) -> tuple[int, int]:
    for name, t in (("intra", intra), ("inter", inter)):
        if not isinstance(t, Transport):
            raise TypeError(f"{name} must be a flcomm Transport, got {type(t).__name__}")
    return inter.size, intra.size


def hierarchical_reduce_scatter(output: Tensor, input: Tensor, intra: Transport, inter: Transport,
                                op: Any = ReduceOp.SUM, async_op: bool = False) -> Tensor | Work | Job:
    """Reduce-scatter over the N x L group described by ``intra`` / ``inter``; same result and
    layout as a flat reduce-scatter over all P = N L ranks.

    Steps (c = output.numel(), input is P chunks of c, chunk r for group rank r):
      1. reorder: view input as [N, L, c] and transpose to [L, N, c] (native kernel), so the
         chunks of local index l (those of ranks n L + l) are contiguous;
      2. intra-node reduce-scatter over the L ranks of the node: local rank l gets the [N, c]
         block l, reduced over the node;
      3. inter-node reduce-scatter of that block over the N ranks with local index l: node n gets
         chunk n L + l = my group rank, reduced over all nodes.
    ``op``: sum, avg (each stage averages: (sum / L) / N, which keeps fp16 in range) or max.
    Either size 1 skips its stage and the reorder. Returns ``output`` (or a handle with
    ``async_op``).
    """
    op = ReduceOp.parse(op)
    N, L = _check_hierarchy(intra, inter)
    P = N * L
    if input.numel() != output.numel() * P:
        raise ValueError(f"hierarchical reduce_scatter over {N} nodes x {L} ranks: input must have "
                         f"{P} x output elements ({P} x {output.numel()} = {P * output.numel()}), got "
                         f"{input.numel()} (pad the input to a multiple of {P})")
    check_pair("hierarchical reduce_scatter", output, input, input.numel() // P)
    check_op(op, input)  # NOTE: before launch: an error inside the engine would stop its lane
    if P == 1:
        output.copy_(input)
        return output
    if N == 1:
        return intra.reduce_scatter(output, input, op, async_op=async_op)
    if L == 1:
        return inter.reduce_scatter(output, input, op, async_op=async_op)

    def run(job: Job) -> Tensor:
        job.stage = "reorder, intra-node reduce-scatter"
        local_major = shard_transpose(input.view(-1), N, L)
        block = torch.empty(N * output.numel(), dtype=output.dtype, device=output.device)
        intra.reduce_scatter(block, local_major, op)
        job.stage = "inter-node reduce-scatter"
        inter.reduce_scatter(output.view(-1), block, op)
        return output

    return _two_stage(run, "hierarchical reduce-scatter", output, input, async_op, intra, inter)


def hierarchical_all_gather(output: Tensor, input: Tensor, intra: Transport, inter: Transport,
                            async_op: bool = False) -> Tensor | Work | Job:
    """All-gather over the N x L group described by ``intra`` / ``inter``; same layout as a flat
    all-gather over all P = N L ranks (chunk r of the output from group rank r).

    Steps (c = input.numel()):
      1. inter-node all-gather over the N ranks with my local index l: [N, c], the chunks of
         ranks n L + l;
      2. intra-node all-gather of that block over the L ranks of the node: [L, N, c];
      3. reorder: transpose [L, N, c] to [N, L, c] (native kernel) into ``output``.
    Either size 1 skips its stage and the reorder.
    """
    N, L = _check_hierarchy(intra, inter)
    P = N * L
    if output.numel() != input.numel() * P:
        raise ValueError(f"hierarchical all_gather over {N} nodes x {L} ranks: output must have "
                         f"{P} x input elements ({P} x {input.numel()} = {P * input.numel()}), got "
                         f"{output.numel()}")
    check_pair("hierarchical all_gather", output, input, input.numel() * P)
    if P == 1:
        output.copy_(input)
        return output
    if N == 1:
        return intra.all_gather(output, input, async_op=async_op)
    if L == 1:
        return inter.all_gather(output, input, async_op=async_op)

    def run(job: Job) -> Tensor:
        job.stage = "inter-node all-gather"
        block = torch.empty(N * input.numel(), dtype=input.dtype, device=input.device)
        inter.all_gather(block, input.view(-1))
        job.stage = "intra-node all-gather, reorder"
        local_major = torch.empty(P * input.numel(), dtype=input.dtype, device=input.device)
        intra.all_gather(local_major, block)
        shard_transpose(local_major, L, N, out=output.view(-1))
        return output

    return _two_stage(run, "hierarchical all-gather", output, input, async_op, intra, inter)


def hierarchical_all_reduce(tensor: Tensor, intra: Transport, inter: Transport,
                            op: Any = ReduceOp.SUM) -> Tensor:
    """In-place all-reduce of contiguous ``tensor`` over the N x L group, as a hierarchical
    reduce-scatter followed by a hierarchical all-gather (so only 1/L of the data crosses the
    inter-node links in each).

    Steps: 1. copy the flat tensor into a buffer padded with zeros to a multiple of P = N L
    (the padding is discarded, so it is harmless for max too); 2. hierarchical reduce-scatter into
    this rank's chunk; 3. hierarchical all-gather of the chunks into the buffer; 4. copy back.
    """
    N, L = _check_hierarchy(intra, inter)
    P = N * L
    if not tensor.is_contiguous():
        raise ValueError(f"tensor must be contiguous, got shape {tuple(tensor.shape)} strides {tensor.stride()}")
    flat = tensor.view(-1)
    c = -(-flat.numel() // P)
    buf = torch.zeros(P * c, dtype=tensor.dtype, device=tensor.device)
    buf[: flat.numel()].copy_(flat)
    chunk = torch.empty(c, dtype=tensor.dtype, device=tensor.device)
    hierarchical_reduce_scatter(chunk, buf, intra, inter, op)
    hierarchical_all_gather(buf, chunk, intra, inter)
    flat.copy_(buf[: flat.numel()])
    return tensor


@dataclass(frozen=True)
class Hierarchy:
    """One rank's view of an N x L group: the ``intra`` (my node) and ``inter`` (my local index
    on every node) transports. Group rank = ``inter.rank * L + intra.rank``. A FedMesh gives the
    hierarchy of its shard or group dim: ``mesh.hierarchy("shard")``."""

    intra: Transport
    inter: Transport

    def __post_init__(self) -> None:
        _check_hierarchy(self.intra, self.inter)

    @property
    def nodes(self) -> int:
        return self.inter.size

    @property
    def local(self) -> int:
        return self.intra.size

    @property
    def size(self) -> int:
        return self.inter.size * self.intra.size

    @property
    def rank(self) -> int:
        return self.inter.rank * self.intra.size + self.intra.rank

    def reduce_scatter(self, output: Tensor, input: Tensor, op: Any = ReduceOp.SUM,
                       async_op: bool = False) -> Tensor | Work | Job:
        return hierarchical_reduce_scatter(output, input, self.intra, self.inter, op, async_op)

    def all_gather(self, output: Tensor, input: Tensor, async_op: bool = False) -> Tensor | Work | Job:
        return hierarchical_all_gather(output, input, self.intra, self.inter, async_op)

    def all_reduce(self, tensor: Tensor, op: Any = ReduceOp.SUM) -> Tensor:
        return hierarchical_all_reduce(tensor, self.intra, self.inter, op)
