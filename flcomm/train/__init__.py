"""Reference training for the four strategies (FSDP, HSDP, FL+FSDP, FL+HSDP).

* :mod:`~flcomm.train.model` - a Llama-style decoder with presets up to the Llama 3.1 8B shape;
* :mod:`~flcomm.train.data` - a built-in byte-level corpus, disjoint per-rank slices, held-out split;
* :mod:`~flcomm.train.driver` - the training loop and :class:`TrainConfig`;
* :mod:`~flcomm.train.launch` - the local launcher, torchrun ranks, failure reports;
* :mod:`~flcomm.train.monitor` - per-rank heartbeats and who failed first;
* :mod:`~flcomm.train.metrics` - per-step JSONL metrics and byte counts per link tier;
* :mod:`~flcomm.train.checkpoint` - atomic torch.distributed.checkpoint save / resume;
* :mod:`~flcomm.train.plot`, :mod:`~flcomm.train.compare` - loss plots and the FSDP vs FL+FSDP table.

Command line: ``python -m flcomm.train --help`` (console script ``flcomm-train``).
"""

from flcomm.train.driver import STRATEGIES, TrainConfig, TrainResult, resolve_topology, train
from flcomm.train.launch import launch_local
from flcomm.train.model import PRESETS, ModelConfig, Transformer, build_model, get_config

__all__ = ["PRESETS", "STRATEGIES", "ModelConfig", "TrainConfig", "TrainResult", "Transformer", "build_model",
           "get_config", "launch_local", "resolve_topology", "train"]
