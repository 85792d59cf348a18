"""FSDP1 (``FullyShardedDataParallel``) communication hook: hierarchical reduce-scatter.

``FullyShardedDataParallel.register_comm_hook(state, hook)`` calls, for the sharded strategies
(FULL_SHARD, SHARD_GRAD_OP), ``hook(state, padded_unsharded_grad, new_sharded_grad)``; the hook
must leave the averaged gradient shard of this rank in ``new_sharded_grad``. FSDP refuses hooks
for the hybrid strategies (HYBRID_SHARD, _HYBRID_SHARD_ZERO2).

:class:`HierarchicalCommState` holds the hierarchy and the pre/post division factors FSDP's
default hook uses (divide by about sqrt(P) before and the rest after the SUM, so fp16
gradients neither overflow nor underflow); :func:`hierarchical_reduce_scatter_hook` is the hook.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from flcomm.collectives.hierarchical import Hierarchy
from flcomm.comm.base import ReduceOp

if TYPE_CHECKING:
    from torch.distributed.fsdp import FullyShardedDataParallel


__all__ = ["HierarchicalCommState", "hierarchical_reduce_scatter_hook", "register_hierarchical_comm_hook"]


def _predivide_factor(world_size: int) -> float:
    """The power of two FSDP1 divides by before the reduction (its DefaultState's rule)."""
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor)


class HierarchicalCommState:
    """State of :func:`hierarchical_reduce_scatter_hook`: the hierarchy of FSDP's process group
    and the gradient division factors (pre * post = group size, as in FSDP's default path)."""

    def __init__(self, hierarchy: Hierarchy) -> None:
        if not isinstance(hierarchy, Hierarchy):
            raise TypeError(f"hierarchy must be a flcomm Hierarchy (e.g. fed_mesh.hierarchy('shard')), got "
                            f"{type(hierarchy).__name__}")
        self.hierarchy = hierarchy
        self.world_size = hierarchy.size
        self.gradient_predivide_factor = _predivide_factor(self.world_size)
        self.gradient_postdivide_factor = self.world_size / self.gradient_predivide_factor


def hierarchical_reduce_scatter_hook(state: HierarchicalCommState, grad: Tensor,
                                     output: Tensor | None = None) -> None:
    """FSDP1 comm hook for FULL_SHARD / SHARD_GRAD_OP.

    Steps: 1. ``grad /= predivide``; 2. hierarchical reduce-scatter (SUM) of the padded flat
    gradient into ``output`` (intra-node, then inter-node); 3. ``output /= postdivide``.
    """
    if output is None:
        raise ValueError("hierarchical_reduce_scatter_hook serves the sharded strategies (FULL_SHARD, "
                         "SHARD_GRAD_OP); FSDP called it without an output shard, i.e. with NO_SHARD")
    if state.gradient_predivide_factor > 1:
        grad.div_(state.gradient_predivide_factor)
    state.hierarchy.reduce_scatter(output, grad, ReduceOp.SUM)
    if state.gradient_postdivide_factor > 1:
        output.div_(state.gradient_postdivide_factor)


def register_hierarchical_comm_hook(model: FullyShardedDataParallel,
                                    hierarchy: Hierarchy) -> HierarchicalCommState:
    """Register :func:`hierarchical_reduce_scatter_hook` on the root FSDP1 ``model`` after
    checking that every FSDP unit shards (no hybrid or NO_SHARD strategy) over a group that is
    the hierarchy. Returns the state."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    if not isinstance(model, FullyShardedDataParallel):
        raise TypeError(f"model must be the root FullyShardedDataParallel, got {type(model).__name__}")
    state = HierarchicalCommState(hierarchy)
    h = state.hierarchy
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        strategy = unit.sharding_strategy
        if strategy not in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
            raise ValueError(f"hierarchical comm hook supports FULL_SHARD and SHARD_GRAD_OP, got {strategy.name} "
                             "(FSDP1 refuses comm hooks for hybrid strategies; NO_SHARD has no reduce-scatter)")
        pg = unit.process_group
        if dist.get_world_size(pg) != h.size or dist.get_rank(pg) != h.rank:
            raise ValueError(f"FSDP's process group has {dist.get_world_size(pg)} ranks (this is rank "
                             f"{dist.get_rank(pg)}), but the hierarchy is {h.nodes} nodes x {h.local} ranks "
                             f"= {h.size} (this is rank {h.rank})")
    model.register_comm_hook(state, hierarchical_reduce_scatter_hook)
    return state
