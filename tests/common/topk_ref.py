"""The sparse top-k format written from its definition, element by element in plain Python, for
the tests: an encoder that builds the whole byte buffer, a decoder and error feedback. Nothing
here comes from flcomm: it is the independent reference the kernels (native and
``flcomm.ops.topk.*_ref``) and the codec are checked against.

The format (flcomm/ops/topk.py and csrc/sparse.h state it too), per block of ``block`` elements:
keep ``min(k, len)`` elements, those of largest ``|y|`` (NaN above +Inf above every finite value;
equal magnitudes: the lower index first), in ascending index order; ``lo``, ``hi`` = the smallest
and largest kept ``|y|`` (both NaN, and every code 0, when a NaN or an Inf is kept); ``L =
2**(bits-1)`` levels, ``step = fp32(fp32(hi - lo) / (L - 1))``; code = sign bit << (bits - 1) |
q, ``q = min(L - 1, round_half_even(fp32(fp32(|y| - lo) / step)))`` (0 unless step > 0); decoded
``+-fp32(lo + fp32(q * step))``. Layout: (lo, hi) float32 per block, k uint16 indices per block,
ceil(k * bits / 8) code bytes per block (code j from bit j * bits), each region zero-padded to 16.
"""

from __future__ import annotations

import math
import struct

import torch
from torch import Tensor


def f32(v: float) -> float:
    """``v`` rounded to the nearest float32 (ties to even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def _key(v: float) -> int:
    """The bits of |v| as a float32, read as an unsigned integer."""
    return struct.unpack("<I", struct.pack("<f", v))[0] & 0x7FFFFFFF


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


def nbytes(n: int, block: int, k: int, bits: int) -> int:
    nb = -(-n // block)
    return _pad16(8 * nb) + _pad16(2 * nb * k) + _pad16(nb * -(-k * bits // 8))


def _block_encode(y: list[float], k: int, bits: int) -> tuple[float, float, list[int], list[int], list[float]]:
    """(lo, hi, kept indices, codes, decoded kept values) of one block."""
    cnt = min(k, len(y))
    order = sorted(range(len(y)), key=lambda i: (-_key(y[i]), i))
    kept = sorted(order[:cnt])
    keys = [_key(y[i]) for i in kept]
    if max(keys) >= 0x7F800000:
        nan = float("nan")
        return nan, nan, kept, [0] * cnt, [nan] * cnt
    lo = struct.unpack("<f", struct.pack("<I", min(keys)))[0]
    hi = struct.unpack("<f", struct.pack("<I", max(keys)))[0]
    L = 1 << (bits - 1)
    step = f32(f32(hi - lo) / (L - 1)) if L > 1 else 0.0
    codes, vals = [], []
    for i in kept:
        a = abs(y[i])
        q = min(L - 1, round(f32(f32(a - lo) / step))) if step > 0 else 0
        neg = math.copysign(1.0, y[i]) < 0
        codes.append((int(neg) << (bits - 1)) | q)
        m = f32(lo + f32(q * step))
        vals.append(-m if neg else m)
    return lo, hi, kept, codes, vals


def encode(x: Tensor, block: int, k: int, bits: int) -> Tensor:
    """The whole encoded buffer of fp32 ``x`` (uint8)."""
    y = [float(v) for v in x.reshape(-1).tolist()]
    n = len(y)
    nb = -(-n // block)
    cb = -(-k * bits // 8)
    scales, idx, codes = bytearray(_pad16(8 * nb)), bytearray(_pad16(2 * nb * k)), bytearray(_pad16(nb * cb))
    for b in range(nb):
        lo, hi, kept, cs, _ = _block_encode(y[b * block:(b + 1) * block], k, bits)
        struct.pack_into("<ff", scales, 8 * b, lo, hi)
        for j, (i, c) in enumerate(zip(kept, cs)):
            struct.pack_into("<H", idx, 2 * (b * k + j), i)
            codes[b * cb + (j * bits) // 8] |= c << ((j * bits) % 8)
    return torch.tensor(list(scales + idx + codes), dtype=torch.uint8)


def round_trip(x: Tensor, block: int, k: int, bits: int) -> Tensor:
    """decode(encode(x)): the kept values where kept, zeros elsewhere (fp32)."""
    y = [float(v) for v in x.reshape(-1).tolist()]
    out = [0.0] * len(y)
    for b in range(-(-len(y) // block)):
        _, _, kept, _, vals = _block_encode(y[b * block:(b + 1) * block], k, bits)
        for i, v in zip(kept, vals):
            out[b * block + i] = v
    return torch.tensor(out, dtype=torch.float32)


def error_feedback(x: Tensor, residual: Tensor, block: int, k: int, bits: int) -> tuple[Tensor, Tensor]:
    """(decoded, new residual) of ``y = fp32(x + residual)``: the residual is ``fp32(y - decoded)``,
    and NaN (0x7fc00000) where a NaN was decoded."""
    y = x.reshape(-1) + residual.reshape(-1)  # NOTE: one fp32 addition, correctly rounded
    d = round_trip(y, block, k, bits)
    return d, torch.where(d.isnan(), torch.full_like(d, float("nan")), y - d)
