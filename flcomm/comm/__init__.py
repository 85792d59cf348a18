"""Transports: one protocol (base.Transport), a torch.distributed implementation and the native
NCCL one (importable without a GPU; ``nccl_available()`` says whether it can run)."""

from flcomm.comm.base import CommStats, LinkTier, ReduceOp, TierStats, Transport, Work, wire_bytes
from flcomm.comm.nccl import NcclTransport, nccl_available
from flcomm.comm.torch_pg import TorchTransport

__all__ = ["CommStats", "LinkTier", "NcclTransport", "ReduceOp", "TierStats", "Transport", "TorchTransport",
           "Work", "nccl_available", "wire_bytes"]
