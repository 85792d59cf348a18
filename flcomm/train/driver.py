"""The reference training loop for the four strategies: FSDP, HSDP, FL+FSDP and FL+HSDP.

One rank's run (:func:`train`, inside an initialized process group):

1. build the :class:`~flcomm.federated.topology.Topology` of the strategy and its FedMesh;
2. build the model (on the meta device for big presets) and apply FSDP2 ``fully_shard`` to
   every decoder block and to the root, over the federation group's mesh: the "shard" dim
   (FSDP) or ("replicate", "shard") (HSDP);
3. read the data slice of this rank (one of P disjoint slices) and the held-out split;
4. AdamW with linear warm-up and cosine decay; for the FL strategies a FedAvg over the "fed"
   dim, stepped after every optimizer step;
5. optionally resume from the latest checkpoint (model, optimizer, FedAvg state, data
   position, RNG);
6. per step: forward, backward, clip, optimizer step, ``fed.step()``; rank 0 writes a JSONL
   record (loss, tokens/s, bytes per tier, exposed communication); evaluation every
   ``eval_every`` steps and at the end (``fed.finish()`` first); checkpoints every
   ``save_every`` steps and at the end.

:func:`launch_local` spawns N local CPU processes with gloo; under ``torchrun``
:func:`worker_main` reads the env:// variables.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flcomm.comm.base import LinkTier
from flcomm.federated.topology import Topology
from flcomm.train import checkpoint as ckpt
from flcomm.train.data import (BUILTIN_CORPUS, ShardedLoader, check_vocab, eval_batches, fingerprint,
                               load_tokens, split_tokens)
from flcomm.train.metrics import FsdpTraffic, MetricsWriter, TierCounter, perplexity
from flcomm.train.model import PRESETS, Transformer, build_model, get_config, lm_loss

if TYPE_CHECKING:
    from flcomm.federated.topology import FedMesh

STRATEGIES = ("fsdp", "hsdp", "fl-fsdp", "fl-hsdp")
OUTERS = ("avg", "nesterov")
INNER_STATES = ("keep", "average", "reset")
_FALLBACK_CODECS = ("none", "bf16", "fp16", "int8", "fp8")


def known_codecs() -> tuple[str, ...]:
    try:
        from flcomm.codecs import CODECS

        return tuple(CODECS)
    except ImportError:  # NOTE: the codec module is optional for the F = 1 strategies
        return _FALLBACK_CODECS


def _pos_int(name: str, v: object, allow_zero: bool = False) -> None:
    lo = 0 if allow_zero else 1
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs; the CLI flags map one to one (``--sync-every`` -> sync_every).

    Topology (None = the strategy's default, see :func:`resolve_topology`): ``ranks_per_node``,
    ``group_size`` (G, ranks per federation group), ``shard_size`` (S, ranks per shard group).
    Batch sizes are per rank; a step consumes ``world * batch_size * seq_len`` tokens.
    """

    strategy: str = "fsdp"
    ranks_per_node: int | None = None
    group_size: int | None = None
    shard_size: int | None = None
    # hierarchical FSDP collectives (intra-node stage, then inter-node) for a shard group that
    # spans nodes; a no-op when it does not
    hierarchical: bool = False
    # FedAvg
    sync_every: int = 8
    codec: str = "none"
    error_feedback: bool = False
    outer: str = "avg"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    inner_state: str = "keep"
    overlap: bool = False
    bucket_mb: float = 25.0
    # model and optimization
    model: str = "tiny"
    vocab_size: int | None = None
    init: str = "auto"  # auto | full | meta
    mixed_precision: str = "none"  # none | bf16
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int | None = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    # data and evaluation
    data: str | None = None
    data_dtype: str | None = None
    max_tokens: int | None = None
    eval_fraction: float = 0.02
    eval_every: int = 0
    eval_batches: int = 4
    # output
    metrics: str | None = None
    checkpoint_dir: str | None = None
    save_every: int = 0
    keep_checkpoints: int = 2
    resume: bool = False
    progress: bool = True
    # runtime
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; expected one of {', '.join(STRATEGIES)}")
        if not isinstance(self.sync_every, int) or isinstance(self.sync_every, bool) or self.sync_every < 1:
            raise ValueError(f"sync_every (E, local steps between FedAvg syncs) must be an integer >= 1, "
                             f"got {self.sync_every!r}")
        codecs = known_codecs()
        if self.codec not in codecs:
            raise ValueError(f"unknown codec {self.codec!r}; expected one of {', '.join(codecs)}")
        if self.outer not in OUTERS:
            raise ValueError(f"unknown outer update {self.outer!r}; expected one of {', '.join(OUTERS)}")
        if self.inner_state not in INNER_STATES:
            raise ValueError(f"unknown inner_state {self.inner_state!r}; expected one of "
                             f"{', '.join(INNER_STATES)}")
        if self.model not in PRESETS:
            raise ValueError(f"unknown model preset {self.model!r}; expected one of {', '.join(PRESETS)}")
        if self.init not in ("auto", "full", "meta"):
            raise ValueError(f"init must be auto, full or meta, got {self.init!r}")
        if self.mixed_precision not in ("none", "bf16"):
            raise ValueError(f"mixed_precision must be none or bf16, got {self.mixed_precision!r}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be auto, gloo or nccl, got {self.backend!r}")
        for name in ("steps", "batch_size", "seq_len", "eval_batches"):
            _pos_int(name, getattr(self, name))
        for name in ("eval_every", "save_every"):
            _pos_int(name, getattr(self, name), allow_zero=True)
        for name in ("ranks_per_node", "group_size", "shard_size", "vocab_size"):
            v = getattr(self, name)
            if v is not None:
                _pos_int(name, v)
        if self.warmup is not None:
            _pos_int("warmup", self.warmup, allow_zero=True)
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs a checkpoint directory (--checkpoint-dir)")
        if self.save_every and not self.checkpoint_dir:
            raise ValueError("save_every needs a checkpoint directory (--checkpoint-dir)")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")

    @property
    def federated(self) -> bool:
        return self.strategy.startswith("fl-")

    @property
    def hybrid(self) -> bool:
        return self.strategy.endswith("hsdp")

    def model_config(self):
        over = {"vocab_size": self.vocab_size} if self.vocab_size else {}
        cfg = get_config(self.model, **over)
        if self.seq_len > cfg.max_seq_len:
            raise ValueError(f"seq_len {self.seq_len} exceeds max_seq_len {cfg.max_seq_len} of model "
                             f"preset {self.model!r}")
        return cfg

    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else min(100, max(1, self.steps // 10))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _one_node(L: int, n: int) -> int:
    """The default size of a sub-group of ``n`` ranks: one node of ``L``, or half of them when
    they all sit on one node (so there are still two sub-groups)."""
    return L if L < n else max(1, n // 2)


def resolve_topology(cfg: TrainConfig, world_size: int, local_world_size: int | None = None) -> Topology:
    """The strategy's Topology for ``world_size`` ranks, with defaults for what was not given.

    Defaults: ranks per node L = ``local_world_size`` (torchrun's LOCAL_WORLD_SIZE) or the whole
    world; fsdp: G = S = P; hsdp: G = P, S = L (a shard group is one node), or P / 2 on one
    node; fl-fsdp: G = L (a federation group is one node), or P / 2 on one node, S = G;
    fl-hsdp: G = 2 L when that leaves two or more groups, else as fl-fsdp, and S = L, or G / 2
    when the group is one node. Raises ValueError naming the numbers when the result does
    not fit the world or is not the strategy (e.g. FL with one group, HSDP with one replica).
    """
    P = world_size
    L = cfg.ranks_per_node or local_world_size or P
    G, S = cfg.group_size, cfg.shard_size
    if L > P or P % L:
        raise ValueError(f"ranks_per_node {L} does not divide the world of {P} ranks into whole nodes")
    if cfg.strategy in ("fsdp", "hsdp"):
        if G is not None and G != P:
            raise ValueError(f"--group-size is for the fl-* strategies; {cfg.strategy} trains one group of "
                             f"all {P} ranks, got group_size {G}")
        G = P
        if cfg.strategy == "fsdp":
            if S is not None and S != G:
                raise ValueError(f"fsdp shards over all {P} ranks; got shard_size {S} (use hsdp)")
            S = G
        elif S is None:
            S = _one_node(L, P)
    else:
        if G is None:
            if cfg.strategy == "fl-hsdp" and 2 * L < P and P % (2 * L) == 0:
                G = 2 * L  # NOTE: two nodes per group, so HSDP's shard group is one node
            else:
                G = _one_node(L, P)
        if cfg.strategy == "fl-fsdp":
            if S is not None and S != G:
                raise ValueError(f"fl-fsdp shards over the whole group of {G}; got shard_size {S} (use fl-hsdp)")
            S = G
        elif S is None:
            S = _one_node(L, G)
    topo = Topology(P, L, G, S)  # NOTE: raises with the numbers when something does not divide
    if cfg.federated and not topo.federated:
        raise ValueError(f"{cfg.strategy} needs at least two federation groups, but group_size {G} "
                         f"covers the whole world of {P} ranks; choose --group-size < {P} (or "
                         f"strategy {cfg.strategy[3:]})")
    if cfg.hybrid and not topo.hybrid:
        raise ValueError(f"{cfg.strategy} needs at least two replicas per group, but shard_size {S} "
                         f"equals the group size {G}; choose --shard-size < {G} (or strategy "
                         f"{cfg.strategy.replace('hsdp', 'fsdp')})")
    return topo


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Learning rate of 1-based ``step``: linear warm-up to ``lr`` over the warm-up steps, then
    cosine decay to ``min_lr_ratio * lr`` at ``steps``."""
    w = cfg.warmup_steps()
    if w and step <= w:
        return cfg.lr * step / w
    span = max(1, cfg.steps - w)
    t = min(1.0, (step - w) / span)
    lo = cfg.lr * cfg.min_lr_ratio
    return lo + 0.5 * (cfg.lr - lo) * (1 + math.cos(math.pi * t))


@dataclass
class TrainResult:
    """What :func:`train` returns on every rank."""

    losses: list[float] = field(default_factory=list)          # group-mean loss per step run here
    eval_losses: dict[int, float] = field(default_factory=dict)  # step -> world-mean eval loss
    start_step: int = 0
    final_step: int = 0
    params: dict[str, Tensor] | None = None                     # full parameters (return_params)
    tokens_per_step: int = 0
    wall_s: float = 0.0
    bytes_per_step: dict[str, float] = field(default_factory=dict)
    num_syncs: int = 0


def _device(backend: str) -> torch.device:
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def shard_model(model: Transformer, mesh: "FedMesh", mp_policy: Any = None) -> list[tuple[nn.Module, bool]]:
    """FSDP2 ``fully_shard`` per decoder block (reshard after forward) and on the root (kept
    unsharded from forward to backward), over the federation group's mesh. Returns the FSDP
    units, innermost first, with their reshard-after-forward flag."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dm = mesh.device_mesh["shard"] if mesh.topology.num_replicas == 1 else mesh.device_mesh["replicate", "shard"]
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


def _check_same_data(fp: int, device: torch.device) -> None:
    t = torch.tensor([fp, -fp], dtype=torch.int64, device=device)
    mx = t.clone()
    dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    if int(mx[0]) != fp or int(-mx[1]) != fp:
        raise RuntimeError(f"ranks read different datasets (fingerprints differ, e.g. {fp:x} here): "
                           "the built-in corpus depends on the Python version; use the same "
                           "environment on every node or --data PATH")


def _full_params(model: nn.Module) -> dict[str, Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.cpu().clone()
    return out


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[Tensor, Tensor]], device: torch.device) -> float:
    """World-mean loss over every rank's held-out batches (collective over the world)."""
    was = model.training
    model.eval()
    tot = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        tot[0] += lm_loss(model(x), y).double() * y.numel()
        tot[1] += y.numel()
    dist.all_reduce(tot)
    model.train(was)
    return float(tot[0] / tot[1])


def train(cfg: TrainConfig, return_params: bool = False, stop_after: int | None = None,
          _save_fault: Any = None) -> TrainResult:
    """Run ``cfg`` on this rank of an initialized process group (see the module docstring).

    ``return_params`` adds the full (unsharded) parameters at the end to the result (tests).
    ``stop_after`` ends the run after that step as if the job were stopped there (a time limit):
    it evaluates and checkpoints as at the end, but the schedule still spans ``cfg.steps``.
    ``_save_fault(tmp_dir)`` is passed to every checkpoint save (tests inject a crash).
    """
    if not dist.is_initialized():
        raise RuntimeError("train() needs torch.distributed to be initialized (use launch_local, "
                           "worker_main or torchrun)")
    P, rank = dist.get_world_size(), dist.get_rank()
    backend = str(dist.get_backend()).lower()
    device = _device(backend)
    local_ws = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
    topo = resolve_topology(cfg, P, local_ws)
    mesh = topo.build(device_type=device.type, timeout=timedelta(seconds=cfg.timeout_s))
    coords = mesh.coords
    mcfg = cfg.model_config()

    # ---- model
    from torch.distributed.fsdp import MixedPrecisionPolicy

    use_meta = cfg.init == "meta" or (cfg.init == "auto" and mcfg.num_params() > 300_000_000)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if cfg.mixed_precision == "bf16" else MixedPrecisionPolicy())
    if use_meta:
        model = build_model(mcfg, device="meta")
        units = shard_model(model, mesh, mp)
        model.to_empty(device=device)
        # NOTE: every rank draws its own shards from one seed: ranks with the same shard
        # coordinates (the fed peers) get identical values, so all groups start equal.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(cfg.seed)
            model.init_weights()
    else:
        model = build_model(mcfg, device="cpu", seed=cfg.seed).to(device)
        units = shard_model(model, mesh, mp)
    hierarchical = cfg.hierarchical and len({r // topo.ranks_per_node for r in mesh.group_ranks["shard"]}) > 1
    if hierarchical:
        from flcomm.collectives.hierarchical import Hierarchy
        from flcomm.fsdp.fsdp2 import apply_hierarchical_collectives

        # NOTE: the hooks' transports count their own bytes (intra- and inter-node apart) into
        # mesh.stats, so FsdpTraffic leaves the shard-dim collectives out.
        apply_hierarchical_collectives(model, Hierarchy.from_mesh(mesh, "shard"))
    elif cfg.hierarchical and rank == 0:
        print("flcomm.train: --hierarchical has no effect: the shard group lies inside one node",
              file=sys.stderr, flush=True)
    traffic = FsdpTraffic(units, mesh, mp.param_dtype, mp.reduce_dtype, count_shard_dim=not hierarchical)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                  weight_decay=cfg.weight_decay)

    # ---- data
    tokens = load_tokens(cfg.data, cfg.data_dtype, cfg.max_tokens)
    if cfg.data is not None:
        check_vocab(tokens, mcfg.vocab_size, f"--data {cfg.data!r}")
    _check_same_data(fingerprint(tokens), device)
    min_eval = P * cfg.batch_size * (cfg.seq_len + 1) + P
    split = split_tokens(tokens, cfg.eval_fraction, min_eval)
    data_index = coords.group * topo.group_size + coords.index
    loader = ShardedLoader(split.train, cfg.seq_len, cfg.batch_size, P, data_index, cfg.seed, device=device)
    held = eval_batches(split.heldout, cfg.seq_len, cfg.batch_size, cfg.eval_batches, P, data_index)

    # ---- FedAvg
    fed = None
    if cfg.federated:
        try:
            from flcomm.federated.fedavg import FedAvg
        except ImportError as e:
            raise RuntimeError(f"strategy {cfg.strategy} needs flcomm.federated.fedavg.FedAvg, which "
                               f"cannot be imported: {e}") from e
        fed = FedAvg(model, mesh, sync_every=cfg.sync_every, codec=cfg.codec,
                     error_feedback=cfg.error_feedback, outer=cfg.outer, outer_lr=cfg.outer_lr,
                     outer_momentum=cfg.outer_momentum, inner_state=cfg.inner_state,
                     overlap=cfg.overlap, bucket_mb=cfg.bucket_mb, optimizer=optimizer)

    # ---- resume
    tokens_per_step = P * cfg.batch_size * cfg.seq_len
    start_step, elapsed0 = 0, 0.0
    meta = {"strategy": cfg.strategy, "topology": ckpt.topology_dict(topo), "model": mcfg.to_dict(),
            "seed": cfg.seed, "seq_len": cfg.seq_len, "batch_size": cfg.batch_size}
    resumed_from = None
    if cfg.resume:
        path = ckpt.latest_checkpoint(cfg.checkpoint_dir)
        if path is not None:
            _, rs = ckpt.load(path, model, optimizer, coords.group, topo, mcfg.to_dict())
            loader.load_state_dict(rs["data"])
            if fed is not None:
                if rs.get("fed") is None:
                    raise ValueError(f"checkpoint {path} has no FedAvg state (written by strategy "
                                     f"without federation), cannot resume {cfg.strategy}")
                fed.load_state_dict(rs["fed"])
            start_step, elapsed0 = int(rs["step"]), float(rs.get("elapsed_s", 0.0))
            resumed_from = path
        if rank == 0:
            print(f"flcomm.train: resuming from {path} (step {start_step})" if path else
                  f"flcomm.train: no checkpoint in {cfg.checkpoint_dir}, starting at step 0",
                  file=sys.stderr, flush=True)

    # ---- metrics
    writer = MetricsWriter(cfg.metrics if rank == 0 else None, append=resumed_from is not None)
    info = {"world_size": P, "mesh_shape": list(topo.mesh_shape), "ranks_per_node": topo.ranks_per_node,
            "group_size": topo.group_size, "shard_size": topo.shard_size, "num_params": mcfg.num_params(),
            "tokens_per_step": tokens_per_step, "backend": backend,
            "data_name": cfg.data or BUILTIN_CORPUS, "train_tokens": len(split.train),
            "heldout_tokens": len(split.heldout),
            "fsdp_bytes_per_step": {t.value: b for t, b in traffic.bytes_per_step.items()},
            "resumed_from": resumed_from, "start_step": start_step}
    writer.write({"config": {**cfg.to_dict(), **info}})

    res = TrainResult(start_step=start_step, tokens_per_step=tokens_per_step)
    counter = TierCounter(mesh.stats)
    group_pg, G = mesh.groups["group"], topo.group_size
    bar = None
    if cfg.progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start_step, desc=cfg.strategy, unit="step",
                   dynamic_ncols=True, file=sys.stderr)
    sums = {t: 0 for t in LinkTier}
    exposed_prev = fed.exposed_comm_s if fed is not None else 0.0
    t_start = time.perf_counter() - elapsed0
    model.train()
    step = start_step
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    try:
        for step in range(start_step + 1, end + 1):
            t0 = time.perf_counter()
            lr = lr_at(cfg, step)
            for g in optimizer.param_groups:
                g["lr"] = lr
            x, y = loader.next_batch()
            loss = lm_loss(model(x), y)
            loss.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            traffic.record_step()
            if fed is not None:
                fed.step()
            # NOTE: the logged loss is the mean over this rank's federation group (an intra-group
            # collective); a world-wide one per step would put a sync on the slow links.
            lt = loss.detach().float().reshape(1)
            dist.all_reduce(lt, group=group_pg)
            loss_v = float(lt) / G
            dt = time.perf_counter() - t0
            res.losses.append(loss_v)
            last = step == end
            ev = None
            if (cfg.eval_every and step % cfg.eval_every == 0) or last:
                if fed is not None:
                    fed.finish()
                ev = counter.excluding(lambda: evaluate(model, held, device))
                res.eval_losses[step] = ev
            if cfg.checkpoint_dir and ((cfg.save_every and step % cfg.save_every == 0) or last):
                if fed is not None:
                    fed.finish()
                rank_state = {"step": step, "data": loader.state_dict(),
                              "fed": fed.state_dict() if fed is not None else None,
                              "elapsed_s": time.perf_counter() - t_start}
                ckpt.save(cfg.checkpoint_dir, step, model, optimizer, rank_state, meta, coords.group,
                          cfg.keep_checkpoints, _save_fault)
            # NOTE: bytes and exposed time are read after evaluation and checkpointing: their
            # fed.finish() may complete (and, bucket by bucket, issue) this step's exchange.
            exposed = (fed.exposed_comm_s - exposed_prev) if fed is not None else 0.0
            exposed_prev = fed.exposed_comm_s if fed is not None else 0.0
            d = counter.delta()
            for t in LinkTier:
                sums[t] += d[t]
            rec: dict[str, Any] = {
                "step": step, "loss": loss_v, "lr": lr, "tokens": step * tokens_per_step,
                "time_s": time.perf_counter() - t_start, "tokens_per_s": tokens_per_step / dt,
                "step_time_s": dt, "exposed_comm_s": exposed,
                "internode_bytes": d[LinkTier.INTER_NODE], "intergroup_bytes": d[LinkTier.INTER_GROUP],
                "intranode_bytes": d[LinkTier.INTRA_NODE],
            }
            if fed is not None:
                rec["num_syncs"] = fed.num_syncs
            if ev is not None:
                rec["eval_loss"], rec["eval_ppl"] = ev, perplexity(ev)
            writer.write(rec)
            if bar is not None:
                bar.update(1)
                post = {"loss": f"{loss_v:.3f}", "tok/s": f"{rec['tokens_per_s']:.0f}"}
                if ev is not None:
                    post["eval"] = f"{ev:.3f}"
                bar.set_postfix(post, refresh=False)
        if fed is not None:
            fed.finish()
    finally:
        if bar is not None:
            bar.close()
    res.final_step = step
    res.wall_s = time.perf_counter() - t_start
    n = max(1, step - start_step)
    res.bytes_per_step = {t.value: sums[t] / n for t in LinkTier}
    res.num_syncs = fed.num_syncs if fed is not None else 0
    steps_recs = res.losses
    writer.write({"summary": {"steps": step, "wall_s": res.wall_s,
                              "final_loss": steps_recs[-1] if steps_recs else None,
                              "eval_loss": res.eval_losses.get(step),
                              "eval_ppl": perplexity(res.eval_losses[step]) if step in res.eval_losses else None,
                              "bytes_per_step": res.bytes_per_step, "num_syncs": res.num_syncs}})
    writer.close()
    if return_params:
        res.params = _full_params(model)
    return res


# ---------------------------------------------------------------- process launch
def _backend(cfg: TrainConfig) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if torch.cuda.is_available() and "LOCAL_RANK" in os.environ else "gloo"


def worker_main(cfg: TrainConfig) -> TrainResult:
    """Entry point of one rank under torchrun (env://: RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    backend = _backend(cfg)
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("--backend nccl needs CUDA GPUs; none is visible (use gloo on CPU)")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout_s))
    try:
        return train(cfg)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_worker(rank: int, world: int, port: int, threads: int, cfg: TrainConfig) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(cfg.ranks_per_node or world)})
    # NOTE: N ranks share the machine's cores: an even split of intra-op threads each.
    torch.set_num_threads(threads)
    worker_main(cfg)


def check_before_launch(cfg: TrainConfig, world_size: int) -> Topology:
    """What can be refused before any process starts: the topology against the world size and
    a checkpoint to resume from that was written by another topology or model."""
    topo = resolve_topology(cfg, world_size, cfg.ranks_per_node)
    cfg.model_config()
    if cfg.resume and cfg.checkpoint_dir:
        path = ckpt.latest_checkpoint(cfg.checkpoint_dir)
        if path is not None:
            ckpt.check_compatible(ckpt.read_meta(path), topo, cfg.model_config().to_dict(), path)
    return topo


def launch_local(cfg: TrainConfig, nproc: int, timeout_s: float | None = None) -> None:
    """Run ``cfg`` on ``nproc`` local processes with gloo (CPU). Raises RuntimeError naming the
    ranks that failed (each prints its own traceback); stops the others on the first failure."""
    import torch.multiprocessing as mp

    _pos_int("nproc", nproc)
    if cfg.backend == "nccl":
        raise ValueError("--nproc launches local CPU processes with gloo; for NCCL use torchrun")
    from dataclasses import replace

    cfg = replace(cfg, backend="gloo", ranks_per_node=cfg.ranks_per_node or nproc)
    check_before_launch(cfg, nproc)
    threads = max(1, (os.cpu_count() or 1) // nproc)
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_local_worker, args=(r, nproc, port, threads, cfg), daemon=False)
             for r in range(nproc)]
    for p in procs:
        p.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failed: list[int] = []
    try:
        while True:
            alive = [p for p in procs if p.exitcode is None]
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed or not alive:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"training did not finish within {timeout_s:.0f} s")
            alive[0].join(timeout=0.2)
    finally:
        if failed or any(p.exitcode is None for p in procs):
            time.sleep(0.5 if failed else 0.0)
            for p in procs:
                if p.exitcode is None:
                    p.terminate()
            for p in procs:
                p.join(timeout=10)
                if p.exitcode is None:
                    p.kill()
                    p.join()
    if failed:
        codes = {r: procs[r].exitcode for r in failed}
        raise RuntimeError(f"rank(s) {failed} failed (exit codes {codes}); see their tracebacks above")
