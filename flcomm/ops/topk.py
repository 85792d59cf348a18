"""Sparse top-k kernels: typed wrappers over ``torch.ops.flcomm.topk_*`` and a plain-torch reference.

The format keeps, in every block of ``block`` elements, the ``k`` elements of largest magnitude,
their indices in the block (uint16) and their values in ``bits`` bits (2, 4 or 8: a sign bit and
a magnitude on ``2**(bits-1)`` levels spaced evenly between the smallest and the largest kept
magnitude of the block)::

    [ scales:  (lo, hi) float32 per block, zero-padded to a multiple of 16 bytes ]
    [ indices: k uint16 per block, ascending in each block, padded to 16         ]
    [ codes:   ceil(k * bits / 8) bytes per block, padded to 16                  ]

The rule, per block of ``len`` elements, ``cnt = min(k, len)`` of which are kept (``csrc/sparse.h``
states it too, and every implementation follows it):

1. the kept elements are those with the largest bits of ``|y|`` read as uint32 (NaN > +Inf > any
   finite value); equal magnitudes go to the lower index; slot ``j < cnt`` holds the j-th kept
   index in ascending order, the slots from ``cnt`` on (a last, partial block only) hold 0;
2. ``lo`` and ``hi`` are the smallest and the largest kept ``|y|``; a block that keeps a NaN or an
   Inf gets ``lo = hi = NaN`` and codes 0, so its kept elements decode as NaN (and get torch's
   NaN, ``0x7fc00000``, as their residual);
3. code = ``sign << (bits - 1) | q``, ``step = (hi - lo) / (L - 1)`` with ``L = 2**(bits - 1)``,
   ``q = min(L - 1, rint((|y| - lo) / step))`` (0 when ``step`` is not positive); the decoded value
   is ``+-(lo + q * step)``, each operation rounded to fp32 on its own;
4. code j of a block sits at bits ``[j * bits, (j + 1) * bits)`` of the block's code bytes, from
   the low bit of byte ``j * bits // 8`` up;
5. decoding writes the kept values and zeros elsewhere (accumulating adds the kept values only;
   an index at or past the block's length, which no encoder writes, is skipped); error
   feedback's new residual is ``y - decoded``: ``y`` itself where nothing was kept.

:func:`topk_encode` (with ``residual``: fused error feedback) and :func:`topk_decode` run the
native CPU kernel (``csrc/sparse.cpp``), the CUDA kernel (``csrc/sparse_cuda.cu``) or the
reference here (``*_ref``), which all give the same bits; ``backend`` chooses as in
:mod:`flcomm.ops.quant`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flcomm import _native
from flcomm.ops.quant import check_buf, check_fp32, decode_target, use_native
from flcomm.validate import integer

__all__ = ["BITS", "MAX_BLOCK", "check_params", "encoded_nbytes", "topk_decode", "topk_decode_ref",
           "topk_encode", "topk_encode_ref"]

MAX_BLOCK = 1 << 16  # NOTE: an index in a block is a uint16
BITS: tuple[int, ...] = (2, 4, 8)
OPS: tuple[str, ...] = ("topk_encode", "topk_decode")
_ALIGN = 16


def _a16(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def check_params(block: int, k: int, bits: int) -> None:
    """ValueError unless ``1 <= block <= 65536``, ``1 <= k <= block`` and ``bits`` is 2, 4 or 8."""
    integer("block", block, 1, MAX_BLOCK, also=" (elements per block: an index must fit 16 bits)")
    integer("k", k, 1, block, also=f" (elements kept per block of {block})")
    if bits not in BITS:
        raise ValueError(f"bits must be one of {', '.join(map(str, BITS))}, got {bits!r}")


def _regions(numel: int, block: int, k: int, bits: int) -> tuple[int, int, int, int]:
    nb = -(-numel // block)
    cb = -(-k * bits // 8)
    scales = _a16(8 * nb)
    return nb, cb, scales, scales + _a16(2 * nb * k)


def encoded_nbytes(numel: int, block: int, k: int, bits: int) -> int:
    """Bytes of the encoding of ``numel`` fp32 elements."""
    check_params(block, k, bits)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    nb, cb, _, codes = _regions(numel, block, k, bits)
    return codes + _a16(nb * cb)


def topk_encode(x: Tensor, out: Tensor | None = None, *, block: int, k: int, bits: int,
                residual: Tensor | None = None, backend: str | None = None) -> Tensor:
    """Encode fp32 ``x`` into ``out`` (uint8 of :func:`encoded_nbytes`). With ``residual`` (fp32,
    as many elements): ``y = x + residual`` is encoded and ``residual = y - decode(out)``."""
    check_params(block, k, bits)
    check_fp32("x", x)
    if residual is not None:
        check_fp32("residual", residual)
        if residual.numel() != x.numel() or residual.device != x.device:
            raise ValueError(f"residual must have {x.numel()} elements on {x.device} like x, got "
                             f"{residual.numel()} on {residual.device}")
    nbytes = encoded_nbytes(x.numel(), block, k, bits)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    check_buf("out", out, nbytes, x.device, "int8")  # NOTE: "int8": float32 scales, 4-byte aligned
    if use_native(backend, x.device, OPS):
        _native.ops().topk_encode(x.view(-1), residual.view(-1) if residual is not None else None, out,
                                  block, k, bits)
    else:
        topk_encode_ref(x, out, block=block, k=k, bits=bits, residual=residual)
    return out


def topk_decode(buf: Tensor, numel: int, out: Tensor | None = None, *, block: int, k: int, bits: int,
                accumulate: bool = False, backend: str | None = None) -> Tensor:
    """Decode ``buf`` into fp32 ``out`` (``numel`` elements); with ``accumulate``, add the kept
    values to ``out`` instead."""
    check_params(block, k, bits)
    out = decode_target(out, numel, buf.device, accumulate)
    check_buf("buf", buf, encoded_nbytes(numel, block, k, bits), out.device, "int8")
    if use_native(backend, out.device, OPS):
        _native.ops().topk_decode(buf, out.view(-1), block, k, bits, accumulate)
    else:
        topk_decode_ref(buf, out, block=block, k=k, bits=bits, accumulate=accumulate)
    return out


# ---- the plain-torch reference ----
def _views(buf: Tensor, numel: int, block: int, k: int, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """(scales [nb, 2] float32, indices [nb, k] int16 bits, codes [nb, cb] uint8) of ``buf``."""
    nb, cb, idx_at, codes_at = _regions(numel, block, k, bits)
    scales = buf[: 8 * nb].view(torch.float32).view(nb, 2)
    idx = buf[idx_at: idx_at + 2 * nb * k].view(torch.int16).view(nb, k)
    codes = buf[codes_at: codes_at + nb * cb].view(nb, cb)
    return scales, idx, codes


def _counts(numel: int, block: int, k: int, device: torch.device) -> Tensor:
    """Elements kept in each block: ``min(k, len)``."""
    nb = -(-numel // block)
    lens = torch.full((nb,), block, dtype=torch.int64, device=device)
    if nb:
        lens[-1] = numel - (nb - 1) * block
    return lens.clamp(max=k)


def topk_encode_ref(x: Tensor, out: Tensor, *, block: int, k: int, bits: int,
                    residual: Tensor | None = None) -> Tensor:
    """Plain-torch :func:`topk_encode` (the module docstring's rule)."""
    n, dev = x.numel(), x.device
    y = x.reshape(-1) if residual is None else x.reshape(-1) + residual.reshape(-1)
    out.zero_()
    if n == 0:
        return out
    nb = -(-n // block)
    yb = torch.zeros(nb * block, dtype=torch.float32, device=dev)
    yb[:n] = y
    yb = yb.view(nb, block)
    key = (yb.view(torch.int32).to(torch.int64) & 0x7FFFFFFF)
    pos = torch.arange(block, dtype=torch.int64, device=dev)
    # NOTE: one distinct number per element, larger for a larger key and then a lower index; the
    # padding of a partial last block ranks below every element
    rank = key * (2 * MAX_BLOCK) + (MAX_BLOCK - 1 - pos)
    if n % block:
        rank[-1, n % block:] = -1
    top = rank.topk(k, dim=1).indices  # [nb, k]: the k largest, ties to the lower index
    cnt = _counts(n, block, k, dev)
    valid = torch.arange(k, device=dev)[None, :] < cnt[:, None]
    sel = torch.where(valid, top, torch.full_like(top, block)).sort(dim=1).values  # ascending; unused last
    valid = sel < block
    sel = torch.where(valid, sel, torch.zeros_like(sel))
    v = yb.gather(1, sel)
    kb = key.gather(1, sel)
    lo_bits = torch.where(valid, kb, torch.full_like(kb, 1 << 40)).amin(dim=1)
    hi_bits = torch.where(valid, kb, torch.full_like(kb, -1)).amax(dim=1)
    bad = hi_bits >= 0x7F800000
    nan = torch.full((nb,), float("nan"), device=dev)
    lo = torch.where(bad, nan, lo_bits.to(torch.int32).view(torch.float32))
    hi = torch.where(bad, nan, hi_bits.to(torch.int32).view(torch.float32))
    levels = 1 << (bits - 1)
    if levels > 1:
        step = (hi - lo) / torch.full_like(hi, levels - 1)  # NOTE: tensor / tensor: a true division
    else:
        step = torch.zeros_like(hi)
    a = v.abs()
    q = ((a - lo[:, None]) / step[:, None]).round().clamp(0, levels - 1)
    q = torch.where((step > 0)[:, None] & ~bad[:, None], q, torch.zeros_like(q)).to(torch.int64)
    sign = (v.view(torch.int32) < 0).to(torch.int64)
    code = torch.where(bad[:, None] | ~valid, torch.zeros_like(q), (sign << (bits - 1)) | q)
    scales, idx, codes = _views(out, n, block, k, bits)
    scales[:, 0], scales[:, 1] = lo, hi
    idx.copy_(sel.to(torch.int32).to(torch.int16))  # NOTE: wraps 32768..65535 to the same uint16 bits
    per = 8 // bits
    cb = codes.shape[1]
    packed = torch.zeros(nb, cb * per, dtype=torch.int64, device=dev)
    packed[:, :k] = code
    shifts = torch.arange(per, device=dev, dtype=torch.int64) * bits
    codes.copy_((packed.view(nb, cb, per) << shifts).sum(dim=2).to(torch.uint8))
    if residual is not None:
        d = torch.zeros(nb, block, dtype=torch.float32, device=dev)
        _decoded_into(d, out, n, block, k, bits)
        d = d.view(-1)[:n]
        residual.view(-1).copy_(torch.where(d.isnan(), torch.full_like(d, float("nan")), y - d))
    return out


def _decoded_into(d: Tensor, buf: Tensor, n: int, block: int, k: int, bits: int, add: bool = False) -> None:
    """The kept values of ``buf`` written (``add``: added) into ``d`` ([nb, block])."""
    scales, idx, codes = _views(buf, n, block, k, bits)
    nb, cb = codes.shape
    per = 8 // bits
    shifts = torch.arange(per, device=d.device, dtype=torch.int64) * bits
    code = ((codes.to(torch.int64)[:, :, None] >> shifts) & ((1 << bits) - 1)).view(nb, cb * per)[:, :k]
    levels = 1 << (bits - 1)
    lo, hi = scales[:, 0:1], scales[:, 1:2]
    step = (hi - lo) / torch.full_like(hi, levels - 1) if levels > 1 else torch.zeros_like(hi)
    q = (code & (levels - 1)).to(torch.float32)
    m = lo + q * step
    val = torch.where((code >> (bits - 1)) & 1 == 1, -m, m)
    pos = idx.to(torch.int64) & 0xFFFF
    valid = torch.arange(k, device=d.device)[None, :] < _counts(n, block, k, d.device)[:, None]
    lens = _counts(n, block, block, d.device)
    valid &= pos < lens[:, None]
    # NOTE: the slots not decoded go to column ``block`` of a wider copy, which is dropped: the
    # kept indices of a block are distinct, so no two writes meet
    pos = torch.where(valid, pos, torch.full_like(code, block))
    wide = torch.cat([d, torch.zeros(nb, 1, dtype=d.dtype, device=d.device)], dim=1)
    if add:
        wide.scatter_(1, pos, wide.gather(1, pos) + val)
    else:
        wide.scatter_(1, pos, val)
    d.copy_(wide[:, :block])


def topk_decode_ref(buf: Tensor, out: Tensor, *, block: int, k: int, bits: int,
                    accumulate: bool = False) -> Tensor:
    """Plain-torch :func:`topk_decode`."""
    n = out.numel()
    if n == 0:
        return out
    nb = -(-n // block)
    d = torch.zeros(nb, block, dtype=torch.float32, device=out.device)
    if accumulate:
        d.view(-1)[:n] = out.view(-1)
    _decoded_into(d, buf, n, block, k, bits, add=accumulate)
    out.view(-1).copy_(d.view(-1)[:n])
    return out
