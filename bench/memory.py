"""Memory a FedAvg holds, per mode, as a multiple of the rank's fp32 shard.

Setup (issue 10's): a plain module of ``--layers`` Linear(``--width``, ``--width``) (8 x 1024:
a 32 MiB fp32 shard), replicated on 2 ranks that are 2 federation groups, two syncs. For each
mode two figures, measured independently:

* ``held``: the bytes of every tensor storage alive after the two syncs (found by walking the
  garbage collector's objects, storages deduplicated) minus those alive before the FedAvg was
  built, i.e. everything the FedAvg keeps (and anything else it leaked);
* ``stats``: :meth:`FedAvg.memory_stats` (its own accounting), split by buffer kind.

``on dev`` is the accounting's device part: ``stats`` minus what lives in host memory with
offload (anchor, local-at-sync copy, momentum, residuals), i.e. the exchange's device pool (``staging``:
bucket buffers, the offload scratch, two-hop plans) and the flags, plus ``transient``, the
largest temporary an exchange allocates there (hop 2's error with error feedback; none on these
2 ranks, whose exchange is one all-gather). On a
CPU-only machine host and device are one memory, so this column is the accounting, not a
measurement: ``held`` checks that the accounting misses no buffer.

The targets (issue 10): the paper's mode <= 2 buckets; int8+EF <= 2.1x; int8+EF+overlap+nesterov
<= 4.1x; with offload <= 2 buckets on the device. On CUDA the device peak is reported as well.

Then the extra sync time of offload: int8+EF with and without ``offload="cpu"`` on two copies of
the model, ``--sync-iters`` blocking syncs each (``sync_every=1``), interleaved, after a warm-up
sync; the time of a sync is the slowest rank's, the table shows the median and the ratio. On CPU
host and device are one memory, so this measures only the staging overhead (the copies through
the scratch, and the single-buffered pipeline of smaller buckets), not a PCIe transfer.

Usage::

    python -m bench.memory                 # table
    python -m bench.memory --json mem.json --bucket-mb 1
    python -m bench.memory --sync-iters 0  # memory only
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from flcomm.federated.mesh import init_fed_mesh

MODES: dict[str, dict[str, Any]] = {
    "paper (none)": {},
    "none, overlap": {"overlap_steps": 1},
    "int8+EF": {"codec": "int8", "error_feedback": True},
    "int8+EF, overlap, nesterov": {"codec": "int8", "error_feedback": True, "overlap_steps": 1, "outer": "nesterov"},
    "int8+EF, ovl, nest, offload": {"codec": "int8", "error_feedback": True, "overlap_steps": 1,
                                    "outer": "nesterov", "offload": "cpu"},
    "int8+EF, bf16 residual": {"codec": "int8", "error_feedback": True, "residual_dtype": "bf16"},
    "int8+EF, fragments=4": {"codec": "int8", "error_feedback": True, "fragments": 4},
}
TARGETS = {"int8+EF": 2.1, "int8+EF, overlap, nesterov": 4.1}
SYNC_MODES: dict[str, dict[str, Any]] = {
    "int8+EF": {"codec": "int8", "error_feedback": True},
    "int8+EF, offload": {"codec": "int8", "error_feedback": True, "offload": "cpu"},
}


def live_storage_bytes() -> int:
    """Bytes of every distinct tensor storage reachable from the garbage collector."""
    seen: dict[int, int] = {}
    warnings.simplefilter("ignore")  # NOTE: isinstance() on deprecated torch aliases warns
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and not o.is_meta:
                st = o.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        except Exception:  # noqa: BLE001 - objects that are not real tensors
            continue
    return sum(seen.values())


@torch.no_grad()
def _train_step(model: nn.Module) -> None:
    """A stand-in for a local step (a function, so no loop variable keeps a tensor alive)."""
    for p in model.parameters():
        p.add_(0.01 * torch.randn_like(p))


def _rank(rank: int, world: int, port: int, a: argparse.Namespace, q: Any) -> None:
    import torch.distributed as dist

    from flcomm.federated.fedavg import FedAvg
    from flcomm.federated.topology import Topology

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    mesh = init_fed_mesh(Topology(world, world, group_size=1, shard_size=1), node_tiers=False)
    rows = []
    for name, kw in MODES.items():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(a.width, a.width, bias=False) for _ in range(a.layers)])
        gc.collect()
        before = live_storage_bytes()
        fed = FedAvg(model, mesh, sync_every=kw.get("fragments", 1), bucket_cap_mb=a.bucket_mb, **kw)
        for _ in range(2 * kw.get("fragments", 1)):  # two syncs of every fragment
            _train_step(model)
            fed.step()
        fed.finish()
        gc.collect()
        held = live_storage_bytes() - before
        st = fed.memory_stats()
        shard = st["shard_fp32"]
        rows.append({"mode": name, "held_bytes": held, "held_x": held / shard, "stats": st,
                     "stats_x": st["total"] / shard, "bucket_x": a.bucket_mb * 2**20 / shard,
                     "shard_bytes": shard})
        del fed, model
    sync = _sync_times(mesh, a) if a.sync_iters > 0 else {}
    if rank == 0:
        q.put((rows, sync))
    dist.destroy_process_group()


def _sync_times(mesh: Any, a: argparse.Namespace) -> dict[str, Any]:
    """Seconds per blocking sync of each of :data:`SYNC_MODES` (the slowest rank's), interleaved."""
    import torch.distributed as dist

    from flcomm.federated.fedavg import FedAvg

    feds = {}
    for name, kw in SYNC_MODES.items():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(a.width, a.width, bias=False) for _ in range(a.layers)])
        feds[name] = (model, FedAvg(model, mesh, sync_every=1, bucket_cap_mb=a.bucket_mb, **kw))
    times: dict[str, list[float]] = {n: [] for n in feds}
    for it in range(a.sync_iters + 1):
        for name, (model, fed) in feds.items():
            _train_step(model)
            dist.barrier()
            t0 = time.perf_counter()
            fed.step()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if it:  # NOTE: the first sync (buffers allocated, plans built) is the warm-up
                times[name].append(float(dt))
    return {"median_s": {n: statistics.median(v) for n, v in times.items()},
            "buckets": {n: fed._exchange.bar.num_buckets for n, (_, fed) in feds.items()},
            "iters": a.sync_iters}


def format_sync(sync: dict[str, Any]) -> str:
    med, nb = sync["median_s"], sync["buckets"]
    base = med["int8+EF"]
    out = [f"{'sync of':<20} {'buckets':>8} {'time/sync':>10} {'ratio':>6}", "-" * 47]
    for n in med:
        out.append(f"{n:<20} {nb[n]:>8} {med[n] * 1e3:8.2f}ms {med[n] / base:5.2f}x")
    out.append(f"(median of {sync['iters']} blocking syncs each, interleaved, slowest rank; on CPU host = "
               "device: this is the staging overhead only (copies through the scratch, a single-buffered "
               "pipeline of smaller buckets), no PCIe transfer)")
    return "\n".join(out)


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'mode':<28} {'held':>7} {'stats':>7} {'target':>8} {'on dev':>7} {'exch':>6} {'anchor':>7} "
            f"{'own':>6} {'moment':>7} {'resid':>6} {'staging':>8}")
    out = [head, "-" * len(head)]
    for r in rows:
        s, sh = r["stats"], r["shard_bytes"]
        target = (f"{2 * r['bucket_x']:.3f}" if r["mode"].startswith("paper") or "offload" in r["mode"] else
                  f"{TARGETS[r['mode']]:.1f}" if r["mode"] in TARGETS else "")
        on_dev = (s["device"] + s["transient"]) / sh
        exch = (s["staging"] + s["transient"]) / sh / r["bucket_x"]
        out.append(f"{r['mode']:<28} {r['held_x']:6.3f}x {r['stats_x']:6.3f}x {target:>8} {on_dev:6.3f}x "
                   f"{exch:6.2f} {s['anchor'] / sh:6.2f}x {s['own'] / sh:5.2f}x {s['momentum'] / sh:6.2f}x "
                   f"{s['residual'] / sh:5.2f}x {s['staging'] / sh:7.3f}x")
    out.append(f"(multiples of the fp32 shard, {rows[0]['shard_bytes'] / 2**20:.0f} MiB; bucket = "
               f"{rows[0]['bucket_x']:.3f}x; paper's-mode and offload targets = 2 buckets, on the device; "
               "'on dev' = stats - offloaded + the largest exchange temporary: the accounting's device part "
               "(on a CPU-only machine the host is the device); 'exch' = the exchange's device buffers (staging "
               "+ temporary) in buckets; 'held' = storages the gc sees)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--sync-iters", type=int, default=5, help="timed syncs per mode (0: skip)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from bench.common import free_port

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, a, q)) for r in range(2)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join(600)
    if any(pr.exitcode != 0 for pr in procs):
        print(f"a rank failed: exit codes {[pr.exitcode for pr in procs]}", file=sys.stderr)
        return 1
    rows, sync = q.get()
    print(format_table(rows))
    if sync:
        print()
        print(format_sync(sync))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a), "rows": rows, "sync": sync}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
