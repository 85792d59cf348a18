"""FSDP integration: hierarchical reduce-scatter / all-gather and the replicate all-reduce hook
for FSDP2 (``fsdp2``), and the hierarchical comm hook for FSDP1 (``fsdp1``).

FSDP2::

    mesh = init_fed_mesh(Strategy.FSDP.topology(world, ranks_per_node))
    fully_shard(block, mesh=mesh.device_mesh["shard"]) ...; fully_shard(model, mesh=...)
    apply_hierarchical_collectives(model, mesh.hierarchy("shard"))

HSDP with the replicate all-reduce as a hook (exact, or compressed with ``codec="int8"``)::

    fully_shard(model, mesh=mesh.device_mesh["shard"])
    apply_all_reduce_hook(model, mesh.transport("replicate"), codec="int8", error_feedback=True)

FSDP1::

    register_hierarchical_comm_hook(fsdp_model, mesh.hierarchy("shard"))
"""

from flcomm.fsdp.fsdp1 import HierarchicalCommState, hierarchical_reduce_scatter_hook, register_hierarchical_comm_hook
from flcomm.fsdp.fsdp2 import (
    HierarchicalAllGather,
    HierarchicalReduceScatter,
    ReplicateAllReduceHook,
    apply_all_reduce_hook,
    apply_hierarchical_collectives,
)

__all__ = [
    "HierarchicalAllGather",
    "HierarchicalCommState",
    "HierarchicalReduceScatter",
    "ReplicateAllReduceHook",
    "apply_all_reduce_hook",
    "apply_hierarchical_collectives",
    "hierarchical_reduce_scatter_hook",
    "register_hierarchical_comm_hook",
]
