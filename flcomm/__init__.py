"""flcomm: federated-learning-style sharded data parallelism inside a GPU cluster.

Federation groups train with FSDP/HSDP on fast links; across groups only a FedAvg of the
parameter shards crosses the slow links, every E local steps (Mittone & Aldinucci, FL+FSDP and
FL+HSDP). See README.md.

The main entry points are importable from here (lazily, so ``import flcomm`` stays cheap)::

    topo = flcomm.Topology.fl_fsdp(world_size, ranks_per_node, group_size=8)
    mesh = topo.build("cuda")
    fed = flcomm.FedAvg(model, mesh, sync_every=8, codec="int8")
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from flcomm.info import build_info

_LAZY = {
    "Topology": "flcomm.federated.topology",
    "FedMesh": "flcomm.federated.topology",
    "FedAvg": "flcomm.federated.fedavg",
    "get_codec": "flcomm.codecs",
    "compressed_all_reduce": "flcomm.collectives.compressed",
    "BucketedAllReduce": "flcomm.collectives.bucketing",
    "Hierarchy": "flcomm.collectives.hierarchical",
    "TorchTransport": "flcomm.comm.torch_pg",
    "CommStats": "flcomm.comm.base",
    "LinkTier": "flcomm.comm.base",
}

__all__ = ["__version__", "build_info", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'flcomm' has no attribute {name!r}")
