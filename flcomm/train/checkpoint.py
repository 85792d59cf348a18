"""Atomic, verified distributed checkpoints with torch.distributed.checkpoint (DCP).

Layout under a checkpoint directory::

    ckpt/step_00000100/     a complete checkpoint: DCP files, rank state files, meta.json
    ckpt/latest             name of the newest complete checkpoint (replaced atomically)
    ckpt/.tmp-step_00000200 a save in progress (or one that crashed: ignored, removed by the
                            next save)
    ckpt/.tmp-pin/step_...  an elastic run's rejoining group: hard links to another group's
                            checkpoint while it loads (pin_latest)

An elastic run keeps one such directory per federation group, ``ckpt/group{f}/``
(:func:`elastic_checkpoint_dir`); a resume loads the groups' newest checkpoints of the newest
step among them (:func:`newest_step_checkpoints`).

What is saved:
  * ``group{f}.model`` / ``group{f}.optim`` (DCP): the model and optimizer state of federation
    group f, as sharded DTensors (each rank writes its shard; replicas of HSDP dedupe). Keyed
    by group because between FedAvg rounds the groups' models differ;
  * ``rank{r}.state.pt``: per rank, tensors and plain types only (torch.save): the FedAvg
    state (its anchor shard, residuals and counters are per rank), the data position, the RNG
    states, the step;
  * ``meta.json``: format, step, strategy, topology, model shape, seed, data record, FedAvg's
    settings (``fedavg``, federated runs), and the size and SHA-256 of every other file: a
    resume with another topology, model, seed, data or FedAvg settings it cannot load is
    refused, and a corrupt file is named, before anything is loaded.

Loading never unpickles arbitrary objects: the rank state and DCP's non-tensor items load with
``torch.load(weights_only=True)``, and DCP's own ``.metadata`` pickle with an unpickler that
allows only the types DCP's metadata is made of (:func:`read_dcp_metadata`; checked before
launch too). The hashes in meta.json detect corruption; they prove nothing against someone
who can rewrite meta.json as well.

Atomicity: every rank writes into ``.tmp-<name>``; after a barrier the ranks hash their files,
rank 0 writes meta.json, renames the directory to ``<name>`` and then replaces ``latest``. A
crash at any point before the rename leaves ``latest`` pointing at the previous complete
checkpoint.

:func:`check_before_launch` refuses, before any process starts, what a run's config, data and
checkpoint to resume from would make fail in the ranks.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from flcomm.federated.persist import config_mismatch
from flcomm.train.config import TrainConfig, resolve_topology
from flcomm.train.data import check_vocab, data_record, data_source, load_tokens, same_data, split_for_ranks

if TYPE_CHECKING:
    from flcomm.federated.topology import Topology

FORMAT_VERSION = 2
LATEST = "latest"
_TMP_PREFIX = ".tmp-"
PIN_DIR = _TMP_PREFIX + "pin"  # pin_latest's folder in a rejoining group's checkpoint directory
_NAME = re.compile(r"step_\d{8}")
META = "meta.json"


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def latest_checkpoint(ckpt_dir: str) -> str | None:
    """Path of the newest complete checkpoint in ``ckpt_dir`` (None when there is none)."""
    ptr = os.path.join(ckpt_dir, LATEST)
    if not os.path.isfile(ptr):
        return None
    with open(ptr, "rb") as f:
        raw = f.read(256)
    name = raw.decode("utf-8", errors="replace").strip()
    if not _NAME.fullmatch(name):
        raise ValueError(f"{ptr} must name a checkpoint of this directory (step_NNNNNNNN), got {name[:80]!r}")
    path = os.path.join(ckpt_dir, name)
    if not os.path.isfile(os.path.join(path, META)):
        raise RuntimeError(f"{ptr} names {name!r}, which is not a complete checkpoint (no meta.json)")
    return path


def read_meta(path: str) -> dict[str, Any]:
    f = os.path.join(path, META)
    if not os.path.isfile(f):
        raise FileNotFoundError(f"{path} is not a flcomm checkpoint: no meta.json")
    try:
        with open(f, "rb") as fh:
            meta = json.loads(fh.read().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{f} is not valid JSON ({e}): the checkpoint is corrupt") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{f} must hold a JSON object, got {type(meta).__name__}")
    return meta


def check_compatible(meta: dict[str, Any], topo: Topology, model_cfg: dict[str, Any], path: str,
                     same_group_shape: bool = False) -> None:
    """Refuse a checkpoint written by another topology (``same_group_shape``: only another
    group shape, i.e. ranks per node, G or S; an elastic run may resume with another number of
    groups) or another model shape."""
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has format {meta.get('format')!r}; this flcomm reads "
                         f"format {FORMAT_VERSION}")
    want = topo.to_dict()
    have = meta.get("topology", {})
    if same_group_shape:
        keys = ("ranks_per_node", "group_size", "shard_size")
        want, have = {k: want[k] for k in keys}, {k: have.get(k) for k in keys}
    if have != want:
        keys = ("world_size", "ranks_per_node", "group_size", "shard_size")
        fmt = lambda d: ", ".join(f"{k}={d.get(k)}" for k in keys)  # noqa: E731
        raise ValueError(f"checkpoint {path} was written by another topology ({fmt(have)}), but "
                         f"this run has ({fmt(want)}); resume with the same world size, "
                         "--ranks-per-node, --group-size and --shard-size")
    if meta.get("model") != model_cfg:
        diff = {k: (meta.get("model", {}).get(k), v) for k, v in model_cfg.items()
                if meta.get("model", {}).get(k) != v}
        raise ValueError(f"checkpoint {path} holds another model shape: (checkpoint, this run) = {diff}")


def check_resume(meta: dict[str, Any], run: dict[str, Any], path: str, allow_data_change: bool = False) -> None:
    """Refuse to resume ``run`` (its ``seed`` and ``data`` record) from a checkpoint of
    another seed, or of other data unless ``allow_data_change``."""
    if meta.get("seed") != run["seed"]:
        raise ValueError(f"checkpoint {path} was written with --seed {meta.get('seed')}, this run has "
                         f"--seed {run['seed']}; resume with the same seed")
    have, want = meta.get("data") or {}, run["data"]
    if not allow_data_change and not same_data(have, want):
        show = lambda d: f"{d.get('source')} ({d.get('tokens')} tokens of {d.get('dtype')})"  # noqa: E731
        raise ValueError(f"checkpoint {path} was trained on other data: {show(have)}, this run reads "
                         f"{show(want)} (or the same file changed); pass --allow-data-change to resume anyway")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _data_files(path: str) -> list[str]:
    return sorted(f for f in os.listdir(path) if f != META and os.path.isfile(os.path.join(path, f)))


def _hash_files(path: str, names: list[str]) -> dict[str, dict[str, Any]]:
    return {n: {"bytes": os.path.getsize(os.path.join(path, n)), "sha256": _sha256(os.path.join(path, n))}
            for n in names}


def verify_files(path: str, meta: dict[str, Any], part: tuple[int, int] = (0, 1)) -> str | None:
    """Check the files of checkpoint ``path`` against meta.json's sizes and hashes (with
    ``part=(i, n)`` only every n-th file from the i-th: ranks share the work). Raises
    ValueError naming the first bad file, missing or extra one."""
    want = meta.get("files")
    if not isinstance(want, dict) or not want:
        raise ValueError(f"{os.path.join(path, META)} lists no file hashes: the checkpoint is corrupt")
    have = set(_data_files(path))
    if have != set(want):
        raise ValueError(f"checkpoint {path} does not hold the files its meta.json lists "
                         f"(missing {sorted(set(want) - have)}, unexpected {sorted(have - set(want))})")
    i, n = part
    for name in sorted(want)[i::n]:
        f = os.path.join(path, name)
        size = os.path.getsize(f)
        if size != want[name].get("bytes"):
            raise ValueError(f"checkpoint file {f} has {size} bytes, meta.json says {want[name].get('bytes')}: "
                             "truncated or overwritten")
        if _sha256(f) != want[name].get("sha256"):
            raise ValueError(f"checkpoint file {f} does not match its SHA-256 in meta.json: the file is corrupt")
        if name == DCP_METADATA:
            read_dcp_metadata(path)
    return None


DCP_METADATA = ".metadata"
# NOTE: what DCP's .metadata pickle is made of (torch 2.11-2.14, pinned by a test on both); a
# hash in meta.json proves integrity, not trust, so nothing else is unpickled
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()) or (module == "torch" and isinstance(
                getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_dcp_metadata(path: str) -> Any:
    """DCP's metadata of checkpoint ``path``, unpickled with only the types DCP's metadata is
    made of (a ValueError of one line names the file and what else it held)."""
    f = os.path.join(path, DCP_METADATA)
    try:
        with open(f, "rb") as fh:
            return _MetadataUnpickler(fh).load()
    except pickle.UnpicklingError as e:
        raise ValueError(f"checkpoint file {f} holds {e}, which is not part of DCP's metadata: refused, "
                         "since loading it could run code") from None
    except (EOFError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"checkpoint file {f} is not DCP metadata: {type(e).__name__}: {e}") from None


def _safe_reader(path: str) -> Any:
    """DCP's file-system reader, reading the metadata with :func:`read_dcp_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_dcp_metadata(path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader(path)


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


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, group: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {f"group{group}": {"model": get_model_state_dict(model),
                              "optim": get_optimizer_state_dict(model, optimizer)}}


def _rank_file(rank: int) -> str:
    return f"rank{rank}.state.pt"


def _all_ranks(obj: Any) -> list[Any]:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def save(ckpt_dir: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         rank_state: dict[str, Any], meta: dict[str, Any], group: int, keep: int = 2,
         fault: Callable[[str], None] | None = None) -> str:
    """Write a checkpoint of ``step`` atomically (collective: every rank calls it).

    Steps:
      1. rank 0 removes a stale ``.tmp-<name>`` left by a crashed save; barrier;
      2. every rank saves ``group{f}.model`` and ``group{f}.optim`` with DCP into
         ``.tmp-<name>``, and its ``rank_state`` + RNG states (tensors and plain types) into
         ``rank{r}.state.pt``;
      3. ``fault(tmp_dir)`` if given (tests inject a crash here); barrier;
      4. the ranks hash the files (each a share), rank 0 writes meta.json with every file's
         size and SHA-256, renames the directory to ``<name>``, replaces ``latest`` (write +
         fsync + rename) and prunes all but the newest ``keep`` checkpoints; barrier.

    Returns the checkpoint's path.
    """
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    name = step_name(step)
    final = os.path.join(ckpt_dir, name)
    tmp = os.path.join(ckpt_dir, _TMP_PREFIX + name)
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    dcp.save(_state(model, optimizer, group), checkpoint_id=tmp)
    with open(os.path.join(tmp, _rank_file(rank)), "wb") as f:
        torch.save({**_to_local(rank_state), "rng": _rng_state()}, f)
        f.flush()
        os.fsync(f.fileno())
    if fault is not None:
        fault(tmp)
    _barrier()
    names = _data_files(tmp)
    hashes = {k: v for part in _all_ranks(_hash_files(tmp, names[rank::world])) for k, v in part.items()}
    if rank == 0:
        _publish(ckpt_dir, tmp, final, {"format": FORMAT_VERSION, "step": step, **meta, "files": hashes})
        _prune(ckpt_dir, keep)
    _barrier()
    return final


def _publish(ckpt_dir: str, tmp: str, final: str, meta: dict[str, Any]) -> None:
    """Rank 0's part of a save: meta.json, the rename, ``latest``."""
    with open(os.path.join(tmp, META), "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    name = os.path.basename(final)
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


def _prune(ckpt_dir: str, keep: int) -> None:
    if keep < 1:
        return
    done = sorted(d for d in os.listdir(ckpt_dir)
                  if _NAME.fullmatch(d) and os.path.isfile(os.path.join(ckpt_dir, d, META)))
    for d in done[:-keep]:
        shutil.rmtree(os.path.join(ckpt_dir, d), ignore_errors=True)


def pin_latest(ckpt_dir: str, into: str, attempts: int = 5) -> tuple[str, str] | None:
    """Hold on to the newest complete checkpoint of ``ckpt_dir`` while another job keeps saving
    there (and pruning): hard-link its files into ``into/<name>`` (copy them where links are
    not possible). Returns ``(pinned, original)`` paths, or None when there is no checkpoint.
    A checkpoint pruned while it is being pinned is dropped and the then newest one is
    pinned instead, up to ``attempts`` times. Remove ``into`` when done."""
    for _ in range(attempts):
        path = latest_checkpoint(ckpt_dir)
        if path is None:
            return None
        dst = os.path.join(into, os.path.basename(path))
        shutil.rmtree(dst, ignore_errors=True)
        os.makedirs(dst)
        try:
            for n in os.listdir(path):
                _link_or_copy(os.path.join(path, n), os.path.join(dst, n))
        except FileNotFoundError:
            pass
        complete = os.path.isfile(os.path.join(dst, META)) and \
            set(_data_files(dst)) == set(read_meta(dst).get("files", ()))
        # NOTE: only checkpoints older than the newest are pruned: an incomplete pin of the
        # newest is a damaged checkpoint, which load() names (it verifies every file)
        if complete or latest_checkpoint(ckpt_dir) == path:
            return dst, path
        shutil.rmtree(dst, ignore_errors=True)
    raise RuntimeError(f"could not pin a checkpoint of {ckpt_dir}: each of {attempts} newest ones was pruned "
                       "while it was being pinned")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except FileNotFoundError:
        raise
    except OSError:  # NOTE: another file system, or one without hard links
        shutil.copy2(src, dst)


def _safe_planner() -> Any:
    """DCP's default load planner, with its non-tensor items loaded ``weights_only``."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _WeightsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            # NOTE: the default unpickles with weights_only=False; optimizer hyper-parameters
            # and step counts are plain types, which weights_only=True loads
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return _WeightsOnlyPlanner()


def verify(path: str, meta: dict[str, Any]) -> None:
    """:func:`verify_files` shared among the ranks (collective); every rank raises the same
    error when one found a bad file."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    try:
        verify_files(path, meta, (rank, world))
        err = None
    except (ValueError, OSError) as e:
        err = str(e)
    errors = [e for e in _all_ranks(err) if e]
    if errors:
        raise ValueError(errors[0])


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, group: int,
         topo: Topology, model_cfg: dict[str, Any],
         same_group_shape: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load a checkpoint into ``model`` and ``optimizer`` (collective).

    Steps: read meta.json and refuse another topology (``same_group_shape``: another group
    shape, see :func:`check_compatible`) or model shape; verify every file's
    size and SHA-256 (the ranks share the work); DCP-load this group's model and optimizer
    state into destinations of the current shapes (non-tensor items ``weights_only``); set them
    into the model and optimizer; load this rank's state file ``weights_only``; restore the RNG
    states.

    ``group`` is the federation group whose model and optimizer state to load (an elastic
    resume may take another group's). Returns ``(meta, rank_state)``; ``rank_state`` holds what
    :func:`save` was given (fed, data, step, ...).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    meta = read_meta(path)
    check_compatible(meta, topo, model_cfg, path, same_group_shape)
    verify(path, meta)
    rank = dist.get_rank() if dist.is_initialized() else 0
    sd = _state(model, optimizer, group)
    dcp.load(sd, storage_reader=_safe_reader(path), planner=_safe_planner())
    g = sd[f"group{group}"]
    set_model_state_dict(model, g["model"])
    set_optimizer_state_dict(model, optimizer, g["optim"])
    f = os.path.join(path, _rank_file(rank))
    if not os.path.isfile(f):
        raise ValueError(f"checkpoint {path} has no state file for rank {rank} ({f})")
    try:
        rank_state = torch.load(f, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - one clear line naming the file
        raise ValueError(f"checkpoint file {f} cannot be loaded as tensors and plain types: "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    _set_rng_state(rank_state.pop("rng"))
    return meta, rank_state


# ---------------------------------------------------------------- elastic runs: a folder per group
def elastic_checkpoint_dir(root: str, group: int) -> str:
    """Federation group ``group``'s checkpoint folder under an elastic run's ``root``."""
    return os.path.join(root, f"group{group}")


def elastic_checkpoint_groups(root: str) -> list[int]:
    """The groups with a folder under an elastic run's ``root`` (:func:`elastic_checkpoint_dir`)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(n[5:]) for n in names if n.startswith("group") and n[5:].isdigit())


def newest_group_checkpoints(root: str) -> dict[int, tuple[int, str]]:
    """Every group's newest checkpoint under an elastic run's ``root``: group -> (step, path)."""
    found = {}
    for f in elastic_checkpoint_groups(root):
        path = latest_checkpoint(elastic_checkpoint_dir(root, f))
        if path is not None:
            found[f] = (int(read_meta(path)["step"]), path)
    return found


def newest_step_checkpoints(root: str) -> dict[int, str]:
    """The groups' newest checkpoints of the newest step among them (what an elastic resume
    loads): group -> path."""
    found = newest_group_checkpoints(root)
    newest = max((st for st, _ in found.values()), default=None)
    return {f: path for f, (st, path) in found.items() if st == newest}


# ---------------------------------------------------------------- before launch
def check_before_launch(cfg: TrainConfig, world_size: int) -> Topology:
    """What can be refused before any process starts: the topology against the world size,
    the model (``seq_len`` within its ``max_seq_len``), the data file and its token ids, and
    a checkpoint to resume from (its files' hashes, and the same topology, model, seed,
    FedAvg settings (:func:`check_fedavg`) and, without ``allow_data_change``, data)."""
    topo = resolve_topology(cfg, world_size, cfg.ranks_per_node)
    if cfg.elastic and cfg.min_groups > topo.num_groups:
        raise ValueError(f"--min-groups {cfg.min_groups} exceeds the {topo.num_groups} federation groups of "
                         f"{world_size} ranks in groups of {topo.group_size}")
    if cfg.elastic and topo.node_groups is not None:
        raise ValueError("--elastic needs contiguous federation groups (no explicit node_groups)")
    mcfg = cfg.model_config()
    tokens = load_tokens(cfg.data, cfg.data_dtype, cfg.max_tokens)
    check_vocab(tokens, mcfg.vocab_size, data_source(cfg.data))
    split_for_ranks(tokens, world_size, cfg.batch_size, cfg.seq_len, cfg.eval_fraction)
    if cfg.resume and cfg.checkpoint_dir:
        run_meta = {"seed": cfg.seed, "data": data_record(cfg.data, tokens)}
        for path in _resume_candidates(cfg):
            meta = read_meta(path)
            check_compatible(meta, topo, mcfg.to_dict(), path, same_group_shape=cfg.elastic)
            check_resume(meta, run_meta, path, cfg.allow_data_change)
            if cfg.federated:
                check_fedavg(meta, cfg.fedavg.to_dict(), path)
            verify_files(path, meta)
    return topo


def check_fedavg(meta: dict[str, Any], run: dict[str, Any], path: str) -> None:
    """Refuse to resume a run of FedAvg config ``run`` from a checkpoint whose FedAvg state it
    cannot load, by the rule the ranks apply
    (:func:`~flcomm.federated.persist.config_mismatch`). A checkpoint without ``fedavg`` in
    meta.json (written before it was recorded) is left to the ranks' check."""
    saved = meta.get("fedavg")
    bad = None if not isinstance(saved, dict) else config_mismatch(saved, run)
    if bad is None:
        return
    key, have, want = bad
    if key == "in_place":
        # NOTE: outer and error_feedback matched (checked first), so --codec or --overlap differs
        why = f"--codec {run['codec']}" if run["codec"] != "none" else "--overlap"
        raise ValueError(f"checkpoint {path} was written in the paper's in-place mode (--codec none, --outer avg, "
                         f"no --overlap, no --error-feedback), which keeps no anchor; this run has {why} and "
                         "needs one; resume with the same FedAvg settings")
    raise ValueError(f"checkpoint {path} was written with {_flag(key, have)}, this run has {_flag(key, want)}; "
                     "resume with the same FedAvg settings")


def _flag(key: str, value: Any) -> str:
    """A FedAvg setting as its command-line flag (``--outer avg``, ``--no-error-feedback``)."""
    name = key.replace("_", "-")
    if isinstance(value, bool):
        return f"--{name}" if value else f"--no-{name}"
    return f"--{name} {value}"


def _resume_candidates(cfg: TrainConfig) -> list[str]:
    """The checkpoints a ``--resume`` may load: the newest one; for ``--elastic`` every group's
    newest of the newest step among the groups (``flcomm.train.run._elastic_source`` picks
    from these; every group's ``latest`` is read)."""
    root = cfg.checkpoint_dir
    if not cfg.elastic:
        path = latest_checkpoint(root)
        return [] if path is None else [path]
    return list(newest_step_checkpoints(root).values())
