"""What a FedAvg holds in memory, per buffer kind (:func:`memory_stats`).

The paper's mode keeps nothing but two staging buckets; the other modes keep the anchor, plus the
residual (error feedback, fp32 or ``residual_dtype="bf16"``), the own copy (overlap: the local
shard at the sync, then the correction) and the momentum (nesterov), each kind one allocation
(:func:`~flcomm.collectives.bucketing.arena`); ``offload="cpu"`` keeps these in host memory
(page-locked on CUDA, exactly their bytes) and streams them through the buckets (with
overlapping fragments the apply step through a scratch of its own:
:mod:`flcomm.federated.exchange`). docs/memory.md has the measurements.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from flcomm.federated.fedavg import FedAvg

__all__ = ["memory_stats"]


def memory_stats(fed: FedAvg) -> dict[str, int]:
    """Bytes ``fed`` holds, per buffer kind (``anchor``, ``own``, ``momentum``,
    ``residual``, ``staging``: the exchange's device pool of bucket buffers, offload scratch
    (and apply scratch) and two-hop plans, ``flags``), their ``total``, ``offloaded`` (the part of the total in
    host memory with ``offload``), ``device`` (the rest: on the device), ``transient`` (the
    largest temporary an exchange adds on the device, :meth:`BucketedAllReduce.memory_bytes`)
    and ``shard_fp32``: the bytes of this rank's averaged tensors in fp32 (the unit of the
    memory targets). On CUDA also ``device_peak`` (torch's peak allocation)."""

    def nbytes(ts: list[Tensor] | None) -> int:
        return sum(t.numel() * t.element_size() for t in ts or [])

    out = {"anchor": 0, "own": 0, "momentum": 0, "residual": 0, "staging": 0, "flags": 0}
    transient = 0
    if fed.federated:
        out["anchor"] = nbytes(fed._anchor)
        out["own"] = nbytes(fed._own)
        out["momentum"] = nbytes(fed._outer.buffers)
        out["flags"] = nbytes([t for fr in fed._frags for t in (fr.flags, fr.world_flags)])
        exchanges = [fr.exchange for fr in fed._frags if fr.exchange is not None]
        for i, ex in enumerate(exchanges):
            mem = ex.memory_bytes()
            out["residual"] += mem["residual"]
            out["staging"] += mem["staging"] if i == 0 else 0  # NOTE: one shared pool
            transient = max(transient, mem["transient"])
    out["total"] = sum(out.values())
    kept = out["anchor"] + out["own"] + out["momentum"] + out["residual"]
    out["offloaded"] = kept if fed.offload and fed.federated else 0
    out["device"] = out["total"] - out["offloaded"]
    out["transient"] = transient
    out["shard_fp32"] = sum(s.local.numel() * 4 for s in fed.slots)
    if fed.federated and fed.device.type == "cuda":
        out["device_peak"] = int(torch.cuda.max_memory_allocated(fed.device))
    return out
