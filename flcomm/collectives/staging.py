"""The staging pool (:class:`StagingPool`): the device buffers and two-hop plans through which
exchanges stage their buckets, reused by every bucket whatever the number of buckets; and, beside
it, the one-allocation layout of the buffers that persist at full size (:func:`arena`, viewed
whole by :func:`span`) and the dtype a tensor is staged in (:func:`bucket_dtype`).

How an exchange uses the slots (double-buffered, or one slot with offload) is in
:mod:`flcomm.collectives.bucketing`'s module docstring.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from flcomm.collectives.compressed import GatherPlan, TwoHopPlan
    from flcomm.comm.base import Work

__all__ = ["StagingPool", "arena", "bucket_dtype", "span"]


class _StageBuffers:
    """A staging buffer (and its two-hop plans, by bucket size) reused by every other bucket.

    Its byte buffers, by name (:func:`_grow`): ``flat`` (the bucket), ``residual`` (bf16
    residuals: the bucket's, staged in fp32), ``scratch`` (offload: host pieces and the residual,
    staged) and those of subclasses (:meth:`~flcomm.collectives.bucketing.BucketedAllReduce.slot_buffer`)."""

    def __init__(self) -> None:
        self.bufs: dict[str, Tensor] = {}
        self.plans: dict[tuple[int, torch.dtype], TwoHopPlan | GatherPlan] = {}
        self.work: Work | None = None
        self.plan: TwoHopPlan | GatherPlan | None = None
        self.staged: Tensor | None = None  # the residual's device view while the bucket is exchanged

    def nbytes(self) -> int:
        bufs = sum(t.numel() * t.element_size() for t in self.bufs.values())
        return bufs + sum(p.nbytes() for p in self.plans.values())


def _grow(bufs: dict[str, Tensor], name: str, nbytes: int, device: torch.device) -> Tensor:
    """The byte buffer ``bufs[name]`` on ``device``, grown to at least ``nbytes``."""
    buf = bufs.get(name)
    if buf is None or buf.numel() < nbytes:
        buf = None
        bufs.pop(name, None)  # NOTE: free the old one first (the device may hold no more)
        buf = bufs[name] = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return buf


class StagingPool:
    """Staging buffers shareable between all-reduces whose exchanges run one after another (the
    same engine lane): two slots (buffers grow on first use) and the named buffers the pool's
    users add (:meth:`buffer`)."""

    def __init__(self) -> None:
        self.slots = [_StageBuffers(), _StageBuffers()]
        self.bufs: dict[str, Tensor] = {}

    def buffer(self, name: str, nbytes: int, device: torch.device) -> Tensor:
        """The pool's byte buffer ``name`` (no exchange of the pool uses it), grown to at least
        ``nbytes``."""
        return _grow(self.bufs, name, nbytes, device)

    def nbytes(self) -> int:
        """Bytes of every buffer and two-hop plan of the pool."""
        return sum(s.nbytes() for s in self.slots) + sum(t.numel() * t.element_size() for t in self.bufs.values())


def arena(specs: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device | str,
          pin: bool = False) -> list[Tensor]:
    """Zeroed tensors of the given (shape, dtype), all views of one flat byte buffer: one
    allocation per kind of buffer, so the bytes held are the bytes asked for (torch's caching
    allocators round each allocation up, the pinned host one to a power of two). The views are
    laid out by falling element size, so each is aligned to its own without padding.

    ``pin`` (host memory, with CUDA): the buffer is page-locked with ``cudaHostRegister``, exactly
    its bytes (not through the caching host allocator), and unregistered when its storage is
    freed (the last view gone). On CPU the same views of one buffer, unpinned."""
    sizes = [math.prod(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in specs]
    order = sorted(range(len(specs)), key=lambda i: -torch.empty((), dtype=specs[i][1]).element_size())
    flat = torch.zeros(sum(sizes), dtype=torch.uint8, device=device)
    if pin and flat.numel():
        _register(flat)
    out: list[Tensor | None] = [None] * len(specs)
    off = 0
    for i in order:
        shape, dt = specs[i]
        out[i] = flat[off: off + sizes[i]].view(dt).view(shape)
        off += sizes[i]
    return out  # type: ignore[return-value]


def span(tensors: list[Tensor]) -> Tensor | None:
    """One 1-D view over ``tensors`` when they lie end to end in one storage, in their order and
    of one dtype (an :func:`arena`'s views of one element size), for a single pass over all of
    them; else None."""
    ts = [t for t in tensors if t.numel()]  # NOTE: an empty tensor's data_ptr() is 0
    if not ts or any(t.dtype != ts[0].dtype for t in tensors):
        return None
    storage, pos = ts[0].untyped_storage().data_ptr(), ts[0].data_ptr()
    for t in ts:
        if not t.is_contiguous() or t.data_ptr() != pos or t.untyped_storage().data_ptr() != storage:
            return None
        pos += t.numel() * t.element_size()
    return ts[0].as_strided((sum(t.numel() for t in ts),), (1,), ts[0].storage_offset())


def _register(flat: Tensor) -> None:
    """Page-lock ``flat`` (a host byte buffer) until its storage is freed."""
    import weakref

    cudart = torch.cuda.cudart()
    ptr = flat.data_ptr()
    rc = int(cudart.cudaHostRegister(ptr, flat.numel(), 0))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister of {flat.numel()} bytes of host memory failed with CUDA error {rc}")
    # NOTE: torch keeps a storage's Python object alive as long as the storage (PyObject
    # preservation), so this runs when the last view is gone; as torch.distributed.checkpoint's
    # pinned staging does
    fin = weakref.finalize(flat.untyped_storage(), cudart.cudaHostUnregister, ptr)
    fin.atexit = False  # NOTE: not after the CUDA context is gone


def bucket_dtype(dtype: torch.dtype, keep_dtype: bool) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels in: its own with ``keep_dtype``, else fp32 (fp64
    stays fp64: precision is never cut)."""
    if keep_dtype or dtype == torch.float64:
        return dtype
    return torch.float32
