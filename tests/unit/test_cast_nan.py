"""The NaN bytes of the 16-bit casts (quantize fmt bf16 / fp16), against c10's own conversion.

The CPU writes c10's NaN (csrc/quant.h kBf16NaNBits / kFp16NaNBits): bf16 0x7fc0 for every NaN,
fp16 the sign | 0x7e00. CUDA's conversions write 0x7fff, so the CUDA kernels write the CPU's
bytes themselves; the GPU test checks they do, bit for bit, for torch's NaN and its negation.
"""

from __future__ import annotations

import pytest
import torch

from flcomm.ops import quant

pytestmark = pytest.mark.skipif(not quant.native_supports("cpu"),
                                reason="flcomm._C without quantization kernels (build with tools/dev_build.sh)")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx2" in flags and " f16c" in flags


CPU_PATHS = [pytest.param("avx2", marks=pytest.mark.skipif(not cpu_has_avx2(), reason="no AVX2+F16C")), "scalar"]


def nan_input() -> torch.Tensor:
    """torch's NaN and its negation, in the 8-wide vector part and in the scalar tail."""
    nan = float("nan")
    x = torch.linspace(-3, 3, 21)
    for i, v in ((0, nan), (3, -nan), (7, nan), (17, -nan), (20, nan)):
        x[i] = v
    return x


def payload_bits(enc: torch.Tensor, n: int, fmt: str) -> torch.Tensor:
    return quant.split_encoded(enc, n, fmt, 256)[0].view(torch.int16)


def torch_bits(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The reference: c10's own element conversion (c10::BFloat16 / c10::Half of each float32,
    which torch.tensor(list, dtype=...) applies on the host), independent of flcomm's kernels.
    NOTE: not ``x.to(dtype)``: torch's vectorized CPU cast writes 0xffff for a bf16 NaN on an
    AVX512 machine (0x7fc0 on others and for 0-dim tensors)."""
    return torch.tensor(x.cpu().tolist(), dtype=DTYPES[fmt]).view(torch.int16)


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("fmt", list(DTYPES))
def test_cpu_nan_bytes_are_torchs(fmt, path, monkeypatch):
    monkeypatch.setenv("FLCOMM_CPU_VEC", "1" if path == "avx2" else "0")
    x = nan_input()
    got = payload_bits(quant.quantize(x, fmt=fmt, backend="native"), x.numel(), fmt)
    assert torch.equal(got, torch_bits(x, fmt)), [hex(v & 0xFFFF) for v in got.tolist()]
    r = torch.zeros_like(x)
    got_ef = payload_bits(quant.quantize_error_feedback(x, r, fmt=fmt, backend="native"), x.numel(), fmt)
    # NOTE: the sum x + 0 keeps a NaN operand on x86, sign included
    assert torch.equal(got_ef, torch_bits(x, fmt)), [hex(v & 0xFFFF) for v in got_ef.tolist()]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(DTYPES))
def test_cuda_nan_bytes_are_the_cpus(fmt):
    """CUDA writes the CPU's NaN bytes (before: 0x7fff), aligned (vector path) and not."""
    x = nan_input()
    for xs in (x, x[1:]):
        n = xs.numel()
        got = payload_bits(quant.quantize(xs.cuda(), fmt=fmt, backend="native").cpu(), n, fmt)
        cpu = payload_bits(quant.quantize(xs, fmt=fmt, backend="native"), n, fmt)
        assert torch.equal(got, torch_bits(xs, fmt)), [hex(v & 0xFFFF) for v in got.tolist()]
        assert torch.equal(got, cpu)
        # error feedback: only torch's positive NaN here. NOTE: the sign of a NaN made by
        # arithmetic is not portable: CUDA's x + r is its canonical positive NaN, x86 keeps a
        # negative operand's sign (csrc/quant.h)
        pos = torch.where(xs.isnan(), torch.full_like(xs, float("nan")), xs)
        r = torch.zeros(n, device="cuda")
        got_ef = payload_bits(quant.quantize_error_feedback(pos.cuda(), r, fmt=fmt, backend="native").cpu(), n,
                              fmt)
        assert torch.equal(got_ef, torch_bits(pos, fmt)), [hex(v & 0xFFFF) for v in got_ef.tolist()]
        assert bool(r.isnan().cpu().eq(pos.isnan()).all()), "residual NaN where the input is NaN, finite elsewhere"
