"""Atomic distributed checkpoints with torch.distributed.checkpoint (DCP).

Layout under a checkpoint directory::

    ckpt/step_00000100/     a complete checkpoint: DCP files + meta.json
    ckpt/latest             name of the newest complete checkpoint (replaced atomically)
    ckpt/.tmp-step_00000200 a save in progress (or one that crashed: ignored, removed by the
                            next save)

What is saved:
  * ``group{f}.model`` / ``group{f}.optim``: the model and optimizer state of federation group
    f, as sharded DTensors (each rank writes its shard; replicas of HSDP dedupe). Keyed by
    group because between FedAvg rounds the groups' models differ;
  * ``rank{r}``: one opaque blob per rank (torch.save bytes): the FedAvg state (its anchor
    shard, residuals and counters are per rank), the data position, the RNG states, the step;
  * ``meta.json``: step, strategy, topology, model shape: a resume with another topology or
    model is refused before anything is loaded.

Atomicity: every rank writes into ``.tmp-<name>``; after a barrier rank 0 writes meta.json,
renames the directory to ``<name>`` and then replaces ``latest``. A crash at any point before
the rename leaves ``latest`` pointing at the previous complete checkpoint.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from flcomm.federated.topology import Topology

FORMAT_VERSION = 1
LATEST = "latest"
_TMP_PREFIX = ".tmp-"


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def latest_checkpoint(ckpt_dir: str) -> str | None:
    """Path of the newest complete checkpoint in ``ckpt_dir`` (None when there is none)."""
    ptr = os.path.join(ckpt_dir, LATEST)
    if not os.path.isfile(ptr):
        return None
    with open(ptr) as f:
        name = f.read().strip()
    path = os.path.join(ckpt_dir, name)
    if not os.path.isfile(os.path.join(path, "meta.json")):
        raise RuntimeError(f"{ptr} names {name!r}, which is not a complete checkpoint (no meta.json)")
    return path


def read_meta(path: str) -> dict[str, Any]:
    f = os.path.join(path, "meta.json")
    if not os.path.isfile(f):
        raise FileNotFoundError(f"{path} is not a flcomm checkpoint: no meta.json")
    with open(f) as fh:
        return json.load(fh)


def topology_dict(topo: "Topology") -> dict[str, int]:
    return {"world_size": topo.world_size, "ranks_per_node": topo.ranks_per_node,
            "group_size": int(topo.group_size), "shard_size": int(topo.shard_size)}


def check_compatible(meta: dict[str, Any], topo: "Topology", model_cfg: dict[str, Any], path: str) -> None:
    """Refuse a checkpoint written by another topology or another model shape."""
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has format {meta.get('format')!r}; this flcomm reads "
                         f"format {FORMAT_VERSION}")
    want = topology_dict(topo)
    have = meta.get("topology", {})
    if have != want:
        fmt = lambda d: ", ".join(f"{k}={d.get(k)}" for k in want)  # noqa: E731
        raise ValueError(f"checkpoint {path} was written by another topology ({fmt(have)}), but "
                         f"this run has ({fmt(want)}); resume with the same world size, "
                         "--ranks-per-node, --group-size and --shard-size")
    if meta.get("model") != model_cfg:
        diff = {k: (meta.get("model", {}).get(k), v) for k, v in model_cfg.items()
                if meta.get("model", {}).get(k) != v}
        raise ValueError(f"checkpoint {path} holds another model shape: (checkpoint, this run) = {diff}")


def _to_local(obj: Any) -> Any:
    """DTensors -> their local shards (per-rank state is saved as plain tensors)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_local(v) for v in obj)
    return obj


def _rng_state() -> dict[str, Any]:
    st: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["cpu"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, group: int, rank: int,
           blob: bytes) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {f"group{group}": {"model": get_model_state_dict(model),
                              "optim": get_optimizer_state_dict(model, optimizer)},
            f"rank{rank}": blob}


def save(ckpt_dir: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         rank_state: dict[str, Any], meta: dict[str, Any], group: int, keep: int = 2,
         fault: Callable[[str], None] | None = None) -> str:
    """Write a checkpoint of ``step`` atomically (collective: every rank calls it).

    Steps:
      1. rank 0 removes a stale ``.tmp-<name>`` left by a crashed save; barrier;
      2. every rank saves ``group{f}.model``, ``group{f}.optim`` and its ``rank{r}`` blob
         (``rank_state`` + RNG states, torch.save'd) with DCP into ``.tmp-<name>``;
      3. ``fault(tmp_dir)`` if given (tests inject a crash here); barrier;
      4. rank 0 writes meta.json, renames the directory to ``<name>``, replaces ``latest``
         (write + fsync + rename) and prunes all but the newest ``keep`` checkpoints; barrier.

    Returns the checkpoint's path.
    """
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank() if dist.is_initialized() else 0
    name = step_name(step)
    final = os.path.join(ckpt_dir, name)
    tmp = os.path.join(ckpt_dir, _TMP_PREFIX + name)
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    buf = io.BytesIO()
    torch.save({**_to_local(rank_state), "rng": _rng_state()}, buf)
    sd = _state(model, optimizer, group, rank, buf.getvalue())
    dcp.save(sd, checkpoint_id=tmp)
    if fault is not None:
        fault(tmp)
    _barrier()
    if rank == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"format": FORMAT_VERSION, "step": step, **meta}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if os.path.exists(final):  # NOTE: re-saving a step (a resumed run): swap, then drop the old
            old = os.path.join(ckpt_dir, _TMP_PREFIX + "old-" + name)
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        ptr_tmp = os.path.join(ckpt_dir, _TMP_PREFIX + LATEST)
        with open(ptr_tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(ptr_tmp, os.path.join(ckpt_dir, LATEST))
        _fsync_dir(ckpt_dir)
        _prune(ckpt_dir, keep)
    _barrier()
    return final


def _prune(ckpt_dir: str, keep: int) -> None:
    if keep < 1:
        return
    done = sorted(d for d in os.listdir(ckpt_dir)
                  if d.startswith("step_") and os.path.isfile(os.path.join(ckpt_dir, d, "meta.json")))
    for d in done[:-keep]:
        shutil.rmtree(os.path.join(ckpt_dir, d), ignore_errors=True)


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, group: int,
         topo: "Topology", model_cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load a checkpoint into ``model`` and ``optimizer`` (collective).

    Steps: read meta.json and refuse another topology or model shape; DCP-load this group's
    model and optimizer state and this rank's blob into destinations of the current shapes;
    set them into the model and optimizer; restore the RNG states.

    Returns ``(meta, rank_state)``; ``rank_state`` holds what :func:`save` was given
    (fed, data, step, ...).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    meta = read_meta(path)
    check_compatible(meta, topo, model_cfg, path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    sd = _state(model, optimizer, group, rank, b"")
    dcp.load(sd, checkpoint_id=path)
    g = sd[f"group{group}"]
    set_model_state_dict(model, g["model"])
    set_optimizer_state_dict(model, optimizer, g["optim"])
    blob = sd[f"rank{rank}"]
    if not isinstance(blob, (bytes, bytearray)) or not blob:
        raise RuntimeError(f"checkpoint {path} has no state for rank {rank}")
    rank_state = torch.load(io.BytesIO(blob), weights_only=False, map_location="cpu")
    _set_rng_state(rank_state.pop("rng"))
    return meta, rank_state
