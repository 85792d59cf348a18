"""Federation: topology and meshes; the FedAvg synchronizer."""

from flcomm.federated.topology import FedMesh, RankCoords, Topology
from flcomm.federated.fedavg import FedAvg

__all__ = ["FedAvg", "FedMesh", "RankCoords", "Topology"]
