"""Transports: one protocol (base.Transport), a torch.distributed implementation and the native
NCCL one (importable without a GPU; ``nccl_available()`` says whether it can run).

Exports are lazy: ``flcomm.comm.base`` (the protocol, byte counts) loads without
torch.distributed.
"""

from flcomm._lazy import lazy_exports

_LAZY = {name: "flcomm.comm.base" for name in (
    "CommStats", "Done", "Handle", "LinkTier", "ReduceOp", "TierStats", "Transport", "Work", "bus_factor",
    "format_bytes", "wire_bytes")}
_LAZY.update({"NcclTransport": "flcomm.comm.nccl", "nccl_available": "flcomm.comm.nccl",
              "TorchTransport": "flcomm.comm.torch_pg"})

__all__ = sorted(_LAZY)
__getattr__ = lazy_exports(__name__, _LAZY)
