"""Federation topology: which rank is in which federation group, replica, shard and node.

World of P ranks on P / L nodes (L ranks per node), split into F federation groups of G ranks.
Inside a group: FSDP over G ranks (S = G), or HSDP with R = G / S replicas of S-way shards
(normally S = L, one node per shard group). Across groups, ranks with the same
(replica, shard) coordinates average their shards ("fed" dim). Mesh dims:
("fed", "replicate", "shard") of shape (F, R, S). F = 1 is plain FSDP/HSDP.

Groups are contiguous rank blocks (group = rank // G), as in the paper's code, unless
``node_groups`` assigns whole nodes to groups explicitly.

A :class:`Topology` is a pure description (the cost model uses it without torch.distributed);
:meth:`Topology.build` makes the runtime :class:`~flcomm.federated.mesh.FedMesh` of a rank. The
four strategies' topologies: :meth:`Strategy.topology <flcomm.federated.strategy.Strategy.topology>`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from flcomm.comm.base import DEFAULT_TIMEOUT, EXCHANGE_MAX_CTAS, CommStats, LinkTier
from flcomm.validate import integer

if TYPE_CHECKING:
    from flcomm.federated.mesh import FedMesh

MESH_DIMS = ("fed", "replicate", "shard")


@dataclass(frozen=True)
class RankCoords:
    rank: int
    node: int          # rank // ranks_per_node
    local_rank: int    # rank % ranks_per_node
    group: int         # federation group f
    index: int         # position inside the group, replica * S + shard
    replica: int       # r in [0, R)
    shard: int         # s in [0, S)


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
              group_rank: int | None = None, exchange_max_ctas: int | None = EXCHANGE_MAX_CTAS,
              transport: str = "torch", exchange_cta_policy: str | None = None) -> FedMesh:
        """Deprecated (for one release): ``flcomm.init_fed_mesh(topology, device_type, ...)``,
        whose :class:`~flcomm.federated.mesh.MeshConfig` holds these settings
        (``hierarchical`` is its ``node_tiers``)."""
        import warnings

        # NOTE: the one import of the runtime half, and the one circle topology <-> mesh; both go
        # with this alias
        from flcomm.federated.mesh import init_fed_mesh

        warnings.warn("Topology.build() is deprecated: use flcomm.init_fed_mesh(topology, device_type, ...) "
                      "(hierarchical= is node_tiers=)", DeprecationWarning, stacklevel=2)
        return init_fed_mesh(self, device_type, stats=stats, group_rank=group_rank, timeout=timeout,
                             node_tiers=hierarchical, exchange_max_ctas=exchange_max_ctas, transport=transport,
                             exchange_cta_policy=exchange_cta_policy)
