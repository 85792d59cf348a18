"""Reference training for the four strategies (FSDP, HSDP, FL+FSDP, FL+HSDP).

* :mod:`~flcomm.train.model` - a Llama-style decoder with presets up to the Llama 3.1 8B shape;
* :mod:`~flcomm.train.data` - a built-in byte-level corpus, disjoint per-rank slices, held-out split;
* :mod:`~flcomm.train.config` - :class:`TrainConfig`, the strategy's topology, the LR schedule;
* :mod:`~flcomm.train.run` - one rank's run set up (mesh, sharded model, data, FedAvg, resume);
* :mod:`~flcomm.train.loop` - the training loop (step, metrics records, evaluation, checkpoints);
* :mod:`~flcomm.train.launch` - the local launcher, torchrun ranks, failure reports;
* :mod:`~flcomm.train.monitor` - per-rank heartbeats and who failed first;
* :mod:`~flcomm.train.metrics` - per-step JSONL metrics and byte counts per link tier;
* :mod:`~flcomm.train.checkpoint` - atomic torch.distributed.checkpoint save / resume, the checks before launch;
* :mod:`~flcomm.train.plot`, :mod:`~flcomm.train.compare` - loss plots and the FSDP vs FL+FSDP table.

Command line: ``python -m flcomm.train --help`` (console script ``flcomm-train``).
"""

from flcomm._lazy import renamed_attributes
from flcomm.train.config import TrainConfig, resolve_topology
from flcomm.train.launch import launch_local
from flcomm.train.loop import TrainResult, train
from flcomm.train.model import MODEL_PRESETS, ModelConfig, Transformer, build_model, get_config

__all__ = ["MODEL_PRESETS", "ModelConfig", "TrainConfig", "TrainResult", "Transformer", "build_model", "get_config",
           "launch_local", "resolve_topology", "train"]

# NOTE: the old name, for one release
__getattr__ = renamed_attributes(__name__, {"PRESETS": "MODEL_PRESETS"})
