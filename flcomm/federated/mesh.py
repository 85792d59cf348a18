"""The runtime half of a :class:`~flcomm.federated.topology.Topology`: a rank's
:class:`FedMesh` (its DeviceMesh, process groups and transports), made by :func:`init_fed_mesh`
from the topology and a :class:`MeshConfig` (the mesh's settings), as
``torch.distributed.device_mesh.init_device_mesh`` makes a DeviceMesh."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from flcomm.comm.base import DEFAULT_TIMEOUT, EXCHANGE_MAX_CTAS, CommStats, LinkTier, Transport
from flcomm.enums import Choice
from flcomm.federated.topology import MESH_DIMS, Topology
from flcomm.validate import integer

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from flcomm.collectives.hierarchical import Hierarchy
    from flcomm.comm.nccl import NcclTransport

__all__ = ["EXCHANGE_GROUPS", "FedMesh", "MeshConfig", "TransportKind", "init_fed_mesh"]

# the groups whose collectives a FedAvg job issues from the progress engine's thread, beside
# FSDP's own: the exchange's and the flags' agreement (review item H3). They get the CTA cap
# (:meth:`FedMesh._pg_options`, :meth:`FedMesh._split`), so they leave compute its SMs.
EXCHANGE_GROUPS = ("fed", "replicate_exchange", "flags_agree")


class TransportKind(Choice, what="transport"):
    """What flcomm's own collectives run on: torch.distributed's process groups, or flcomm's
    native NCCL communicators."""

    TORCH = "torch"
    NATIVE = "native"


@dataclass(frozen=True)
class MeshConfig:
    """Every setting of a :class:`FedMesh`, checked when it is made (a bad value raises
    ValueError naming the field, what is allowed and what came). The trainer's
    ``TrainConfig.mesh`` and an elastic :class:`~flcomm.federated.elastic.Federation` read the
    same object.

    Fields:
        transport: what flcomm's own collectives run on (the hooks, FedAvg's exchange):
            ``"torch"``, torch.distributed's process groups; ``"native"``, flcomm's NCCL
            communicators (CUDA only), one root per process and every tier split from it. FSDP's
            DeviceMesh stays on torch's process groups either way.
        node_tiers: also make the intra-node and inter-node groups of the shard dim and of the
            federation group (``shard_intra`` / ``shard_inter``, ``group_intra`` /
            ``group_inter``), which the hierarchical collectives use.
        timeout: every collective's timeout (a ``timedelta``, or seconds).
        exchange_max_ctas: on NCCL, the CTAs (SMs) each collective of the FedAvg exchange's
            groups may hold (None: NCCL's default); the groups inside a federation group keep
            NCCL's defaults.
        exchange_cta_policy: ``transport="native"`` only, the exchange's communicators' NCCL CTA
            policy (NCCL >= 2.27: ``"default"``, ``"efficiency"``, ``"zero"``; None: NCCL's
            default), beside ``exchange_max_ctas``; checked against the loaded NCCL when the
            mesh is built.
    """

    transport: str = "torch"
    node_tiers: bool = True
    timeout: timedelta = DEFAULT_TIMEOUT
    exchange_max_ctas: int | None = EXCHANGE_MAX_CTAS
    exchange_cta_policy: str | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "transport", TransportKind.parse(self.transport).value)
        if not isinstance(self.node_tiers, bool):
            raise ValueError(f"node_tiers must be True or False, got {self.node_tiers!r}")
        if isinstance(self.timeout, (int, float)) and not isinstance(self.timeout, bool):
            set_(self, "timeout", timedelta(seconds=self.timeout))
        if not isinstance(self.timeout, timedelta) or self.timeout <= timedelta(0):
            raise ValueError(f"timeout must be a positive timedelta (or seconds), got {self.timeout!r}")
        if self.exchange_max_ctas is not None:
            integer("exchange_max_ctas", self.exchange_max_ctas, 1, also=" or None (NCCL's default)")
        if self.exchange_cta_policy is not None and not isinstance(self.exchange_cta_policy, str):
            raise ValueError(f"exchange_cta_policy must be a policy name or None, got {self.exchange_cta_policy!r}")
        if self.exchange_cta_policy is not None and self.transport != TransportKind.NATIVE.value:
            raise ValueError(f"exchange_cta_policy needs transport='native' (torch's ProcessGroupNCCL has no CTA "
                             f"policy option), got exchange_cta_policy={self.exchange_cta_policy!r} with "
                             f"transport='{self.transport}'")

    @property
    def transport_kind(self) -> TransportKind:
        return TransportKind(self.transport)

    @classmethod
    def make(cls, config: MeshConfig | None = None, **settings: Any) -> MeshConfig:
        """``config`` with ``settings`` replaced (a new default config when None); TypeError naming
        an unknown setting."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(settings) - set(names))
        if unknown:
            hint = " (hierarchical is node_tiers)" if "hierarchical" in unknown else ""
            raise TypeError(f"unknown mesh setting(s) {unknown}{hint}; the settings are: {', '.join(names)}")
        if config is not None and not isinstance(config, cls):
            raise TypeError(f"config must be a MeshConfig, got {type(config).__name__}")
        return dataclasses.replace(config, **settings) if config is not None else cls(**settings)


def init_fed_mesh(topology: Topology, device_type: str = "cpu", config: MeshConfig | None = None, *,
                  stats: CommStats | None = None, group_rank: int | None = None, **settings: Any) -> FedMesh:
    """This rank's :class:`FedMesh` of ``topology`` (collective: every rank calls it, once
    torch.distributed is initialized), as ``init_device_mesh`` makes a DeviceMesh.

    ``config``: the :class:`MeshConfig`; keyword ``settings`` replace fields of it (or of the
    default): ``init_fed_mesh(topo, "cuda", transport="native", timeout=timedelta(minutes=2))``.
    ``stats``: the :class:`~flcomm.comm.base.CommStats` the transports count into (a new one by
    default). ``group_rank``: torch.distributed's world is this rank's federation group only
    (elastic federation: each group is its own world) and this is the rank's global rank; the
    mesh then has the group's dims only, and the "fed" dim is left to the federation."""
    return FedMesh(topology, device_type, MeshConfig.make(config, **settings), stats=stats, group_rank=group_rank)


def cta_policy_value(name: str | None) -> int | None:
    """The NCCL value of CTA policy ``name`` for the exchange's communicators (None: NCCL's
    default), refused before anything is built unless it is one of the loaded NCCL's policies
    (:class:`MeshConfig` refuses one without the native transport)."""
    if name is None:
        return None
    from flcomm.comm.nccl import library

    policies = dict(getattr(library(), "NCCL_CTA_POLICIES", {}))
    if name not in policies:
        have = ", ".join(sorted(policies)) or "none (NCCL >= 2.27 has them)"
        raise ValueError(f"exchange_cta_policy must be one of the loaded NCCL's CTA policies ({have}), got {name!r}")
    return int(policies[name])


class FedMesh:
    """A rank's view of a :class:`Topology` once torch.distributed is initialized: the
    DeviceMesh ("fed", "replicate", "shard"), the process groups of each tier, and transports on
    them sharing one :class:`CommStats`.

    Groups (all ranks create all of them, in the same order):
      ``shard``, ``replicate``, ``fed``, ``group`` (all G ranks of my federation group), and for
      the hierarchical collectives of the shard dim, ``shard_intra`` (my shard group's ranks on
      my node) and ``shard_inter`` (my shard group's ranks with my local position on the
      other nodes); the same for ``group_intra`` / ``group_inter``.

    With ``transport="native"`` the transports are flcomm's NCCL communicators instead: one root
    over torch's world (its unique id through the c10d store), and one ``ncclCommSplit`` of it
    per tier, colored by the tier's groups; the exchange's communicators carry the CTA cap. The
    process groups above still exist for FSDP's DeviceMesh and the trainer; the intra/inter-node
    tiers are communicators only.
    """

    def __init__(self, topo: Topology, device_type: str, config: MeshConfig, *, stats: CommStats | None = None,
                 group_rank: int | None = None) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        self.config = config
        if not dist.is_initialized():
            raise RuntimeError("init_fed_mesh needs torch.distributed to be initialized first")
        if self.transport_kind is TransportKind.NATIVE:
            _check_native(device_type)
        self._cta_policy = cta_policy_value(config.exchange_cta_policy)
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
        self._group_ranks = topo.group_ranks(self.coords.group)
        self.stats = stats if stats is not None else CommStats()
        self.group_ranks: dict[str, list[int]] = {}
        dims = MESH_DIMS[1:] if self.group_world else MESH_DIMS
        self.groups: dict[str, dist.ProcessGroup] = {d: self.new_groups(topo.dim_groups(d), d) for d in dims}
        mesh = topo.mesh()
        if self.group_world:
            self.group_ranks["fed"] = topo.dim_groups("fed")[self.coords.index]
            mesh = [[self._group_ranks.index(r) for r in row] for row in mesh[self.coords.group]]  # (R, S)
        # NOTE: a DeviceMesh built by DeviceMesh(...) / init_device_mesh creates its dims' groups
        # with torch's default 30-minute timeout: a frozen rank would hang FSDP's collectives
        # that long. The mesh is built on our own groups instead, which carry ``timeout``.
        self.device_mesh: DeviceMesh = DeviceMesh.from_group(
            [self.groups[d] for d in dims], device_type,
            torch.tensor(mesh, dtype=torch.int), mesh_dim_names=dims)
        self.groups["group"] = self.new_groups(topo.dim_groups("group"), "group")
        self._native: dict[str, NcclTransport] = {}
        self._private: dict[str, tuple[str, Transport]] = {}  # name -> (dim, transport)
        #: ``observe(transport, name)``: what :meth:`transport` hands out instead (e.g. the
        #: trainer's failure report noting each collective); None: the transport itself
        self.observe: Callable[[Transport, str], Transport] | None = None
        tiers = {d: topo.dim_groups(d) for d in (*dims, "group")}
        if config.node_tiers:
            for base in ("shard", "group"):
                intra_all, inter_all = [], []
                for ranks in topo.dim_groups(base):
                    intra, inter = topo.node_split(ranks)
                    intra_all += intra
                    inter_all += inter
                tiers[f"{base}_intra"], tiers[f"{base}_inter"] = intra_all, inter_all
                if self.transport_kind is TransportKind.TORCH:
                    self.groups[f"{base}_intra"] = self.new_groups(intra_all, f"{base}_intra")
                    self.groups[f"{base}_inter"] = self.new_groups(inter_all, f"{base}_inter")
        if self.transport_kind is TransportKind.NATIVE:
            self._build_native(tiers)

    def new_groups(self, lists: list[list[int]], name: str):
        """One process group per rank list (global ranks), this rank's returned and recorded
        under ``name`` (collective: every rank calls it with the same lists). In a group's own
        world only the lists inside the group exist, in torch's (group) ranks."""
        import torch.distributed as dist

        mine = None
        for ranks in lists:  # NOTE: every rank must create every group, in the same order
            if self.group_world and not set(ranks) <= set(self._group_ranks):
                continue
            local = self._torch_ranks(ranks)
            g = dist.new_group(local, timeout=self.timeout, use_local_synchronization=False,
                               pg_options=self._pg_options(name))
            if self.rank in ranks:
                mine, self.group_ranks[name] = g, list(ranks)
        return mine

    def _mine(self, lists: list[list[int]]) -> tuple[int, int, list[int]] | None:
        """(index of my list, my position in it, the list) among the lists that exist in this
        world (a group's own world has only the lists inside the group); None if in none."""
        lists = [r for r in lists if not self.group_world or set(r) <= set(self._group_ranks)]
        for i, ranks in enumerate(lists):
            if self.rank in ranks:
                return i, list(ranks).index(self.rank), list(ranks)
        return None

    def _build_native(self, tiers: dict[str, list[list[int]]]) -> None:
        """The root communicator and one split of it per tier (collective, in the same order on
        every rank: a split is collective over the root)."""
        from flcomm.comm.nccl import NcclTransport

        self._root = NcclTransport.from_group(None, LinkTier.INTRA_NODE, self.stats, self.timeout)
        for name, lists in tiers.items():
            self._split(name, lists)

    # NOTE: read-only views of the settings the mesh's code reads most
    transport_kind = property(lambda self: self.config.transport_kind)
    timeout = property(lambda self: self.config.timeout)
    exchange_max_ctas = property(lambda self: self.config.exchange_max_ctas)

    def _split(self, name: str, lists: list[list[int]]) -> NcclTransport | None:
        mine = self._mine(lists)
        color, key = (mine[0], mine[1]) if mine is not None else (-1, 0)
        if mine is not None:
            self.group_ranks[name] = mine[2]
        cap, policy = (self.exchange_max_ctas, self._cta_policy) if name in EXCHANGE_GROUPS else (None, None)
        t = self._root.split(color, key, self.tier(name) if mine is not None else None, max_ctas=cap,
                             cta_policy=policy)
        if t is not None:
            t.ranks = self._torch_ranks(self.group_ranks[name])
            self._native[name] = t
        return t

    def _torch_ranks(self, ranks: Sequence[int]) -> list[int]:
        """torch.distributed's ranks of global ranks (the inverse of :meth:`global_ranks`)."""
        return [self._group_ranks.index(r) for r in ranks] if self.group_world else list(ranks)

    def private_transport(self, name: str, dim: str) -> Transport:
        """A transport per group of ``dim`` (this rank's returned), of its own, named ``name``:
        for collectives that must not interleave with the dim's own, e.g. those a job of the
        progress engine issues from its thread. A process group, or a split of the native root.
        Collective the first time a name is asked for (every rank asks, in the same order); later
        calls return the same transport (the jobs of one engine lane run one after another)."""
        if name in self._private:
            if self._private[name][0] != dim:
                raise ValueError(f"private transport {name!r} is over dim {self._private[name][0]!r}, not {dim!r}")
            return self._private[name][1]
        if self.transport_kind is TransportKind.NATIVE:
            t: Transport | None = self._split(name, self.topology.dim_groups(dim))
            assert t is not None  # NOTE: every rank is in one group of every dim
        else:
            from flcomm.comm.torch_pg import TorchTransport

            mine = self.new_groups(self.topology.dim_groups(dim), name)
            t = TorchTransport(mine, self.tier(name), self.stats, self.timeout)
        self._private[name] = (dim, t)
        return t

    def exchange_replicate_transport(self, sharded: bool | None, elastic: bool = False) -> Transport | None:
        """The transport a sharded exchange gathers its slices over, or None when it does not shard:
        ``sharded`` None means "when the topology has R > 1 replicas" (FL+HSDP); False never; True
        when R > 1 (with R = 1 there is nothing to shard).

        ``elastic`` (an elastic federation): never sharded, and True is refused. The replicas'
        gather runs on a group that lives across generations: after an aborted round one replica
        may have issued it and the other not, so the redo would meet it out of step (the survivors
        hang on the torch transport; on the native one the watchdog aborts it for good). Each
        replica then exchanges its whole shard over its own generation's fed transport.

        Collective: every rank calls it with the same ``sharded``. The first call on a mesh creates a
        private transport per replicate-dim group (:meth:`private_transport`, with the mesh's
        timeout), counting into the mesh's stats on the replicate dim's tier; later calls reuse it
        (the exchanges of one engine lane run one after another, as they share the shard peers' transport).

        NOTE: not the mesh's own replicate group: HSDP all-reduces gradients on that one from the
        training loop, and an overlapped exchange issuing there from the engine's thread would
        interleave with it differently on different ranks.
        """
        topo = self.topology
        if elastic and sharded and topo.num_replicas > 1:
            raise ValueError("sharded_exchange=True cannot run in an elastic federation: the replicas' gather does "
                             "not survive an aborted round; leave it None (each replica exchanges its whole shard)")
        if sharded is False or elastic or topo.num_replicas == 1 or not topo.federated:
            return None
        return self.private_transport("replicate_exchange", "replicate")

    def native_transports(self) -> list[Transport]:
        """The native communicators' transports (the tiers' splits, the private ones, the root):
        what a watchdog may have aborted. Empty for a torch mesh."""
        if not self._native:
            return []
        private = [t for _, t in self._private.values() if t not in self._native.values()]
        return [*self._native.values(), *private, self._root]

    def close(self) -> None:
        """Free the native communicators (the splits, then the root); the process groups are
        torch.distributed's to destroy. Nothing for a torch mesh."""
        for t in [*self._native.values(), *([self._root] if self._native else [])]:
            t.close()
        self._native.clear()

    def _pg_options(self, name: str) -> Any:
        """On NCCL, the exchange's groups (:data:`EXCHANGE_GROUPS`) get the CTA cap
        (:data:`~flcomm.comm.base.EXCHANGE_MAX_CTAS`): their slow transfers run beside
        compute. Every other group keeps NCCL's defaults."""
        import torch.distributed as dist

        from flcomm.comm.torch_pg import nccl_options

        if name not in EXCHANGE_GROUPS or self.exchange_max_ctas is None or dist.get_backend() != "nccl":
            return None
        return nccl_options(self.timeout, max_ctas=self.exchange_max_ctas)

    def global_ranks(self, ranks: Sequence[int]) -> list[int]:
        """Global ranks of torch.distributed ranks (different only in a group's own world)."""
        return [self._group_ranks[r] for r in ranks] if self.group_world else list(ranks)

    def describe(self, name: str) -> str:
        """``'group NAME (ranks [...])'``: how an error names a process group."""
        return f"group {name!r} (ranks {self.group_ranks.get(name)})"

    def tier(self, name: str) -> LinkTier:
        return self.topology.tier(self.group_ranks[name], "fed" if name == "fed" else None)

    def hierarchy(self, base: str = "shard") -> Hierarchy:
        """The :class:`~flcomm.collectives.hierarchical.Hierarchy` (intra-node and inter-node
        transports) of group ``base`` ("shard" or "group"); needs ``node_tiers=True``."""
        from flcomm.collectives.hierarchical import Hierarchy

        if base not in ("shard", "group"):
            raise ValueError(f"base must be 'shard' or 'group', got {base!r}")
        for name in (f"{base}_intra", f"{base}_inter"):
            if name not in self.groups and name not in self._native:
                raise ValueError(f"FedMesh has no {name!r} group: build it with node_tiers=True")
        return Hierarchy(self.transport(f"{base}_intra"), self.transport(f"{base}_inter"))

    def transport(self, name: str) -> Transport:
        """The transport of group ``name``, counting into this mesh's shared stats: a
        TorchTransport on its process group, or (``transport="native"``) its NcclTransport;
        passed through :attr:`observe` when set (the private transports are not)."""
        from flcomm.comm.torch_pg import TorchTransport

        if self.transport_kind is TransportKind.NATIVE and name in self._native:
            t: Transport = self._native[name]
        elif name not in self.groups:
            hint = " (the fed dim of an elastic federation is its Federation's transport)" if name == "fed" else ""
            raise KeyError(f"no process group {name!r}; have {sorted(self.groups)}{hint}")
        else:
            t = TorchTransport(self.groups[name], self.tier(name), self.stats, self.timeout)
        return self.observe(t, name) if self.observe is not None else t


def _check_native(device_type: str) -> None:
    """Refuse a native mesh before any group is made: NCCL must load, on the device type its
    communicators run on."""
    from flcomm.comm import nccl

    ok, reason = nccl.nccl_available()
    if not ok:
        raise RuntimeError(f"init_fed_mesh(transport='native'): {reason}; transport='torch' runs anywhere")
    if device_type != nccl.device_type():
        raise ValueError(f"init_fed_mesh(transport='native') runs on {nccl.device_type()!r} devices (NCCL), "
                         f"got device_type {device_type!r}")
