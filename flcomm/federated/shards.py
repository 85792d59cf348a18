"""The tensors a rank averages with its federation peers: its local parameter shards and buffers.

Three model kinds are recognised, by what their parameters are:

* **FSDP2** (``fully_shard``): parameters are DTensors; the rank's shard is ``p.to_local()``,
  a view of the storage FSDP2 all-gathers from, so writing into it updates the model.
* **FSDP1** (``FullyShardedDataParallel``, ``use_orig_params`` either way): each FSDP unit owns
  one ``FlatParameter`` whose data is the rank's (padded) flat shard between forward passes;
  the original parameters, when exposed, are views into it. The flat parameters are averaged.
* **plain** modules (replicated, e.g. DDP or no wrapper): every parameter whole.

Buffers (running statistics) are never sharded: persistent floating buffers are averaged like
parameters (always a plain average, never through the outer optimizer); integer buffers (e.g.
``num_batches_tracked``) and non-persistent buffers (derived caches such as RoPE tables, equal on
every rank by construction) stay local.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from flcomm._lazy import renamed_attributes

if TYPE_CHECKING:
    from flcomm.comm.base import Transport


@dataclass
class AveragedTensor:
    """One averaged tensor; ``local`` is the rank's own storage (written in place)."""

    name: str
    get: Callable[[], Tensor]
    is_param: bool
    coord: tuple[int, ...]  # the rank's position among the ranks sharding this tensor
    numel: int = 0  # elements of the whole (unsharded) tensor: the same on every rank

    @property
    def local(self) -> Tensor:
        # NOTE: fetched on every use, not cached: FSDP2's lazy init re-pads the sharded storage
        # (a new local tensor) and FSDP1 swaps ``flat_param.data`` between shard and full views.
        return self.get()


# NOTE: the old name, for one release
__getattr__ = renamed_attributes(__name__, {"Slot": "AveragedTensor"})


def is_dtensor(t: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch < 2.4
        return False
    return isinstance(t, DTensor)


def _fsdp1_units(model: nn.Module) -> list[nn.Module]:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        return []
    return [m for m in FSDP.fsdp_modules(model) if getattr(m, "_handle", None) is not None]


def model_kind(model: nn.Module) -> str:
    """``"fsdp2"``, ``"fsdp1"`` or ``"plain"``."""
    if _fsdp1_units(model):
        return "fsdp1"
    if any(is_dtensor(p) for p in model.parameters()):
        return "fsdp2"
    return "plain"


def collect_slots(model: nn.Module) -> tuple[str, list[AveragedTensor]]:
    """The model kind and the tensors to average, in a deterministic order (parameters in
    ``named_parameters`` / FSDP-unit order, then buffers). Whether the sharding matches the
    topology is :func:`~flcomm.federated.sharding.check_sharding`'s."""
    import torch.distributed as dist

    kind = model_kind(model)
    slots: list[AveragedTensor] = []
    if kind == "fsdp1":
        units = _fsdp1_units(model)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        if not isinstance(model, FSDP):
            raise ValueError("FSDP1 models must be wrapped at the root (FullyShardedDataParallel(model)) "
                             f"so that every parameter is in a flat parameter; got a {type(model).__name__} "
                             "with FSDP units inside")
        seen: set[int] = set()
        for i, unit in enumerate(units):
            fp = unit._handle.flat_param
            if id(fp) in seen:
                continue
            seen.add(id(fp))
            pg = unit.process_group
            if fp.is_floating_point():
                full = getattr(fp, "_unpadded_unsharded_size", None)
                n = full.numel() if full is not None else fp.numel() * dist.get_world_size(pg)
                slots.append(AveragedTensor(f"flat_param.{i}", lambda fp=fp: fp.data, True, (dist.get_rank(pg),), n))
    else:
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            if is_dtensor(p):
                coord = tuple(p.device_mesh.get_coordinate() or ())
                slots.append(AveragedTensor(name, lambda p=p: p.to_local(), True, coord, p.numel()))
            else:
                slots.append(AveragedTensor(name, lambda p=p: p.data, True, (), p.numel()))
    for name, owner, bname in persistent_buffers(model):
        if owner._buffers[bname].is_floating_point():
            slots.append(AveragedTensor(name, lambda m=owner, n=bname: _local(m._buffers[n]), False, (),
                              owner._buffers[bname].numel()))
    return kind, slots


def _local(t: Tensor) -> Tensor:
    return t.to_local() if is_dtensor(t) else t.data


def persistent_buffers(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(qualified name, owning module, attribute name)`` of every buffer, without the
    non-persistent ones (which never enter a state dict); the owner is kept so a buffer
    replaced by ``module.to()`` is found again."""
    out: list[tuple[str, nn.Module, str]] = []
    seen: set[int] = set()
    for mname, m in model.named_modules():
        skip = getattr(m, "_non_persistent_buffers_set", set())
        for bname, b in m._buffers.items():
            if b is None or bname in skip or id(b) in seen:
                continue
            seen.add(id(b))
            out.append((f"{mname}.{bname}" if mname else bname, m, bname))
    return out


def fingerprint(slots: list[AveragedTensor]) -> Tensor:
    """[number of tensors, total elements, crc32 of names/shapes/dtypes/coordinates] as int64;
    equal on all shard peers when they hold the same shards of the same model."""
    desc = ";".join(f"{s.name}:{tuple(s.local.shape)}:{s.local.dtype}:{s.coord}:{int(s.is_param)}"
                    for s in slots)
    return torch.tensor([len(slots), sum(s.local.numel() for s in slots), zlib.crc32(desc.encode())],
                        dtype=torch.int64)


def describe(slots: list[AveragedTensor]) -> list[tuple[str, tuple[int, ...]]]:
    return [(s.name, tuple(s.local.shape)) for s in slots]


def check_same_shards(slots: list[AveragedTensor], transport: Transport, fed_ranks: list[int]) -> None:
    """ValueError unless all shard peers (``transport``, over ``fed_ranks``) hold
    the same shards of the same model (:func:`fingerprint`). Collective."""
    # NOTE: on the transport's device: NCCL groups cannot gather CPU tensors
    fp = fingerprint(slots).to(transport.device)
    flat = torch.zeros(len(fed_ranks) * fp.numel(), dtype=fp.dtype, device=fp.device)
    transport.all_gather(flat, fp)
    got = list(flat.view(len(fed_ranks), -1))
    if any(not torch.equal(g, got[0]) for g in got):
        rows = ", ".join(f"rank {r}: {int(g[0])} tensors / {int(g[1])} elements / layout {int(g[2]):08x}"
                         for r, g in zip(fed_ranks, got))
        raise ValueError("the shard peers "
                         f"{fed_ranks} do not hold the same shards of one model ({rows}); "
                         "every federation group must build the same model and shard it the same "
                         "way inside the group")


@torch.no_grad()
def broadcast(transport: Transport, tensors: list[Tensor], src: int) -> None:
    """Every rank of ``transport`` takes rank ``src``'s ``tensors`` (one broadcast per dtype,
    through a flat copy on the transport's device that exists only here). Collective."""
    tensors = [t for t in tensors if t.numel()]
    for dt in dict.fromkeys(t.dtype for t in tensors):
        ts = [t for t in tensors if t.dtype == dt]
        flat = torch.cat([t.reshape(-1).to(transport.device) for t in ts])
        transport.broadcast(flat, src=src)
        for t, v in zip(ts, flat_views(flat, [t.shape for t in ts])):
            t.copy_(v)


def nonfinite(tensors: list[Tensor], flat: Tensor | None = None) -> Tensor:
    """A 0-dim bool on the tensors' device, without a host read: whether any of ``tensors`` holds
    a NaN or an Inf. ``flat``: one view over all of them (:func:`~flcomm.collectives.staging.span`),
    checked in one op instead of one per tensor."""
    # NOTE: min and max propagate NaN and show Inf, without a tensor-sized bool temporary
    ts = [flat] if flat is not None else [t for t in tensors if t.numel()]
    if not ts:
        return torch.zeros((), dtype=torch.bool, device=tensors[0].device if tensors else None)
    ext = torch.cat([torch.stack(torch.aminmax(t)).double() for t in ts])  # NOTE: fp64's range too
    return (~torch.isfinite(ext)).any()


def flat_views(flat: Tensor, shapes: list[torch.Size]) -> list[Tensor]:
    """Views of consecutive pieces of ``flat`` with the given shapes."""
    out, off = [], 0
    for s in shapes:
        n = 1
        for d in s:
            n *= d
        out.append(flat[off:off + n].view(s))
        off += n
    return out


def partition(numels: list[int], k: int) -> list[list[int]]:
    """Contiguous runs of tensor indices, K of them, of about equal size: fragment j ends after
    the first tensor at which the running total reaches (j+1)/K of the whole. ValueError when a
    fragment would be empty (too few tensors, or one tensor larger than several fragments)."""
    total = sum(numels)
    bounds, cum, j = [0], 0, 1
    for i, n in enumerate(numels):
        cum += n
        while j < k and cum * k >= j * total:
            bounds.append(i + 1)
            j += 1
    bounds += [len(numels)] * (k + 1 - len(bounds))
    parts = [list(range(bounds[f], bounds[f + 1])) for f in range(k)]
    if any(not p for p in parts):
        raise ValueError(f"cannot split {len(numels)} tensors (sizes {numels[:8]}{'...' if len(numels) > 8 else ''}) "
                         f"into {k} fragments of about equal size: use fewer fragments")
    return parts
