"""The Python wrappers of the native kernels, one module per source of ``csrc/``:
:mod:`~flcomm.ops.quant` (``csrc/quant.cpp``: blockwise quantization, the dense codecs),
:mod:`~flcomm.ops.topk` (``csrc/sparse.cpp``: the sparse top-k codec) and
:mod:`~flcomm.ops.apply` (``csrc/apply.cpp``: the exchange's fused apply), each with its
plain-torch reference."""

from flcomm.ops import apply, quant, topk

__all__ = ["apply", "quant", "topk"]
