"""Federation: topology and meshes; the FedAvg synchronizer."""

from flcomm.federated.topology import FedMesh, RankCoords, Topology

__all__ = ["FedMesh", "RankCoords", "Topology"]
