"""The inner (per-group) optimizer state at a FedAvg sync: ``keep`` (the paper), ``average``
(its floating tensors averaged over the shard peers, uncompressed, blocking) or ``reset``
(cleared, as if new)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from flcomm.collectives.staging import bucket_dtype
from flcomm.enums import Choice
from flcomm.federated.shards import flat_views, is_dtensor

if TYPE_CHECKING:
    from flcomm.comm.base import Transport

__all__ = ["InnerState", "average_inner_state", "sync_inner_state"]


class InnerState(Choice, what="inner_state"):
    """What happens to the inner (per-group) optimizer state at a sync."""

    KEEP = "keep"
    AVERAGE = "average"
    RESET = "reset"


def sync_inner_state(kind: InnerState, optimizer: torch.optim.Optimizer | None, transport: Transport) -> None:
    """What ``kind`` does to ``optimizer``'s state at a sync (nothing for ``keep``)."""
    if kind is InnerState.AVERAGE:
        assert optimizer is not None
        average_inner_state(optimizer, transport)
    elif kind is InnerState.RESET:
        assert optimizer is not None
        optimizer.state.clear()


def average_inner_state(optimizer: torch.optim.Optimizer, transport: Transport) -> None:
    """Average the floating inner-optimizer state (all but ``step``) over ``transport`` (the fed
    group): one all-reduce per working dtype."""
    tensors: list[Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p, {})
            for k in sorted(st):
                v = st[k]
                if k == "step" or not isinstance(v, Tensor) or not v.is_floating_point():
                    continue
                v = v.to_local() if is_dtensor(v) else v
                if v.numel():
                    tensors.append(v)
    if not tensors:
        return
    for dt in dict.fromkeys(bucket_dtype(t.dtype, False) for t in tensors):
        ts = [t for t in tensors if bucket_dtype(t.dtype, False) == dt]
        flat = torch.cat([t.reshape(-1).to(dt) for t in ts])
        transport.all_reduce(flat, op="avg")
        for t, v in zip(ts, flat_views(flat, [t.shape for t in ts])):
            t.copy_(v)
