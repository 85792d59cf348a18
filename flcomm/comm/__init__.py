"""Transports: one protocol (base.Transport), a torch.distributed implementation and the native
NCCL one."""

from flcomm.comm.base import CommStats, LinkTier, ReduceOp, TierStats, Transport, Work, wire_bytes
from flcomm.comm.torch_pg import TorchTransport

__all__ = ["CommStats", "LinkTier", "ReduceOp", "TierStats", "Transport", "TorchTransport", "Work", "wire_bytes"]
