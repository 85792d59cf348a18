"""Quantization kernels: GB/s against the memory-copy ceiling and against the same math in torch
ops, measured side by side in one run.

For each device, format, block size and size:

  1. ``bytes``: the memory traffic of the kernel (bytes read + bytes written): quantize reads the
     fp32 input and writes the encoding; dequantize the reverse; dequantize-accumulate also reads
     the fp32 accumulator; error feedback reads input and residual and writes residual and
     encoding; ``quant+dequant`` is a quantize followed by a dequantize (the issue's target);
  2. the native kernel (``backend="native"``), the plain-torch version (``backend="torch"``:
     flcomm.ops.quant's reference, the same math in torch ops) and a plain copy that moves the same
     bytes (``dst.copy_(src)`` of ``bytes/2``) are timed in rounds, interleaved, so machine load
     hits all three alike; each time is the median over rounds;
  3. ``gbps = bytes / time``; ``copy_gbps``: the same bytes at the copy's time (the ceiling);
     ``torch_ops_gbps``: at the torch version's time. ``of_copy = gbps / copy_gbps``,
     ``vs_torch = gbps / torch_ops_gbps``;
  4. ``load``: the 1-minute load average (``uptime``'s first figure) when the row was measured;
     the full ``uptime`` line is printed before and after the run. The figures hold for the
     machine's state: with a load of 1 or more on a CPU run, other processes shared the cores.

The copy is ``torch.Tensor.copy_`` of uint8 tensors on the same device with torch's threads (as
many as the native kernel's ``at::parallel_for``); note that a kernel's traffic is not split
between reads and writes as the copy's is (quantize reads 4x what it writes, dequantize the
reverse), so a fraction above 1 is possible where reads and writes cost differently.

Usage::

    python bench/kernels.py                                   # CPU (and CUDA when present)
    python bench/kernels.py --sizes 64M --formats int8 --block-sizes 64 128 256 512 1024
    python bench/kernels.py --device cuda --sizes 16M 256M --json kernels.json

``--json PATH`` writes a list of records: kernel, device, codec, bytes, gbps, copy_gbps,
torch_ops_gbps, plus block_size, numel, size_bytes (fp32 input), time_us, copy_time_us,
torch_ops_time_us, of_copy, vs_torch, threads, load.

Sizes: ``--sizes 64M 256M 1G`` (K/M/G: powers of 1024 bytes of fp32 input); a GPU run wants 256M
or more, since 64 MiB fits in an H200's L2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from flcomm.ops import quant  # noqa: E402

KERNELS = ("quantize", "dequantize", "dequantize_acc", "error_feedback", "quant+dequant")


@dataclass
class KernelRecord:
    kernel: str
    device: str
    codec: str
    bytes: int
    gbps: float
    copy_gbps: float
    torch_ops_gbps: float
    block_size: int
    numel: int
    size_bytes: int
    time_us: float
    copy_time_us: float
    torch_ops_time_us: float
    of_copy: float
    vs_torch: float
    threads: int
    load: float


def parse_size(s: str) -> int:
    """'4K', '16M', '1G' (powers of 1024; bytes of fp32 input) -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", s, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"size must be a number with an optional K/M/G suffix, got {s!r}")
    return int(m.group(1)) * 1024 ** " KMG".index(m.group(2).upper() or " ")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Seconds per call of ``iters`` back-to-back calls (CUDA: events on the current stream)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def side_by_side(fns: dict[str, Callable[[], object]], device: torch.device, iters: int, rounds: int,
                 warmup: int = 2, stat: str = "median") -> dict[str, float]:
    """Median (or with ``stat="min"`` the fastest) round's seconds per call of each function,
    timed in interleaved rounds."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            times[k].append(_time(fn, device, iters))
    pick = min if stat == "min" else statistics.median
    return {k: pick(v) for k, v in times.items()}


def _copy_of(nbytes: int, device: torch.device) -> Callable[[], object]:
    """A copy of ``nbytes / 2`` bytes: it reads and writes ``nbytes``, the same traffic as the
    kernel (the buffers live as long as the callable)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def bench_case(device: torch.device, fmt: str, block: int, numel: int, which: list[str], iters: int,
               rounds: int, stat: str = "median") -> list[KernelRecord]:
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(numel, generator=g).to(device)
    res = (torch.randn(numel, generator=g) * 0.01).to(device)
    acc = torch.zeros(numel, device=device)
    out = torch.empty(numel, device=device)
    E = quant.encoded_nbytes(numel, fmt, block)
    buf = torch.empty(E, dtype=torch.uint8, device=device)
    quant.quantize(x, buf, fmt=fmt, block_size=block, backend="native")
    F = 4 * numel
    plans: dict[str, tuple[int, Callable[[str], Callable[[], object]]]] = {
        "quantize": (F + E, lambda be: lambda: quant.quantize(x, buf, fmt=fmt, block_size=block, backend=be)),
        "dequantize": (E + F, lambda be: lambda: quant.dequantize(buf, numel, out, fmt=fmt, block_size=block,
                                                                    backend=be)),
        "dequantize_acc": (E + 2 * F, lambda be: lambda: quant.dequantize(
            buf, numel, acc, fmt=fmt, block_size=block, accumulate=True, backend=be)),
        "error_feedback": (2 * F + F + E, lambda be: lambda: quant.quantize_error_feedback(
            x, res, buf, fmt=fmt, block_size=block, backend=be)),
        "quant+dequant": (2 * (F + E), lambda be: lambda: (
            quant.quantize(x, buf, fmt=fmt, block_size=block, backend=be),
            quant.dequantize(buf, numel, out, fmt=fmt, block_size=block, backend=be))),
    }
    records = []
    for name in which:
        nbytes, make = plans[name]
        t = side_by_side({"native": make("native"), "torch": make("torch"), "copy": _copy_of(nbytes, device)},
                         device, iters, rounds, stat=stat)
        gb = lambda s: nbytes / s / 1e9  # noqa: E731
        records.append(KernelRecord(
            kernel=name, device=device.type, codec=fmt, bytes=nbytes, gbps=gb(t["native"]),
            copy_gbps=gb(t["copy"]), torch_ops_gbps=gb(t["torch"]), block_size=block, numel=numel,
            size_bytes=F, time_us=t["native"] * 1e6, copy_time_us=t["copy"] * 1e6,
            torch_ops_time_us=t["torch"] * 1e6, of_copy=t["copy"] / t["native"],
            vs_torch=t["torch"] / t["native"], threads=torch.get_num_threads(), load=os.getloadavg()[0]))
    return records


HEADER = (f"# bytes: read + written by the kernel; copy: dst.copy_(src) of bytes/2 (reads bytes/2, writes\n"
          f"# bytes/2: the same total), timed interleaved with the kernel; %copy = GB/s / copy GB/s\n"
          f"#{'device':>6} {'codec':>5} {'block':>5} {'kernel':>15} {'size':>10} {'bytes':>11} {'time':>9} "
          f"{'GB/s':>7} {'copy':>7} {'torch':>7} {'%copy':>6} {'xtorch':>6} {'load':>5}\n"
          f"#{'':>6} {'':>5} {'':>5} {'':>15} {'(fp32 B)':>10} {'(moved)':>11} {'(us)':>9} "
          f"{'':>7} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6} {'':>6} {'(1m)':>5}")


def fmt_row(r: KernelRecord) -> str:
    return (f" {r.device:>6} {r.codec:>5} {r.block_size:>5} {r.kernel:>15} {r.size_bytes:>10} {r.bytes:>11} "
            f"{r.time_us:>9.1f} {r.gbps:>7.2f} {r.copy_gbps:>7.2f} {r.torch_ops_gbps:>7.2f} "
            f"{100 * r.of_copy:>5.0f}% {r.vs_torch:>6.2f} {r.load:>5.2f}")


def uptime() -> str:
    """``uptime``'s line (its load averages), or the load averages alone where it is missing."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{v:.2f}" for v in os.getloadavg())


def main(argv: list[str] | None = None) -> list[KernelRecord]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", nargs="+", default=None, help="cpu and/or cuda (default: cpu, plus cuda if present)")
    p.add_argument("--formats", nargs="+", default=list(quant.FORMATS), choices=quant.FORMATS)
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--block-sizes", nargs="+", type=int, default=[quant.DEFAULT_BLOCK_SIZE])
    p.add_argument("--sizes", nargs="+", type=parse_size, default=[parse_size("64M")],
                   help="fp32 input sizes in bytes (K/M/G suffixes)")
    p.add_argument("--iters", type=int, default=5, help="calls per timed round")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (the median is kept)")
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="which round's time to keep per function (min: the fastest, for a loaded machine; "
                        "the same statistic for kernel, copy and torch ops)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    args = p.parse_args(argv)
    if not quant.native_supports("cpu"):
        p.error("flcomm._C has no quantization kernels: build it first (tools/dev_build.sh)")
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = args.device or (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    records: list[KernelRecord] = []
    print(f"# uptime before: {uptime()}", flush=True)
    print(f"# times: the {args.stat} of {args.rounds} interleaved rounds of {args.iters} calls", flush=True)
    print(HEADER, flush=True)
    for dev in devices:
        device = torch.device(dev)
        if device.type == "cuda" and not (torch.cuda.is_available() and quant.native_supports("cuda")):
            print(f"# skipping {dev}: no GPU or no CUDA kernels built", flush=True)
            continue
        for fmt in args.formats:
            blocks = args.block_sizes if fmt in quant.BLOCKED_FORMATS else [quant.DEFAULT_BLOCK_SIZE]
            for block in blocks:
                for size in args.sizes:
                    for r in bench_case(device, fmt, block, size // 4, args.kernels, args.iters, args.rounds,
                                        args.stat):
                        print(fmt_row(r), flush=True)
                        records.append(r)
    print(f"# uptime after: {uptime()}", flush=True)
    for r in records:
        if r.kernel in ("quantize", "dequantize") and r.codec == "int8":
            print(f"# {r.device} int8 {r.kernel} (block {r.block_size}, {r.size_bytes} B): "
                  f"{100 * r.of_copy:.0f}% of copy (target 70%), load {r.load:.2f}")
        if r.kernel == "quant+dequant" and r.codec == "int8":
            target = 0.7 if r.device == "cuda" else 0.5
            print(f"# {r.device} int8 quant+dequant (block {r.block_size}, {r.size_bytes} B): "
                  f"{100 * r.of_copy:.0f}% of copy (target {100 * target:.0f}%), "
                  f"{r.vs_torch:.2f}x torch ops" + (" (target 3x)" if r.device == "cpu" else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in records], f, indent=1)
    return records


if __name__ == "__main__":
    main()
