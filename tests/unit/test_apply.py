"""The exchange's fused apply (flcomm/ops/apply.py; csrc/apply.cpp, csrc/apply_cuda.cu) against the
formula written out here with torch's elementwise ops, bit for bit, on every backend: the native
CPU kernel (one and two threads), the plain-torch fallback, and CUDA where a GPU is visible.
Where ``ok`` is False nothing is written, a NaN average included; bad input is refused with what
was expected and what came."""

from __future__ import annotations

import pytest
import torch

from flcomm import _native
from flcomm.ops import quant
from flcomm.ops.apply import OPS, apply_average

needs_native = pytest.mark.skipif(not quant.native_supports("cpu", OPS),
                                  reason=f"flcomm._C without apply_average: {_native.unavailable_reason()}")

SIZES = [0, 1, 7, 1000, 200_003]  # the last spans several of the kernel's parallel chunks


def _inputs(n: int, dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    mean = torch.randn(n, generator=g, dtype=torch.float64) * 1e-3
    anchor = torch.randn(n, generator=g, dtype=torch.float64)
    target = anchor + torch.randn(n, generator=g, dtype=torch.float64) * 1e-2
    if n > 4:  # subnormal, zero and signed-zero operands: the kernels must not flush them
        mean[:4] = torch.tensor([1e-40, -0.0, 0.0, -1e-310])
        anchor[:4] = torch.tensor([-1e-40, 0.0, -0.0, 1e-310])
    return tuple(t.to(dtype).to(device) for t in (mean, anchor, target))  # type: ignore[return-value]


def _want(mean, anchor, target, correction):
    a = torch.add(anchor, mean)
    return a, (torch.sub(a, target) if correction else a.clone())


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    itype = torch.int64 if got.dtype == torch.float64 else torch.int32
    return torch.equal(got.view(itype), want.view(itype))


def _check(backend: str, device: str = "cpu") -> None:
    for dtype in (torch.float32, torch.float64):
        for n in SIZES:
            for correction in (True, False):
                mean, anchor, target = _inputs(n, dtype, device)
                a_want, t_want = _want(mean, anchor, target, correction)
                ok = torch.tensor(True, device=device)
                apply_average(mean, anchor, target, ok, correction=correction, backend=backend)
                assert _same_bits(anchor, a_want), (dtype, n, correction)
                assert _same_bits(target, t_want), (dtype, n, correction)
                # not ok: nothing written, whatever the average holds
                mean, anchor, target = _inputs(n, dtype, device)
                mean[n // 2:] = float("nan")
                a0, t0 = anchor.clone(), target.clone()
                apply_average(mean, anchor, target, ~ok, correction=correction, backend=backend)
                assert _same_bits(anchor, a0) and _same_bits(target, t0), (dtype, n, correction)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_native_cpu_kernel_is_the_formula_bit_for_bit(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check("native")
    finally:
        torch.set_num_threads(before)


def test_torch_fallback_is_the_formula_bit_for_bit():
    _check("torch")


@needs_native
def test_bad_input_is_refused_with_what_was_expected():
    ops = _native.ops()
    m, a, t = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    ok = torch.tensor(True)
    raw = torch.zeros(32, dtype=torch.uint8)  # a flag inside the anchor's bytes
    cases = [
        ((m.half(), a, t, ok), "mean must be float32 or float64, got Half"),
        ((m, a.double(), t, ok), r"must have mean's dtype \(Float\), got Double and Float"),
        ((m, a, torch.zeros(9), ok), "must have mean's 8 elements, got 8 and 9"),
        ((m, torch.zeros(16)[::2], t, ok), "must be contiguous"),
        ((m, a, t, torch.tensor(1.0)), "ok must be one bool on mean's device"),
        ((m, a, t, torch.ones(2, dtype=torch.bool)), r"got 2 element\(s\) of Bool"),
        ((m, a, a, ok), "must not overlap each other, mean or ok"),
        ((m, m, t, ok), "must not overlap each other, mean or ok"),
        ((m, raw[:32].view(torch.float32), t, raw[4:5].view(torch.bool)), "must not overlap each other, mean or ok"),
    ]
    for args, match in cases:
        with pytest.raises(RuntimeError, match=match):
            ops.apply_average(*args, True)


@needs_native
@pytest.mark.gpu
def test_cuda_kernel_is_the_formula_bit_for_bit():
    assert quant.native_supports("cuda", OPS)
    _check("native", "cuda")
    # the flag is read on the device: a False made there leaves everything as it was
    mean, anchor, target = _inputs(1000, torch.float32, "cuda")
    a0, t0 = anchor.clone(), target.clone()
    ok = torch.isfinite(mean.sum() * float("nan"))
    apply_average(mean, anchor, target, ok, correction=True)
    assert _same_bits(anchor, a0) and _same_bits(target, t0)
