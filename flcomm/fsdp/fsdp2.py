"""FSDP2 (``torch.distributed.fsdp.fully_shard``) hooks: hierarchical reduce-scatter and
all-gather, and an all-reduce hook for the replicate dimension.

* :class:`HierarchicalReduceScatter` / :class:`HierarchicalAllGather` implement FSDP2's
  ``ReduceScatter`` / ``AllGather`` contracts (``torch/distributed/fsdp/_fully_shard/_fsdp_api.py``):
  ``allocate(size, *, dtype, device)`` returns the buffers FSDP copies into (plain
  ``torch.empty``: the intermediate stage buffers are allocated by the collective itself) and
  ``__call__(output_tensor, input_tensor, group, [op,] async_op)`` runs the collective and returns
  a ``dist.Work`` when ``async_op`` (FSDP waits on it before reading the output) or None.
* :func:`apply_hierarchical_collectives` sets them on every FSDP module of a model.
* :class:`ReplicateAllReduceHook` / :func:`apply_all_reduce_hook`: ``set_all_reduce_hook`` for
  HSDP's replicate dimension. FSDP shards over the 1-D shard mesh and the hook all-reduces each
  reduce-scatter output over the replicas, exactly or through
  :func:`flcomm.collectives.compressed.compressed_all_reduce` (with optional error feedback).

Ops: FSDP2 passes ``AVG`` (fp32/bf16), ``SUM`` (fp16 and ``set_force_sum_reduction_for_comms``,
with pre/post division done by FSDP) or ``PREMUL_SUM`` (``set_gradient_divide_factor``), which
is refused: use ``set_force_sum_reduction_for_comms(True)`` with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from flcomm.collectives.compressed import compressed_all_reduce
from flcomm.collectives.hierarchical import Hierarchy
from flcomm.comm.base import ReduceOp, Transport

try:  # torch >= 2.8 exposes the contracts here
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError as e:  # pragma: no cover - older torch
    raise ImportError(f"flcomm.fsdp.fsdp2 needs FSDP2's custom collective API "
                      f"(torch >= 2.8), not found in torch {torch.__version__}: {e}") from e

__all__ = [
    "HierarchicalAllGather",
    "HierarchicalReduceScatter",
    "ReplicateAllReduceHook",
    "apply_all_reduce_hook",
    "apply_hierarchical_collectives",
]


class _FlcommWork(dist.Work):
    """A ``dist.Work`` around a flcomm handle, so FSDP2 recognises and waits on it
    (``foreach_all_gather_copy_out`` only waits on ``dist.Work`` instances)."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self._inner = inner

    def wait(self, timeout: timedelta | None = None) -> bool:  # type: ignore[override]
        self._inner.wait(None if timeout is None or timeout == timedelta(0) else timeout)
        return True

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())

    def is_success(self) -> bool:
        return True


def _parse_fsdp_op(op: Any) -> ReduceOp:
    try:
        return ReduceOp.parse(op)
    except ValueError:
        raise ValueError(f"hierarchical reduce-scatter supports SUM, AVG and MAX, got {op!r}. "
                         "FSDP2 issues PREMUL_SUM after set_gradient_divide_factor(): also call "
                         "module.set_force_sum_reduction_for_comms(True) so it reduces with SUM and "
                         "divides itself") from None


class _HierarchicalComm:
    """Shared part of the two hooks: the hierarchy and the check that FSDP's group is it."""

    def __init__(self, hierarchy: Hierarchy) -> None:
        if not isinstance(hierarchy, Hierarchy):
            raise TypeError(f"hierarchy must be a flcomm Hierarchy, got {type(hierarchy).__name__}")
        self.hierarchy = hierarchy

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _check_group(self, group: dist.ProcessGroup) -> None:
        # NOTE: FSDP lays chunk `group.rank()` out for this rank, so the hierarchy must number the
        # same ranks the same way; anything else would silently scramble the shards.
        h = self.hierarchy
        if group.size() != h.size or group.rank() != h.rank:
            raise ValueError(
                f"{type(self).__name__}: FSDP's group has {group.size()} ranks (this is rank "
                f"{group.rank()}), but the hierarchy is {h.nodes} nodes x {h.local} ranks = {h.size} "
                f"(this is rank {h.rank}): build the hierarchy from the mesh dim FSDP shards over "
                "(mesh.hierarchy('shard') for fully_shard(mesh=mesh.device_mesh['shard']))")


class HierarchicalReduceScatter(_HierarchicalComm, ReduceScatter):
    """FSDP2 reduce-scatter that runs :func:`hierarchical_reduce_scatter` (intra-node stage,
    then inter-node stage; the flat output layout)."""

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup,
                 op: Any = dist.ReduceOp.SUM, async_op: bool = False) -> dist.Work | None:
        self._check_group(group)
        rop = _parse_fsdp_op(op)
        if async_op:
            return _FlcommWork(self.hierarchy.reduce_scatter(output_tensor, input_tensor, rop, async_op=True))
        self.hierarchy.reduce_scatter(output_tensor, input_tensor, rop)
        return None


class HierarchicalAllGather(_HierarchicalComm, AllGather):
    """FSDP2 all-gather that runs :func:`hierarchical_all_gather` (inter-node stage, then
    intra-node stage; the flat output layout)."""

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        self._check_group(group)
        if async_op:
            return _FlcommWork(self.hierarchy.all_gather(output_tensor, input_tensor, async_op=True))
        self.hierarchy.all_gather(output_tensor, input_tensor)
        return None


def _fsdp_modules(model: nn.Module) -> list[tuple[str, FSDPModule]]:
    mods = [(name or "<root>", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not mods:
        raise ValueError(f"{type(model).__name__} has no FSDP modules: call fully_shard on it first")
    return mods


def _param_groups(module: FSDPModule) -> list[Any]:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.14: one optional param group per module
        g = getattr(state, "_fsdp_param_group", None)
        groups = [g] if g is not None else []
    return list(groups)


def apply_hierarchical_collectives(model: nn.Module, hierarchy: Hierarchy, *,
                                   reduce_scatter: bool = True,
                                   all_gather: bool = True) -> list[FSDPModule]:
    """Set :class:`HierarchicalReduceScatter` / :class:`HierarchicalAllGather` on every FSDP
    module of ``model`` (``hierarchy``: the :class:`Hierarchy` of the group FSDP shards over,
    e.g. ``fed_mesh.hierarchy("shard")``). Returns the modules.

    Every module is checked before any is changed: a module with several parameter groups
    (per-parameter meshes from ``shard_placement_fn``) is refused with FSDP's own error.
    """
    rs, ag = HierarchicalReduceScatter(hierarchy), HierarchicalAllGather(hierarchy)
    mods = _fsdp_modules(model)
    for name, m in mods:
        if len(_param_groups(m)) > 1:
            try:  # FSDP raises its own reason before changing anything
                m.set_custom_reduce_scatter(rs)
            except ValueError as e:
                raise ValueError(f"FSDP module {name!r}: {e}") from e
            raise ValueError(f"FSDP module {name!r} has {len(_param_groups(m))} parameter groups; "
                             "hierarchical collectives need one")
    for _, m in mods:
        if reduce_scatter:
            m.set_custom_reduce_scatter(rs)
        if all_gather:
            m.set_custom_all_gather(ag)
    return [m for _, m in mods]


class ReplicateAllReduceHook:
    """``hook(reduce_output)`` for ``FSDPModule.set_all_reduce_hook``: all-reduces the
    reduce-scatter output over ``transport`` (HSDP's replicate dim), in place.

    Steps: 1. if ``codec`` is None or "none": ``transport.all_reduce(output, op)``, exact;
    2. otherwise ``compressed_all_reduce(transport, buf, codec, op, residual)`` on an fp32,
    contiguous view of the output (a copy when the reduce dtype is not fp32), with a residual per
    hook when ``error_feedback``; the result is copied back.

    Use one hook per FSDP module (:func:`apply_all_reduce_hook` does): the residual has the shape
    of that module's gradient shard. A non-finite gradient passes through as non-finite (for
    GradScaler to see and skip), but never stays in the residual: its entries are zeroed.
    """

    def __init__(self, transport: Transport, codec: Any = "none", op: Any = "avg",
                 error_feedback: bool = False) -> None:
        if not isinstance(transport, Transport):
            raise TypeError(f"transport must be a flcomm Transport, got {type(transport).__name__}")
        self.transport = transport
        self.op = ReduceOp.parse(op)
        self.codec = None if codec in (None, "none") else codec
        if error_feedback and self.codec is None:
            raise ValueError(f"error_feedback needs a lossy codec (e.g. 'int8'), got codec={codec!r}")
        self.error_feedback = error_feedback
        self.residual: Tensor | None = None

    def __call__(self, reduce_output: Tensor) -> None:
        if reduce_output.is_cuda:
            # NOTE: FSDP2 allocates reduce_output on its reduce-scatter stream and runs this hook
            # on its all-reduce stream; it keeps the buffer alive across streams only for native
            # HSDP. With param_dtype != reduce_dtype the next reduce-scatter could reuse the
            # memory while our all-reduce still runs: tell the caching allocator it is in use on
            # this (the hook's) stream. Buffers made below are allocated on this stream, and the
            # transports record what they launch elsewhere.
            reduce_output.record_stream(torch.cuda.current_stream(reduce_output.device))
        if self.codec is None:
            self.transport.all_reduce(reduce_output, self.op)
            return
        exact_f32 = reduce_output.dtype == torch.float32 and reduce_output.is_contiguous()
        buf = reduce_output if exact_f32 else reduce_output.to(torch.float32, memory_format=torch.contiguous_format)
        residual = None
        if self.error_feedback:
            if self.residual is None:
                self.residual = torch.zeros_like(buf)
            elif self.residual.shape != buf.shape:
                raise ValueError(f"ReplicateAllReduceHook: error-feedback residual has shape "
                                 f"{tuple(self.residual.shape)}, this gradient {tuple(buf.shape)}: "
                                 "use one hook per FSDP module")
            residual = self.residual
        compressed_all_reduce(self.transport, buf, self.codec, self.op.value, residual=residual)
        if residual is not None:
            # NOTE: a non-finite gradient (fp16 overflow, which GradScaler then skips) makes the
            # residual of its blocks NaN/Inf, and error feedback would add that to every later
            # gradient. Zero it on the device: no host sync, one pass over the shard.
            residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        if not exact_f32:
            reduce_output.copy_(buf)

    def state_dict(self) -> dict[str, Tensor | None]:
        return {"residual": self.residual}

    def load_state_dict(self, sd: dict[str, Tensor | None]) -> None:
        if "residual" not in sd:
            raise KeyError(f"ReplicateAllReduceHook state needs key 'residual', got {sorted(sd)}")
        self.residual = sd["residual"]


def apply_all_reduce_hook(model: nn.Module, transport: Transport, *, codec: Any = "none",
                          op: Any = "avg", error_feedback: bool = False) -> dict[str, ReplicateAllReduceHook]:
    """Give every FSDP module of ``model`` its own :class:`ReplicateAllReduceHook` on
    ``transport`` (HSDP's replicate dim, e.g. ``fed_mesh.transport("replicate")``). Returns the
    hooks by module name.

    The model must be sharded on the 1-D shard mesh (``fully_shard(m, mesh=mesh['shard'])``):
    with native HSDP (a 2-D mesh) FSDP already all-reduces over the replicas before the hook,
    so such modules are refused.
    """
    if not isinstance(transport, Transport):
        raise TypeError(f"transport must be a flcomm Transport (e.g. fed_mesh.transport('replicate')), "
                        f"got {type(transport).__name__}")
    mods = _fsdp_modules(model)
    for name, m in mods:
        groups = _param_groups(m)
        if len(groups) > 1:
            try:  # FSDP raises its own reason before changing anything
                m.set_all_reduce_hook(lambda t: None)
            except ValueError as e:
                raise ValueError(f"FSDP module {name!r}: {e}") from e
            raise ValueError(f"FSDP module {name!r} has {len(groups)} parameter groups; the "
                             "all-reduce hook needs one")
        if any(getattr(g, "_is_hsdp", False) for g in groups):
            raise ValueError(f"FSDP module {name!r} is native HSDP (2-D mesh): it all-reduces over the "
                             "replicas itself, and the hook would reduce a second time. Shard it with "
                             "fully_shard(..., mesh=mesh['shard']) and let the hook do the replicate "
                             "all-reduce")
    hooks: dict[str, ReplicateAllReduceHook] = {}
    for name, m in mods:
        hooks[name] = ReplicateAllReduceHook(transport, codec, op, error_feedback)
        m.set_all_reduce_hook(hooks[name])
    return hooks
