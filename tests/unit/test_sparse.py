"""The sparse top-k kernels (flcomm.ops.topk: native CPU and the plain-torch reference) against the
format written from its definition (tests/common/topk_ref.py, no flcomm code): every byte of
the encoding, the decoded and accumulated values and the error-feedback residual, bit for bit,
over block sizes, densities, bit widths, partial blocks and special values; the codec's names
and options; bad input."""

from __future__ import annotations

import pytest
import torch

from flcomm.codecs import TopKCodec, get_codec
from flcomm.ops import quant, topk
from tests.common import topk_ref

NATIVE = quant.native_supports("cpu", topk.OPS)
BACKENDS = ["torch", "native"] if NATIVE else ["torch"]

# (n, block, k, bits)
GRID = [(10000, 4096, 82, 2), (8192, 4096, 41, 4), (5000, 1000, 20, 8), (2500, 1000, 1, 2), (300, 256, 256, 2),
        (7, 4, 3, 4), (1, 4096, 82, 2), (0, 256, 5, 2), (1000, 65536, 1311, 2)]


def _input(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if n > 40:
        x[3:9] = 1.25  # ties of equal magnitude (all kept or all dropped on this grid; see below)
        x[10:14] = -1.25
        x[20] = -0.0
        x[21:24] = torch.tensor([1e-40, -3e-42, 2e-45])  # subnormals
        x[::17] = 0.0
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits (NaN payloads and signed zeros included)."""
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,block,k,bits", GRID)
def test_encoding_is_the_definitions_byte_for_byte(backend, n, block, k, bits):
    x = _input(n, n + k)
    got = topk.topk_encode(x, block=block, k=k, bits=bits, backend=backend)
    want = topk_ref.encode(x, block, k, bits)
    assert got.numel() == topk.encoded_nbytes(n, block, k, bits) == topk_ref.nbytes(n, block, k, bits)
    assert _same(got, want), (got != want).nonzero()[:8].flatten().tolist()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,block,k,bits", GRID)
def test_decode_accumulate_and_error_feedback_are_the_definitions(backend, n, block, k, bits):
    x = _input(n, 7 * n + bits)
    r = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.3
    buf = topk_ref.encode(x, block, k, bits)
    want = topk_ref.round_trip(x, block, k, bits)
    assert _same(topk.topk_decode(buf, n, block=block, k=k, bits=bits, backend=backend), want)
    acc = torch.randn(n)
    base = acc.clone()
    topk.topk_decode(buf, n, acc, block=block, k=k, bits=bits, accumulate=True, backend=backend)
    kept = want != 0
    assert _same(acc[~kept], base[~kept])  # NOTE: what is not kept is not touched, not even + 0
    assert _same(acc[kept], base[kept] + want[kept])
    res = r.clone()
    enc = topk.topk_encode(x, block=block, k=k, bits=bits, residual=res, backend=backend)
    d_want, r_want = topk_ref.error_feedback(x, r, block, k, bits)
    assert _same(enc, topk_ref.encode(x + r, block, k, bits))
    assert _same(res, r_want)
    assert _same(topk.topk_decode(enc, n, block=block, k=k, bits=bits, backend=backend), d_want)


# NOTE: ties that straddle k (review F3): per block, 3 values above the tie level, then 12 values
# of equal magnitude (mixed signs, scattered); k = 8 keeps the 3 and 5 of the 12, and the written
# rule ("equal magnitudes: the lower index first") decides which 5
TIE_BLOCK, TIE_K = 256, 8


def _straddling_ties(blocks: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """The input, and the indices the rule keeps, worked out here from the rule alone."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(blocks * TIE_BLOCK, generator=g) - 0.5)  # |x| < 0.5: never kept
    keep = []
    for b in range(blocks):
        pos = (torch.randperm(TIE_BLOCK, generator=g)[:15] + b * TIE_BLOCK).tolist()
        above, ties = pos[:3], pos[3:]
        x[above] = torch.tensor([3.0, -2.5, 2.25])
        x[ties] = torch.tensor([2.0, -2.0] * 6)
        keep += sorted(above + sorted(ties)[:TIE_K - 3])
    return x, sorted(keep)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_ties_that_straddle_k_keep_the_lower_indices(backend, bits):
    x, keep = _straddling_ties(blocks=3, seed=11 + bits)
    n = x.numel()
    got = topk.topk_encode(x, block=TIE_BLOCK, k=TIE_K, bits=bits, backend=backend)
    assert _same(got, topk_ref.encode(x, TIE_BLOCK, TIE_K, bits))
    dec = topk.topk_decode(got, n, block=TIE_BLOCK, k=TIE_K, bits=bits, backend=backend)
    assert dec.nonzero().flatten().tolist() == keep
    res = torch.zeros(n)
    topk.topk_encode(x, block=TIE_BLOCK, k=TIE_K, bits=bits, residual=res, backend=backend)
    _, r_want = topk_ref.error_feedback(x, torch.zeros(n), TIE_BLOCK, TIE_K, bits)
    assert _same(res, r_want)
    dropped = [i for i in range(n) if abs(float(x[i])) == 2.0 and i not in set(keep)]
    assert dropped and all(res[i] == x[i] for i in dropped)  # a dropped tie is carried whole


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_blocks_decode_as_nan_and_keep_nan_residuals(backend):
    block, k, bits = 64, 4, 2
    x = torch.randn(4 * block)
    x[5] = float("nan")
    x[block + 9] = float("inf")
    x[2 * block + 1] = float("-inf")
    got = topk.topk_encode(x, block=block, k=k, bits=bits, backend=backend)
    assert _same(got, topk_ref.encode(x, block, k, bits))
    d = topk.topk_decode(got, x.numel(), block=block, k=k, bits=bits, backend=backend)
    for b in range(3):
        assert d[b * block:(b + 1) * block].isnan().sum() == k  # the kept ones, NaN included
    assert torch.isfinite(d[3 * block:]).all() and (d[3 * block:] != 0).sum() == k
    res = torch.zeros_like(x)
    topk.topk_encode(x, block=block, k=k, bits=bits, residual=res, backend=backend)
    assert res[:3 * block].isnan().sum() == 3 * k and torch.isfinite(res[3 * block:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_non_finite_blocks_residual_is_torchs_nan_whatever_the_nan(backend):
    """The kept elements of a non-finite block get 0x7fc00000 as residual: not the bits of a
    negative NaN or of a NaN with a payload, which arithmetic would pass on differently by device."""
    x = torch.randn(64)
    x.view(torch.int32)[3] = -0x00400001  # NOTE: 0xffbfffff: a negative NaN with a payload
    res = torch.zeros_like(x)
    topk.topk_encode(x, block=64, k=4, bits=2, residual=res, backend=backend)
    kept = res.isnan()
    assert kept.sum() == 4 and bool((res.view(torch.int32)[kept] == 0x7FC00000).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_skips_an_index_past_the_block(backend):
    """A hand-made buffer whose index points past a partial last block writes nothing there."""
    n, block, k, bits = 70, 64, 2, 4
    buf = topk.topk_encode(torch.ones(n), block=block, k=k, bits=bits, backend="torch")
    idx = buf[topk_ref.nbytes(n, block, 0, bits):].view(torch.int16)  # NOTE: past the scales: the indices
    idx[k + 1] = 40  # block 1 has 6 elements
    out = torch.full((n,), 7.0)
    topk.topk_decode(buf, n, out, block=block, k=k, bits=bits, accumulate=True, backend=backend)
    assert (out[64:] != 7.0).sum() == 1 and (out[:64] != 7.0).sum() == 2


@pytest.mark.skipif(not NATIVE, reason="flcomm._C is not built with the sparse kernels")
def test_native_matches_the_reference_on_a_large_input():
    """Many blocks in parallel tasks, a 16-bit index range and a partial last block."""
    x = torch.randn(3 * 65536 + 4097) * torch.logspace(-20, 20, 3 * 65536 + 4097)
    for block, k, bits in [(4096, 82, 2), (65536, 655, 4)]:
        r1, r2 = torch.randn_like(x), None
        r2 = r1.clone()
        a = topk.topk_encode(x, block=block, k=k, bits=bits, residual=r1, backend="native")
        b = topk.topk_encode(x, block=block, k=k, bits=bits, residual=r2, backend="torch")
        assert _same(a, b) and _same(r1, r2)


def test_the_target_byte_ratio_at_2_percent_and_2_bits():
    """Wire bytes per sync against codec none's all-reduce, from the formula: an all-gather of
    one encoding per rank, (F-1) E, against a ring all-reduce of fp32, 2 (F-1)/F 4 N."""
    from flcomm.collectives.compressed import compressed_wire_bytes

    c = get_codec("topk:d=0.02:bits=2")
    n = 64 * 4096
    for F in (2, 4):
        ratio = compressed_wire_bytes(n, F, c) / compressed_wire_bytes(n, F, "none")
        assert ratio == pytest.approx(F * topk_ref.nbytes(n, 4096, 82, 2) / (8 * n))
        assert ratio <= 0.03, (F, ratio)


# ---- the codec ----
def test_codec_names_and_options():
    c = get_codec("topk:d=0.02:bits=2")
    assert isinstance(c, TopKCodec) and (c.block, c.k, c.bits) == (4096, 82, 2) and c.sparse
    assert c.spec == "topk:d=0.02:bits=2" and get_codec(c.spec).k == 82
    c = get_codec("TopK:k=5:bits=4:block=256")
    assert (c.block, c.k, c.bits, c.spec) == (256, 5, 4, "topk:k=5:bits=4:block=256")
    assert get_codec(c.spec).k == 5
    assert get_codec("topk").spec == "topk:d=0.02:bits=2"
    assert get_codec("topk", d=0.01, bits=4).k == 41
    assert get_codec("int8:block_size=512").block_size == 512  # NOTE: options work for every codec
    assert c.align_numel == 256 and not get_codec("int8").sparse


@pytest.mark.parametrize("spec,match", [
    ("topk:d=0", "density d must be a number in"), ("topk:d=1.5", "density"), ("topk:bits=3", "bits must be one of"),
    ("topk:block=70000", "block"), ("topk:k=300:block=256", "k"), ("topk:d=0.1:k=4", "not both"),
    ("topk:d", "key=value"), ("topk:d=abc", "must be a number"), ("topk:depth=2", "bad options for codec 'topk'"),
    ("sparse:d=0.1", "unknown codec"),
])
def test_bad_codec_options_are_refused_naming_them(spec, match):
    with pytest.raises(ValueError, match=match):
        get_codec(spec)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_buffers_are_refused_before_any_work(backend):
    x = torch.randn(100)
    n = topk.encoded_nbytes(100, 64, 4, 2)
    with pytest.raises(ValueError, match=f"exactly {n} bytes"):
        topk.topk_encode(x, torch.empty(n + 1, dtype=torch.uint8), block=64, k=4, bits=2, backend=backend)
    with pytest.raises(ValueError, match="4-byte aligned"):
        topk.topk_encode(x, torch.empty(n + 1, dtype=torch.uint8)[1:], block=64, k=4, bits=2, backend=backend)
    with pytest.raises(TypeError, match="float32"):
        topk.topk_encode(x.double(), block=64, k=4, bits=2, backend=backend)
    with pytest.raises(ValueError, match="residual must have 100"):
        topk.topk_encode(x, block=64, k=4, bits=2, residual=torch.zeros(99), backend=backend)
    with pytest.raises(ValueError, match="accumulate=True needs"):
        topk.topk_decode(torch.zeros(n, dtype=torch.uint8), 100, block=64, k=4, bits=2, accumulate=True)


@pytest.mark.skipif(not NATIVE, reason="flcomm._C is not built with the sparse kernels")
def test_the_native_operator_checks_its_arguments_too():
    """Called directly (not through flcomm.ops.topk), the operator names what it expected."""
    from flcomm import _native

    x = torch.randn(100)
    out = torch.empty(topk.encoded_nbytes(100, 64, 4, 2), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="bits must be 2, 4 or 8, got 3"):
        _native.ops().topk_encode(x, None, out, 64, 4, 3)
    with pytest.raises(RuntimeError, match="must hold"):
        _native.ops().topk_encode(x, None, out, 64, 5, 2)
