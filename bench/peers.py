"""flcomm side by side with torchft (meta-pytorch/torchft), the peer a user would pick instead:
the same job on the same (emulated) cluster, each library measured the same way.

The job: the driver's model preset (``--model``, default ``small``), FSDP2 per decoder block and
on the root inside each federation group (torchft: replica group), the built-in corpus with the
same slice per (group, rank) as the driver's, AdamW inner, SGD-Nesterov 0.7 / 0.9 outer on the
averaged pseudo-gradient every E steps, the same init on every rank.

Rows (``--rows``; ``E`` comes from ``--sync-every``, each value a pass of its own):

  local         FSDP2 inside each group, no sync: the compute-only limit (the exposed-time base)
  fsdp          plain FSDP2 over every rank, across the slow links: the baseline
  tft           torchft DiLoCo
  tft-stream    torchft Streaming DiLoCo, 2 fragments (half the blocks each), delay 1
  fl            flcomm FedAvg(outer="nesterov"), codec none, blocking
  fl-ovl        the same, overlapped (overlap_steps="auto")
  fl-int8       int8 + error feedback, overlapped ("auto")
  fl-frag       2 fragments, overlap 1 (Streaming DiLoCo's schedule in flcomm)
  fl-avg        the paper's mode: the plain average (outer="avg"), codec none, blocking, in place
  tft-hsdp      R = 2 replicas inside each group (HSDP), torchft DiLoCo across groups: every
                replica sends its whole shard
  fl-hsdp       the same shape with flcomm's sharded FL+HSDP exchange: each replica sends 1/R

Columns, each taken the same way for both libraries, outside either library's own accounting:

  step s        mean wall time of a step after the first round (rank 0)
  exposed/rnd   (step s - the local row's step s) x E: communication not hidden, per round of E
                steps (one whole shard exchanged; fragments move 1/K of it K times per round)
  wire B/rnd    bytes the nodes' interfaces sent in the timed window (kernel counters,
                ``/sys/class/net/<if>/statistics/tx_bytes`` in each node's namespace) per round
  fixed s       ``--fixed``: exposed time per sync of a near-empty model (E = 1), the libraries'
                fixed cost per sync
  sync MB       tensor bytes the synchronizer object retains between steps (its object graph
                walked; the model's parameters and gradients and the inner optimizer's state
                left out)
  peak MB       sync MB plus the largest rise of allocated tensor bytes inside an optimizer
                step and the synchronizer's step over one extra round under torch's memory
                profiler, less the local row's (AdamW's own temporaries): what a sync needs at
                its height. NOTE: the profiler sees the training thread's allocations only
  RSS MB        peak resident set per rank (ru_maxrss), and its excess over the local row's
  eval          held-out loss at the end (equal tokens: every row trains the same steps)
  |dθ|          parity (``tft`` against ``fl``, codec none): the largest |θ_flcomm - θ_torchft|
                over the shards after each round, absolute and relative to max |θ|

``--recovery``: the recovery columns (kill a rank of group 1, restart its group; survivors' lost
time, the rejoined group's time back, steps redone and missed), from :mod:`bench.recovery`.

Usage (as root, for the emulated cluster; torchft is the ``peers`` extra)::

    pip install -e ".[peers]"
    python -m bench.peers --nodes 2 --ranks-per-node 2 --rate 100mbit --sync-every 4 16 \\
        --json peers.json --png peers.png
    # without root: every link is loopback (parity, memory and bytes hold; times do not)
    python -m bench.peers --launcher local --model tiny --rows tft fl --sync-every 2 --steps 6

``python -m bench.peers worker ...`` is what each rank runs (set by the launcher).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import types
from datetime import timedelta
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import recovery  # noqa: E402
from bench.tft_common import (  # noqa: E402
    OUTER_LR,
    OUTER_MOMENTUM,
    Env,
    build_data,
    build_model_sharded,
    end_rank,
    free_port,
    init_group_world,
    lighthouse_code,
    local_shard,
    reap,
    serve,
    start_rank,
    tft_diloco,
    tft_manager,
    train_step,
)

INSTALL = 'pip install -e ".[peers]"   (torchft>=0.2, the peer library this benchmark compares with)'
ROWS = ("local", "fsdp", "tft", "tft-stream", "fl", "fl-ovl", "fl-int8", "fl-frag", "fl-avg", "tft-hsdp", "fl-hsdp")
FED_ROWS = tuple(r for r in ROWS if r not in ("local", "fsdp"))
STORE_PORT, LIGHTHOUSE_PORT, FLCOMM_PORT = 29610, 29650, 29660


def require_torchft() -> str:
    """torchft's version; exits 2 with the install line when it is missing."""
    try:
        import importlib.metadata as md

        import torchft  # noqa: F401
        return md.version("torchft")
    except ImportError as e:
        sys.exit(f"bench.peers needs torchft ({e}); install it with:\n    {INSTALL}")


# ---------------------------------------------------------------- the worker (one rank) ----

def retained_bytes(root: Any, exclude: set[int]) -> int:
    """Bytes of the tensor storages reachable from ``root``'s object graph, each storage once,
    leaving out those whose data pointer is in ``exclude``. Modules (Python's), classes and
    functions' globals are not followed; closures are."""
    import torch

    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = [root]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            t = o._local_tensor if hasattr(o, "_local_tensor") else o
            if t.device.type != "meta":
                s = t.untyped_storage()
                if s.data_ptr() not in exclude and s.nbytes() > 0:
                    storages[s.data_ptr()] = s.nbytes()
            stack.extend(gc.get_referents(o))
            continue
        if isinstance(o, (types.ModuleType, type, str, bytes, int, float)):
            continue
        if isinstance(o, types.FunctionType):
            stack.extend(c.cell_contents for c in (o.__closure__ or ()) if _cell_full(c))
            continue
        stack.extend(gc.get_referents(o))
    return sum(storages.values())


def peak_allocated(prof: Any) -> int:
    """The largest running total of tensor bytes allocated minus freed in a memory-profiled
    window (``profile_memory=True``): the window's peak over what it started with. NOTE: torch's
    profiler sees the allocations of the profiling thread only."""
    total = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        total += e.nbytes()
        peak = max(peak, total)
    return peak


def _cell_full(c: Any) -> bool:
    try:
        c.cell_contents  # noqa: B018
        return True
    except ValueError:
        return False


def _ptrs(tensors) -> set[int]:
    out = set()
    for t in tensors:
        if t is None:
            continue
        t = t._local_tensor if hasattr(t, "_local_tensor") else t
        out.add(t.untyped_storage().data_ptr())
    return out


def _tx_bytes(ifname: str | None) -> int | None:
    if not ifname:
        return None
    try:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def _world_and_mesh(a: argparse.Namespace, env: Env, timeout: timedelta) -> tuple[Any, Any]:
    """The row's gloo world and the device mesh FSDP2 shards over: (that mesh, flcomm's FedMesh
    for the flcomm rows, else None). torchft and ``local``: one world per group; ``fsdp`` and
    flcomm: one world of every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    row = a.row
    hsdp = row in ("tft-hsdp", "fl-hsdp")
    if row.startswith("tft") or row == "local":
        # one world per group (torchft: a replica group), its store on the node's own address
        init_group_world(env, a.store_port + env.node, timeout)
        return (init_device_mesh("cpu", (2, env.per_node // 2), mesh_dim_names=("replicate", "shard")) if hsdp
                else init_device_mesh("cpu", (env.per_node,), mesh_dim_names=("shard",))), None
    dist.init_process_group("gloo", init_method=f"tcp://{env.addrs[0]}:{a.flcomm_port}", rank=env.rank,
                            world_size=env.world, timeout=timeout)
    if row == "fsdp":
        return init_device_mesh("cpu", (env.world,), mesh_dim_names=("shard",)), None
    import flcomm

    strategy = flcomm.Strategy.FL_HSDP if hsdp else flcomm.Strategy.FL_FSDP
    topo = strategy.topology(env.world, ranks_per_node=env.per_node, group_size=env.per_node,
                             shard_size=env.per_node // 2 if hsdp else None)
    mesh = flcomm.init_fed_mesh(topo, "cpu", timeout=timeout)
    return (mesh.device_mesh["replicate", "shard"] if hsdp else mesh.device_mesh["shard"]), mesh


def _synchronizer(a: argparse.Namespace, env: Env, model: Any, inner: Any, mesh: Any) -> tuple[Any, Any, Any]:
    """The row's synchronizer: (flcomm's FedAvg, torchft's DiLoCo, its Manager), None where the row
    has none (``local`` and ``fsdp``: neither)."""
    import torch

    row = a.row
    if row.startswith("tft"):
        manager = tft_manager(a, env, model, inner, env.nodes, a.store_port + env.node)
        if row == "tft-stream":
            n = len(model.layers) // 2
            frags = [torch.nn.ModuleList([model.tok_embeddings, *model.layers[:n]]),
                     torch.nn.ModuleList([*model.layers[n:], model.norm, model.output])]
        else:
            frags = [model]
        return None, tft_diloco(a, manager, frags, inner, delay=1 if row == "tft-stream" else 0), manager
    if row.startswith("fl"):
        import flcomm

        over = {"fl": 0, "fl-ovl": "auto", "fl-int8": "auto", "fl-frag": 1, "fl-avg": 0, "fl-hsdp": 0}[row]
        cfg = flcomm.FedAvgConfig(sync_every=a.sync_every, codec="int8" if row == "fl-int8" else "none",
                                  error_feedback=row == "fl-int8", outer="avg" if row == "fl-avg" else "nesterov",
                                  outer_lr=OUTER_LR,
                                  outer_momentum=OUTER_MOMENTUM, overlap_steps=over,
                                  fragments=2 if row == "fl-frag" else 1, bucket_cap_mb=a.bucket_mb)
        return flcomm.FedAvg(model, mesh, cfg), None, None
    return None, None, None


def _timed_steps(a: argparse.Namespace, env: Env, model: Any, inner: Any, fed: Any,
                 loader: Any) -> tuple[list[float], list, dict]:
    """The ``a.steps`` steps from a barrier: (each step's wall time, the shards after each sync
    with ``--dump``, the node's interface tx bytes at the timed window's ``start`` and ``end``)."""
    import torch.distributed as dist

    ifname = os.environ.get("PEERS_IFNAME") if env.local == 0 else None
    times, shards, tx = [], [], {}
    dist.barrier()
    t_prev = time.perf_counter()
    for step in range(1, a.steps + 1):
        if step == a.warmup + 1:
            tx["start"] = _tx_bytes(ifname)
        loss = train_step(model, inner, fed, loader)
        now = time.perf_counter()
        times.append(now - t_prev)
        t_prev = now
        if a.dump and step % a.sync_every == 0:
            shards.append(local_shard(model).clone())
        if env.rank == 0 and not a.quiet:
            print(f"[{a.row}] step {step}/{a.steps} loss {float(loss):.4f} {times[-1]:.3f} s", flush=True)
    tx["end"] = _tx_bytes(ifname)
    return times, shards, tx


def _transient_bytes(a: argparse.Namespace, model: Any, inner: Any, fed: Any, loader: Any) -> int:
    """One more round (``--profile-memory``; else 0) under torch's memory profiler: the largest rise
    of allocated tensor bytes inside an optimizer step plus the synchronizer's step (the sync and
    the apply included)."""
    import torch

    from flcomm.train.model import lm_loss

    transient = 0
    for _ in range(a.sync_every if a.profile_memory else 0):
        x, y = loader.next_batch()
        lm_loss(model(x), y).backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            inner.step()
            inner.zero_grad(set_to_none=True)
            if fed is not None:
                fed.step()
        transient = max(transient, peak_allocated(prof))
    return transient


def _sync_bytes(model: Any, inner: Any, sync_obj: Any) -> int:
    """The tensor bytes ``sync_obj`` retains, the parameters, their gradients and the inner
    optimizer's state left out (0 without a synchronizer)."""
    import torch

    params = list(model.parameters())
    exclude = _ptrs(params) | _ptrs(p.grad for p in params)
    for st in inner.state.values():
        exclude |= _ptrs(v for v in st.values() if isinstance(v, torch.Tensor))
    return retained_bytes(sync_obj, exclude) if sync_obj is not None else 0


def _save(a: argparse.Namespace, env: Env, out: dict, shards: list) -> None:
    """This rank's record (``rank<r>.json``) and, with ``--dump``, its shards (``shards<r>.npy``)."""
    import torch

    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"rank{env.rank}.json"), "w") as f:
        json.dump(out, f)
    if shards:
        import numpy as np

        np.save(os.path.join(a.out, f"shards{env.rank}.npy"), torch.stack(shards).numpy(), allow_pickle=False)


def worker(a: argparse.Namespace) -> int:
    """One rank of a row: the row's world and synchronizer, the timed steps, the held-out loss,
    the profiled round and the memory figures, written to ``--out``."""
    import torch

    from flcomm.train.model import lm_loss

    env = start_rank()
    dm, mesh = _world_and_mesh(a, env, timedelta(seconds=a.timeout))
    model, inner = build_model_sharded(a, dm)
    rss_before = _rss_mb()
    fed, diloco, manager = _synchronizer(a, env, model, inner, mesh)
    loader, held = build_data(a, env)
    times, shards, tx = _timed_steps(a, env, model, inner, fed, loader)
    if fed is not None:
        fed.finish()  # NOTE: the overlapped rows' last exchange applied before the evaluation
    with torch.no_grad():
        ev = [float(lm_loss(model(xe), ye)) for xe, ye in held]
    transient = _transient_bytes(a, model, inner, fed, loader)
    if fed is not None:
        fed.finish()
    sync_bytes = _sync_bytes(model, inner, diloco if diloco is not None else fed)
    out = {"row": a.row, "rank": env.rank, "node": env.node, "local": env.local, "step_times": times,
           "transient_bytes": transient,
           "tx_start": tx.get("start"), "tx_end": tx["end"], "sync_bytes": sync_bytes,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_before_mb": rss_before,
           "eval_loss": statistics.fmean(ev), "params": sum(p.numel() for p in model.parameters())}
    if fed is not None:
        out["flcomm_memory_stats"] = fed.memory_stats()
    _save(a, env, out, shards)
    return end_rank(diloco, manager)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


# ---------------------------------------------------------------- launching ----

class LocalCluster:
    """The emulated cluster's launch interface on loopback, for machines without root: every
    node's address is 127.0.0.1; no shaping, no interface counters."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def addr(self, node: int) -> str:
        return "127.0.0.1"

    def exec_argv(self, node: int, argv: list[str]) -> list[str]:
        return list(argv)

    def rank_env(self, rank: int, ranks_per_node: int, extra: dict[str, str]) -> dict[str, str]:
        return dict(os.environ, RANK=str(rank), WORLD_SIZE=str(self.nodes * ranks_per_node),
                    LOCAL_RANK=str(rank % ranks_per_node), LOCAL_WORLD_SIZE=str(ranks_per_node),
                    NODE_RANK=str(rank // ranks_per_node), OMP_NUM_THREADS="1", **extra)

    def launch(self, argv: list[str], ranks_per_node: int, *, env: dict[str, str], timeout: float,
               log_dir: str, **_: Any) -> None:
        os.makedirs(log_dir, exist_ok=True)
        world = self.nodes * ranks_per_node
        procs, files = [], []
        for r in range(world):
            e = self.rank_env(r, ranks_per_node, env)
            f = open(os.path.join(log_dir, f"rank{r}.log"), "w")
            files.append(f)
            procs.append(subprocess.Popen(argv, env=e, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                    time.sleep(2.0)
                    break
                time.sleep(0.1)
        finally:
            reap(procs, files)
        bad = [r for r, p in enumerate(procs) if p.returncode != 0]
        if bad:
            with open(os.path.join(log_dir, f"rank{bad[0]}.log")) as f:
                tail = "".join(f.readlines()[-30:])
            raise RuntimeError(f"ranks {bad} failed (exit codes {[procs[r].returncode for r in bad]}); rank {bad[0]}'s "
                               f"log ({log_dir}):\n{tail}")

    def tx_bytes(self) -> list[int] | None:
        return None


def run_row(c: Any, a: argparse.Namespace, row: str, E: int, out: str, empty: bool = False,
            dump: bool = False) -> dict:
    """Launch ``row`` at ``E`` on every rank of ``c`` and read back the per-rank records."""
    lighthouse = None
    env = {"PEERS_ADDRS": ",".join(c.addr(n) for n in range(a.nodes)),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if not isinstance(c, LocalCluster):
        from flcomm.train.netns import NODE_IF

        env["PEERS_IFNAME"] = NODE_IF
    ports = (["--store-port", str(free_port()), "--lighthouse-port", str(free_port()), "--flcomm-port",
              str(free_port())] if isinstance(c, LocalCluster) else [])
    lh_port = int(ports[3]) if ports else LIGHTHOUSE_PORT
    if row.startswith("tft"):
        from torchft._torchft import LighthouseServer  # noqa: F401 (fails early without torchft)

        lighthouse = serve(c, 0, f"import time; {lighthouse_code(lh_port, a.nodes)}time.sleep(1e9)",
                           os.path.join(out, "lighthouse.log"))
    argv = [sys.executable, "-m", "bench.peers", "worker", "--row", row, "--sync-every", str(E), "--model", a.model,
            "--steps", str(a.steps), "--warmup", str(E), "--batch-size", str(a.batch_size),
            "--seq-len", str(a.seq_len), "--lr", str(a.lr), "--seed", str(a.seed), "--eval-batches",
            str(a.eval_batches), "--bucket-mb", str(a.bucket_mb), "--timeout", str(a.timeout), "--out", out,
            "--quiet", "--profile-memory", *ports, *(["--empty"] if empty else []), *(["--dump"] if dump else [])]
    t0 = time.perf_counter()
    try:
        c.launch(argv, a.ranks_per_node, env=env, timeout=a.timeout * 2, log_dir=os.path.join(out, "logs"),
                 stream_rank0=False, cwd=ROOT)
    finally:
        if lighthouse is not None:
            reap([lighthouse])
    wall = time.perf_counter() - t0
    with open(os.path.join(out, "row.json"), "w") as f:
        json.dump({"row": row, "sync_every": E, "empty": empty, "wall_s": wall}, f)
    return read_row(out)


def read_row(out: str) -> dict:
    """A launched row's record (``row.json``) with every rank's record."""
    with open(os.path.join(out, "row.json")) as f:
        rec = json.load(f)
    ranks, r = [], 0
    while os.path.isfile(os.path.join(out, f"rank{r}.json")):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
        r += 1
    return {**rec, "ranks": ranks, "out": out}


# ---------------------------------------------------------------- analysis ----

def summarize(rec: dict, warmup: int) -> dict:
    """One row's figures from its per-rank records (see the module docstring)."""
    r0 = rec["ranks"][0]
    timed = r0["step_times"][warmup:]
    E = rec["sync_every"]
    rounds = len(timed) / E
    tx = [r["tx_end"] - r["tx_start"] for r in rec["ranks"]
          if r.get("tx_start") is not None and r["tx_end"] is not None]
    out = {"row": rec["row"], "sync_every": E, "step_s": statistics.fmean(timed),
           "wire_bytes_per_round": sum(tx) / rounds if tx else None,
           "sync_mb": max(r["sync_bytes"] for r in rec["ranks"]) / 2 ** 20,
           "transient_mb": max(r["transient_bytes"] for r in rec["ranks"]) / 2 ** 20,
           "peak_rss_mb": max(r["peak_rss_mb"] for r in rec["ranks"]),
           "eval_loss": statistics.fmean(r["eval_loss"] for r in rec["ranks"]),
           "params": r0["params"]}
    ms = r0.get("flcomm_memory_stats")
    if ms:
        out["flcomm_reported_mb"] = sum(v for v in ms.values() if isinstance(v, int)) / 2 ** 20
    return out


def parity(out_fl: str, out_tft: str, world: int, per_node: int) -> dict:
    """Largest |θ_flcomm - θ_torchft| per round over every rank's shard, relative to max |θ|,
    and within each library the largest difference between the groups' copies of a shard."""
    import numpy as np

    fl = [np.load(os.path.join(out_fl, f"shards{r}.npy")) for r in range(world)]
    tf = [np.load(os.path.join(out_tft, f"shards{r}.npy")) for r in range(world)]
    rounds = min(len(x) for x in fl + tf)
    absd = [max(float(np.abs(fl[r][k] - tf[r][k]).max()) for r in range(world)) for k in range(rounds)]
    scale = [max(float(np.abs(tf[r][k]).max()) for r in range(world)) for k in range(rounds)]

    def spread(x: list) -> list[float]:
        return [max(float(np.abs(x[r][k] - x[r % per_node][k]).max()) for r in range(world)) for k in range(rounds)]

    return {"rounds": rounds, "max_abs": absd, "max_rel": [d / s for d, s in zip(absd, scale)],
            "groups_spread_flcomm": spread(fl), "groups_spread_torchft": spread(tf)}


def fmt(v: Any, spec: str) -> str:
    """``format(v, spec)``, or "-" in the same width when ``v`` is None."""
    if v is None:
        width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
        return "-".rjust(int(width or 1))
    return format(v, spec)


COLUMNS = (("row", "<11", "row"), ("E", ">3", "sync_every"), ("step s", "7.3f", "step_s"),
           ("exposed/rnd", "11.3f", "exposed_per_round_s"), ("wire B/rnd", "11.3e", "wire_bytes_per_round"),
           ("fixed s", "7.3f", "fixed_s"), ("sync MB", "7.2f", "sync_mb"), ("peak MB", "7.2f", "sync_peak_mb"),
           ("RSS MB", "7.0f", "peak_rss_mb"), ("+RSS", "+6.0f", "rss_over_local_mb"), ("eval", "7.4f", "eval_loss"))


def table(rows: list[dict]) -> str:
    """nccl-tests style: one line a row, fixed-width columns, "-" where a figure does not apply."""
    def width(spec: str) -> int:
        return int("".join(ch for ch in spec.split(".")[0] if ch.isdigit()) or 1)

    hdr = " ".join(name.ljust(width(spec)) if spec.startswith("<") else name.rjust(width(spec))
                   for name, spec, _ in COLUMNS)
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        lines.append(" ".join(fmt(r.get(key), spec) for _, spec, key in COLUMNS))
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['row']} E={r['sync_every']}" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    colors = ["C1" if r["row"].startswith("tft") else "C0" if r["row"].startswith("fl") else "C7" for r in rows]
    for ax, key, name in zip(axes, ("step_s", "wire_bytes_per_round", "sync_peak_mb"),
                             ("step time (s)", "wire bytes per round", "synchronizer MB per rank")):
        vals = [r.get(key) or (1.0 if key == "wire_bytes_per_round" else 0.0) for r in rows]
        ax.barh(range(len(rows)), vals, color=colors)
        ax.set_yticks(range(len(rows)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(name)
        if key == "wire_bytes_per_round" and any(vals):
            ax.set_xscale("log")  # NOTE: plain FSDP sends an order of magnitude more
            ax.set_xlim(left=max(min(v for v in vals if v > 1.0), max(vals) / 1e3) / 2)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title + "  (blue: flcomm, orange: torchft, grey: torch alone)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_args(a: argparse.Namespace) -> None:
    """Exit with what was expected and what came when the flags cannot make a run."""
    for r in a.rows:
        if r not in ROWS:
            sys.exit(f"--rows: expected some of {', '.join(ROWS)}, got {r!r}")
    if a.ranks_per_node < 2 or a.ranks_per_node % 2:
        sys.exit(f"--ranks-per-node: expected an even number >= 2 (the HSDP rows put R = 2 replicas in a group), "
                 f"got {a.ranks_per_node}")
    for E in a.sync_every:
        if a.steps <= E or a.steps % E:
            sys.exit(f"--steps: expected a multiple of every --sync-every above it (the first round is the warm-up), "
                     f"got {a.steps} with E = {E}")
    for E in a.sync_every if a.recovery else ():
        k = recovery.kill_step(a, E)
        if not 1 <= k < a.steps - E:
            sys.exit(f"--kill-step: expected a step in [1, {a.steps - E}) for E = {E} (a sync must follow the "
                     f"restart), got {k}")


def figures(a: argparse.Namespace, recs: list[dict]) -> tuple[list[dict], list[dict]]:
    """The table's rows from the launched rows' records (the columns relative to the ``local``
    row and the near-empty runs' fixed cost filled in) and the parity of ``fl`` against ``tft``
    at each E."""
    rows = [summarize(r, r["sync_every"]) for r in recs if not r["empty"]]
    local = next((r for r in rows if r["row"] == "local"), None)
    empties = {r["row"]: summarize(r, 1) for r in recs if r["empty"]}
    for r in rows:
        if local is not None and r["row"] != "local":
            r["exposed_per_round_s"] = (r["step_s"] - local["step_s"]) * r["sync_every"]
            r["rss_over_local_mb"] = r["peak_rss_mb"] - local["peak_rss_mb"]
            r["sync_peak_mb"] = r["sync_mb"] + max(0.0, r["transient_mb"] - local["transient_mb"])
        lib = "tft" if r["row"].startswith("tft") else "fl" if r["row"].startswith("fl") else None
        if lib in empties and "local" in empties:
            r["fixed_s"] = empties[lib]["step_s"] - empties["local"]["step_s"]
    par = []
    for E in a.sync_every:
        fl = next((x for x in recs if x["row"] == "fl" and x["sync_every"] == E and not x["empty"]), None)
        tf = next((x for x in recs if x["row"] == "tft" and x["sync_every"] == E and not x["empty"]), None)
        if fl and tf:
            par.append({"sync_every": E, **parity(fl["out"], tf["out"], a.nodes * a.ranks_per_node,
                                                  a.ranks_per_node)})
    return rows, par


def bench(a: argparse.Namespace) -> int:
    tft_version = require_torchft()
    import torch

    import flcomm

    check_args(a)
    out_dir = a.out_dir or tempfile.mkdtemp(prefix="flcomm-peers-")
    load0 = os.getloadavg()[0]
    log = (lambda s: None) if a.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    if a.launcher == "local":
        cluster: Any = LocalCluster(a.nodes)
    else:
        from flcomm.train.netns import ClusterSpec, EmulatedCluster

        cluster = EmulatedCluster(ClusterSpec(a.nodes, a.rate))
    recs: list[dict] = []
    if a.reanalyse:
        for d in a.reanalyse:
            for sub in sorted(os.listdir(d)):
                if os.path.isfile(os.path.join(d, sub, "row.json")):
                    recs.append(read_row(os.path.join(d, sub)))
        a.sync_every = sorted({r["sync_every"] for r in recs if not r["empty"]})
        cluster = contextlib.nullcontext()
    with cluster as c:
        plan = [(row, E) for E in a.sync_every for row in a.rows if row in FED_ROWS or E == a.sync_every[0]]
        if a.fixed:
            plan += [(row, 1, "empty") for row in ("local", "tft", "fl")]
        for i, item in enumerate([] if a.reanalyse else plan):
            row, E, empty = item[0], item[1], len(item) > 2
            log(f"[{i + 1}/{len(plan)}] {row} E={E}{' (near-empty model)' if empty else ''}")
            path = os.path.join(out_dir, f"{i:02d}_{row}_E{E}{'_empty' if empty else ''}")
            try:
                recs.append(run_row(c, a, row, E, path, empty=empty, dump=row in ("tft", "fl") and not empty))
            except (RuntimeError, OSError) as e:
                # NOTE: one failed row should not cost the others' results (ClusterError is a RuntimeError)
                log(f"      FAILED, left out of the table: {e}")
        rec_rows = []
        if a.recovery:
            rec_rows = recovery.reanalyse(a.reanalyse) if a.reanalyse else recovery.run(c, a, out_dir, log)
    rows, par = figures(a, recs)
    loads = ("re-analysed from the recorded rows" if a.reanalyse else
             f"load average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    head = (f"bench.peers: {a.model}, {a.nodes} nodes x {a.ranks_per_node} ranks, "
            f"{'loopback' if a.launcher == 'local' else a.rate + ' between nodes'}, {a.steps} steps; "
            f"flcomm {flcomm.__version__}, torchft {tft_version}, torch {torch.__version__}; "
            f"{loads}")
    print(head)
    print(table(rows))
    for p in par:
        print(f"parity E={p['sync_every']} (codec none, {p['rounds']} rounds): max |dθ| per round "
              + " ".join(f"{d:.1e}" for d in p["max_abs"]) + f"; relative at the end {p['max_rel'][-1]:.1e}; "
              f"groups' copies differ by at most {max(p['groups_spread_flcomm']):.1e} (flcomm), "
              f"{max(p['groups_spread_torchft']):.1e} (torchft)")
    if rec_rows:
        print(recovery.table(rec_rows))
    print(f"records in {out_dir}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"header": head, "args": vars(a), "load_start": load0, "rows": rows, "parity": par,
                       "recovery": rec_rows}, f, indent=2)
    if a.png:
        plot(rows, a.png, head.split(";")[0])
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        w = argparse.ArgumentParser(prog="bench.peers worker")
        w.add_argument("--row", choices=ROWS, required=True)
        for k, t, d in (("sync-every", int, 4), ("steps", int, 16), ("warmup", int, 4), ("batch-size", int, 8),
                        ("seq-len", int, 128), ("lr", float, 3e-3), ("seed", int, 0), ("eval-batches", int, 2),
                        ("bucket-mb", float, 25.0), ("timeout", float, 300.0), ("store-port", int, STORE_PORT),
                        ("lighthouse-port", int, LIGHTHOUSE_PORT), ("flcomm-port", int, FLCOMM_PORT)):
            w.add_argument("--" + k, type=t, default=d)
        w.add_argument("--model", default="small")
        w.add_argument("--out", required=True)
        for flag in ("empty", "dump", "quiet", "profile-memory"):
            w.add_argument("--" + flag, action="store_true")
        return worker(w.parse_args(argv[1:]))
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launcher", choices=("emulated", "local"), default="emulated")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--rate", default="100mbit", help="inter-node rate per node (emulated)")
    p.add_argument("--rows", nargs="*", default=list(ROWS), help="none with --recovery: the recovery runs alone")
    p.add_argument("--sync-every", type=int, nargs="+", default=[4, 16])
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=48, help="a multiple of every E; the first round is the warm-up")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="both libraries' bucket size")
    p.add_argument("--fixed", action="store_true", help="also the fixed cost per sync (a near-empty model, E = 1)")
    p.add_argument("--recovery", action="store_true",
                   help="also the recovery columns (bench/recovery.py): kill a rank of group 1 at --kill-step")
    p.add_argument("--kill-step", type=int, default=None,
                   help="the step after which the rank is killed (default: the middle of the second round)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per collective; a run gets twice that")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--reanalyse", nargs="+", metavar="OUT_DIR", default=None,
                   help="run nothing: tabulate the rows recorded under these --out-dir folders")
    return bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
