"""Federation topology: which rank is in which federation group, replica, shard and node.

World of P ranks on P / L nodes (L ranks per node), split into F federation groups of G ranks.
Inside a group: FSDP over G ranks (S = G), or HSDP with R = G / S replicas of S-way shards
(normally S = L, one node per shard group). Across groups, ranks with the same
(replica, shard) coordinates average their shards ("fed" dim). Mesh dims:
("fed", "replicate", "shard") of shape (F, R, S). F = 1 is plain FSDP/HSDP.

Groups are contiguous rank blocks (group = rank // G), as in the paper's code, unless
``node_groups`` assigns whole nodes to groups explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from flcomm.comm.base import DEFAULT_TIMEOUT, EXCHANGE_MAX_CTAS, CommStats, LinkTier
from flcomm.validate import integer

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from flcomm.collectives.hierarchical import Hierarchy
    from flcomm.comm.torch_pg import TorchTransport

MESH_DIMS = ("fed", "replicate", "shard")
EXCHANGE_GROUPS = ("fed", "replicate_exchange")  # the FedAvg exchange's groups (:meth:`FedMesh._pg_options`)


@dataclass(frozen=True)
class RankCoords:
    rank: int
    node: int          # rank // ranks_per_node
    local_rank: int    # rank % ranks_per_node
    group: int         # federation group f
    index: int         # position inside the group, replica * S + shard
    replica: int       # r in [0, R)
    shard: int         # s in [0, S)


def _strategy(name: str):
    # NOTE: strategy.py builds on this module; the factories below are its shortcuts.
    from flcomm.federated.strategy import Strategy

    return Strategy.parse(name)


@dataclass(frozen=True)
class Topology:
    """Federation topology of a world of ``world_size`` ranks.

    Args:
        world_size: P, all ranks.
        ranks_per_node: L, ranks (GPUs) per node; must divide P.
        group_size: G, ranks per federation group (default P: one group, no federation).
        shard_size: S, ranks per shard group inside a federation group (default G: FSDP;
            S < G: HSDP with R = G / S replicas).
        node_groups: optional explicit assignment: ``node_groups[f]`` lists the nodes of group f
            (each node exactly once, G / L nodes per group). Default: contiguous blocks.
    """

    world_size: int
    ranks_per_node: int
    group_size: int | None = None
    shard_size: int | None = None
    node_groups: tuple[tuple[int, ...], ...] | None = None
    _group_ranks: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        P = integer("world_size", self.world_size, 1)
        L = integer("ranks_per_node", self.ranks_per_node, 1)
        G = integer("group_size", self.group_size if self.group_size is not None else P, 1)
        S = integer("shard_size", self.shard_size if self.shard_size is not None else G, 1)
        object.__setattr__(self, "group_size", G)
        object.__setattr__(self, "shard_size", S)
        if P % L:
            raise ValueError(f"world_size {P} is not a whole number of nodes of ranks_per_node {L}")
        if P % G:
            raise ValueError(f"group_size {G} does not divide world_size {P} into federation groups")
        if G % S:
            raise ValueError(f"shard_size {S} does not divide group_size {G} into replicas")
        for name, v in (("group_size", G), ("shard_size", S)):
            if v % L and L % v:
                raise ValueError(f"{name} {v} must be a multiple or a divisor of ranks_per_node {L} "
                                 "(a group or shard must not split a node unevenly)")
        if self.node_groups is None:
            groups = tuple(tuple(range(f * G, (f + 1) * G)) for f in range(P // G))
        else:
            groups = self._explicit_groups(P, L, G)
        object.__setattr__(self, "_group_ranks", groups)

    def _explicit_groups(self, P: int, L: int, G: int) -> tuple[tuple[int, ...], ...]:
        ng = tuple(tuple(int(n) for n in g) for g in self.node_groups)
        object.__setattr__(self, "node_groups", ng)
        if G % L:
            raise ValueError(f"node_groups needs groups of whole nodes: group_size {G} is not a "
                             f"multiple of ranks_per_node {L}")
        if len(ng) != P // G:
            raise ValueError(f"node_groups must list {P // G} groups, got {len(ng)}")
        nodes = sorted(n for g in ng for n in g)
        if nodes != list(range(P // L)):
            raise ValueError(f"node_groups must name every node 0..{P // L - 1} exactly once, got {ng}")
        for f, g in enumerate(ng):
            if len(g) != G // L:
                raise ValueError(f"node_groups[{f}] must list {G // L} nodes, got {len(g)}: {g}")
        return tuple(tuple(n * L + i for n in g for i in range(L)) for g in ng)

    def to_dict(self) -> dict[str, Any]:
        """The topology as plain JSON types: what a checkpoint or a FedAvg state records, and
        what a resume compares."""
        return {"world_size": self.world_size, "ranks_per_node": self.ranks_per_node,
                "group_size": int(self.group_size), "shard_size": int(self.shard_size),
                "mesh_shape": list(self.mesh_shape),
                "node_groups": None if self.node_groups is None else [list(g) for g in self.node_groups]}

    # ---- factories for the four strategies (defaults: flcomm.federated.strategy) ----
    @classmethod
    def fsdp(cls, world_size: int, ranks_per_node: int) -> Topology:
        return _strategy("fsdp").topology(world_size, ranks_per_node)

    @classmethod
    def hsdp(cls, world_size: int, ranks_per_node: int, shard_size: int | None = None) -> Topology:
        return _strategy("hsdp").topology(world_size, ranks_per_node, S=shard_size)

    @classmethod
    def fl_fsdp(cls, world_size: int, ranks_per_node: int, group_size: int | None = None) -> Topology:
        return _strategy("fl-fsdp").topology(world_size, ranks_per_node, G=group_size)

    @classmethod
    def fl_hsdp(cls, world_size: int, ranks_per_node: int, group_size: int | None = None,
                shard_size: int | None = None) -> Topology:
        return _strategy("fl-hsdp").topology(world_size, ranks_per_node, G=group_size, S=shard_size)

    # ---- sizes ----
    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def num_groups(self) -> int:  # F
        return self.world_size // self.group_size

    @property
    def num_replicas(self) -> int:  # R
        return self.group_size // self.shard_size

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        return (self.num_groups, self.num_replicas, self.shard_size)

    @property
    def federated(self) -> bool:
        return self.num_groups > 1

    @property
    def hybrid(self) -> bool:
        return self.num_replicas > 1

    # ---- coordinates ----
    def group_ranks(self, f: int) -> tuple[int, ...]:
        return self._group_ranks[f]

    def mesh(self) -> list[list[list[int]]]:
        """mesh[f][r][s] = global rank."""
        S = self.shard_size
        return [[list(g[r * S:(r + 1) * S]) for r in range(self.num_replicas)] for g in self._group_ranks]

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        for f, g in enumerate(self._group_ranks):
            if rank in g:
                i = g.index(rank)
                return RankCoords(rank, rank // self.ranks_per_node, rank % self.ranks_per_node, f, i,
                                  i // self.shard_size, i % self.shard_size)
        raise AssertionError("unreachable: groups partition the world")

    def dim_groups(self, dim: str) -> list[list[int]]:
        """Every process group of mesh dim ``dim`` ("fed", "replicate", "shard", or "group":
        all ranks of a federation group), each as a list of global ranks; they partition the
        world."""
        m = self.mesh()
        F, R, S = self.mesh_shape
        if dim == "shard":
            return [m[f][r] for f in range(F) for r in range(R)]
        if dim == "replicate":
            return [[m[f][r][s] for r in range(R)] for f in range(F) for s in range(S)]
        if dim == "fed":
            return [[m[f][r][s] for f in range(F)] for r in range(R) for s in range(S)]
        if dim == "group":
            return [list(g) for g in self._group_ranks]
        raise ValueError(f"dim must be one of fed, replicate, shard, group; got {dim!r}")

    def tier(self, ranks: Sequence[int], dim: str | None = None) -> LinkTier:
        """The slowest links a collective over ``ranks`` crosses."""
        if dim == "fed" and self.federated:
            return LinkTier.INTER_GROUP
        nodes = {r // self.ranks_per_node for r in ranks}
        return LinkTier.INTRA_NODE if len(nodes) == 1 else LinkTier.INTER_NODE

    def node_split(self, ranks: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Split an ordered rank list into its two hierarchical stages.

        Returns ``(intra, inter)``: ``intra[n]`` the ranks of the list on its n-th node, and
        ``inter[i]`` the ranks with local position i on every node. Needs the same number of
        ranks on every node, and the list ordered node by node.
        """
        L = self.ranks_per_node
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            by_node.setdefault(r // L, []).append(r)
        intra = list(by_node.values())
        flat = [r for g in intra for r in g]
        if flat != list(ranks):
            raise ValueError(f"ranks must be ordered node by node for a hierarchical split, got {list(ranks)}")
        counts = {len(g) for g in intra}
        if len(counts) != 1:
            raise ValueError(f"hierarchical split needs the same number of ranks on every node, got "
                             f"{ {n: len(g) for n, g in by_node.items()} }")
        k = counts.pop()
        inter = [[g[i] for g in intra] for i in range(k)]
        return intra, inter

    def build(self, device_type: str = "cpu", stats: CommStats | None = None,
              timeout: timedelta = DEFAULT_TIMEOUT, hierarchical: bool = True,
              group_rank: int | None = None, exchange_max_ctas: int | None = EXCHANGE_MAX_CTAS) -> FedMesh:
        """Create the DeviceMesh and the process groups (collective: every rank calls it).

        ``group_rank``: torch.distributed's world is this rank's federation group only (elastic
        federation: each group is its own world) and this is the rank's global rank; the mesh
        then has the group's dims only, and the "fed" dim is left to the federation.
        ``exchange_max_ctas``: on NCCL, the CTAs (SMs) each collective of the FedAvg exchange's
        groups may hold (None: NCCL's default); the groups inside a federation group keep NCCL's
        defaults.
        """
        return FedMesh(self, device_type, stats, timeout, hierarchical, group_rank, exchange_max_ctas)


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
