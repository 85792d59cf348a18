"""The independent references of the compressed all-reduce (flcomm.collectives.compressed):
single-process simulations of its two hops and of its one all-gather (two ranks), with the
formats written from their definitions (tests/common/format_ref.py, no flcomm code), the
format's per-element error bound, and per-rank test inputs."""

from __future__ import annotations

import torch

from tests.common import format_ref


def rank_input(rank: int, case: int, n: int, mag: float) -> torch.Tensor:
    """Rank ``rank``'s input of test case ``case``: ``n`` normal values times ``mag``."""
    g = torch.Generator().manual_seed(1_000_003 * rank + 7919 * case + n)
    x = torch.randn(n, generator=g) * mag
    if n > 20:
        x[(rank * 13) % n] = 30 * mag  # per-rank outliers: blocks with different scales
    return x


# ---- the independent references ----
#: the codecs' default block size (flcomm.ops.quant.DEFAULT_BLOCK_SIZE, documented as 256)
BLOCK = 256


def _align(name: str, block: int) -> int:
    return {"none": 4, "bf16": 8, "fp16": 8}.get(name, block)


def round_trip(x: torch.Tensor, name: str, block: int) -> torch.Tensor:
    return x.clone() if name == "none" else format_ref.round_trip(x, name, block)


def _padded_inputs(xs: list[torch.Tensor], name: str, block: int,
                   residuals: list[torch.Tensor] | None) -> tuple[int, list[torch.Tensor]]:
    """The chunk ``c`` (ceil(n / W) rounded up to whole blocks) and each rank's input plus its
    residual, zero-padded to ``W * c`` elements."""
    W, n = len(xs), xs[0].numel()
    a = _align(name, block)
    c = -(-n // W)
    c = -(-c // a) * a
    ys = []
    for i, x in enumerate(xs):
        y = torch.zeros(W * c)
        y[:n] = x
        if residuals is not None:
            y[:n] += residuals[i]
        ys.append(y)
    return c, ys


def simulate_two_hop(xs: list[torch.Tensor], name: str, op: str, block: int = BLOCK,
                     residuals: list[torch.Tensor] | None = None):
    """Single-process two-hop all-reduce with the formats of tests/common/format_ref.py. Steps: pad to
    W chunks of whole blocks; hop 1: every rank's chunk j is encoded and decoded (rank j's
    share); the shares are summed in rank order (/ W for avg); hop 2: the reduced chunk is
    encoded and decoded again. Returns (result, reduced values before the second quantization,
    new residuals: each rank's hop-1 error plus, on its own chunk, the hop-2 error (x W for
    avg))."""
    W, n = len(xs), xs[0].numel()
    c, ys = _padded_inputs(xs, name, block, residuals)
    P = W * c
    deq = []
    for y in ys:
        deq.append(torch.cat([round_trip(y[j * c:(j + 1) * c], name, block) for j in range(W)]))
    new_res = [y - d for y, d in zip(ys, deq)]
    acc = torch.zeros(P)
    for d in deq:
        acc += d
    if op == "avg":
        acc /= W
    out = torch.cat([round_trip(acc[j * c:(j + 1) * c], name, block) for j in range(W)])
    for j in range(W):
        e = acc[j * c:(j + 1) * c] - out[j * c:(j + 1) * c]
        new_res[j][j * c:(j + 1) * c] += e * (W if op == "avg" else 1)
    return out[:n], acc[:n], [r[:n] for r in new_res]


def simulate_gather(xs: list[torch.Tensor], name: str, op: str, block: int = BLOCK,
                    residuals: list[torch.Tensor] | None = None):
    """Single-process one-hop all-reduce (what flcomm documents for a dense codec on two ranks):
    pad as :func:`simulate_two_hop` does; every rank's whole padded tensor is encoded and decoded
    once; the decoded tensors are summed in rank order (/ W for avg). Returns (result, the same
    result: there is no second quantization, new residuals: each rank's one error)."""
    W, n = len(xs), xs[0].numel()
    _, ys = _padded_inputs(xs, name, block, residuals)
    deq = [round_trip(y, name, block) for y in ys]
    out = deq[0].clone()
    for d in deq[1:]:
        out += d
    if op == "avg":
        out /= W
    return out[:n], out[:n], [(y - d)[:n] for y, d in zip(ys, deq)]


def simulate(xs: list[torch.Tensor], name: str, op: str, block: int = BLOCK,
             residuals: list[torch.Tensor] | None = None):
    """The all-reduce flcomm documents for ``len(xs)`` ranks and no replicas: one all-gather on two
    ranks (:func:`simulate_gather`), two hops on more (:func:`simulate_two_hop`)."""
    sim = simulate_gather if len(xs) == 2 else simulate_two_hop
    return sim(xs, name, op, block, residuals)


def two_hop_bound(xs: list[torch.Tensor], reduced: torch.Tensor, name: str, op: str,
                  hops: int = 2) -> torch.Tensor:
    """Per-element bound from the format's definition (tests/common/format_ref.py): sum of the hop-1
    bounds (over W for avg) plus, with ``hops`` 2, the hop-2 bound of the reduced values, plus
    fp32 summation slack."""
    W = len(xs)
    # NOTE: chunks are whole blocks, so blocking the whole tensor gives the chunks' blocks
    h1 = sum(format_ref.error_bound(x, name, BLOCK) for x in xs)
    if op == "avg":
        h1 = h1 / W
    slack = sum(x.abs().double() for x in xs) * (W * 2.0**-22) / (W if op == "avg" else 1)
    h2 = format_ref.error_bound(reduced, name, BLOCK) if hops == 2 else 0
    return h1 + h2 + slack + 1e-30
