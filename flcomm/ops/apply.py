"""The exchange's fused apply: a typed wrapper over ``torch.ops.flcomm.apply_average`` and its
plain-torch reference.

Where the 0-dim bool ``ok`` holds, elementwise over ``mean``, ``anchor`` and ``target`` (one dtype,
float32 or float64, one device)::

    a = anchor + mean;  anchor = a;  target = a - target   (correction)
                                     target = a            (otherwise)

and where it does not, nothing is written. FedAvg's exchange applies a bucket's average with it
(:mod:`flcomm.federated.exchange`): with overlap ``target`` is the local shard as of the sync, which
becomes the correction the apply step adds (the new anchor less it); without, the local shard,
which becomes the new anchor.

The native kernels (``csrc/apply.cpp``, ``csrc/apply_cuda.cu``) make one pass over the three
tensors and read ``ok`` where it lives: the CPU kernel returns at once when it is False, and
every CUDA thread reads it in device memory, so the host never waits for the device. Each element
is one IEEE add or subtract, so they give the bits of the reference, :func:`apply_average_ref`,
which runs wherever the extension is not built (and allocates two temporaries the size of
``mean``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from flcomm import _native
from flcomm.ops.quant import use_native

__all__ = ["OPS", "apply_average", "apply_average_ref", "apply_function"]

OPS: tuple[str, ...] = ("apply_average",)


def apply_average(mean: Tensor, anchor: Tensor, target: Tensor, ok: Tensor, *, correction: bool,
                  backend: str | None = None) -> None:
    """Apply ``mean`` to ``anchor`` and ``target`` where ``ok`` holds (module docstring).
    ``backend``: as the quantization kernels' (:func:`flcomm.ops.quant.use_native`)."""
    apply_function(mean.device, backend)(mean, anchor, target, ok, correction)


def apply_function(device: torch.device, backend: str | None = None) -> Callable[..., None]:
    """What :func:`apply_average` runs on ``device``, decided once (for a caller that applies
    many pieces): ``fn(mean, anchor, target, ok, correction)``."""
    if use_native(backend, device, OPS):
        return _native.ops().apply_average
    return lambda mean, anchor, target, ok, correction: apply_average_ref(mean, anchor, target, ok,
                                                                           correction=correction)


def apply_average_ref(mean: Tensor, anchor: Tensor, target: Tensor, ok: Tensor, *, correction: bool) -> None:
    """Plain-torch :func:`apply_average`: each result selected by ``ok`` (no host read)."""
    a = anchor + mean
    new = a - target if correction else a
    torch.where(ok, new, target, out=target)
    torch.where(ok, a, anchor, out=anchor)
