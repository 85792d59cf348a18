"""Codecs: how an fp32 tensor is put on the wire. A user picks one by name::

    codec = get_codec("int8")                 # none, bf16, fp16, int8, fp8, topk
    codec = get_codec("topk:d=0.02:bits=2")   # options after the name, or as keywords
    buf = codec.encode(x)                     # uint8: payload and scales in one buffer
    y = codec.decode(buf, x.numel())          # fp32
    codec.decode_accumulate(buf, n, acc)      # acc += decode(buf): the reduce step

A new codec is one file: subclass :class:`Codec`, set ``name``, implement ``encoded_nbytes``,
``encode``, ``decode`` (and ``decode_accumulate`` / ``encode_error_feedback`` when a fused kernel
exists), and decorate the class with :func:`register_codec`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import Tensor

from flcomm.ops import quant, topk

__all__ = ["CODECS", "DENSE_CODECS", "Codec", "KernelCodec", "NoneCodec", "TopKCodec", "check_replicate_codec",
           "get_codec", "register_codec"]


class Codec(ABC):
    """Encodes ``numel`` fp32 elements into ``encoded_nbytes(numel)`` bytes and back.

    Attributes:
        name: the registry name.
        lossless: whether ``decode(encode(x)) == x`` bit for bit.
        align_numel: chunk sizes that are a multiple of this avoid partial blocks (collectives
            round their per-rank chunks up to it).
        sparse: a sum of two encodings is not an encoding of the same size, so an all-reduce
            does not reduce the encodings in two hops: it all-gathers them, and every rank
            decodes and adds them all (:mod:`flcomm.collectives.compressed`).
    """

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = False
    sparse: ClassVar[bool] = False
    align_numel: int = 4

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    @property
    def spec(self) -> str:
        """The name :func:`get_codec` makes this codec from, options included (what configs and
        checkpoints record)."""
        return self.name

    @abstractmethod
    def encoded_nbytes(self, numel: int) -> int:
        """Bytes of the encoding of ``numel`` fp32 elements."""

    @abstractmethod
    def encode(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """Encode contiguous fp32 ``x`` into ``out`` (uint8 of ``encoded_nbytes(x.numel())``)."""

    @abstractmethod
    def decode(self, buf: Tensor, numel: int, out: Tensor | None = None) -> Tensor:
        """Decode ``buf`` into fp32 ``out`` of ``numel`` elements."""

    def decode_accumulate(self, buf: Tensor, numel: int, acc: Tensor) -> None:
        """``acc += decode(buf)`` in fp32 (codecs with a fused kernel override this)."""
        acc.add_(self.decode(buf, numel).view_as(acc))

    def encode_error_feedback(self, x: Tensor, residual: Tensor, out: Tensor | None = None) -> Tensor:
        """Encode ``y = x + residual`` and set ``residual = y - decode(encode(y))``."""
        y = x + residual
        out = self.encode(y, out)
        residual.copy_(y - self.decode(out, y.numel()).view_as(y))
        return out

    def error_bound(self, x: Tensor) -> Tensor:
        """Per-element bound on ``|decode(encode(x)) - x|`` for fp32 ``x`` (used by the tests;
        zero for lossless codecs)."""
        return torch.zeros_like(x)


_REGISTRY: dict[str, type[Codec]] = {}
#: names of the registered codecs, in registration order
CODECS: tuple[str, ...] = ()


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make ``cls`` available to :func:`get_codec` under ``cls.name``."""
    global CODECS
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise TypeError(f"register_codec expects a Codec subclass, got {cls!r}")
    if not cls.name:
        raise ValueError(f"{cls.__name__}.name must be a non-empty string")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"a codec named {cls.name!r} is already registered ({_REGISTRY[cls.name].__name__})")
    _REGISTRY[cls.name] = cls
    CODECS = tuple(_REGISTRY)
    return cls


def get_codec(name_or_codec: str | Codec, **kwargs: Any) -> Codec:
    """The codec named ``name_or_codec``, with options after the name (``topk:d=0.02:bits=2``)
    or as keyword arguments (``block_size=512``), which go to its constructor; a :class:`Codec`
    instance is returned as is."""
    if isinstance(name_or_codec, Codec):
        if kwargs:
            raise ValueError(f"options {sorted(kwargs)} given with a codec instance {name_or_codec!r}")
        return name_or_codec
    if not isinstance(name_or_codec, str):
        raise TypeError(f"codec must be a name ({', '.join(CODECS)}) or a Codec, got "
                        f"{type(name_or_codec).__name__}")
    name, *opts = name_or_codec.strip().lower().split(":")
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown codec {name_or_codec!r}; known codecs: {', '.join(CODECS)}")
    options = dict(_option(name_or_codec, o) for o in opts)
    both = sorted(set(options) & set(kwargs))
    if both:
        raise ValueError(f"codec options {both} given both in {name_or_codec!r} and as keywords")
    try:
        return cls(**options, **kwargs)
    except TypeError as e:
        raise ValueError(f"bad options for codec {name!r} in {name_or_codec!r}: {e}") from None


def _option(spec: str, text: str) -> tuple[str, int | float]:
    """One ``key=value`` option of a codec name; the value an int or a float."""
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise ValueError(f"codec options are key=value after the name, e.g. 'topk:d=0.02:bits=2'; "
                         f"got {text!r} in {spec!r}")
    try:
        return key, int(value)
    except ValueError:
        pass
    try:
        return key, float(value)
    except ValueError:
        raise ValueError(f"codec option {key!r} must be a number, got {value!r} in {spec!r}") from None


def _check_input(x: Tensor) -> None:
    quant.check_fp32("codec input", x, hint=" (cast it, e.g. x.float())")


@register_codec
class NoneCodec(Codec):
    """No compression: the fp32 bytes themselves."""

    name = "none"
    lossless = True
    align_numel = 4

    def encoded_nbytes(self, numel: int) -> int:
        return 4 * numel

    def encode(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        _check_input(x)
        raw = x.reshape(-1).view(torch.uint8)
        if out is None:
            return raw.clone()
        quant.check_buf("out", out, raw.numel(), x.device)
        out.copy_(raw)
        return out

    def decode(self, buf: Tensor, numel: int, out: Tensor | None = None) -> Tensor:
        quant.check_buf("buf", buf, 4 * numel, out.device if out is not None else buf.device)
        vals = buf.view(torch.float32)
        if out is None:
            return vals.clone()
        quant.check_fp32("out", out)
        out.view(-1).copy_(vals)
        return out

    def decode_accumulate(self, buf: Tensor, numel: int, acc: Tensor) -> None:
        quant.check_fp32("acc", acc)
        quant.check_buf("buf", buf, 4 * numel, acc.device)
        acc.view(-1).add_(buf.view(torch.float32))

    def encode_error_feedback(self, x: Tensor, residual: Tensor, out: Tensor | None = None) -> Tensor:
        # NOTE: lossless: y encodes exactly and the residual becomes zero.
        y = x + residual
        residual.zero_()
        return self.encode(y, out)


class KernelCodec(Codec):
    """A codec backed by the quantization kernels of :mod:`flcomm.ops.quant`."""

    fmt: ClassVar[str] = ""

    def __init__(self, block_size: int = quant.DEFAULT_BLOCK_SIZE, backend: str | None = None) -> None:
        quant.check_format(self.fmt, block_size)
        if backend is not None and backend not in quant.BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(quant.BACKENDS)}, got {backend!r}")
        self.block_size = block_size
        self.backend = backend
        # NOTE: 16-byte multiples keep encoded chunks aligned; whole blocks avoid partial ones.
        self.align_numel = block_size if self.fmt in quant.BLOCKED_FORMATS else 8

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, block_size={self.block_size})"

    def encoded_nbytes(self, numel: int) -> int:
        return quant.encoded_nbytes(numel, self.fmt, self.block_size)

    def encode(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        _check_input(x)
        return quant.quantize(x, out, fmt=self.fmt, block_size=self.block_size, backend=self.backend)

    def decode(self, buf: Tensor, numel: int, out: Tensor | None = None) -> Tensor:
        return quant.dequantize(buf, numel, out, fmt=self.fmt, block_size=self.block_size,
                                  backend=self.backend)

    def decode_accumulate(self, buf: Tensor, numel: int, acc: Tensor) -> None:
        quant.dequantize(buf, numel, acc, fmt=self.fmt, block_size=self.block_size, accumulate=True,
                           backend=self.backend)

    def encode_error_feedback(self, x: Tensor, residual: Tensor, out: Tensor | None = None) -> Tensor:
        _check_input(x)
        return quant.quantize_error_feedback(x, residual, out, fmt=self.fmt, block_size=self.block_size,
                                               backend=self.backend)

    def _block_absmax(self, x: Tensor) -> Tensor:
        """Per-element absmax of the element's block."""
        xb = quant.blocked(x.reshape(-1).float(), self.block_size)
        amax = xb.abs().amax(dim=1, keepdim=True).expand_as(xb)
        return amax.reshape(-1)[: x.numel()].view_as(x)


@register_codec
class BF16Codec(KernelCodec):
    """bfloat16 cast (round to nearest even): relative error <= 2^-8."""

    name = "bf16"
    fmt = "bf16"

    def error_bound(self, x: Tensor) -> Tensor:
        return x.abs() * 2.0**-8


@register_codec
class FP16Codec(KernelCodec):
    """float16 cast (round to nearest even): relative error <= 2^-11 above 2^-14, absolute
    2^-25 below; |x| > 65504 becomes inf (use bf16 or a scaled codec for such ranges)."""

    name = "fp16"
    fmt = "fp16"

    def error_bound(self, x: Tensor) -> Tensor:
        return x.abs() * 2.0**-11 + 2.0**-25


@register_codec
class Int8Codec(KernelCodec):
    """int8 with one absmax scale per block: error <= scale/2 = absmax/254 per element."""

    name = "int8"
    fmt = "int8"

    def error_bound(self, x: Tensor) -> Tensor:
        # NOTE: scale/2 plus a few ulps for the fp32 products x*inv and q*scale.
        amax = self._block_absmax(x)
        return amax / 254.0 * (1 + 2.0**-20) + amax * 2.0**-22


@register_codec
class FP8Codec(KernelCodec):
    """float8 e4m3 with one absmax scale per block (absmax -> 448): relative error <= 2^-4 for
    normals, absolute 2^-10 * scale in the subnormal range."""

    name = "fp8"
    fmt = "fp8"

    def error_bound(self, x: Tensor) -> Tensor:
        amax = self._block_absmax(x)
        scale = amax / 448.0
        return x.abs() * 2.0**-4 * (1 + 2.0**-20) + scale * 2.0**-10 + amax * 2.0**-22


@register_codec
class TopKCodec(Codec):
    """Sparse top-k: in each block of ``block`` elements the ``k = round(d * block)`` of largest
    magnitude, as uint16 indices and ``bits``-bit values (a sign and ``2**(bits-1)`` magnitude
    levels between the block's smallest and largest kept magnitude; :mod:`flcomm.ops.topk`).

    Named with its options, ``topk:d=0.02:bits=2`` (``block=4096`` by default; ``k=`` instead of
    ``d=`` gives the count itself). A sum of sparse encodings is not sparse, so the exchange does
    not reduce in two hops: it all-gathers every rank's encoding and each rank decodes them all,
    in rank order (:attr:`sparse`). Meant with error feedback, which keeps what was not sent."""

    name = "topk"
    sparse = True
    DEFAULT_BLOCK = 4096
    DEFAULT_DENSITY = 0.02
    DEFAULT_BITS = 2

    def __init__(self, d: float | None = None, bits: int = DEFAULT_BITS, block: int = DEFAULT_BLOCK,
                 k: int | None = None, backend: str | None = None) -> None:
        if backend is not None and backend not in quant.BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(quant.BACKENDS)}, got {backend!r}")
        topk.check_params(block, 1, bits)
        if d is not None and k is not None:
            raise ValueError(f"topk takes d (density) or k (elements per block), not both: got d={d!r}, k={k!r}")
        if k is None:
            d = self.DEFAULT_DENSITY if d is None else d
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1:
                raise ValueError(f"topk's density d must be a number in (0, 1], got {d!r}")
            k = max(1, min(block, round(d * block)))
            self._option = f"d={d:g}"
        else:
            self._option = f"k={k}"
        topk.check_params(block, k, bits)
        self.block, self.k, self.bits, self.backend = block, k, bits, backend
        self.density = k / block
        self.align_numel = block

    @property
    def spec(self) -> str:
        s = f"topk:{self._option}:bits={self.bits}"
        return s + (f":block={self.block}" if self.block != self.DEFAULT_BLOCK else "")

    def __repr__(self) -> str:
        return f"TopKCodec({self.spec!r}, k={self.k})"

    def encoded_nbytes(self, numel: int) -> int:
        return topk.encoded_nbytes(numel, self.block, self.k, self.bits)

    def _opts(self) -> dict:
        return {"block": self.block, "k": self.k, "bits": self.bits, "backend": self.backend}

    def encode(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        _check_input(x)
        return topk.topk_encode(x, out, **self._opts())

    def decode(self, buf: Tensor, numel: int, out: Tensor | None = None) -> Tensor:
        return topk.topk_decode(buf, numel, out, **self._opts())

    def decode_accumulate(self, buf: Tensor, numel: int, acc: Tensor) -> None:
        topk.topk_decode(buf, numel, acc, accumulate=True, **self._opts())

    def encode_error_feedback(self, x: Tensor, residual: Tensor, out: Tensor | None = None) -> Tensor:
        _check_input(x)
        return topk.topk_encode(x, out, residual=residual, **self._opts())

    def error_bound(self, x: Tensor) -> Tensor:
        # NOTE: an element not kept is dropped whole: the bound is |x| (kept ones err less)
        return x.abs()


#: the registered dense codecs (all but the sparse ones; an all-reduce reduces them in two hops, or
#: all-gathers them on two ranks): the choices of the replicas' gradient all-reduce
DENSE_CODECS: tuple[str, ...] = tuple(n for n in CODECS if not _REGISTRY[n].sparse)


def check_replicate_codec(name: Any, error_feedback: bool = False, *, hybrid: bool = True, strategy: str = "") -> str:
    """The codec of the replicas' gradient all-reduce (HSDP / FL+HSDP's replicate dim, through
    :class:`~flcomm.fsdp.fsdp2.ReplicateAllReduceHook`), checked once for the trainer and the
    cost model: a dense codec (a sparse one keeps no gradient average), only with a replicate dim
    (``hybrid``; ``strategy`` names the strategy in the error), and error feedback only with a
    lossy codec. Returns the codec's name; ValueError naming what was expected otherwise."""
    dense = ", ".join(c for c in DENSE_CODECS if c != "none")
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in DENSE_CODECS:
        raise ValueError(f"unknown replicate codec {name!r}; expected one of {', '.join(DENSE_CODECS)} (a dense "
                         "codec: the replicas all-reduce their gradients)")
    if key != "none" and not hybrid:
        raise ValueError(f"replicate codec {key!r} compresses the all-reduce over the replicate dim, which strategy "
                         f"{strategy} does not have; expected strategy hsdp or fl-hsdp (R = G / S > 1 replicas), "
                         f"got {strategy}")
    if error_feedback and key == "none":
        raise ValueError("replicate error feedback keeps what the replicate codec dropped; expected a replicate codec "
                         f"one of {dense}, got none")
    return key
