"""The checks of FedAvg's settings, before anything is built: :func:`check_config` for those that
need no model or mesh (:meth:`TrainConfig.check_federation
<flcomm.train.config.TrainConfig.check_federation>` calls it before anything launches),
:func:`check_inputs` for the mesh and the optimizer, :func:`one_device` for the averaged tensors."""

from __future__ import annotations

from typing import Any

import torch

from flcomm.federated.exchange import resolve_codec
from flcomm.federated.inner import InnerState
from flcomm.federated.outer import Outer
from flcomm.validate import integer, number

__all__ = ["RESIDUAL_DTYPES", "check_config", "check_inputs", "one_device"]

RESIDUAL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_config(*, sync_every: Any, bucket_mb: Any = 25.0, overlap_steps: Any = 1, fragments: Any = 1,
                 inner_state: Any = "keep", residual_dtype: Any = "fp32", offload: Any = None,
                 codec: Any = "none", outer: Any = "avg", elastic: bool = False, overlap: bool = False) -> None:
    """ValueError naming the setting, what is allowed and what came, for the settings that need
    no model or mesh."""
    integer("sync_every (E, local steps between syncs)", sync_every, 1)
    number("bucket_mb", bucket_mb, 0, lo_open=True)
    integer("overlap_steps (k, steps between a sync and its apply)", overlap_steps, 1, sync_every,
            also=" (at most sync_every)")
    integer("fragments (K)", fragments, 1)
    if sync_every % fragments:
        raise ValueError(f"fragments (K) must divide sync_every={sync_every}, got {fragments!r}")
    inner = InnerState.parse(inner_state)
    if fragments > 1 and inner is not InnerState.KEEP:
        raise ValueError(f"inner_state={inner_state!r} is not supported with fragments > 1 (only 'keep')")
    if elastic and fragments > 1 and overlap:
        raise ValueError("an elastic federation does not support overlap with fragments > 1 (a membership "
                         "change would meet another fragment's round in flight); use one of them")
    if elastic and inner is not InnerState.KEEP:
        raise ValueError(f"inner_state={inner_state!r} is not supported by an elastic federation (only 'keep': "
                         "a redone round cannot undo an averaged or reset optimizer state)")
    if residual_dtype not in RESIDUAL_DTYPES:
        raise ValueError(f"residual_dtype must be one of {list(RESIDUAL_DTYPES)}, got {residual_dtype!r}")
    if offload not in (None, "cpu"):
        raise ValueError(f"offload must be None or 'cpu', got {offload!r}")
    resolve_codec(codec)
    Outer.parse(outer)


def check_inputs(mesh: Any, optimizer: Any, inner_state: InnerState) -> None:
    """TypeError or ValueError unless ``mesh`` is a FedMesh and ``optimizer`` a torch optimizer
    (or None where ``inner_state`` needs none)."""
    if inner_state is not InnerState.KEEP and optimizer is None:
        raise ValueError(f"inner_state={inner_state.value!r} needs the inner optimizer: pass optimizer=...")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not hasattr(mesh, "topology") or not hasattr(mesh, "transport"):
        raise TypeError(f"mesh must be a flcomm FedMesh (Topology.build()), got {type(mesh).__name__}")


def one_device(tensors: list[torch.Tensor]) -> torch.device:
    """The device of all ``tensors`` (the CPU when there are none); ValueError when they are on
    several."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"all averaged tensors must be on one device, got {sorted(map(str, devices))}")
    return devices.pop() if devices else torch.device("cpu")
