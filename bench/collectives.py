"""Collective bandwidth in the nccl-tests format: reduce-scatter, all-gather and all-reduce,
flat vs hierarchical (intra-node stage, then inter-node stage), plus the compressed two-hop
all-reduce, over a size sweep.

For each transport (``--transport torch``, the default: torch.distributed process groups, i.e.
ProcessGroupNCCL on GPUs; ``native``: flcomm's NCCL communicators, ``NcclTransport.from_group``;
``both``: the two in one run, then a side-by-side table), collective and size:

  1. fill the input with small integers (rank-dependent), so every sum is exact in any dtype
     and ``error`` is the max |result - exact| computed locally (0 for a correct collective);
  2. ``flat``: the transport's collective over all ranks; ``hierarchical``: the intra-node /
     inter-node composition of ``flcomm.collectives.hierarchical`` over the emulated nodes
     (``--ranks-per-node``); the all-reduce is the hierarchical reduce-scatter + all-gather;
  3. ``two-hop-<codec>`` (all-reduce only, fp32, from ``--codecs``): the compressed all-reduce on
     normal random data; ``error`` is the max difference from the exact fp32 all-reduce;
  4. time: warm-up, then ``--iters`` calls; the slowest rank's mean. ``algbw`` = size / time,
     ``busbw`` = algbw x the nccl-tests factor (all-reduce 2(n-1)/n, the others (n-1)/n, size
     = the whole array), ``wire`` = the bytes one rank actually sent (all tiers) / time.

Usage::

    # locally: 4 spawned gloo ranks as 2 emulated nodes x 2 ranks
    python bench/collectives.py --nproc 4 --ranks-per-node 2 -b 4K -e 16M -f 4 --json coll.json
    # only some rows; several codecs for the compressed all-reduce (none: skip them)
    python bench/collectives.py --nproc 8 --ranks-per-node 4 --collectives all_reduce --codecs int8 bf16
    # a GPU cluster, NCCL: the torch.distributed and the native transport side by side
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        bench/collectives.py --transport both -b 1M -e 1G -f 4 --json coll.json

The output table has one row per (collective, algo, size); ``--json PATH`` writes the same rows
as a list of records (``bench/common.py`` :class:`Record`: collective, algo, transport, world,
size_bytes, dtype, time_us, algbw_gbps, busbw_gbps, wire_bytes, max_err, ...). The last lines
compare hierarchical to flat busbw per collective at the largest size; with both transports, a
table puts torch's and the native time / algbw / busbw side by side per row. ``native`` where
NCCL cannot run (no GPU, a build without NCCL) exits with status 2 and one line saying why.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    DTYPES,
    HEADER,
    Env,
    Record,
    add_common_args,
    format_row,
    launch,
    make_record,
    max_over_ranks,
    size_sweep,
    time_op,
    write_json,
)
from flcomm.federated.mesh import init_fed_mesh

COLLECTIVES = ("reduce_scatter", "all_gather", "all_reduce")


def _refuse(why: str) -> None:
    """One line on stderr, exit status 2 (a usage error: nothing was measured)."""
    print(f"bench/collectives.py: {' '.join(why.split())}", file=sys.stderr)
    raise SystemExit(2)


def _require_native() -> type:
    """The NcclTransport class; exits with status 2 and nccl_available()'s reason where the native
    transport cannot run."""
    try:
        from flcomm.comm.nccl import NcclTransport, nccl_available
    except ImportError as e:
        _refuse(f"--transport native: flcomm.comm.nccl cannot be imported ({e})")
    ok, reason = nccl_available()
    if not ok:
        _refuse(f"--transport native is unavailable here: {reason}")
    return NcclTransport


def transport_names(given: list[str]) -> list[str]:
    """--transport's values in order, ``both`` = torch then native, each once."""
    out: list[str] = []
    for name in given:
        for n in (("torch", "native") if name == "both" else (name,)):
            if n not in out:
                out.append(n)
    return out


def make_transports(name: str, env: Env, mesh, stats) -> dict[str, object]:
    """{"flat", "intra", "inter"} transports of kind ``name`` on the mesh's shard groups."""
    groups = {"flat": "shard", "intra": "shard_intra", "inter": "shard_inter"}
    if name == "torch":
        from flcomm.comm.torch_pg import TorchTransport

        return {k: TorchTransport(mesh.groups[g], mesh.tier(g), stats, env.timeout) for k, g in groups.items()}
    if name == "native":
        NcclTransport = _require_native()
        if env.device.type != "cuda":
            _refuse("--transport native needs GPUs (run under torchrun with the nccl backend)")
        return {k: NcclTransport.from_group(mesh.groups[g], mesh.tier(g), stats, env.timeout)
                for k, g in groups.items()}
    raise SystemExit(f"--transport must be torch or native, got {name!r}")


def _pattern(n: int, rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Small integers (0..12 + rank % 4): sums over up to thousands of ranks stay exact."""
    return ((torch.arange(n, device=device) + 7 * rank) % 13 + rank % 4).to(dtype)


def _exact(n: int, world: int, device: torch.device, op: str) -> torch.Tensor:
    """The exact reduction (sum or max) of every rank's pattern, in float64."""
    acc = _pattern(n, 0, torch.float64, device)
    for r in range(1, world):
        x = _pattern(n, r, torch.float64, device)
        acc = torch.maximum(acc, x) if op == "max" else acc + x
    return acc


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.to(torch.float64) - want.to(torch.float64)).abs().max().item()) if got.numel() else 0.0


def run(env: Env, args: argparse.Namespace) -> None:
    from flcomm.collectives.hierarchical import Hierarchy
    from flcomm.comm.base import CommStats, LinkTier
    from flcomm.federated.strategy import Strategy

    dtype = DTYPES[args.dtype]
    esize = torch.tensor([], dtype=dtype).element_size()
    P, L = env.world, env.ranks_per_node
    mesh = init_fed_mesh(Strategy.FSDP.topology(P, L), device_type=env.device.type, timeout=env.timeout)
    dev = env.device
    records: list[Record] = []
    say = print if env.rank == 0 else (lambda *a, **k: None)
    say(f"# flcomm collectives: {P} ranks = {P // L} nodes x {L}, backend {env.backend}, device {dev}, "
        f"dtype {args.dtype}, redop {args.op}, warmup {args.warmup}, iters {args.iters}")

    for tname in args.transport:
        stats = CommStats()
        tr = make_transports(tname, env, mesh, stats)
        hier = Hierarchy(tr["intra"], tr["inter"])
        flat = tr["flat"]
        say(f"#\n# transport {tname}\n{HEADER}")

        def measure(collective: str, algo: str, nbytes: int, fn, err: float, **extra) -> None:
            stats.reset()
            fn()  # one call, counted
            wire = sum(stats.bytes(tier) for tier in (LinkTier.INTRA_NODE, LinkTier.INTER_NODE, LinkTier.INTER_GROUP))
            wire_inter = stats.bytes(LinkTier.INTER_NODE)
            t = time_op(fn, env, args.warmup, args.iters)
            wire_dtype = dtype if not algo.startswith("two-hop") else torch.float32
            rec = make_record(collective, algo, tname, env, nbytes, wire_dtype,
                              t, wire, wire_inter, max_over_ranks(err, env), args.op, **extra)
            records.append(rec)
            say(format_row(rec), flush=True)

        for collective in args.collectives:
            for size in size_sweep(args.min_bytes, args.max_bytes, args.step_factor):
                count = (size // esize) // P * P
                if count == 0:
                    continue
                nbytes, c = count * esize, count // P
                if collective == "reduce_scatter":
                    x = _pattern(count, env.rank, dtype, dev)
                    want = _exact(count, P, dev, args.op)[env.rank * c:(env.rank + 1) * c]
                    for algo in args.algos:
                        out = torch.empty(c, dtype=dtype, device=dev)
                        call = (lambda: flat.reduce_scatter(out, x, args.op)) if algo == "flat" else \
                               (lambda: hier.reduce_scatter(out, x, args.op))
                        call()
                        measure(collective, algo, nbytes, call, _err(out, want))
                elif collective == "all_gather":
                    x = _pattern(c, env.rank, dtype, dev)
                    want = torch.cat([_pattern(c, r, torch.float64, dev) for r in range(P)])
                    for algo in args.algos:
                        out = torch.empty(count, dtype=dtype, device=dev)
                        call = ((lambda: flat.all_gather(out, x)) if algo == "flat"
                                else (lambda: hier.all_gather(out, x)))
                        call()
                        measure(collective, algo, nbytes, call, _err(out, want))
                else:
                    want = _exact(count, P, dev, args.op)
                    for algo in args.algos:
                        buf = _pattern(count, env.rank, dtype, dev)
                        call = (lambda: flat.all_reduce(buf, args.op)) if algo == "flat" else \
                               (lambda: hier.all_reduce(buf, args.op))
                        call()
                        err = _err(buf, want)
                        measure(collective, algo, nbytes, call, err)
                    if dtype == torch.float32 and args.op == "sum":
                        _compressed_rows(env, args, flat, count, measure)

        _ratios(records, tname, say)
    _side_by_side(records, say)
    if env.rank == 0 and args.json:
        write_json(args.json, records)
        say(f"# wrote {len(records)} records to {args.json}")


def _compressed_rows(env: Env, args: argparse.Namespace, flat, count: int, measure) -> None:
    """two-hop-<codec> rows: compressed all-reduce of random normal fp32 data vs the exact one."""
    if not args.codecs:
        return
    from flcomm.collectives.compressed import compressed_all_reduce

    g = torch.Generator(device="cpu").manual_seed(1234 + env.rank)
    data = torch.randn(count, generator=g).to(env.device)
    exact = data.clone()
    flat.all_reduce(exact, "sum")
    for codec in args.codecs:
        buf = data.clone()
        compressed_all_reduce(flat, buf, codec, op="sum")
        err = _err(buf, exact)
        work = data.clone()
        # NOTE: time on a scratch copy refreshed from `data` outside the timed call would add a
        # copy to every iteration; the in-place growth of `work` does not change the cost.
        measure("all_reduce", f"two-hop-{codec}", count * 4,
                lambda: compressed_all_reduce(flat, work, codec, op="sum"), err, codec=codec)


def _ratios(records: list[Record], tname: str, say) -> None:
    for coll in COLLECTIVES:
        rows = [r for r in records if r.transport == tname and r.collective == coll]
        if not rows:
            continue
        top = max(r.size_bytes for r in rows)
        by = {r.algo: r for r in rows if r.size_bytes == top}
        if "flat" in by and "hierarchical" in by and by["flat"].busbw_gbps > 0:
            f, h = by["flat"], by["hierarchical"]
            say(f"# {tname} {coll} @ {top} B: busbw flat {f.busbw_gbps:.3f} GB/s, hierarchical "
                f"{h.busbw_gbps:.3f} GB/s ({h.busbw_gbps / f.busbw_gbps:.2f}x); inter-node bytes per rank "
                f"{f.wire_bytes_inter} -> {h.wire_bytes_inter}")
        for algo, r in sorted(by.items()):
            if algo.startswith("two-hop") and "flat" in by:
                f = by["flat"]
                say(f"# {tname} {algo} @ {top} B: wire bytes {r.wire_bytes / max(1, f.wire_bytes):.3f}x of fp32, "
                    f"logical busbw {r.busbw_gbps / max(1e-12, f.busbw_gbps):.2f}x, max err {r.max_err:.2e}")


SIDE_HEADER = (f"#{'collective':>15} {'algo':>14} {'size':>11} {'count':>11} {'type':>8} "
               f"{'torch time':>11} {'algbw':>8} {'busbw':>8} {'native time':>12} {'algbw':>8} {'busbw':>8} "
               f"{'native/torch':>12}\n"
               f"#{'':>15} {'':>14} {'(B)':>11} {'(elements)':>11} {'':>8} "
               f"{'(us)':>11} {'(GB/s)':>8} {'(GB/s)':>8} {'(us)':>12} {'(GB/s)':>8} {'(GB/s)':>8} {'busbw':>12}")


def side_by_side_rows(records: list[Record]) -> list[str]:
    """One line per (collective, algo, size) measured on both transports: the nccl-tests columns
    of torch's ProcessGroupNCCL and of flcomm's NcclTransport, and the native/torch busbw ratio."""
    by = {(r.collective, r.algo, r.size_bytes, r.transport): r for r in records}
    lines = []
    for r in records:
        if r.transport != "torch" or (r.collective, r.algo, r.size_bytes, "native") not in by:
            continue
        n = by[(r.collective, r.algo, r.size_bytes, "native")]
        ratio = n.busbw_gbps / r.busbw_gbps if r.busbw_gbps > 0 else float("nan")
        lines.append(f" {r.collective:>15} {r.algo:>14} {r.size_bytes:>11} {r.count:>11} {r.dtype:>8} "
                     f"{r.time_us:>11.1f} {r.algbw_gbps:>8.3f} {r.busbw_gbps:>8.3f} "
                     f"{n.time_us:>12.1f} {n.algbw_gbps:>8.3f} {n.busbw_gbps:>8.3f} {ratio:>12.2f}")
    return lines


def _side_by_side(records: list[Record], say) -> None:
    lines = side_by_side_rows(records)
    if lines:
        say(f"#\n# side by side: torch (ProcessGroupNCCL / gloo) vs native (flcomm NcclTransport)\n{SIDE_HEADER}")
        for line in lines:
            say(line)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--transport", nargs="+", choices=("torch", "native", "both"), default=["torch"],
                   help="torch: torch.distributed (ProcessGroupNCCL on GPUs); native: flcomm's NcclTransport; "
                        "both: the two side by side")
    p.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=list(COLLECTIVES))
    p.add_argument("--algos", nargs="+", choices=("flat", "hierarchical"), default=["flat", "hierarchical"])
    p.add_argument("--codecs", nargs="*", default=None,
                   help="codecs of the compressed all-reduce rows (default: int8 when available; none given: no rows)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--op", choices=("sum", "max"), default="sum")
    args = p.parse_args(argv)
    if args.codecs is None:
        args.codecs = ["int8"]
    args.codecs = [c for c in args.codecs if c != "none"]
    args.transport = transport_names(args.transport)
    if "native" in args.transport:  # fail before starting any rank
        _require_native()
    launch(args, run)


if __name__ == "__main__":
    main()
