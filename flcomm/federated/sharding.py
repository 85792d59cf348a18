"""FedAvg's checks at construction and at every step against training wrongly without a word.

* :func:`check_sharding` (at construction): the model's sharding matches the topology. Every
  FSDP2 parameter is sharded over exactly the FedMesh's ``shard`` dim and, with R > 1 replicas
  (FL+HSDP), replicated over exactly its ``replicate`` dim; FSDP1 units shard over the
  ``shard`` group (and, R > 1, replicate over the ``replicate`` group, HYBRID_SHARD); a
  DistributedDataParallel module replicates over the whole federation group. Compared by the
  global ranks of the groups, not by object identity (a mesh of one's own over the same ranks
  is fine). A trainable plain parameter (no FSDP, no DDP) in a group of more than one rank is
  refused unless the user says it is kept equal by other means (``replicated=True``).
* :class:`StepOrder`: ``FedAvg.step()`` must follow ``optimizer.step()``; a step post-hook of
  the optimizer FedAvg is given counts its steps or, given none, a global one those of any
  torch optimizer over the model's parameters.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

if TYPE_CHECKING:
    from flcomm.federated.mesh import FedMesh

__all__ = ["StepOrder", "check_sharding"]


def _fix(replicate: bool) -> str:
    dims = "'replicate', 'shard'" if replicate else "'shard'"
    return f"fully_shard(module, mesh=fed_mesh.device_mesh[{dims}]) for every unit and the root"


def _dims_ranks(dm: Any, dims: list[int]) -> list[int]:
    """The ranks of DeviceMesh ``dm`` that differ from this rank only along ``dims``."""
    coord = dm.get_coordinate()
    if coord is None:  # NOTE: this rank is not in the mesh: all of it is "elsewhere"
        return sorted(int(r) for r in dm.mesh.flatten().tolist())
    index = tuple(slice(None) if i in dims else c for i, c in enumerate(coord))
    return sorted(int(r) for r in dm.mesh[index].flatten().tolist())


def _expect(mesh: FedMesh) -> tuple[list[int], list[int]]:
    """The ranks a tensor of this rank must be sharded and replicated over."""
    rep = mesh.group_ranks.get("replicate", [mesh.rank]) if mesh.topology.num_replicas > 1 else [mesh.rank]
    return sorted(mesh.group_ranks["shard"]), sorted(rep)


def _compare(what: str, sharded: list[int], replicated: list[int], mesh: FedMesh, fix: str) -> None:
    """ValueError unless ``sharded`` / ``replicated`` (global ranks) are what the topology says."""
    group = mesh.group_ranks["group"]
    if not set(sharded) | set(replicated) <= set(group):
        raise ValueError(
            f"{what} is sharded or replicated over ranks {sorted(set(sharded) | set(replicated))}, which leave the "
            f"federation group of rank {mesh.rank} (ranks {group}): shard the model inside its group only "
            f"({fix}), or the groups would not train independently")
    want_s, want_r = _expect(mesh)
    if (sharded, replicated) != (want_s, want_r):
        t = mesh.topology
        hsdp = t.num_replicas > 1
        drift = (" (replicated over too few ranks, the replicas never all-reduce their gradients and drift apart)"
                 if hsdp and replicated != want_r else "")
        raise ValueError(
            f"{what} is sharded over ranks {sharded} and replicated over ranks {replicated}, but the topology "
            f"(G={t.group_size}, S={t.shard_size}, R={t.num_replicas}) expects it sharded over the FedMesh's 'shard' "
            f"dim, ranks {want_s}" + (f", and replicated over its 'replicate' dim, ranks {want_r}" if hsdp else "")
            + f"{drift}: use {fix}")


def _check_dtensor(name: str, p: Any, mesh: FedMesh, hooked: dict[int, list[int]]) -> None:
    dm = p.device_mesh
    shard = [i for i, pl in enumerate(p.placements) if pl.is_shard()]
    rep = [i for i, pl in enumerate(p.placements) if pl.is_replicate()]
    replicated = sorted(mesh.global_ranks(_dims_ranks(dm, rep)))
    if replicated == [mesh.rank] and id(p) in hooked:  # NOTE: an all-reduce hook replicates it
        replicated = hooked[id(p)]
    _compare(f"parameter {name!r}", sorted(mesh.global_ranks(_dims_ranks(dm, shard))),
             replicated, mesh, _fix(mesh.topology.num_replicas > 1))


def _hook_replicas(model: nn.Module, mesh: FedMesh) -> dict[int, list[int]]:
    """{id(parameter): global ranks} of the FSDP2 parameters whose gradients an all-reduce hook
    (``set_all_reduce_hook``, e.g. flcomm.fsdp's ReplicateAllReduceHook) reduces over a
    transport's ranks."""
    out: dict[int, list[int]] = {}
    for m in model.modules():
        state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
        groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
        for g in groups:
            ranks = getattr(getattr(getattr(g, "_all_reduce_hook", None), "transport", None), "ranks", None)
            if g is not None and ranks is not None:
                out.update({id(fp.sharded_param): sorted(mesh.global_ranks(ranks)) for fp in g.fsdp_params})
    return out


def _pg_ranks(pg: Any, mesh: FedMesh) -> list[int]:
    import torch.distributed as dist

    return sorted(mesh.global_ranks(dist.get_process_group_ranks(pg))) if pg is not None else [mesh.rank]


def _check_fsdp1(model: nn.Module, mesh: FedMesh) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy as SS

    t = mesh.topology
    hsdp = t.num_replicas > 1
    fix = ("FullyShardedDataParallel(model, process_group=(fed_mesh.groups['shard'], fed_mesh.groups['replicate']), "
           "sharding_strategy=ShardingStrategy.HYBRID_SHARD)" if hsdp else
           "FullyShardedDataParallel(model, process_group=fed_mesh.groups['shard'])")
    if hsdp and t.shard_size == 1:
        fix += (" (FSDP1 turns HYBRID_SHARD over a one-rank shard group into NO_SHARD, which drops the replicate "
                "group: with S = 1 use sharding_strategy=NO_SHARD, process_group=fed_mesh.groups['replicate'], "
                "or FSDP2)")
    for i, unit in enumerate(FSDP.fsdp_modules(model)):
        if getattr(unit, "_handle", None) is None:
            continue
        pg, strategy = _pg_ranks(unit.process_group, mesh), unit.sharding_strategy
        if strategy == SS.NO_SHARD:  # NOTE: its process group replicates
            sharded, replicated = [mesh.rank], pg
        elif strategy in (SS.HYBRID_SHARD, SS._HYBRID_SHARD_ZERO2):
            sharded, replicated = pg, _pg_ranks(getattr(unit, "_inter_node_pg", None), mesh)
        else:
            sharded, replicated = pg, [mesh.rank]
        _compare(f"FSDP1 unit {i} ({type(unit.module).__name__}, {strategy.name})", sharded, replicated, mesh, fix)


def _ddp_params(model: nn.Module, mesh: FedMesh) -> set[int]:
    """The parameters DistributedDataParallel keeps equal (checked: over the whole group)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out: set[int] = set()
    for m in model.modules():
        if isinstance(m, DDP):
            ranks, group = _pg_ranks(m.process_group, mesh), sorted(mesh.group_ranks["group"])
            if ranks != group:
                raise ValueError(f"DistributedDataParallel replicates over ranks {ranks}, but rank {mesh.rank}'s "
                                 f"federation group is ranks {group}: use DistributedDataParallel(module, "
                                 "process_group=fed_mesh.groups['group'])")
            out |= {id(p) for p in m.module.parameters()}
    return out


def check_sharding(model: nn.Module, mesh: FedMesh, kind: str, replicated: bool) -> None:
    """ValueError when the model's sharding does not match the topology of ``mesh`` (module
    docstring); ``kind``: :func:`~flcomm.federated.shards.model_kind`'s."""
    from flcomm.federated.shards import is_dtensor

    if kind == "fsdp1":
        _check_fsdp1(model, mesh)
        return
    kept = _ddp_params(model, mesh)
    plain = []
    hooked = _hook_replicas(model, mesh)
    for name, p in model.named_parameters():
        if is_dtensor(p):
            _check_dtensor(name, p, mesh, hooked)
        elif id(p) not in kept and p.is_floating_point() and p.requires_grad:  # NOTE: a frozen one cannot drift
            plain.append(name)
    group = mesh.group_ranks["group"]
    if plain and len(group) > 1 and not replicated:
        more = f" (and {len(plain) - 1} more)" if len(plain) > 1 else ""
        raise ValueError(
            f"parameter {plain[0]!r}{more} is a plain tensor (not sharded by FSDP, not in DistributedDataParallel) "
            f"in a federation group of {len(group)} ranks ({group}): nothing keeps it equal across the group, whose "
            f"ranks would train apart. Use {_fix(mesh.topology.num_replicas > 1)}, or "
            "DistributedDataParallel(module, process_group=fed_mesh.groups['group']), or pass "
            "FedAvg(..., replicated=True) if you keep it equal yourself (your own gradient all-reduce)")


class StepOrder:
    """``FedAvg.step()`` must come after ``optimizer.step()``: called before it, the groups end
    apart by the last local step (about 1e-2 on the README's loop), with no other sign.

    Rules (:meth:`check` runs at every ``FedAvg.step()``):

    1. An optimizer FedAvg is given (``FedAvg(inner_optimizer=)``, :meth:`FedAvg.attach`) counts its
       steps through a step post-hook of its own; a FedAvg step with none since the previous one
       is refused (unless ``skipped=True``).
    2. Without one, a global optimizer step post-hook
       (``torch.optim.optimizer.register_optimizer_step_post_hook``) counts the steps of every
       torch optimizer that holds one of the model's parameters. From the first such step on,
       rule 1 holds. A FedAvg step before any such step, with none before it, is remembered and
       refused at the first FedAvg step after an optimizer step showed that there is one (the
       loop that calls ``fed.step()`` before ``optimizer.step()`` stops at its second step).
    3. A loop with no torch optimizer over the model's parameters is never refused.

    The global hook holds the checker weakly and goes when it does."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, model: nn.Module | None = None) -> None:
        self.pending = 0
        self._watched: set[int] = set()
        self._seen = False  # NOTE: rule 2: an optimizer over the model's parameters stepped
        self._early: int | None = None
        self._params = {id(p) for p in model.parameters()} if model is not None else set()
        self._holds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        if optimizer is not None:
            self.watch(optimizer)
        elif self._params:
            me = weakref.ref(self)

            def seen(opt: torch.optim.Optimizer, *_: Any) -> None:
                if (order := me()) is not None:
                    order._seen_step(opt)

            weakref.finalize(self, register_optimizer_step_post_hook(seen).remove)

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer``'s steps (once per optimizer; before any hook registered later)."""
        if id(optimizer) not in self._watched:
            self._watched.add(id(optimizer))
            optimizer.register_step_post_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.pending += 1

    def _seen_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Rule 2: a step of ``optimizer``, counted when it holds one of the model's parameters."""
        if id(optimizer) in self._watched:
            return  # NOTE: counted by its own hook
        holds = self._holds.get(optimizer)
        if holds is None:
            holds = self._holds[optimizer] = any(id(p) in self._params for g in optimizer.param_groups
                                                 for p in g["params"])
        if holds:
            self._seen = True
            self.pending += 1

    def check(self, step: int, skipped: bool) -> None:
        """RuntimeError when local step ``step`` came with no optimizer step (and not ``skipped``),
        or (rule 2) an earlier one did."""
        if not skipped and (self._watched or self._seen):
            if self._early is not None:
                raise RuntimeError(
                    f"FedAvg.step() for local step {self._early} came before any optimizer.step() of an "
                    "optimizer holding the model's parameters (one has stepped since): " + _ORDER_FIX)
            if not self.pending:
                raise RuntimeError(f"FedAvg.step() for local step {step} came with no optimizer.step() since the "
                                   "previous FedAvg.step(): " + _ORDER_FIX)
        elif not skipped and self._early is None:
            self._early = step
        self.pending = 0


_ORDER_FIX = ("call fed.step() once after optimizer.step() in every step (before it, the groups end apart by the "
              "last local step), or fed.attach(optimizer) once and no fed.step() by hand; a step whose optimizer "
              "step was skipped on purpose (non-finite gradients) is fed.step(skipped=True)")
