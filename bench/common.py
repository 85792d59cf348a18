"""Shared harness of the flcomm benchmarks (nccl-tests style, ``src/common.cu``).

* process start-up: under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` in the
  environment: NCCL on GPUs when available, gloo otherwise) or locally with ``--nproc N``
  (spawned gloo ranks on this machine, split into emulated nodes of ``--ranks-per-node``);
* sizes: ``--min-bytes`` / ``--max-bytes`` / ``--step-factor`` with K/M/G suffixes;
* timing: warm-up iterations, then ``--iters`` back-to-back calls; the time of a size is the
  slowest rank's mean (a collective is as slow as its slowest member);
* the nccl-tests table (size, count, type, redop, time, algbw, busbw, error) with its
  bus-bandwidth factors (all-reduce 2(n-1)/n; reduce-scatter and all-gather (n-1)/n, over the
  whole array), printed by rank 0;
* ``--json PATH``: every row as a record (:class:`Record`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python bench/x.py` from anywhere
    sys.path.insert(0, ROOT)

from flcomm.comm.base import bus_factor  # noqa: E402

DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16, "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}
_SHORT = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat16", torch.float64: "double",
          torch.int32: "int32", torch.int64: "int64"}


@dataclass
class Record:
    """One row of a collective benchmark (``--json``). Bandwidths in GB/s (1e9 bytes)."""

    collective: str          # all_reduce | reduce_scatter | all_gather
    algo: str                # flat | hierarchical | two-hop-<codec>
    transport: str           # torch | native
    world: int
    size_bytes: int          # the whole array (nccl-tests convention)
    dtype: str
    time_us: float
    algbw_gbps: float        # logical: size_bytes / time
    busbw_gbps: float        # algbw * the collective's bus factor
    wire_bytes: int          # bytes one rank sends per call, all tiers (CommStats)
    max_err: float           # max |result - exact|
    count: int = 0
    redop: str = ""
    nodes: int = 1
    ranks_per_node: int = 1
    backend: str = ""
    wire_gbps: float = 0.0   # wire_bytes / time: the on-the-wire bandwidth of one rank
    wire_bytes_inter: int = 0  # of which over the inter-node links
    extra: dict[str, Any] = field(default_factory=dict)


def parse_size(s: str) -> int:
    """'64', '4K', '16M', '1G' (powers of 1024) -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", s, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"size must be a number with an optional K/M/G suffix, got {s!r}")
    return int(m.group(1)) * 1024 ** " KMG".index(m.group(2).upper() or " ")


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"need 1 <= min-bytes <= max-bytes and step-factor >= 2, got "
                         f"{min_bytes}, {max_bytes}, {factor}")
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def add_common_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("harness")
    g.add_argument("--nproc", type=int, default=0,
                   help="spawn this many local gloo ranks (0: run under torchrun / the environment)")
    g.add_argument("--ranks-per-node", type=int, default=0,
                   help="ranks per (emulated) node (default: LOCAL_WORLD_SIZE under torchrun, else 2)")
    g.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: nccl when CUDA is available under torchrun, else gloo")
    g.add_argument("-b", "--min-bytes", type=parse_size, default=parse_size("1K"))
    g.add_argument("-e", "--max-bytes", type=parse_size, default=parse_size("4M"))
    g.add_argument("-f", "--step-factor", type=int, default=4)
    g.add_argument("-w", "--warmup", type=int, default=3, help="warm-up iterations per size")
    g.add_argument("-n", "--iters", type=int, default=10, help="timed iterations per size")
    g.add_argument("--timeout", type=float, default=300.0, help="seconds before a collective fails")
    g.add_argument("--json", metavar="PATH", help="write the records to PATH (rank 0)")


@dataclass
class Env:
    rank: int
    world: int
    ranks_per_node: int
    backend: str
    device: torch.device
    timeout: timedelta


def _init(args: argparse.Namespace, rank: int, world: int, local_rank: int, local_world: int) -> Env:
    import torch.distributed as dist

    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and not args.nproc else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise SystemExit("--backend nccl needs CUDA, and torch sees no GPU")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=args.timeout)
    kw: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kw)
    L = args.ranks_per_node or local_world or 2
    if world % L:
        raise SystemExit(f"--ranks-per-node {L} does not divide the world of {world} ranks")
    return Env(rank, world, L, backend, device, timeout)


def wait_ranks(procs: list[Any], timeout_s: float) -> list[int]:
    """The exit codes of the local rank processes ``procs`` (``subprocess.Popen``), each waited
    up to ``timeout_s``; any still running then (or after an error) is killed."""
    try:
        return [p.wait(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, args: argparse.Namespace, main: Callable[[Env, argparse.Namespace], None],
             port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # NOTE: many ranks on few cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    env = _init(args, rank, args.nproc, 0, 0)
    try:
        main(env, args)
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def launch(args: argparse.Namespace, main: Callable[[Env, argparse.Namespace], None]) -> None:
    """Run ``main(env, args)`` on every rank: spawned locally with ``--nproc``, else from the
    torchrun environment."""
    if args.nproc:
        import torch.multiprocessing as mp

        mp.start_processes(_spawned, args=(args, main, free_port()), nprocs=args.nproc, start_method="spawn")
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit("no torchrun environment (RANK, WORLD_SIZE): run under torchrun, or pass "
                         "--nproc N to spawn N local gloo ranks")
    env = _init(args, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 0)))
    try:
        main(env, args)
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn: Callable[[], Any], env: Env, warmup: int, iters: int) -> float:
    """Seconds per call: warm up, align the ranks, time ``iters`` calls back to back; returns
    the slowest rank's mean."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    sync(env.device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(env.device)
    dt = torch.tensor([(time.perf_counter() - t0) / max(1, iters)], dtype=torch.float64, device=env.device)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt.item())


def max_over_ranks(x: float, env: Env) -> float:
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def make_record(collective: str, algo: str, transport: str, env: Env, nbytes: int, dtype: torch.dtype,
                seconds: float, wire: int, wire_inter: int, max_err: float, redop: str,
                **extra: Any) -> Record:
    n = env.world
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return Record(collective=collective, algo=algo, transport=transport, world=n, size_bytes=nbytes,
                  dtype=_SHORT.get(dtype, str(dtype)), time_us=seconds * 1e6, algbw_gbps=algbw,
                  busbw_gbps=algbw * bus_factor(collective, n), wire_bytes=int(wire), max_err=max_err,
                  count=nbytes // torch.tensor([], dtype=dtype).element_size(), redop=redop,
                  nodes=n // env.ranks_per_node, ranks_per_node=env.ranks_per_node, backend=env.backend,
                  wire_gbps=wire / seconds / 1e9 if seconds > 0 else 0.0, wire_bytes_inter=int(wire_inter),
                  extra=dict(extra))


HEADER = (f"#{'collective':>15} {'algo':>14} {'size':>11} {'count':>11} {'type':>8} {'redop':>6} "
          f"{'time':>10} {'algbw':>8} {'busbw':>8} {'wire':>8} {'error':>9}\n"
          f"#{'':>15} {'':>14} {'(B)':>11} {'(elements)':>11} {'':>8} {'':>6} "
          f"{'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'(GB/s)':>8} {'':>9}")


def format_row(r: Record) -> str:
    return (f" {r.collective:>15} {r.algo:>14} {r.size_bytes:>11} {r.count:>11} {r.dtype:>8} {r.redop or '-':>6} "
            f"{r.time_us:>10.1f} {r.algbw_gbps:>8.3f} {r.busbw_gbps:>8.3f} {r.wire_gbps:>8.3f} {r.max_err:>9.2e}")


def write_json(path: str, records: list[Record]) -> None:
    """A JSON list of records, one per measurement."""
    with open(path, "w") as f:
        json.dump([asdict(r) for r in records], f, indent=1)
