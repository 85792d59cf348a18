"""Quantization kernels: typed wrappers over ``torch.ops.flcomm.*`` and plain-torch references.

Formats (``fmt``):

======= ======================================= ======================================
int8    symmetric absmax per block of           ``q = round(x * 127/absmax)`` in [-127, 127],
        ``block_size`` elements                  ``x' = q * absmax/127``
fp8     float8 e4m3 (fn) with an absmax scale   ``q = e4m3(x * 448/absmax)``, ``x' = q * absmax/448``
        per block
bf16    round-to-nearest-even cast              no scales
fp16    round-to-nearest-even cast              no scales (|x| > 65504 overflows to inf)
======= ======================================= ======================================

Encoded layout (one ``uint8`` buffer, so payload and scales travel together)::

    [ payload: numel * itemsize bytes, zero-padded to a multiple of 16 ]
    [ scales:  ceil(numel / block_size) float32, zero-padded to a multiple of 16 ]   (int8, fp8)

NOTE: every region starts 16-byte aligned, so encoded buffers laid end to end (one per rank in
an all-to-all) keep the 16-byte alignment the vectorized CUDA loads need.

Each kernel has three implementations that compute bit-identical int8/fp8/bf16/fp16 payloads and
scales: the native CPU one (``csrc/quant.cpp``), the native CUDA one (``csrc/quant_cuda.cu``) and
the plain-torch reference here (``*_ref``), which the tests use as the independent reference and
which also runs wherever the native extension is not built. ``backend`` selects: ``"auto"``
(native when it is loaded and has the kernel, else torch), ``"native"`` or ``"torch"``; the
environment variable ``FLCOMM_KERNELS`` sets the default.

Non-finite and tiny values (one rule, also in ``csrc/quant.h``; every implementation follows it):

1. a block's absmax is taken over ``|x|`` with NaN winning over Inf winning over any finite value;
2. a block holding a NaN or an Inf (int8, fp8) encodes as payload 0 with a NaN scale, so the whole
   block decodes as NaN and stays visible to inf checks and ``GradScaler``; with error feedback its
   residual becomes ``y - decoded = NaN`` too;
3. a block whose absmax is below ``2**-64`` is scaled by ``2**64`` before the multiplication by
   ``qmax / absmax`` (both exact powers of two), so ``qmax / absmax`` never overflows and every
   element is encoded as if it were of normal size; the scale ``absmax / qmax`` keeps subnormals
   (no flush to zero anywhere, including the CUDA build: see ``setup.py`` ``nvcc_flags``);
4. an all-zero block has scale 0 and decodes as zeros (``-0.0`` encodes as fp8 ``0x80``);
5. bf16 / fp16 casts keep NaN and +-Inf (fp16 overflows to +-Inf above 65504).

Encoded buffers must start at a 4-byte (int8, fp8: the scales are float32) or 2-byte (bf16, fp16)
aligned address: a uint8 view at an odd offset is rejected before launch.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch
from torch import Tensor

from flcomm import _native
from flcomm.validate import integer

Format = Literal["int8", "fp8", "bf16", "fp16"]
Backend = Literal["auto", "native", "torch"]

FORMATS: tuple[str, ...] = ("int8", "fp8", "bf16", "fp16")
BLOCKED_FORMATS: tuple[str, ...] = ("int8", "fp8")
#: largest quantized magnitude: the absmax of a block maps to it
QMAX: dict[str, float] = {"int8": 127.0, "fp8": 448.0}
ITEMSIZE: dict[str, int] = {"int8": 1, "fp8": 1, "bf16": 2, "fp16": 2}
ALIGN = 16
#: below this absmax a block is scaled by TINY_PRESCALE first (rule 3 of the module docstring)
TINY_ABSMAX = 2.0 ** -64
TINY_PRESCALE = 2.0 ** 64
#: default elements per scale for int8/fp8. NOTE: 256 keeps the scales at 1/64 of the int8
#: payload (0.254x of fp32 on the wire, under the 0.27x target with room for padding), is eight
#: 32-wide AVX2 steps on CPU and two float4 steps per lane of one warp on CUDA. Measured on a
#: 2-core CPU (`bench/kernels.py --device cpu --formats int8 --kernels quant+dequant
#: --block-sizes 64 128 256 512 1024 --sizes 64M`), int8 quant+dequant ran at 43/62/72/88/92% of
#: the copy ceiling: 256 clears the 50% target; 512 is faster still for ~6% more error per element.
DEFAULT_BLOCK_SIZE = 256
BACKENDS: tuple[str, ...] = ("auto", "native", "torch")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


MAX_BLOCK_SIZE = 1 << 20  # NOTE: a scale per block; a larger block only loses precision


def check_format(fmt: str, block_size: int) -> None:
    """Raise ValueError unless ``fmt`` is a known format and ``block_size`` an int in
    [1, MAX_BLOCK_SIZE]."""
    if fmt not in FORMATS:
        raise ValueError(f"quantization format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    integer("block_size", block_size, 1, MAX_BLOCK_SIZE, also=" (elements per scale)")


def num_blocks(numel: int, block_size: int) -> int:
    return (numel + block_size - 1) // block_size


def payload_nbytes(numel: int, fmt: str) -> int:
    """Bytes of the payload region (16-byte aligned)."""
    return _align(numel * ITEMSIZE[fmt])


def encoded_nbytes(numel: int, fmt: str, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of the encoding of ``numel`` fp32 elements: payload plus scales, each 16-aligned."""
    check_format(fmt, block_size)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    n = payload_nbytes(numel, fmt)
    if fmt in BLOCKED_FORMATS:
        n += _align(4 * num_blocks(numel, block_size))
    return n


def split_encoded(buf: Tensor, numel: int, fmt: str, block_size: int) -> tuple[Tensor, Tensor | None]:
    """Views of an encoded buffer: (payload as int8/float8/bfloat16/float16 of ``numel``,
    scales as float32 of ``num_blocks``; None for the casts)."""
    p = payload_nbytes(numel, fmt)
    raw = buf[: numel * ITEMSIZE[fmt]]
    payload = raw.view({"int8": torch.int8, "fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16,
                        "fp16": torch.float16}[fmt])
    if fmt not in BLOCKED_FORMATS:
        return payload, None
    nb = num_blocks(numel, block_size)
    return payload, buf[p: p + 4 * nb].view(torch.float32)


# ---- input checks ----
def check_fp32(name: str, t: Tensor, hint: str = "") -> None:
    """A contiguous float32 tensor, or TypeError/ValueError naming ``name``, what was expected
    and what came (``hint`` is appended to a dtype error)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}{hint}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")


def check_buf(name: str, buf: Tensor, nbytes: int, device: torch.device, fmt: str | None = None) -> None:
    """An encoded buffer: a contiguous uint8 tensor of exactly ``nbytes`` on ``device``, and (given
    ``fmt``) starting at the address alignment its scalars need; else TypeError/ValueError naming
    ``name``, what was expected and what came."""
    if not isinstance(buf, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8 (an encoded buffer), got {buf.dtype}")
    if not buf.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {buf.stride()}")
    if buf.numel() != nbytes:
        raise ValueError(f"{name} must hold exactly {nbytes} bytes for this numel/format, got {buf.numel()}")
    if buf.device != device:
        raise ValueError(f"{name} must be on {device} like the fp32 tensor, got {buf.device}")
    if fmt is not None and nbytes > 0:
        need = 4 if fmt in BLOCKED_FORMATS else ITEMSIZE[fmt]
        if buf.data_ptr() % need:
            raise ValueError(f"{name} must start at a {need}-byte aligned address for {fmt} (its "
                             f"{'float32 scales' if need == 4 else 'payload'}), got address "
                             f"{buf.data_ptr():#x} (a uint8 view at an odd offset?)")


def decode_target(out: Tensor | None, numel: int, device: torch.device, accumulate: bool) -> Tensor:
    """The fp32 tensor a decode of ``numel`` elements writes: ``out`` checked (contiguous fp32 of
    ``numel`` elements), or a new one on ``device`` (not with ``accumulate``, which needs one)."""
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs an `out` tensor to accumulate into")
        out = torch.empty(numel, dtype=torch.float32, device=device)
    check_fp32("out", out)
    if out.numel() != numel:
        raise ValueError(f"out must have numel={numel} elements, got {out.numel()}")
    return out


def _check_same(name: str, t: Tensor, ref: Tensor) -> None:
    if t.numel() != ref.numel():
        raise ValueError(f"{name} must have {ref.numel()} elements like x, got {t.numel()}")
    if t.device != ref.device:
        raise ValueError(f"{name} must be on {ref.device} like x, got {t.device}")


# ---- backend choice ----
@functools.cache
def _native_has(op: str) -> bool:
    if not _native.available():
        return False
    try:
        return hasattr(_native.ops(), op) and getattr(_native.ops(), op) is not None
    except (RuntimeError, AttributeError):
        return False


#: the operators of the quantization kernels (csrc/quant.cpp)
QUANT_OPS: tuple[str, ...] = ("quantize", "dequantize", "quantize_error_feedback")


@functools.cache
def native_supports(device_type: str, ops: tuple[str, ...] = QUANT_OPS) -> bool:
    """Whether the native kernels ``ops`` (default: the quantization kernels) are built for
    ``device_type`` ("cpu" or "cuda")."""
    if not _native_has(ops[0]) or device_type not in ("cpu", "cuda"):
        return False
    # NOTE: ask the dispatcher: an extension built with CUDA may still lack a .cu file's kernels.
    key = "CPU" if device_type == "cpu" else "CUDA"
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"flcomm::{op}", key) for op in ops)


def use_native(backend: str | None, device: torch.device, ops: tuple[str, ...] = QUANT_OPS) -> bool:
    """Whether a call on ``device`` with ``backend`` (None: ``FLCOMM_KERNELS``, else auto) runs
    the native kernels ``ops``; RuntimeError when ``"native"`` was asked for and they are not
    built."""
    backend = backend or os.environ.get("FLCOMM_KERNELS", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return False
    ok = native_supports(device.type, ops)
    if backend == "native" and not ok:
        reason = _native.unavailable_reason() or f"flcomm._C has no kernels {', '.join(ops)} for {device.type}"
        raise RuntimeError(f"backend='native' requested but unavailable: {reason}")
    return ok


# ---- public kernels ----
def quantize(x: Tensor, out: Tensor | None = None, *, fmt: str, block_size: int = DEFAULT_BLOCK_SIZE,
             backend: str | None = None) -> Tensor:
    """Encode fp32 ``x`` (any shape, contiguous) into ``out`` (uint8, ``encoded_nbytes``)."""
    check_format(fmt, block_size)
    check_fp32("x", x)
    nbytes = encoded_nbytes(x.numel(), fmt, block_size)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    check_buf("out", out, nbytes, x.device, fmt)
    if use_native(backend, x.device):
        _native.ops().quantize(x.view(-1), out, fmt, block_size)
    else:
        quantize_ref(x, out, fmt=fmt, block_size=block_size)
    return out


def dequantize(buf: Tensor, numel: int, out: Tensor | None = None, *, fmt: str,
               block_size: int = DEFAULT_BLOCK_SIZE, accumulate: bool = False,
               backend: str | None = None) -> Tensor:
    """Decode ``buf`` into fp32 ``out`` (``numel`` elements); with ``accumulate``, ``out +=``
    the decoded values (the fused reduce step of the two-hop all-reduce)."""
    check_format(fmt, block_size)
    out = decode_target(out, numel, buf.device, accumulate)
    check_buf("buf", buf, encoded_nbytes(numel, fmt, block_size), out.device, fmt)
    if use_native(backend, out.device):
        _native.ops().dequantize(buf, out.view(-1), fmt, block_size, accumulate)
    else:
        dequantize_ref(buf, out, fmt=fmt, block_size=block_size, accumulate=accumulate)
    return out


def quantize_error_feedback(x: Tensor, residual: Tensor, out: Tensor | None = None, *, fmt: str,
                            block_size: int = DEFAULT_BLOCK_SIZE, backend: str | None = None) -> Tensor:
    """Fused error feedback. Steps, per element:

    1. ``y = x + residual``;
    2. ``out = quant(y)`` (the encoding of ``y``);
    3. ``residual = y - dequant(out)`` (what the encoding dropped; carried to the next round).
    """
    check_format(fmt, block_size)
    check_fp32("x", x)
    check_fp32("residual", residual)
    _check_same("residual", residual, x)
    nbytes = encoded_nbytes(x.numel(), fmt, block_size)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    check_buf("out", out, nbytes, x.device, fmt)
    if use_native(backend, x.device):
        _native.ops().quantize_error_feedback(x.view(-1), residual.view(-1), out, fmt, block_size)
    else:
        quantize_error_feedback_ref(x, residual, out, fmt=fmt, block_size=block_size)
    return out


# ---- plain-torch references ----
def blocked(x: Tensor, block_size: int) -> Tensor:
    """``x`` flat, zero-padded to whole blocks, as [blocks, block_size]."""
    n = x.numel()
    nb = num_blocks(n, block_size)
    if n == nb * block_size:
        return x.reshape(nb, block_size)
    xb = torch.zeros(nb * block_size, dtype=x.dtype, device=x.device)
    xb[:n] = x.reshape(-1)
    return xb.view(nb, block_size)


def quantize_ref(x: Tensor, out: Tensor, *, fmt: str, block_size: int = DEFAULT_BLOCK_SIZE) -> Tensor:
    """Plain-torch :func:`quantize` (the reference the native kernels must match bit for bit)."""
    n = x.numel()
    out.zero_()
    payload, scales = split_encoded(out, n, fmt, block_size)
    if fmt == "bf16":
        payload.copy_(x.reshape(-1).to(torch.bfloat16))
        return out
    if fmt == "fp16":
        payload.copy_(x.reshape(-1).to(torch.float16))
        return out
    qmax = QMAX[fmt]
    xb = blocked(x, block_size)
    # rule 1: amax propagates NaN (torch max reductions do); Inf stays Inf
    amax = xb.abs().amax(dim=1)
    bad = ~torch.isfinite(amax)
    # NOTE: multiply by the reciprocal (one division per block, as the kernels do); a zero or a
    # non-finite block gets inverse 0. Rule 3: tiny blocks are scaled up by an exact power of two
    # first; for the others `xb * 1` is exact, so this is the kernels' `y * inv`.
    # NOTE: tensor / tensor divisions: `qmax / amax` on a tensor is reciprocal-then-multiply in
    # torch, which can differ from the kernels' division in the last bit.
    q_t = torch.full_like(amax, qmax)
    pre = torch.where(amax < TINY_ABSMAX, torch.full_like(amax, TINY_PRESCALE), torch.ones_like(amax))
    inv = torch.where((amax > 0) & ~bad, q_t / (amax * pre), torch.zeros_like(amax))
    y = (xb * pre[:, None]) * inv[:, None]
    y = torch.where(bad[:, None], torch.zeros_like(y), y)  # rule 2: payload 0
    if fmt == "int8":
        q = y.round().clamp_(-qmax, qmax).to(torch.int8)
    else:
        q = y.clamp_(-qmax, qmax).to(torch.float8_e4m3fn)
    payload.copy_(q.reshape(-1)[:n])
    assert scales is not None
    scales.copy_(torch.where(bad, torch.full_like(amax, float("nan")), amax / q_t))
    return out


def dequantize_ref(buf: Tensor, out: Tensor, *, fmt: str, block_size: int = DEFAULT_BLOCK_SIZE,
                   accumulate: bool = False) -> Tensor:
    """Plain-torch :func:`dequantize`."""
    n = out.numel()
    payload, scales = split_encoded(buf, n, fmt, block_size)
    if scales is None:
        vals = payload.to(torch.float32)
    else:
        vals = (blocked(payload.to(torch.float32), block_size) * scales[:, None]).reshape(-1)[:n]
    flat = out.view(-1)
    if accumulate:
        flat.add_(vals)
    else:
        flat.copy_(vals)
    return out


def quantize_error_feedback_ref(x: Tensor, residual: Tensor, out: Tensor, *, fmt: str,
                                block_size: int = DEFAULT_BLOCK_SIZE) -> Tensor:
    """Plain-torch :func:`quantize_error_feedback`."""
    y = x.reshape(-1) + residual.reshape(-1)
    quantize_ref(y, out, fmt=fmt, block_size=block_size)
    d = torch.empty_like(y)
    dequantize_ref(out, d, fmt=fmt, block_size=block_size)
    residual.view(-1).copy_(y - d)
    return out
