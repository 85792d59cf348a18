"""The wire formats written from their definitions, in float64 torch ops, for the tests: an
encoder that builds the whole uint8 buffer, a decoder, the fused decode-accumulate and error
feedback, and the per-element error bound of each format. Nothing here comes from flcomm: it is
the independent reference that the kernels (native and ``flcomm.ops.quant.*_ref``) and the codecs
are checked against.

The formats (flcomm/ops/quant.py docstring and csrc/quant.h state the same rules):

* grids: a float with ``m`` stored mantissa bits and least normal exponent ``emin`` holds, in
  the binade ``[2^e, 2^(e+1))``, the multiples of ``2^(max(e, emin) - m)``; a cast rounds to the
  nearest grid value, ties to even. bf16 (m 7, emin -126), fp16 (m 10, emin -14), e4m3 (m 3,
  emin -6, largest 448);
* int8, fp8: per block of ``block`` elements ``absmax`` (NaN over Inf over finite),
  ``inv = fp32(qmax / absmax)``, ``q = grid(fp32(x * inv))`` clamped to +-qmax (int8: round to an
  integer, ties to even), ``scale = fp32(absmax / qmax)``, decoded ``fp32(q * scale)``; a block
  with a NaN or an Inf: payload 0 and a NaN scale; a block of absmax below 2^-64 is scaled by
  2^64 first (``inv = fp32(qmax / (absmax 2^64))``, ``q = grid(fp32(x 2^64 inv))``); an all-zero
  block: scale 0;
* layout: payload (``numel * itemsize`` bytes, zero-padded to a multiple of 16), then the fp32
  scales (zero-padded to a multiple of 16).

NOTE: float64 is exact for the product of two fp32 values and, for one +, -, *, / of fp32
operands, rounding the float64 result to fp32 gives the correctly rounded fp32 result (53 >=
2 * 24 + 2 bits), so ``fp32(a op b)`` is computed as ``(a.double() op b.double()).float()``.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: (stored mantissa bits, least normal exponent) of each float grid
GRIDS = {"bf16": (7, -126), "fp16": (10, -14), "e4m3": (3, -6)}
QMAX = {"int8": 127.0, "fp8": 448.0}
PAYLOAD_DTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp16": torch.float16}
ITEMSIZE = {"int8": 1, "fp8": 1, "bf16": 2, "fp16": 2}
#: unit roundoff of fp32
U32 = 2.0 ** -24
TINY, PRESCALE = 2.0 ** -64, 2.0 ** 64


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


def _ulp_exponent(v: Tensor, grid: str) -> Tensor:
    """``max(floor(log2 |v|), emin) - m`` of each finite float64 ``v`` (zero: emin - m)."""
    m, emin = GRIDS[grid]
    _, e = torch.frexp(v)  # v = f 2^e with |f| in [0.5, 1): floor(log2 |v|) = e - 1
    return torch.where(v == 0, emin, torch.clamp(e - 1, min=emin)) - m


def round_to_grid(v: Tensor, grid: str) -> Tensor:
    """float64 ``v`` rounded to the nearest value of ``grid``, ties to even; the sign of zero
    and NaN / Inf are kept (overflow is the caller's: the value above the largest comes back)."""
    step = torch.ldexp(torch.ones_like(v), _ulp_exponent(v, grid))
    r = torch.copysign(torch.round(v.abs() / step) * step, v)  # v / step is exact (a power of two)
    return torch.where(torch.isfinite(v), r, v)


def half_ulp(v: Tensor, grid: str) -> Tensor:
    """Half the grid spacing at float64 ``v``: the largest error of rounding ``v`` to ``grid``
    (0 at 0, which is on every grid)."""
    return torch.where(v == 0, 0.0, torch.ldexp(torch.full_like(v, 0.5), _ulp_exponent(v, grid)))


def _blocks(x: Tensor, block: int) -> Tensor:
    """float64 copy of ``x`` flat, zero-padded to whole blocks, as [blocks, block]."""
    n = x.numel()
    nb = -(-n // block)
    xb = torch.zeros(nb * block, dtype=torch.float64)
    xb[:n] = x.reshape(-1).double()
    return xb.view(nb, block)


def _absmax(xb: Tensor) -> Tensor:
    """Per block: NaN if any NaN, else Inf if any Inf, else max |x|."""
    a = xb.abs().amax(dim=1)
    return torch.where(xb.isnan().any(dim=1), float("nan"), a)


def _block_codes(x: Tensor, fmt: str, block: int) -> tuple[Tensor, Tensor]:
    """(codes as float64 [blocks, block], fp32-valued float64 scales [blocks])."""
    qmax = QMAX[fmt]
    xb = _blocks(x, block)
    amax = _absmax(xb)
    bad = ~torch.isfinite(amax)
    pre = torch.where(amax < TINY, PRESCALE, 1.0)
    inv = (qmax / (amax * pre)).float().double()
    inv = torch.where((amax > 0) & ~bad, inv, 0.0)
    y = ((xb * pre[:, None]) * inv[:, None]).float().double()  # x * 2^64 is exact in fp32 too
    y = y.clamp(-qmax, qmax)
    q = torch.round(y) if fmt == "int8" else round_to_grid(y, "e4m3")
    q = torch.where(bad[:, None], 0.0, q)
    scale = torch.where(bad, float("nan"), (amax / qmax).float().double())
    return q, scale


def encode(x: Tensor, fmt: str, block: int) -> Tensor:
    """The encoded uint8 buffer of fp32 ``x`` (on the CPU)."""
    n = x.numel()
    p = _pad16(n * ITEMSIZE[fmt])
    if fmt in GRIDS:
        payload = round_to_grid(x.reshape(-1).double(), fmt).to(PAYLOAD_DTYPE[fmt])  # exact: on the grid
        scales = None
    else:
        q, scale = _block_codes(x, fmt, block)
        payload = q.reshape(-1)[:n].to(PAYLOAD_DTYPE[fmt])  # exact: q is on the format's grid
        scales = scale.float()
    buf = torch.zeros(p + (_pad16(4 * scales.numel()) if scales is not None else 0), dtype=torch.uint8)
    buf[: n * ITEMSIZE[fmt]] = payload.view(torch.uint8)
    if scales is not None:
        buf[p: p + 4 * scales.numel()] = scales.view(torch.uint8)
    return buf


def _split(buf: Tensor, n: int, fmt: str, block: int) -> tuple[Tensor, Tensor | None]:
    payload = buf[: n * ITEMSIZE[fmt]].view(PAYLOAD_DTYPE[fmt])
    if fmt in GRIDS:
        return payload, None
    p, nb = _pad16(n * ITEMSIZE[fmt]), -(-n // block)
    return payload, buf[p: p + 4 * nb].view(torch.float32)


def decode(buf: Tensor, n: int, fmt: str, block: int) -> Tensor:
    """fp32 values of an encoded buffer of ``n`` elements."""
    payload, scales = _split(buf.cpu(), n, fmt, block)
    vals = payload.double()
    if scales is None:
        return vals.float()
    return (_blocks(vals, block) * scales.double()[:, None]).reshape(-1)[:n].float()


def decode_accumulate(buf: Tensor, n: int, acc: Tensor, fmt: str, block: int) -> Tensor:
    """``fp32(acc + decode(buf))``: a new tensor."""
    return (acc.double() + decode(buf, n, fmt, block).double()).float()


def error_feedback(x: Tensor, residual: Tensor, fmt: str, block: int) -> tuple[Tensor, Tensor]:
    """(encoding of ``y = fp32(x + residual)``, new residual ``fp32(y - decode)``)."""
    y = (x.reshape(-1).double() + residual.reshape(-1).double()).float()
    buf = encode(y, fmt, block)
    return buf, (y.double() - decode(buf, y.numel(), fmt, block).double()).float()


def round_trip(x: Tensor, fmt: str, block: int) -> Tensor:
    """``decode(encode(x))`` shaped like ``x``."""
    return decode(encode(x, fmt, block), x.numel(), fmt, block).view_as(x)


def error_bound(x: Tensor, fmt: str, block: int) -> Tensor:
    """Per-element bound on ``|decode(encode(x)) - x|`` for finite fp32 ``x`` (float64).

    Casts: half the grid spacing at ``x`` (one correctly rounded cast). int8 / fp8: half the
    grid spacing at the exact scaled value ``x qmax / absmax``, times ``absmax / qmax``, plus the
    fp32 roundings: ``inv`` and ``x * inv`` move the scaled value by at most 2u |y| <= 2u qmax,
    and ``q * scale`` (``scale`` rounded too) moves the result by 2u |q| scale <= 2u absmax; with
    the O(u^2) terms, 5u absmax covers both. The 2^-64 prescale is exact and does not change it.
    """
    xd = x.reshape(-1).double()
    if fmt in GRIDS:
        return half_ulp(xd, fmt).view_as(x)
    qmax = QMAX[fmt]
    xb = _blocks(x, block)
    amax = _absmax(xb)[:, None].expand_as(xb)
    safe = torch.where(amax > 0, amax, 1.0)
    y = xb * qmax / safe
    rounding = torch.full_like(y, 0.5) if fmt == "int8" else half_ulp(y, "e4m3")
    bound = rounding * amax / qmax + 5 * U32 * amax
    return bound.reshape(-1)[: x.numel()].view_as(x)


def same_encoding(a: Tensor, b: Tensor, n: int, fmt: str) -> bool:
    """Byte for byte equal buffers of ``n`` elements, except that a NaN of a cast (bf16, fp16)
    equals any NaN (the formats keep NaN, not its bits)."""
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape:
        return False
    if fmt not in GRIDS:
        return torch.equal(a, b)
    k = n * ITEMSIZE[fmt]
    pa, pb = a[:k].view(PAYLOAD_DTYPE[fmt]), b[:k].view(PAYLOAD_DTYPE[fmt])
    both_nan = pa.isnan() & pb.isnan()
    same_bits = a[:k].view(torch.int16) == b[:k].view(torch.int16)
    return bool((same_bits | both_nan).all()) and torch.equal(a[k:], b[k:])
