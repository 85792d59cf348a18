"""One rank's run, set up: :func:`build_run` and the :class:`Run` it returns, and what the
training loop (:mod:`flcomm.train.loop`) calls on it besides the step: :func:`evaluate`.

:func:`build_run` (collective) makes the :class:`~flcomm.federated.topology.Topology` of the
strategy and its FedMesh (every group, mesh dims included, with the configured timeout); the
model, built on the meta device for big presets and sharded with FSDP2 ``fully_shard`` per
decoder block and at the root over the group's "shard" dim (FSDP) or ("replicate", "shard")
(HSDP) (:func:`shard_model`); this rank's data slice (one of P disjoint slices) and held-out
batches; AdamW; for the FL strategies a FedAvg over the "fed" dim; then the resume from the
latest checkpoint (an elastic run's: any group's of the newest step) and, for a restarted
group (``--rejoin``), its admission by the survivors.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flcomm.federated.fedavg import FedAvg
from flcomm.federated.mesh import init_fed_mesh
from flcomm.federated.topology import Topology
from flcomm.train import checkpoint as ckpt
from flcomm.train.config import TrainConfig, resolve_topology
from flcomm.train.data import (
    BUILTIN_CORPUS,
    ShardedLoader,
    check_vocab,
    data_record,
    data_source,
    eval_batches,
    fingerprint,
    load_tokens,
    split_for_ranks,
)
from flcomm.train.metrics import FsdpTraffic
from flcomm.train.model import Transformer, build_model, lm_loss
from flcomm.train.monitor import Monitor

if TYPE_CHECKING:
    from flcomm.federated.elastic import Federation
    from flcomm.federated.mesh import FedMesh


def _device(backend: str) -> torch.device:
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def shard_model(model: Transformer, mesh: FedMesh, mp_policy: Any = None,
                replicate_hook: bool = False) -> list[tuple[nn.Module, bool]]:
    """FSDP2 ``fully_shard`` per decoder block (reshard after forward) and on the root (kept
    unsharded from forward to backward), over the federation group's mesh: ("replicate",
    "shard") with R > 1 replicas, else "shard"; and "shard" alone with ``replicate_hook`` (the
    replicate all-reduce is then flcomm's hook, :func:`_replicate_hook`). Returns the FSDP
    units, innermost first, with their reshard-after-forward flag."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    one_dim = mesh.topology.num_replicas == 1 or replicate_hook
    dm = mesh.device_mesh["shard"] if one_dim else mesh.device_mesh["replicate", "shard"]
    kw: dict[str, Any] = {"mesh": dm, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    units: list[tuple[nn.Module, bool]] = []
    for block in model.layers:
        fully_shard(block, reshard_after_forward=True, **kw)
        units.append((block, True))
    # NOTE: explicit False for the root (FSDP2's default for the root too): it is needed again
    # right at the start of backward, and it makes the traffic count in FsdpTraffic exact.
    fully_shard(model, reshard_after_forward=False, **kw)
    units.append((model, False))
    return units


STARTUP_TIMEOUT_S = 120.0


def _startup_barrier(cfg: TrainConfig) -> None:
    """Wait for every rank to have built its model and read its data, for up to
    max(timeout_s, STARTUP_TIMEOUT_S); then the default group gets ``timeout_s``."""
    # NOTE: ranks start and build their models at different speeds (a loaded host, a slow file
    # system, torch imported by each rank); the first collectives would otherwise time out
    # after timeout_s, which is meant for a step's collectives. The launchers initialize the
    # default group with the start-up timeout; a group of its own carries it here (its
    # creation already waits for every rank).
    g = dist.new_group(timeout=timedelta(seconds=max(cfg.timeout_s, STARTUP_TIMEOUT_S)))
    dist.barrier(group=g)
    dist.destroy_process_group(g)
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout  # torch < 2.12
    set_timeout(timedelta(seconds=cfg.timeout_s))


def _check_same_data(fp: int, device: torch.device) -> None:
    t = torch.tensor([fp, -fp], dtype=torch.int64, device=device)
    mx = t.clone()
    dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    if int(mx[0]) != fp or int(-mx[1]) != fp:
        raise RuntimeError(f"ranks read different datasets (fingerprints differ, e.g. {fp:x} here): "
                           "the built-in corpus depends on the Python version; use the same "
                           "environment on every node or --data PATH")


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[Tensor, Tensor]], device: torch.device,
             fed: Any = None, step: int = 0) -> float:
    """World-mean loss over every rank's held-out batches (collective over the world; an elastic
    run's world is its group: the groups' sums then add up over the live groups, as an agreed
    round of ``fed``, :meth:`FedAvg.cross_group`)."""
    was = model.training
    model.eval()
    tot = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        tot[0] += lm_loss(model(x), y).double() * y.numel()
        tot[1] += y.numel()
    dist.all_reduce(tot)
    model.train(was)
    if fed is not None and fed.federation is not None:
        def over_groups(transport: Any) -> Tensor:
            t = tot.clone().to(transport.device)
            transport.all_reduce(t, op="sum")
            return t

        tot = fed.cross_group(f"eval{step}", over_groups)
    return float(tot[0] / tot[1])


@dataclass
class Run:
    """Everything :func:`build_run` sets up for one rank; the loop's state lives here too."""

    cfg: TrainConfig
    rank: int
    device: torch.device
    topo: Topology
    mesh: FedMesh
    model: nn.Module
    optimizer: torch.optim.Optimizer
    traffic: FsdpTraffic
    fed: Any
    loader: ShardedLoader
    held: list[tuple[Tensor, Tensor]]
    meta: dict[str, Any]                 # what every checkpoint's meta.json records
    info: dict[str, Any]                 # the metrics file's config record (beyond cfg)
    monitor: Monitor
    start_step: int = 0
    elapsed0: float = 0.0
    resumed_from: str | None = None
    bad_step: int | None = None          # first non-finite step of this group, not yet agreed
    group_wait_s: float = 0.0            # seconds waited for other federation groups at world-wide checks
    federation: Federation | None = None  # --elastic

    @property
    def tokens_per_step(self) -> int:
        ranks = len(self.federation.live_ranks()) if self.federation is not None else self.topo.world_size
        return ranks * self.cfg.batch_size * self.cfg.seq_len

    def checkpoint_dir(self) -> str:
        """Where this rank's checkpoints go: elastic runs save per federation group."""
        assert self.cfg.checkpoint_dir
        if self.federation is None:
            return self.cfg.checkpoint_dir
        return ckpt.elastic_checkpoint_dir(self.cfg.checkpoint_dir, self.mesh.coords.group)


def _build_model(cfg: TrainConfig, mesh: FedMesh, device: torch.device) -> tuple[nn.Module, FsdpTraffic]:
    """The model, sharded with FSDP2 over ``mesh`` (hierarchical collectives on request), and
    the counter of FSDP's traffic."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mcfg = cfg.model_config()
    use_meta = cfg.init == "meta" or (cfg.init == "auto" and mcfg.num_params() > 300_000_000)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if cfg.mixed_precision == "bf16" else MixedPrecisionPolicy())
    hooked = cfg.replicate_codec != "none"
    if use_meta:
        model = build_model(mcfg, device="meta")
        units = shard_model(model, mesh, mp, hooked)
        model.to_empty(device=device)
        # NOTE: every rank draws its own shards from one seed: ranks with the same shard
        # coordinates (the shard peers) get identical values, so all groups start equal.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(cfg.seed)
            model.init_weights()
    else:
        model = build_model(mcfg, device="cpu", seed=cfg.seed).to(device)
        units = shard_model(model, mesh, mp, hooked)
    topo = mesh.topology
    hierarchical = cfg.hierarchical and len({r // topo.ranks_per_node for r in mesh.group_ranks["shard"]}) > 1
    if hierarchical:
        from flcomm.fsdp.fsdp2 import apply_hierarchical_collectives

        # NOTE: the hooks' transports count their own bytes (intra- and inter-node apart) into
        # mesh.stats, so FsdpTraffic leaves the shard-dim collectives out.
        apply_hierarchical_collectives(model, mesh.hierarchy("shard"))
    elif cfg.hierarchical and mesh.rank == 0:
        print("flcomm.train: --hierarchical has no effect: the shard group lies inside one node",
              file=sys.stderr, flush=True)
    if hooked:
        _replicate_hook(cfg, model, mesh)
    return model, FsdpTraffic(units, mesh, mp.param_dtype, mp.reduce_dtype, count_shard_dim=not hierarchical,
                              count_replicate_dim=not hooked)


def _replicate_hook(cfg: TrainConfig, model: nn.Module, mesh: FedMesh) -> None:
    """``--replicate-codec``: every FSDP unit's gradient shard all-reduced over the replicate dim
    by flcomm's hook, in the codec (with error feedback on request), on the mesh's transport."""
    from flcomm.fsdp.fsdp2 import apply_all_reduce_hook

    # NOTE: the hook's transport counts its own wire bytes (the codec's) into mesh.stats, so
    # FsdpTraffic leaves the replicate-dim all-reduce out.
    apply_all_reduce_hook(model, mesh.transport("replicate"), codec=cfg.replicate_codec,
                          error_feedback=cfg.replicate_error_feedback)


def _build_data(cfg: TrainConfig, mesh: FedMesh, device: torch.device):
    """This rank's loader (slice ``group * G + index`` of P), its held-out batches, and the
    data record a checkpoint keeps (:func:`flcomm.train.data.data_record`)."""
    topo, coords = mesh.topology, mesh.coords
    P = topo.world_size
    tokens = load_tokens(cfg.data, cfg.data_dtype, cfg.max_tokens)
    check_vocab(tokens, cfg.model_config().vocab_size, data_source(cfg.data))
    _startup_barrier(cfg)
    _check_same_data(fingerprint(tokens), device)
    split = split_for_ranks(tokens, P, cfg.batch_size, cfg.seq_len, cfg.eval_fraction)
    index = coords.group * topo.group_size + coords.index
    loader = ShardedLoader(split.train, cfg.seq_len, cfg.batch_size, P, index, cfg.seed, device=device)
    held = eval_batches(split.heldout, cfg.seq_len, cfg.batch_size, cfg.eval_batches, P, index)
    sizes = {"train_tokens": len(split.train), "heldout_tokens": len(split.heldout)}
    return loader, held, data_record(cfg.data, tokens), sizes


def build_run(cfg: TrainConfig, monitor: Monitor, store: Any = None) -> Run:
    """Mesh, model, sharding, hooks, data, FedAvg and resume of this rank (collective).
    ``--elastic``: torch.distributed's world is this rank's federation group (see
    :func:`flcomm.train.launch.worker_main`), RANK / WORLD_SIZE the job's, and ``store`` the
    job's store, which the :class:`~flcomm.federated.elastic.Federation` works through."""
    if cfg.elastic:
        P, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    else:
        P, rank = dist.get_world_size(), dist.get_rank()
    backend = str(dist.get_backend()).lower()
    device = _device(backend)
    local_ws = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
    topo = resolve_topology(cfg, P, local_ws)
    mesh = init_fed_mesh(topo, device.type, cfg.mesh_config(), group_rank=rank if cfg.elastic else None)
    federation = None
    if cfg.elastic:
        from flcomm.federated.elastic import Federation

        if store is None:
            raise RuntimeError("--elastic needs the job's store (flcomm.train.launch.worker_main passes it)")
        federation = Federation(store, topo, rank, mesh.config, backend=backend, grace_s=cfg.elastic_grace_s,
                                min_groups=cfg.min_groups, stats=mesh.stats, rejoin_mode=cfg.rejoin)
    monitor.set_groups({k: list(v) for k, v in mesh.group_ranks.items()})
    # NOTE: the global generators are seeded, so the RNG state a checkpoint saves is the same
    # run to run (nothing in the loop draws from them today; dropout would).
    torch.manual_seed(cfg.seed)
    model, traffic = _build_model(cfg, mesh, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                  weight_decay=cfg.weight_decay)
    loader, held, data_rec, sizes = _build_data(cfg, mesh, device)
    fed = None
    if cfg.federated:
        # NOTE: FedAvg agrees inside the group too (the refusal flags at the apply, the overlap
        # choice): a failure there names that group (its job's agreement stage says so itself)
        mesh.observe = lambda t, name: monitor.noting(t, "in-group all-reduce", "group") if name == "group" else t
        fed = FedAvg(model, mesh, cfg.fedavg, inner_optimizer=optimizer, federation=federation,
                     sync_module_states=not cfg.rejoin)
    mcfg = cfg.model_config()
    meta = {"strategy": cfg.strategy, "transport": cfg.transport, "replicate_codec": cfg.replicate_codec,
            "replicate_error_feedback": cfg.replicate_error_feedback, "topology": topo.to_dict(),
            "model": mcfg.to_dict(), "seed": cfg.seed,
            "seq_len": cfg.seq_len, "batch_size": cfg.batch_size, "data": data_rec}
    if fed is not None:  # NOTE: what check_before_launch compares before a resume starts the ranks
        meta["fedavg"] = fed.config.to_dict()
    info = {"world_size": P, "mesh_shape": list(topo.mesh_shape), "ranks_per_node": topo.ranks_per_node,
            "group_size": topo.group_size, "shard_size": topo.shard_size, "num_params": mcfg.num_params(),
            "tokens_per_step": P * cfg.batch_size * cfg.seq_len, "backend": backend,
            "data_name": cfg.data or BUILTIN_CORPUS, **sizes,
            "fsdp_bytes_per_step": {t.value: b for t, b in traffic.bytes_per_step.items()}}
    run = Run(cfg, rank, device, topo, mesh, model, optimizer, traffic, fed, loader, held, meta, info, monitor,
              federation=federation)
    monitor.poison = lambda: _poison(model)
    if cfg.resume or cfg.rejoin:
        _resume(run)
    if cfg.rejoin:
        _rejoin(run)
    return run


def _rejoin(run: Run) -> None:
    """A restarted group: wait until the survivors admit it at a sync, take their anchor, and go
    on from that step (the data position follows the step; the optimizer state is the
    checkpoint's)."""
    run.monitor.enter(run.start_step, "rejoin")
    step = run.fed.rejoin()
    run.start_step = step
    run.loader.position = step * run.cfg.batch_size
    print(f"flcomm.train: rank {run.rank}: federation group {run.mesh.coords.group} rejoined at step {step} "
          f"(generation {run.federation.generation})", file=sys.stderr, flush=True)


@torch.no_grad()
def _poison(model: nn.Module) -> None:
    """NaN into this rank's parameters (the fault tests' "nan" action)."""
    for p in model.parameters():
        p.fill_(float("nan"))


def _resume(run: Run) -> None:
    """Load the latest checkpoint of ``run.cfg.checkpoint_dir``, if there is one: model,
    optimizer, data position, FedAvg state, step (refusing another topology, model, seed or,
    without ``allow_data_change``, other data)."""
    cfg = run.cfg
    coords = run.mesh.coords
    path, src, pin = (ckpt.latest_checkpoint(cfg.checkpoint_dir), coords.group, None) if run.federation is None \
        else _elastic_source(run)
    try:
        if path is not None:
            _load(run, pin or path, src)
            run.resumed_from = path
    finally:
        if pin is not None:
            dist.barrier()  # NOTE: every rank of the group has read its files
            if dist.get_rank() == 0:
                shutil.rmtree(os.path.dirname(pin), ignore_errors=True)
    if run.rank == 0:
        print(f"flcomm.train: resuming from {path} (step {run.start_step})" if path else
              f"flcomm.train: no checkpoint in {cfg.checkpoint_dir}, starting at step 0",
              file=sys.stderr, flush=True)


def _load(run: Run, path: str, src: int) -> None:
    """:func:`_resume` of checkpoint ``path``, federation group ``src``'s state in it."""
    cfg, coords = run.cfg, run.mesh.coords
    ckpt.check_resume(ckpt.read_meta(path), run.meta, path, cfg.allow_data_change)
    _, rs = ckpt.load(path, run.model, run.optimizer, src, run.topo, run.meta["model"],
                      same_group_shape=run.federation is not None)
    if run.federation is not None and (src != coords.group or rs["data"].get("n_windows") != run.loader.n_windows):
        # NOTE: elastic, another group's (or another number of groups'): the data position only
        # (the windows consumed per rank: the same on every rank)
        run.loader.position = int(rs["data"]["position"])
    else:
        run.loader.load_state_dict(rs["data"])
    if run.fed is not None:
        if rs.get("fed") is None:
            raise ValueError(f"checkpoint {path} has no FedAvg state (written by strategy "
                             f"without federation), cannot resume {cfg.strategy}")
        # NOTE: elastic: another group's entry for the rank with this rank's shard coordinates
        run.fed.load_state_dict(rs["fed"], source_rank=src * run.topo.group_size + coords.index)
    run.start_step, run.elapsed0 = int(rs["step"]), float(rs.get("elapsed_s", 0.0))


def _elastic_source(run: Run) -> tuple[str | None, int, str | None]:
    """An elastic resume: the newest checkpoint of any group (their number may differ from this
    run's), this rank's own group's when it has that step; the group it belongs to; and for a
    rejoining group, the checkpoint pinned (:func:`flcomm.train.checkpoint.pin_latest`: the
    survivors go on saving and pruning while it loads), else None."""
    root = run.cfg.checkpoint_dir
    mine = run.mesh.coords.group
    choice: tuple[str | None, int, str | None] = (None, mine, None)
    error = None
    if dist.get_rank() == 0:
        try:
            newest = ckpt.newest_step_checkpoints(root)
            if newest:
                src = mine if mine in newest else min(newest)
                choice = (newest[src], src, None)
                if run.cfg.rejoin:
                    into = os.path.join(ckpt.elastic_checkpoint_dir(root, mine), ckpt.PIN_DIR)
                    shutil.rmtree(into, ignore_errors=True)  # NOTE: a pin a crashed rejoin left
                    pinned = ckpt.pin_latest(ckpt.elastic_checkpoint_dir(root, src), into)
                    choice = (pinned[1], src, pinned[0]) if pinned is not None else choice
        except (OSError, ValueError, RuntimeError) as e:
            error = (type(e).__name__, str(e))
    # NOTE: the group's first rank chooses for all: survivors may publish a newer one meanwhile
    box = [(choice, error)]
    dist.broadcast_object_list(box, src=0)
    choice, error = box[0]
    if error is not None:
        raise (ValueError if error[0] == "ValueError" else RuntimeError)(
            f"the group's first rank could not choose a checkpoint under {root}: {error[0]}: {error[1]}")
    return choice
