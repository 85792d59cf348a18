"""flcomm: federated-learning-style sharded data parallelism inside a GPU cluster.

Federation groups train with FSDP/HSDP on fast links; across groups only a FedAvg of the
parameter shards crosses the slow links, every E local steps (Mittone & Aldinucci, FL+FSDP and
FL+HSDP). See README.md and docs/.

The main entry points are importable from here (lazily, so ``import flcomm`` stays cheap)::

    topo = flcomm.Strategy.FL_FSDP.topology(world_size, ranks_per_node, group_size=8)
    mesh = flcomm.init_fed_mesh(topo, "cuda")
    fed = flcomm.FedAvg(model, mesh, flcomm.FedAvgConfig(sync_every=8, codec="int8"))

Layers (imports only go down; ``tests/unit/test_layering.py`` parses every import, lazy and
type-only ones included, and checks these rules):

* ``enums``, ``_lazy`` and ``validate`` (the numeric checks) import nothing from flcomm; every
  layer may use them;
* ``_native`` and ``info`` import only each other;
* ``comm`` (transports) imports only ``_native``, ``info`` and ``enums``: never collectives or
  anything above;
* ``ops`` (the wrappers of ``csrc/``: ``quant``, ``topk``, ``apply``) imports only ``_native``;
  ``codecs`` imports ``ops`` (public names only); ``kernels``, ``sparse`` and ``apply``, the
  deprecated names of ``ops.quant``, ``ops.topk`` and ``ops.apply``, import only those, and
  nothing in flcomm imports them;
* ``collectives`` imports ``comm``, ``codecs``, ``ops``: never ``federated``, ``fsdp``,
  ``costmodel`` or ``train``;
* ``fsdp`` (hooks) imports ``collectives`` and below: a hook takes a ``Hierarchy`` or a
  transport, never a ``FedMesh``;
* ``federated`` imports ``collectives``, ``ops`` and below (not ``fsdp``);
* ``costmodel``: ``model`` and ``search`` (the analytic part) import ``federated.strategy`` /
  ``federated.topology``, ``codecs``, ``comm.base`` and no ``torch.distributed``, also not at
  import time through those modules; ``probe`` measures with torch.distributed;
* only ``train`` (and ``bench/``, outside the package) import everything.
"""

from __future__ import annotations

from flcomm._lazy import lazy_exports
from flcomm.info import VERSION as __version__
from flcomm.info import build_info

_LAZY = {
    # the topology and its runtime mesh
    "Strategy": "flcomm.federated.strategy",
    "Topology": "flcomm.federated.topology",
    "FedMesh": "flcomm.federated.mesh",
    "MeshConfig": "flcomm.federated.mesh",
    "init_fed_mesh": "flcomm.federated.mesh",
    # FedAvg across federation groups
    "FedAvg": "flcomm.federated.fedavg",
    "FedAvgConfig": "flcomm.federated.config",
    "Federation": "flcomm.federated.elastic",
    # the FSDP hooks (FSDP2 and FSDP1)
    "apply_hierarchical_collectives": "flcomm.fsdp.fsdp2",
    "apply_all_reduce_hook": "flcomm.fsdp.fsdp2",
    "register_hierarchical_comm_hook": "flcomm.fsdp.fsdp1",
    # errors a training script may catch
    "NonFiniteAverageError": "flcomm.federated.nonfinite",
    "ReplicaMismatchError": "flcomm.federated.verify",
    "GroupLostError": "flcomm.federated.elastic",
    "TooFewGroupsError": "flcomm.federated.elastic",
    "EngineError": "flcomm.comm.engine",
    "EngineTimeout": "flcomm.comm.engine",
    # collectives, codecs and transports, for use without FSDP
    "get_codec": "flcomm.codecs",
    "compressed_all_reduce": "flcomm.collectives.compressed",
    "BucketedAllReduce": "flcomm.collectives.bucketing",
    "Hierarchy": "flcomm.collectives.hierarchical",
    "TorchTransport": "flcomm.comm.torch_pg",
    "CommStats": "flcomm.comm.base",
    "LinkTier": "flcomm.comm.base",
}

__all__ = ["__version__", "build_info", *_LAZY]
__getattr__ = lazy_exports(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted(__all__)
