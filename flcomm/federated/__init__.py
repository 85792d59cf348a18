"""Federation: the strategies and their topology and meshes; the FedAvg synchronizer; the
elastic federation.

Exports are lazy, so importing :mod:`flcomm.federated.topology` or
:mod:`flcomm.federated.strategy` (pure descriptions, used by the cost model) does not import
torch.distributed through :mod:`flcomm.federated.fedavg`.
"""

from __future__ import annotations

from flcomm._lazy import lazy_exports

_LAZY = {
    "FedAvg": "flcomm.federated.fedavg",
    "FedAvgConfig": "flcomm.federated.config",
    "NonFiniteAverageError": "flcomm.federated.nonfinite",
    "ReplicaMismatchError": "flcomm.federated.verify",
    "FedMesh": "flcomm.federated.mesh",
    "MeshConfig": "flcomm.federated.mesh",
    "init_fed_mesh": "flcomm.federated.mesh",
    "RankCoords": "flcomm.federated.topology",
    "Topology": "flcomm.federated.topology",
    "Strategy": "flcomm.federated.strategy",
    "Federation": "flcomm.federated.elastic",
    "GroupLostError": "flcomm.federated.elastic",
    "TooFewGroupsError": "flcomm.federated.elastic",
}

__all__ = list(_LAZY)
__getattr__ = lazy_exports(__name__, _LAZY)
