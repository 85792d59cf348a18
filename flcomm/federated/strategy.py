"""The four strategies and the topology each implies: one home for their names, their
properties and the default sizes of their groups.

=========  ===================  ==============================================================
strategy   groups (F, G)        shards (S) and replicas (R = G / S)
=========  ===================  ==============================================================
fsdp       one group, G = P     S = G
hsdp       one group, G = P     S = one node (R >= 2)
fl-fsdp    G = one node         S = G
fl-hsdp    G = two nodes        S = one node inside the group (R >= 2)
=========  ===================  ==============================================================

"One node" is L ranks, or half of the ranks when they all sit on one node (so that there are
still two groups or two replicas); fl-hsdp takes two nodes per group only when that leaves two
or more groups, else it falls back to one node. The driver, the cost model and the strategy
benchmark all resolve a run with :meth:`Strategy.topology`, so they describe the same run by
construction.
"""

from __future__ import annotations

from flcomm.enums import Choice
from flcomm.federated.topology import Topology


def one_node(L: int, n: int) -> int:
    """The default size of a sub-group of ``n`` ranks: one node of ``L`` ranks, or half of the
    ``n`` ranks when they all sit on one node (so there are still two sub-groups)."""
    return L if L < n else max(1, n // 2)


class Strategy(Choice, what="strategy"):
    """One of the four ways to train, by name; the home of their default group sizes.

    Members (the value is the name on the command line, in ``--strategy`` and in the cost model):

    * ``FSDP`` ("fsdp"): one group of all P ranks, sharded over all of them (S = P);
    * ``HSDP`` ("hsdp"): one group, R = P / S replicas of S shards (S: a node by default);
      the replicas all-reduce their gradients every step;
    * ``FL_FSDP`` ("fl-fsdp"): F = P / G federation groups (G: a node by default), FSDP inside each,
      a FedAvg of the shards across groups every E steps;
    * ``FL_HSDP`` ("fl-hsdp"): F groups (two nodes each by default), HSDP inside each (R x S),
      the FedAvg across groups every E steps.

    Made by :meth:`parse` (a member or its name in any case, ``_`` or ``+`` for ``-``:
    ``Strategy.parse("FL+FSDP")``; ValueError listing the names otherwise) or :meth:`of` (the
    strategy a :class:`Topology` runs); :meth:`topology` makes the Topology of a world;
    :meth:`values` lists the names.
    """

    FSDP = "fsdp"
    HSDP = "hsdp"
    FL_FSDP = "fl-fsdp"
    FL_HSDP = "fl-hsdp"

    @classmethod
    def _normalize(cls, text: str) -> str:
        """"FL_FSDP", " fl+fsdp " -> "fl-fsdp" (what :meth:`parse` compares)."""
        return text.strip().lower().replace("_", "-").replace("+", "-")

    @property
    def federated(self) -> bool:
        """Several federation groups, averaged with FedAvg."""
        return self in (Strategy.FL_FSDP, Strategy.FL_HSDP)

    @property
    def hybrid(self) -> bool:
        """Several replicas of each shard inside a group (HSDP)."""
        return self in (Strategy.HSDP, Strategy.FL_HSDP)

    @property
    def inner(self) -> Strategy:
        """What runs inside one federation group: fsdp or hsdp."""
        return Strategy.HSDP if self.hybrid else Strategy.FSDP

    def default_group_size(self, P: int, L: int) -> int:
        """G when none is given (see the module table)."""
        if not self.federated:
            return P
        if self.hybrid and 2 * L < P and P % (2 * L) == 0:
            return 2 * L  # NOTE: two nodes per group, so the HSDP shard group is one node
        return one_node(L, P)

    def default_shard_size(self, G: int, L: int) -> int:
        """S when none is given, for groups of ``G`` ranks."""
        return one_node(L, G) if self.hybrid else G

    def topology(self, world_size: int, ranks_per_node: int, group_size: int | None = None,
                 shard_size: int | None = None) -> Topology:
        """The :class:`Topology` of this strategy on ``world_size`` ranks (P), ``ranks_per_node``
        (L) per node, with federation groups of ``group_size`` ranks (G) and shard groups of
        ``shard_size`` ranks (S); None: the defaults of the module table::

            topo = Strategy.FL_HSDP.topology(world_size, ranks_per_node=8, group_size=16, shard_size=8)

        Raises ValueError naming the numbers when they do not fit the world (Topology's own
        checks) or are not this strategy: a group size other than P for fsdp/hsdp, a shard size
        other than G for fsdp/fl-fsdp, one group for fl-*, one replica for *hsdp.
        """
        P, L, G, S = world_size, ranks_per_node, group_size, shard_size
        if not isinstance(L, int) or isinstance(L, bool) or L < 1 or not isinstance(P, int) or P % L:
            raise ValueError(f"ranks_per_node {L!r} does not divide the world of {P!r} ranks into whole nodes")
        if not self.federated and G is not None and G != P:
            raise ValueError(f"group_size is for the fl-* strategies; {self.value} trains one group of all "
                             f"{P} ranks, got group_size {G}")
        G = self.default_group_size(P, L) if G is None else G
        if not self.hybrid and S is not None and S != G:
            raise ValueError(f"{self.value} shards over the whole group of {G} ranks; got shard_size {S} "
                             f"(use {self.value.replace('fsdp', 'hsdp')})")
        S = self.default_shard_size(G, L) if S is None else S
        topo = Topology(P, L, G, S)  # NOTE: raises with the numbers when something does not divide
        if self.federated and not topo.federated:
            raise ValueError(f"{self.value} needs at least two federation groups, but group_size {G} covers "
                             f"the whole world of {P} ranks; choose a group size < {P} (or strategy "
                             f"{self.inner.value})")
        if self.hybrid and not topo.hybrid:
            raise ValueError(f"{self.value} needs at least two replicas per group, but shard_size {S} equals "
                             f"the group size {G}; choose a shard size < {G} (or strategy "
                             f"{self.value.replace('hsdp', 'fsdp')})")
        return topo

    @classmethod
    def of(cls, topo: Topology) -> Strategy:
        """The strategy a topology runs: federated when it has several groups, hybrid when it
        has several replicas."""
        return {(False, False): cls.FSDP, (False, True): cls.HSDP, (True, False): cls.FL_FSDP,
                (True, True): cls.FL_HSDP}[(topo.federated, topo.hybrid)]
