"""The independent references of the compressed two-hop all-reduce (flcomm.collectives.compressed):
a single-process simulation of both hops with the plain-torch reference kernels, the format's
per-element error bound, and per-rank test inputs."""

from __future__ import annotations

import torch

from flcomm import kernels
from flcomm.codecs import get_codec


def rank_input(rank: int, case: int, n: int, mag: float) -> torch.Tensor:
    """Rank ``rank``'s input of test case ``case``: ``n`` normal values times ``mag``."""
    g = torch.Generator().manual_seed(1_000_003 * rank + 7919 * case + n)
    x = torch.randn(n, generator=g) * mag
    if n > 20:
        x[(rank * 13) % n] = 30 * mag  # per-rank outliers: blocks with different scales
    return x


def _align(name: str, block: int) -> int:
    return {"none": 4, "bf16": 8, "fp16": 8}.get(name, block)


def simulate_two_hop(xs: list[torch.Tensor], name: str, op: str, block: int = kernels.DEFAULT_BLOCK_SIZE,
                     residuals: list[torch.Tensor] | None = None):
    """Single-process two-hop all-reduce with the reference kernels. Returns (result, reduced
    values before the second quantization, new residuals)."""
    W, n = len(xs), xs[0].numel()
    c = -(-n // W)
    a = _align(name, block)
    c = -(-c // a) * a
    P = W * c

    def pad(t):
        z = torch.zeros(P)
        z[:n] = t
        return z

    ys = [pad(x) + (pad(r) if residuals is not None else 0) for x, r in
          zip(xs, residuals if residuals is not None else xs)]
    deq = []
    for y in ys:
        d = torch.empty(P)
        for j in range(W):
            buf = torch.empty(kernels.encoded_nbytes(c, name, block), dtype=torch.uint8)
            kernels.quantize_ref(y[j * c:(j + 1) * c], buf, fmt=name, block_size=block)
            kernels.dequantize_ref(buf, d[j * c:(j + 1) * c], fmt=name, block_size=block)
        deq.append(d)
    new_res = [y - d for y, d in zip(ys, deq)]
    acc = torch.zeros(P)
    for d in deq:
        acc += d
    if op == "avg":
        acc /= W
    out = torch.empty(P)
    for j in range(W):
        buf = torch.empty(kernels.encoded_nbytes(c, name, block), dtype=torch.uint8)
        kernels.quantize_ref(acc[j * c:(j + 1) * c], buf, fmt=name, block_size=block)
        kernels.dequantize_ref(buf, out[j * c:(j + 1) * c], fmt=name, block_size=block)
        e = acc[j * c:(j + 1) * c] - out[j * c:(j + 1) * c]
        new_res[j][j * c:(j + 1) * c] += e * (W if op == "avg" else 1)
    return out[:n], acc[:n], [r[:n] for r in new_res]


def two_hop_bound(xs: list[torch.Tensor], reduced: torch.Tensor, name: str, op: str) -> torch.Tensor:
    """Per-element bound from the format: sum of the hop-1 bounds (over W for avg) plus the hop-2
    bound of the reduced values, plus fp32 summation slack."""
    codec = get_codec(name)
    W = len(xs)
    # NOTE: chunks are whole blocks, so blocking the whole tensor gives the chunks' blocks
    h1 = sum(codec.error_bound(x) for x in xs)
    if op == "avg":
        h1 = h1 / W
    slack = sum(x.abs() for x in xs) * (W * 2.0**-22) / (W if op == "avg" else 1)
    return h1 + codec.error_bound(reduced) + slack + 1e-30
