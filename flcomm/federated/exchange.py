"""The inter-group exchange of the FedAvg synchronizer: average a fixed list of fp32 tensors
over the "fed" transport, asynchronously, bucketed and optionally compressed.

The work is done by :class:`flcomm.collectives.bucketing.BucketedAllReduce` (persistent flat
buckets, per-bucket pipelining, codecs, error feedback). When that module cannot be imported,
codec ``"none"`` falls back to one asynchronous ``transport.all_reduce(op="avg")`` on a flat
buffer (the tensors are views into it, so nothing is copied); any other codec then raises.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from flcomm.comm.base import Transport


class _Waitable(Protocol):
    def wait(self, timeout: timedelta | float | None = None) -> Any: ...

    def is_completed(self) -> bool: ...


def known_codecs() -> tuple[str, ...]:
    try:
        from flcomm.codecs import CODECS
    except ImportError:
        return ("none",)
    return tuple(CODECS)


def check_codec(codec: str) -> str:
    """The codec's registry name; ValueError naming the known ones otherwise."""
    if not isinstance(codec, str):
        name = getattr(codec, "name", None)
        if isinstance(name, str) and name:
            return check_codec(name)
        raise ValueError(f"codec must be a codec name, one of {known_codecs()}, got {codec!r}")
    try:
        from flcomm.codecs import get_codec
    except ImportError:
        if codec != "none":
            raise ValueError(f"codec must be one of {known_codecs()} (flcomm.codecs is unavailable), "
                             f"got {codec!r}") from None
        return codec
    return get_codec(codec).name  # raises ValueError listing the known ones


class _FlatAverage:
    """Fallback: one async AVG all-reduce of the flat buffer the tensors are views of."""

    def __init__(self, transport: "Transport", flat: Tensor) -> None:
        self.transport, self.flat = transport, flat

    def start(self) -> _Waitable:
        return self.transport.all_reduce(self.flat, op="avg", async_op=True)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        if sd:
            raise ValueError(f"the plain exchange has no state, got keys {sorted(sd)}")


class DeltaExchange:
    """Averages ``tensors`` (fp32 views of ``flat``) across the ranks of ``transport``.

    ``start()`` returns a handle; its ``wait()`` leaves the average in the tensors.
    ``backend`` says which implementation runs ("bucketed" or "flat").
    """

    def __init__(self, transport: "Transport", flat: Tensor, tensors: list[Tensor], codec: str,
                 bucket_mb: float, error_feedback: bool) -> None:
        self.codec = codec
        self.error_feedback = error_feedback
        try:
            from flcomm.collectives.bucketing import BucketedAllReduce
        except ImportError as e:
            if codec != "none" or error_feedback:
                raise RuntimeError(f"codec {codec!r} (error_feedback={error_feedback}) needs "
                                   f"flcomm.collectives.bucketing, which cannot be imported: {e}") from e
            self.backend = "flat"
            self._impl: Any = _FlatAverage(transport, flat)
            return
        self.backend = "bucketed"
        self._impl = BucketedAllReduce(transport, tensors, codec=codec, bucket_mb=bucket_mb,
                                       error_feedback=error_feedback, op="avg")

    def start(self) -> _Waitable:
        return self._impl.start()

    def state_dict(self) -> dict:
        return self._impl.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self._impl.load_state_dict(sd)

    @torch.no_grad()
    def sanitize(self) -> None:
        """Zero the non-finite entries of the error-feedback state (after a refused round, whose
        NaN/Inf the residuals would otherwise carry into every later round)."""
        sd = self.state_dict()
        found = False

        def walk(x: Any) -> None:
            nonlocal found
            if isinstance(x, Tensor) and x.is_floating_point():
                if not bool(torch.isfinite(x).all()):
                    x.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
                    found = True
            elif isinstance(x, dict):
                for v in x.values():
                    walk(v)
            elif isinstance(x, (list, tuple)):
                for v in x:
                    walk(v)

        walk(sd)
        if found:
            self.load_state_dict(sd)


def flat_views(flat: Tensor, shapes: list[torch.Size]) -> list[Tensor]:
    """Views of consecutive pieces of ``flat`` with the given shapes."""
    out, off = [], 0
    for s in shapes:
        n = 1
        for d in s:
            n *= d
        out.append(flat[off:off + n].view(s))
        off += n
    return out
