"""The runtime half of a :class:`~flcomm.federated.topology.Topology`: a rank's
:class:`FedMesh` (its DeviceMesh, process groups and transports), made by
:meth:`Topology.build <flcomm.federated.topology.Topology.build>`."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from flcomm.comm.base import EXCHANGE_MAX_CTAS, CommStats, LinkTier
from flcomm.federated.topology import MESH_DIMS, Topology

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from flcomm.collectives.hierarchical import Hierarchy
    from flcomm.comm.torch_pg import TorchTransport

__all__ = ["EXCHANGE_GROUPS", "FedMesh"]

EXCHANGE_GROUPS = ("fed", "replicate_exchange")  # the FedAvg exchange's groups (:meth:`FedMesh._pg_options`)


class FedMesh:
    """A rank's view of a :class:`Topology` once torch.distributed is initialized: the
    DeviceMesh ("fed", "replicate", "shard"), the process groups of each tier, and transports on
    them sharing one :class:`CommStats`.

    Groups (all ranks create all of them, in the same order):
      ``shard``, ``replicate``, ``fed``, ``group`` (all G ranks of my federation group), and for
      the hierarchical collectives of the shard dim, ``shard_intra`` (my shard group's ranks on
      my node) and ``shard_inter`` (my shard group's ranks with my local position on the
      other nodes); the same for ``group_intra`` / ``group_inter``.
    """

    def __init__(self, topo: Topology, device_type: str, stats: CommStats | None,
                 timeout: timedelta, hierarchical: bool, group_rank: int | None = None,
                 exchange_max_ctas: int | None = EXCHANGE_MAX_CTAS) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        if not dist.is_initialized():
            raise RuntimeError("Topology.build needs torch.distributed to be initialized first")
        self.group_world = group_rank is not None
        want = topo.group_size if self.group_world else topo.world_size
        if dist.get_world_size() != want:
            raise ValueError(f"topology is for {'a federation group of ' if self.group_world else ''}world_size "
                             f"{want}, but torch.distributed has {dist.get_world_size()} ranks")
        self.topology = topo
        self.rank = group_rank if self.group_world else dist.get_rank()
        self.coords = topo.coords(self.rank)
        if self.group_world and dist.get_rank() != self.coords.index:
            raise ValueError(f"rank {self.rank} is rank {self.coords.index} of federation group {self.coords.group}, "
                             f"but torch.distributed's rank is {dist.get_rank()}")
        # NOTE: in a group's own world, torch's rank of global rank r is its index in the group
        self._own = topo.group_ranks(self.coords.group)
        self.stats = stats if stats is not None else CommStats()
        self.timeout = timeout
        self.exchange_max_ctas = exchange_max_ctas
        self.group_ranks: dict[str, list[int]] = {}
        dims = MESH_DIMS[1:] if self.group_world else MESH_DIMS
        self.groups: dict[str, dist.ProcessGroup] = {d: self.new_groups(topo.dim_groups(d), d) for d in dims}
        mesh = topo.mesh()
        if self.group_world:
            self.group_ranks["fed"] = topo.dim_groups("fed")[self.coords.index]
            mesh = [[self._own.index(r) for r in row] for row in mesh[self.coords.group]]  # (R, S)
        # NOTE: a DeviceMesh built by DeviceMesh(...) / init_device_mesh creates its dims' groups
        # with torch's default 30-minute timeout: a frozen rank would hang FSDP's collectives
        # that long. The mesh is built on our own groups instead, which carry ``timeout``.
        self.device_mesh: DeviceMesh = DeviceMesh.from_group(
            [self.groups[d] for d in dims], device_type,
            torch.tensor(mesh, dtype=torch.int), mesh_dim_names=dims)
        self.groups["group"] = self.new_groups(topo.dim_groups("group"), "group")
        if hierarchical:
            for base in ("shard", "group"):
                intra_all, inter_all = [], []
                for ranks in topo.dim_groups(base):
                    intra, inter = topo.node_split(ranks)
                    intra_all += intra
                    inter_all += inter
                self.groups[f"{base}_intra"] = self.new_groups(intra_all, f"{base}_intra")
                self.groups[f"{base}_inter"] = self.new_groups(inter_all, f"{base}_inter")

    def new_groups(self, lists: list[list[int]], name: str):
        """One process group per rank list (global ranks), this rank's returned and recorded
        under ``name`` (collective: every rank calls it with the same lists). In a group's own
        world only the lists inside the group exist, in torch's (group) ranks."""
        import torch.distributed as dist

        mine = None
        for ranks in lists:  # NOTE: every rank must create every group, in the same order
            if self.group_world and not set(ranks) <= set(self._own):
                continue
            local = [self._own.index(r) for r in ranks] if self.group_world else ranks
            g = dist.new_group(local, timeout=self.timeout, use_local_synchronization=False,
                               pg_options=self._pg_options(name))
            if self.rank in ranks:
                mine, self.group_ranks[name] = g, list(ranks)
        return mine

    def _pg_options(self, name: str) -> Any:
        """On NCCL, the exchange's groups (``fed``, ``replicate_exchange``) get the CTA cap
        (:data:`~flcomm.comm.base.EXCHANGE_MAX_CTAS`): their slow transfers run beside
        compute. Every other group keeps NCCL's defaults."""
        import torch.distributed as dist

        from flcomm.comm.torch_pg import nccl_options

        if name not in EXCHANGE_GROUPS or self.exchange_max_ctas is None or dist.get_backend() != "nccl":
            return None
        return nccl_options(self.timeout, max_ctas=self.exchange_max_ctas)

    def global_ranks(self, ranks: Sequence[int]) -> list[int]:
        """Global ranks of torch.distributed ranks (different only in a group's own world)."""
        return [self._own[r] for r in ranks] if self.group_world else list(ranks)

    def describe(self, name: str) -> str:
        """``'group NAME (ranks [...])'``: how an error names a process group."""
        return f"group {name!r} (ranks {self.group_ranks.get(name)})"

    def tier(self, name: str) -> LinkTier:
        return self.topology.tier(self.group_ranks[name], "fed" if name == "fed" else None)

    def hierarchy(self, base: str = "shard") -> Hierarchy:
        """The :class:`~flcomm.collectives.hierarchical.Hierarchy` (intra-node and inter-node
        transports) of group ``base`` ("shard" or "group"); needs ``hierarchical=True``."""
        from flcomm.collectives.hierarchical import Hierarchy

        if base not in ("shard", "group"):
            raise ValueError(f"base must be 'shard' or 'group', got {base!r}")
        for name in (f"{base}_intra", f"{base}_inter"):
            if name not in self.groups:
                raise ValueError(f"FedMesh has no {name!r} group: build it with hierarchical=True")
        return Hierarchy(self.transport(f"{base}_intra"), self.transport(f"{base}_inter"))

    def transport(self, name: str) -> TorchTransport:
        """A TorchTransport on group ``name``, counting into this mesh's shared stats."""
        from flcomm.comm.torch_pg import TorchTransport

        if name not in self.groups:
            hint = " (the fed dim of an elastic federation is its Federation's transport)" if name == "fed" else ""
            raise KeyError(f"no process group {name!r}; have {sorted(self.groups)}{hint}")
        return TorchTransport(self.groups[name], self.tier(name), self.stats, self.timeout)
