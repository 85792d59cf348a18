"""Native quantization kernels against the plain-torch reference, bit for bit: every format x
block size x size (including sizes that are not a multiple of the block or the vector width) x
magnitude, for quantize, dequantize, dequantize-accumulate and the fused error feedback; the
scalar CPU path (FLCOMM_CPU_VEC=0) in a subprocess; CUDA against CPU when a GPU is present."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from flcomm import kernels

pytestmark = pytest.mark.skipif(not kernels.native_supports("cpu"),
                                reason="flcomm._C without quantization kernels (build with tools/dev_build.sh)")

FORMATS = ["int8", "fp8", "bf16", "fp16"]
BLOCKS = [1, 3, 32, 256, 1000]
SIZES = [1, 7, 31, 32, 33, 255, 256, 1000, 3 * 65536 + 5]
MAGS = [1e-30, 1.0, 1e4]


def _x(n: int, mag: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * mag
    if n > 40:
        x[5] = 1e6 * mag  # a block whose small values land in fp8's subnormal range
        x[17:40] = 0
        x[-1] = -0.0
    return x


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, with NaN equal to NaN (fp16 overflows to inf, and inf - inf residuals are NaN)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def compare(device: str, backend_a: str = "native", backend_b: str = "torch", quick: bool = False) -> int:
    """Run every case on ``device`` with backend_a vs the reference (on CPU); returns the number
    of cases checked, raises AssertionError naming the first that differs."""
    count = 0
    sizes = SIZES[:-1] if quick else SIZES
    for fmt in FORMATS:
        blocks = BLOCKS if fmt in kernels.BLOCKED_FORMATS else [256]
        for B in blocks:
            for n in sizes:
                for mag in MAGS:
                    seed = hash((fmt, B, n, mag)) % 2**31
                    x = _x(n, mag, seed)
                    r = _x(n, mag * 0.01, seed + 1)
                    case = (fmt, B, n, mag)
                    ref = kernels.quantize(x, fmt=fmt, block_size=B, backend=backend_b)
                    got = kernels.quantize(x.to(device), fmt=fmt, block_size=B, backend=backend_a).cpu()
                    assert torch.equal(got, ref), ("quantize", case, int((got != ref).sum()))
                    d_ref = kernels.dequantize(ref, n, fmt=fmt, block_size=B, backend=backend_b)
                    d_got = kernels.dequantize(ref.to(device), n, fmt=fmt, block_size=B, backend=backend_a).cpu()
                    assert same(d_got, d_ref), ("dequantize", case)
                    acc_ref = r.clone()
                    kernels.dequantize(ref, n, acc_ref, fmt=fmt, block_size=B, accumulate=True, backend=backend_b)
                    acc_got = r.to(device)
                    kernels.dequantize(ref.to(device), n, acc_got, fmt=fmt, block_size=B, accumulate=True,
                                       backend=backend_a)
                    assert same(acc_got.cpu(), acc_ref), ("dequantize-accumulate", case)
                    res_ref = r.clone()
                    e_ref = kernels.quantize_error_feedback(x, res_ref, fmt=fmt, block_size=B, backend=backend_b)
                    res_got = r.to(device)
                    e_got = kernels.quantize_error_feedback(x.to(device), res_got, fmt=fmt, block_size=B,
                                                            backend=backend_a)
                    assert torch.equal(e_got.cpu(), e_ref), ("error feedback: encoding", case)
                    assert same(res_got.cpu(), res_ref), ("error feedback: residual", case)
                    count += 1
    return count


def test_cpu_native_matches_reference_bit_for_bit():
    assert compare("cpu") == 2 * len(BLOCKS) * len(SIZES) * len(MAGS) + 2 * len(SIZES) * len(MAGS)


def test_cpu_scalar_path_matches_reference():
    """The portable path (no AVX2) in a fresh process, where FLCOMM_CPU_VEC=0 takes effect."""
    env = dict(os.environ, FLCOMM_CPU_VEC="0", OMP_NUM_THREADS="2")
    code = "from tests.test_kernels import compare; print(compare('cpu', quick=True))"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert int(p.stdout.strip().splitlines()[-1]) > 0


def test_unaligned_and_sliced_inputs():
    """Views at odd offsets (the vector code must not assume 32-byte alignment)."""
    base = _x(5000, 1.0, 3)
    for off in (1, 3):
        x = base[off:off + 4001]
        for fmt in FORMATS:
            ref = kernels.quantize(x.clone(), fmt=fmt, backend="torch")
            got = kernels.quantize(x, fmt=fmt, backend="native")
            assert torch.equal(got, ref), (fmt, off)
            out = torch.empty(4100)[off: off + 4001]
            kernels.dequantize(ref, 4001, out, fmt=fmt, backend="native")
            assert torch.equal(out, kernels.dequantize(ref, 4001, fmt=fmt, backend="torch"))


def test_native_errors_are_clear():
    ops = torch.ops.flcomm
    x = torch.zeros(10)
    buf = torch.empty(kernels.encoded_nbytes(10, "int8", 4), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="must be one of int8, fp8, bf16, fp16, got 'int4'"):
        ops.quantize(x, buf, "int4", 4)
    with pytest.raises(RuntimeError, match="x must be float32, got Double"):
        ops.quantize(x.double(), buf, "int8", 4)
    with pytest.raises(RuntimeError, match="must hold 32 bytes, got 31"):
        ops.quantize(x, buf[:31], "int8", 4)
    with pytest.raises(RuntimeError, match="block_size must be >= 1, got 0"):
        ops.quantize(x, buf, "int8", 0)
    with pytest.raises(RuntimeError, match="residual must have 10 elements like x, got 9"):
        ops.quantize_error_feedback(x, torch.zeros(9), buf, "int8", 4)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.dequantize(buf, torch.zeros(20)[::2], "int8", 4, False)
    with pytest.raises(ValueError, match="backend must be one of auto, native, torch"):
        kernels.quantize(x, fmt="int8", backend="numpy")


@pytest.mark.gpu
def test_cuda_matches_cpu_bit_for_bit():
    assert compare("cuda", backend_a="native", backend_b="native") > 0


@pytest.mark.gpu
def test_cuda_runs_on_the_callers_stream_and_unaligned():
    x = _x(1 << 20, 1.0, 9).cuda()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        buf = kernels.quantize(x, fmt="int8", backend="native")
        y = kernels.dequantize(buf, x.numel(), fmt="int8", backend="native")
    s.synchronize()
    ref = kernels.quantize(x.cpu(), fmt="int8", backend="native")
    assert torch.equal(buf.cpu(), ref)
    assert torch.equal(y.cpu(), kernels.dequantize(ref, x.numel(), fmt="int8", backend="native"))
    for fmt in FORMATS:
        xs = x[1:40001]
        r = torch.zeros(40001, device="cuda")
        got = kernels.quantize_error_feedback(xs, r, fmt=fmt, block_size=100, backend="native")
        r_ref = torch.zeros(40001)
        ref = kernels.quantize_error_feedback(xs.cpu(), r_ref, fmt=fmt, block_size=100, backend="native")
        assert torch.equal(got.cpu(), ref) and torch.equal(r.cpu(), r_ref), fmt
