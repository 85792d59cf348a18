"""Codecs: registry and errors; every codec's round trip over a grid of size x magnitude against
the format's error bound (derived in tests/common/format_ref.py from the format's definition, not
flcomm's ``Codec.error_bound``, which has a test of its own); the layout (payload and scales in
one buffer) read back by hand."""

from __future__ import annotations

import math
import re

import pytest
import torch

from flcomm.codecs import CODECS, Codec, KernelCodec, get_codec, register_codec
from flcomm.ops import quant
from tests.common import format_ref

SIZES = [1, 7, 255, 256, 257, 1000, 4099]
MAGS = [1e-6, 1e-2, 1.0, 1e3]


def _x(n: int, mag: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + n)
    x = torch.randn(n, generator=g) * mag
    if n > 10:  # outliers and an all-zero block exercise the scales
        x[3] = 40 * mag
        x[-5:] = 0
    return x


def test_registry_names_and_errors():
    assert set(CODECS) >= {"none", "bf16", "fp16", "int8", "fp8"}
    for name in ("none", "bf16", "fp16", "int8", "fp8"):
        c = get_codec(name)
        assert c.name == name and get_codec(c) is c
    assert get_codec("INT8").name == "int8"
    with pytest.raises(ValueError, match="known codecs: none, bf16, fp16, int8, fp8"):
        get_codec("int4")
    with pytest.raises(TypeError, match="codec must be a name"):
        get_codec(8)  # type: ignore[arg-type]
    for bad in (0, 2**40, 2**63, True, 256.0):
        with pytest.raises(ValueError, match=r"block_size must be an integer in \[1, 1048576\] "
                                             rf"\(elements per scale\), got {re.escape(repr(bad))}"):
            get_codec("int8", block_size=bad)
    assert get_codec("int8", block_size=1 << 20).block_size == 1 << 20


def test_register_a_new_codec_in_one_class():
    class Halves(KernelCodec):
        name = "test_halves"
        fmt = "fp16"

    register_codec(Halves)
    import flcomm.codecs as mod

    assert "test_halves" in mod.CODECS
    x = _x(100, 1.0)
    c = get_codec("test_halves")
    assert torch.equal(c.decode(c.encode(x), 100), x.half().float())
    with pytest.raises(ValueError, match="already registered"):
        class Other(Codec):
            name = "int8"
        register_codec(Other)


@pytest.mark.parametrize("name", ["none", "bf16", "fp16", "int8", "fp8"])
def test_bad_inputs_are_refused_with_clear_errors(name):
    c = get_codec(name)
    with pytest.raises(TypeError, match="float32, got torch.float64"):
        c.encode(torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        c.encode(torch.zeros(8, 8)[:, 0])
    x = torch.zeros(64)
    with pytest.raises(ValueError, match="exactly"):
        c.encode(x, torch.empty(c.encoded_nbytes(64) + 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        c.decode(torch.zeros(c.encoded_nbytes(64) // 4), 64)
    meta = torch.zeros(64, device="meta")
    with pytest.raises(ValueError, match="must be on"):
        c.encode(x, torch.empty(c.encoded_nbytes(64), dtype=torch.uint8, device="meta"))
    del meta


@pytest.mark.parametrize("name", ["none", "bf16", "fp16", "int8", "fp8"])
@pytest.mark.parametrize("block", [32, 256])
def test_round_trip_within_format_bound(name, block):
    c = get_codec(name) if name == "none" else get_codec(name, block_size=block)
    for n in SIZES:
        for mag in MAGS:
            x = _x(n, mag)
            buf = c.encode(x)
            assert buf.dtype == torch.uint8 and buf.numel() == c.encoded_nbytes(n)
            y = c.decode(buf, n)
            if name == "none":
                assert torch.equal(y, x)
            else:
                err = (y.double() - x.double()).abs()
                bound = format_ref.error_bound(x, name, block)
                assert bool((err <= bound).all()), (name, n, mag, float((err - bound).max()))
            acc = torch.full((n,), 0.5)
            c.decode_accumulate(buf, n, acc)
            assert torch.allclose(acc, y + 0.5, rtol=0, atol=1e-6 * max(1.0, mag * 40))


@pytest.mark.parametrize("name", ["bf16", "fp16", "int8", "fp8"])
def test_codec_error_bound_against_the_format(name):
    """``Codec.error_bound`` (a documented per-element bound) over the grid: never below the
    largest rounding error the format allows (tests/common/format_ref.py, less its fp32 slack, so it
    holds for the worst case too) and at most twice the format's bound plus half the step of
    its subnormal grid (not vacuous)."""
    block = 32
    c = get_codec(name, block_size=block)
    for n in SIZES:
        for mag in MAGS:
            x = _x(n, mag)
            fmt_bound = format_ref.error_bound(x, name, block)
            amax = _block_absmax(x, block)
            worst = fmt_bound - (5 * format_ref.U32 * amax if name in ("int8", "fp8") else 0)
            floor = {"bf16": 2.0 ** -134, "fp16": 2.0 ** -25, "int8": 0.0, "fp8": 2.0 ** -10 * amax / 448}[name]
            got = c.error_bound(x).double()
            assert bool((got >= worst).all()), (name, n, mag, float((worst - got).max()))
            assert bool((got <= 2 * fmt_bound + floor).all()), (name, n, mag, float((got - 2 * fmt_bound).max()))


def _block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """float64 absmax of each element's block."""
    n = x.numel()
    xb = torch.zeros(-(-n // block) * block, dtype=torch.float64)
    xb[:n] = x.double().abs()
    return xb.view(-1, block).amax(dim=1).repeat_interleave(block)[:n]


def test_int8_layout_and_exact_values():
    """Payload then scales, each 16-aligned; q = round(x * 127/absmax), scale = absmax/127."""
    c = get_codec("int8", block_size=4)
    x = torch.tensor([1.0, -2.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0])
    buf = c.encode(x)
    assert buf.numel() == 16 + 16  # 9 bytes -> 16; 3 scales = 12 bytes -> 16
    q = buf[:9].view(torch.int8).tolist()
    assert q == [64, -127, 32, 0, 0, 0, 0, 0, 127]  # 63.5 -> 64 (half to even), 31.75 -> 32
    assert buf[9:16].tolist() == [0] * 7
    scales = buf[16:28].view(torch.float32).tolist()
    assert scales == pytest.approx([2.0 / 127, 0.0, 3.0 / 127], rel=1e-7)
    y = c.decode(buf, 9)
    assert torch.allclose(y, torch.tensor([64 * 2 / 127, -2.0, 32 * 2 / 127, 0, 0, 0, 0, 0, 3.0]), atol=1e-7)


def test_encoded_sizes_meet_the_wire_targets():
    n = 1 << 20
    assert get_codec("int8").encoded_nbytes(n) / (4 * n) <= 0.27
    assert get_codec("fp8").encoded_nbytes(n) / (4 * n) <= 0.27
    assert get_codec("bf16").encoded_nbytes(n) / (4 * n) == 0.5
    assert get_codec("none").encoded_nbytes(n) == 4 * n
    assert quant.encoded_nbytes(1000, "int8", 256) == 1008 + 16


@pytest.mark.parametrize("name", ["bf16", "fp16", "int8", "fp8"])
def test_error_feedback_identity(name):
    """residual' = x + residual - decode(encode(x + residual)), exactly in fp32."""
    c = get_codec(name)
    x, r = _x(1000, 1.0, 1), _x(1000, 0.01, 2)
    y = x + r
    r2 = r.clone()
    buf = c.encode_error_feedback(x, r2)
    assert torch.equal(buf, c.encode(y))
    assert torch.equal(r2, y - c.decode(buf, 1000))


def test_fp8_and_int8_zero_and_constant_blocks():
    for name in ("int8", "fp8"):
        c = get_codec(name, block_size=8)
        x = torch.zeros(24)
        x[8:16] = -3.25
        y = c.decode(c.encode(x), 24)
        assert torch.equal(y[:8], torch.zeros(8)) and torch.equal(y[16:], torch.zeros(8))
        assert torch.allclose(y[8:16], x[8:16], rtol=2**-20)
        assert not math.isnan(float(y.sum()))
