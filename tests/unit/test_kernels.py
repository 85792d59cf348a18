"""Native quantization kernels against flcomm's plain-torch kernels and against the formats
written from their definitions in float64 (tests/common/format_ref.py, which shares no code with
flcomm), bit for bit: every format x
block size x size (including sizes that are not a multiple of the block or the vector width) x
magnitude, for quantize, dequantize, dequantize-accumulate and the fused error feedback; the
AVX-512, the AVX2 and the scalar CPU path (FLCOMM_CPU_VEC=avx512 / avx2 / 0, read at every call)
each; the non-finite /
tiny-block rule of csrc/quant.h on every path; CUDA against CPU when a GPU is present."""

from __future__ import annotations

import zlib

import pytest
import torch

from flcomm.ops import quant
from tests.common import format_ref
from tests.common.markers import NO_AVX512

# NOTE: per test, not per module: the plain-torch path's tests run without the extension too
# (FLCOMM_NATIVE=0, CI's no-extension step)
needs_native = pytest.mark.skipif(not quant.native_supports("cpu"),
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


def stable_seed(*case: object) -> int:
    """A seed that is the same in every process (``hash`` of a str is salted per process; CRC-32
    is a fixed function of the bytes, so there is nothing of ours to test about it)."""
    return zlib.crc32(repr(case).encode())


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_avx2() -> bool:
    return {"avx2", "f16c"} <= cpu_flags()


def cpu_has_avx512() -> bool:
    return cpu_has_avx2() and {"avx512f", "avx512bw"} <= cpu_flags()


# FLCOMM_CPU_VEC of each native CPU path (csrc/quant.cpp use_vec: "0" scalar, "avx2" at most
# AVX2, unset: the best the CPU has).
VEC_ENV = {"scalar": "0", "avx2": "avx2", "avx512": "avx512"}
NATIVE_PATHS = [
    pytest.param("avx512", marks=[needs_native, pytest.mark.skipif(not cpu_has_avx512(), reason=NO_AVX512)]),
    pytest.param("avx2", marks=[needs_native, pytest.mark.skipif(not cpu_has_avx2(), reason="no AVX2+F16C")])]
# The CPU paths: the plain-torch reference, and the native kernels forced to AVX-512, AVX2 or scalar.
CPU_PATHS = ["torch", *NATIVE_PATHS, pytest.param("scalar", marks=needs_native)]


@pytest.fixture
def cpu_path(request, monkeypatch) -> str:
    """Selects a CPU path: returns the kernels backend; FLCOMM_CPU_VEC picks the native path."""
    if request.param != "torch":
        monkeypatch.setenv("FLCOMM_CPU_VEC", VEC_ENV[request.param])
    return "torch" if request.param == "torch" else "native"


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, with NaN equal to NaN (fp16 overflows to inf, and inf - inf residuals are NaN)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def check_definition(x, r, enc, dec, acc, enc_ef, res_ef, fmt: str, B: int) -> None:
    """The reference side of a case against the format's definition (tests/common/format_ref.py):
    encoding, decoding, decode-accumulate onto ``r``, error feedback of ``x`` with residual ``r``."""
    n, case = x.numel(), (fmt, B, x.numel())
    assert format_ref.same_encoding(enc, format_ref.encode(x, fmt, B), n, fmt), ("quantize vs definition", case)
    assert same(dec, format_ref.decode(enc, n, fmt, B)), ("dequantize vs definition", case)
    assert same(acc, format_ref.decode_accumulate(enc, n, r, fmt, B)), ("dequantize-accumulate vs definition", case)
    want_enc, want_res = format_ref.error_feedback(x, r, fmt, B)
    assert format_ref.same_encoding(enc_ef, want_enc, n, fmt), ("error feedback: encoding vs definition", case)
    assert same(res_ef, want_res), ("error feedback: residual vs definition", case)


def compare(device: str, backend_a: str = "native", backend_b: str = "torch", quick: bool = False) -> int:
    """Run every case on ``device`` with backend_a vs backend_b (on CPU), and backend_b against
    the format's definition; returns the number of cases checked, raises AssertionError naming
    the first that differs."""
    count = 0
    sizes = SIZES[:-1] if quick else SIZES
    for fmt in FORMATS:
        blocks = BLOCKS if fmt in quant.BLOCKED_FORMATS else [256]
        for B in blocks:
            for n in sizes:
                for mag in MAGS:
                    seed = stable_seed(fmt, B, n, mag)
                    x = _x(n, mag, seed)
                    r = _x(n, mag * 0.01, seed + 1)
                    case = (fmt, B, n, mag)
                    ref = quant.quantize(x, fmt=fmt, block_size=B, backend=backend_b)
                    got = quant.quantize(x.to(device), fmt=fmt, block_size=B, backend=backend_a).cpu()
                    assert torch.equal(got, ref), ("quantize", case, int((got != ref).sum()))
                    d_ref = quant.dequantize(ref, n, fmt=fmt, block_size=B, backend=backend_b)
                    d_got = quant.dequantize(ref.to(device), n, fmt=fmt, block_size=B, backend=backend_a).cpu()
                    assert same(d_got, d_ref), ("dequantize", case)
                    acc_ref = r.clone()
                    quant.dequantize(ref, n, acc_ref, fmt=fmt, block_size=B, accumulate=True, backend=backend_b)
                    acc_got = r.clone().to(device)  # NOTE: r.to('cpu') is r itself
                    quant.dequantize(ref.to(device), n, acc_got, fmt=fmt, block_size=B, accumulate=True,
                                       backend=backend_a)
                    assert same(acc_got.cpu(), acc_ref), ("dequantize-accumulate", case)
                    res_ref = r.clone()
                    e_ref = quant.quantize_error_feedback(x, res_ref, fmt=fmt, block_size=B, backend=backend_b)
                    res_got = r.clone().to(device)  # NOTE: r.to('cpu') is r itself
                    e_got = quant.quantize_error_feedback(x.to(device), res_got, fmt=fmt, block_size=B,
                                                            backend=backend_a)
                    assert torch.equal(e_got.cpu(), e_ref), ("error feedback: encoding", case)
                    assert same(res_got.cpu(), res_ref), ("error feedback: residual", case)
                    check_definition(x, r, ref, d_ref, acc_ref, e_ref, res_ref, fmt, B)
                    count += 1
    return count


@pytest.mark.parametrize("vec", NATIVE_PATHS)
def test_cpu_native_matches_reference_bit_for_bit(monkeypatch, vec):
    monkeypatch.setenv("FLCOMM_CPU_VEC", VEC_ENV[vec])
    assert compare("cpu") == 2 * len(BLOCKS) * len(SIZES) * len(MAGS) + 2 * len(SIZES) * len(MAGS)


def test_torch_path_matches_the_definition():
    """The plain-torch kernels (what runs without the extension) against the formats'
    definitions (tests/common/format_ref.py) over the grid of formats, blocks, sizes and
    magnitudes, the largest size left out."""
    count = 0
    for fmt in FORMATS:
        for B in BLOCKS if fmt in quant.BLOCKED_FORMATS else [256]:
            for n in SIZES[:-1]:
                for mag in MAGS:
                    seed = stable_seed(fmt, B, n, mag)
                    x, r = _x(n, mag, seed), _x(n, mag * 0.01, seed + 1)
                    enc = quant.quantize(x, fmt=fmt, block_size=B, backend="torch")
                    acc, res = r.clone(), r.clone()
                    quant.dequantize(enc, n, acc, fmt=fmt, block_size=B, accumulate=True, backend="torch")
                    e_ef = quant.quantize_error_feedback(x, res, fmt=fmt, block_size=B, backend="torch")
                    check_definition(x, r, enc, quant.dequantize(enc, n, fmt=fmt, block_size=B, backend="torch"),
                                     acc, e_ef, res, fmt, B)
                    count += 1
    assert count == (2 * len(BLOCKS) + 2) * (len(SIZES) - 1) * len(MAGS)


@needs_native
def test_cpu_scalar_path_matches_reference(monkeypatch):
    """The portable path (no vector code), forced in-process: FLCOMM_CPU_VEC is read at every call."""
    monkeypatch.setenv("FLCOMM_CPU_VEC", "0")
    assert compare("cpu", quick=True) > 0


@pytest.mark.parametrize("cpu_path", CPU_PATHS, indirect=True)
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_dequantize_every_byte_bit_for_bit(cpu_path, fmt):
    """Every payload byte (fp8: the NaN bytes 0x7f / 0xff and the subnormals too, which the
    vector code decodes arithmetically instead of by table) times normal, subnormal, zero and NaN
    scales, plain and accumulated; the bits against torch's own conversion (not the reference's
    ``same``, which takes any NaN for any other)."""
    B = 256
    scales = torch.tensor([1.0, 3.0e-3, 2.0 ** -140, 0.0, float("nan"), 7.5e30, -1.0])
    n = B * scales.numel() - 5  # a partial last block
    buf = torch.zeros(quant.encoded_nbytes(n, fmt, B), dtype=torch.uint8)
    payload, sc = quant.split_encoded(buf, n, fmt, B)
    payload.view(torch.uint8).copy_(torch.arange(n) % 256)
    sc.copy_(scales)
    codes = payload.view(torch.uint8)
    vals = codes.view(torch.int8).float() if fmt == "int8" else codes.view(torch.float8_e4m3fn).float()
    per_elem = scales.repeat_interleave(B)[:n]
    expect = vals * per_elem
    # NOTE: NaN byte times NaN scale: which NaN comes out depends on the operand order the
    # compiler picked (x86 returns the first operand's); any NaN is right there.
    either = vals.isnan() & per_elem.isnan()

    def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        diff = (got.view(torch.int32) != want.view(torch.int32)) & ~either
        assert not diff.any() and got[either].isnan().all(), (what, fmt, diff.nonzero()[:4].flatten().tolist())

    check(quant.dequantize(buf, n, fmt=fmt, block_size=B, backend=cpu_path), expect, "dequantize")
    acc = torch.linspace(-2, 2, n)
    want = acc + expect
    quant.dequantize(buf, n, acc, fmt=fmt, block_size=B, accumulate=True, backend=cpu_path)
    check(acc, want, "dequantize-accumulate")


@pytest.mark.parametrize("vec", NATIVE_PATHS)
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_dequantize_large_output_bit_for_bit(monkeypatch, vec, fmt):
    """Outputs of 32 MiB and more (csrc/quant.cpp kStreamBytes) are written with streaming
    stores: those, a partial last block and an output that misses their alignment, against the
    reference."""
    monkeypatch.setenv("FLCOMM_CPU_VEC", VEC_ENV[vec])
    B = 256
    n = (32 << 20) // 4 + 3 * B + 5
    x = _x(n, 1.0, stable_seed("large", fmt))
    enc = quant.quantize(x, fmt=fmt, block_size=B, backend="torch")
    want = quant.dequantize(enc, n, fmt=fmt, block_size=B, backend="torch")
    assert torch.equal(quant.dequantize(enc, n, fmt=fmt, block_size=B, backend="native"), want)
    base = torch.empty(n + 1)
    shifted = base[1:]  # 4 bytes past a 64-byte boundary: plain stores
    quant.dequantize(enc, n, shifted, fmt=fmt, block_size=B, backend="native")
    assert torch.equal(shifted, want)


@pytest.mark.parametrize("vec", NATIVE_PATHS)
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("ef", [False, True])
def test_quantize_large_input_bit_for_bit(monkeypatch, vec, fmt, ef):
    """Inputs of 32 MiB and more (csrc/quant.cpp kStreamBytes) write the payload with streaming
    stores: those, a NaN block, a partial last block and a buffer that misses their alignment
    (plain stores), payload, scales and residual against the reference."""
    monkeypatch.setenv("FLCOMM_CPU_VEC", VEC_ENV[vec])
    B = 256
    n = (32 << 20) // 4 + 3 * B + 5
    x = _x(n, 1.0, stable_seed("large-q", fmt, ef))
    x[7 * B + 3] = float("nan")
    r0 = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-3
    r_want = r0.clone()
    want = (quant.quantize_error_feedback(x, r_want, fmt=fmt, block_size=B, backend="torch") if ef
            else quant.quantize(x, fmt=fmt, block_size=B, backend="torch"))
    E = quant.encoded_nbytes(n, fmt, B)
    for shift in (0, 4):  # 0: a 64-byte aligned buffer (streaming stores); 4: plain stores
        base = torch.full((E + 64,), 0xAB, dtype=torch.uint8)
        buf = base[shift:shift + E]
        r = r0.clone()
        if ef:
            quant.quantize_error_feedback(x, r, buf, fmt=fmt, block_size=B, backend="native")
            assert torch.equal(r.view(torch.int32), r_want.view(torch.int32)), (fmt, shift)
        else:
            quant.quantize(x, buf, fmt=fmt, block_size=B, backend="native")
        assert torch.equal(buf, want), (fmt, shift, (buf != want).nonzero()[:4].flatten().tolist())


# ---- the non-finite / tiny-block rule (csrc/quant.h, flcomm/ops/quant.py docstring) ----

def rule_input(B: int) -> tuple[torch.Tensor, dict[str, list[int]]]:
    """Blocks of B elements: kind -> block indices. The last block is partial."""
    g = torch.Generator().manual_seed(stable_seed("rule", B))
    kinds = ["nan", "normal", "+inf", "-inf", "tiny", "zero", "nan+inf", "subnormal", "normal"]
    x = torch.randn(len(kinds) * B, generator=g)
    blocks: dict[str, list[int]] = {}
    for b, kind in enumerate(kinds):
        blk = x[b * B:(b + 1) * B]
        if kind == "nan":
            blk[B // 3] = float("nan")
        elif kind == "+inf":
            blk[B - 1] = float("inf")
        elif kind == "-inf":
            blk[0] = float("-inf")
        elif kind == "tiny":  # absmax 1e-38 (< 2^-64 and near FLT_MIN): qmax / absmax overflows
            blk.mul_(1e-38 / blk.abs().max())
            blk[1] = 0.0
        elif kind == "zero":
            blk.zero_()
            blk[2] = -0.0
        elif kind == "nan+inf":
            blk[3], blk[4] = float("inf"), float("nan")
        elif kind == "subnormal":  # every value subnormal
            blk.mul_(1e-40 / blk.abs().max())
        blocks.setdefault(kind, []).append(b)
    return x[: len(kinds) * B - B // 2], blocks  # a partial last block


@pytest.mark.parametrize("cpu_path", CPU_PATHS, indirect=True)
@pytest.mark.parametrize("B", [32, 40, 256])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_non_finite_and_tiny_blocks(cpu_path, fmt, B):
    x, kinds = rule_input(B)
    n = x.numel()
    enc = quant.quantize(x, fmt=fmt, block_size=B, backend=cpu_path)
    payload, scales = quant.split_encoded(enc, n, fmt, B)
    dec = quant.dequantize(enc, n, fmt=fmt, block_size=B, backend=cpu_path)
    bad = kinds["nan"] + kinds["+inf"] + kinds["-inf"] + kinds["nan+inf"]
    for b in range(scales.numel()):
        sl = slice(b * B, min(n, (b + 1) * B))
        if b in bad:  # rule 2
            assert scales[b].isnan(), (b, scales[b])
            assert (payload[sl].view(torch.uint8) == 0).all(), b
            assert dec[sl].isnan().all(), b
        else:
            assert torch.isfinite(dec[sl]).all(), b
    z = kinds["zero"][0]  # rule 4
    assert scales[z] == 0 and (dec[z * B:(z + 1) * B] == 0).all()
    qmax = quant.QMAX[fmt]
    for kind in ("tiny", "subnormal"):  # rule 3: encoded as if of normal size
        b = kinds[kind][0]
        blk = x[b * B:(b + 1) * B]
        # NOTE: * 2^100 is exact (subnormals included) and lands in the normal range
        big = quant.quantize(blk * 2.0 ** 100, fmt=fmt, block_size=B, backend="torch")
        p_big, _ = quant.split_encoded(big, B, fmt, B)
        assert torch.equal(payload[b * B:(b + 1) * B].view(torch.uint8), p_big.view(torch.uint8)), kind
        amax = blk.abs().max().double()
        assert scales[b] == (amax / qmax).float() and scales[b] > 0, kind  # kept subnormal, not 0
        err = (dec[b * B:(b + 1) * B].double() - blk.double()).abs().max().item()
        bound = amax.item() * (0.5 / qmax if fmt == "int8" else 2 ** -4) + qmax * 2.0 ** -149
        assert err <= bound, (kind, err, bound)
    # error feedback: residual = y - decoded, NaN on the non-finite blocks
    r = torch.zeros_like(x)
    y = x + r  # NOTE: -0.0 + 0.0 is +0.0, which fp8 encodes differently from -0.0
    enc_ef = quant.quantize_error_feedback(x, r, fmt=fmt, block_size=B, backend=cpu_path)
    assert torch.equal(enc_ef, quant.quantize(y, fmt=fmt, block_size=B, backend="torch"))
    dec_y = quant.dequantize(enc_ef, n, fmt=fmt, block_size=B, backend="torch")
    for b in range(scales.numel()):
        sl = slice(b * B, min(n, (b + 1) * B))
        assert (r[sl].isnan().all() if b in bad else torch.equal(r[sl], y[sl] - dec_y[sl])), b
    # and every path is the reference (the native ones; the torch path is the reference) and the
    # format's definition, bit for bit
    if cpu_path != "torch":
        assert torch.equal(enc, quant.quantize(x, fmt=fmt, block_size=B, backend="torch"))
    check_definition(x, torch.zeros_like(x), enc, dec, quant.dequantize(enc, n, torch.zeros_like(x), fmt=fmt,
                     block_size=B, accumulate=True, backend=cpu_path), enc_ef, r, fmt, B)


@pytest.mark.parametrize("cpu_path", CPU_PATHS, indirect=True)
@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_casts_keep_non_finite(cpu_path, fmt):
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e-38, 1e-45, 0.0, -0.0, 1.5] * 5)
    dec = quant.dequantize(quant.quantize(x, fmt=fmt, backend=cpu_path), x.numel(), fmt=fmt,
                             backend=cpu_path)
    expect = x.to(torch.bfloat16 if fmt == "bf16" else torch.float16).float()
    assert same(dec, expect) and dec[0].isnan() and dec[1] == float("inf") and dec[2] == float("-inf")
    assert same(dec, format_ref.round_trip(x, fmt, 256))


@needs_native
def test_misaligned_encoded_buffers_are_rejected():
    """Item 4: a uint8 view at an odd offset is refused with a clear error before launch (Python
    check and native check alike), an aligned offset works."""
    ops = torch.ops.flcomm
    x = torch.randn(100)
    for fmt, need in (("int8", 4), ("fp8", 4), ("bf16", 2), ("fp16", 2)):
        nbytes = quant.encoded_nbytes(100, fmt, 32)
        storage = torch.zeros(nbytes + 16, dtype=torch.uint8)
        for off in range(1, need):
            buf = storage[off: off + nbytes]
            with pytest.raises(ValueError, match=f"{need}-byte aligned address for {fmt}"):
                quant.quantize(x, buf, fmt=fmt, block_size=32)
            with pytest.raises(RuntimeError, match=f"{need}-byte aligned address for {fmt}"):
                ops.quantize(x, buf, fmt, 32)
            with pytest.raises(RuntimeError, match=f"{need}-byte aligned address for {fmt}"):
                ops.dequantize(buf, torch.empty(100), fmt, 32, False)
        buf = storage[need: need + nbytes]
        quant.quantize(x, buf, fmt=fmt, block_size=32, backend="native")
        assert torch.equal(buf, quant.quantize(x, fmt=fmt, block_size=32, backend="torch"))


@needs_native
def test_unaligned_and_sliced_inputs():
    """Views at odd offsets (the vector code must not assume 32-byte alignment)."""
    base = _x(5000, 1.0, 3)
    for off in (1, 3):
        x = base[off:off + 4001]
        for fmt in FORMATS:
            ref = quant.quantize(x.clone(), fmt=fmt, backend="torch")
            got = quant.quantize(x, fmt=fmt, backend="native")
            assert torch.equal(got, ref), (fmt, off)
            out = torch.empty(4100)[off: off + 4001]
            quant.dequantize(ref, 4001, out, fmt=fmt, backend="native")
            assert torch.equal(out, quant.dequantize(ref, 4001, fmt=fmt, backend="torch"))


@needs_native
def test_native_errors_are_clear():
    ops = torch.ops.flcomm
    x = torch.zeros(10)
    buf = torch.empty(quant.encoded_nbytes(10, "int8", 4), dtype=torch.uint8)
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
        quant.quantize(x, fmt="int8", backend="numpy")


@pytest.mark.gpu
def test_cuda_matches_cpu_bit_for_bit():
    assert compare("cuda", backend_a="native", backend_b="native") > 0


@pytest.mark.gpu
def test_cuda_runs_on_the_callers_stream_and_unaligned():
    x = _x(1 << 20, 1.0, 9).cuda()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        buf = quant.quantize(x, fmt="int8", backend="native")
        y = quant.dequantize(buf, x.numel(), fmt="int8", backend="native")
    s.synchronize()
    ref = quant.quantize(x.cpu(), fmt="int8", backend="native")
    assert torch.equal(buf.cpu(), ref)
    assert torch.equal(y.cpu(), quant.dequantize(ref, x.numel(), fmt="int8", backend="native"))
    for fmt in FORMATS:
        xs = x[1:40001]
        r = torch.zeros(40001, device="cuda")
        got = quant.quantize_error_feedback(xs, r, fmt=fmt, block_size=100, backend="native")
        r_ref = torch.zeros(40001)
        ref = quant.quantize_error_feedback(xs.cpu(), r_ref, fmt=fmt, block_size=100, backend="native")
        assert torch.equal(got.cpu(), ref) and torch.equal(r.cpu(), r_ref), fmt


@pytest.mark.gpu
@pytest.mark.parametrize("B", [32, 40, 256])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_non_finite_tiny_and_subnormal_match_cpu(fmt, B):
    """The rule of csrc/quant.h on the GPU: CUDA against the CPU kernels, bit for bit (encoding,
    decoding, error-feedback residual), on NaN / Inf / tiny / zero / subnormal blocks."""
    x, _ = rule_input(B)
    n = x.numel()
    for xs in (x, x[1:]):  # also unaligned (scalar CUDA path)
        n = xs.numel()
        ref = quant.quantize(xs, fmt=fmt, block_size=B, backend="native")
        got = quant.quantize(xs.cuda(), fmt=fmt, block_size=B, backend="native")
        assert torch.equal(got.cpu(), ref), ("quantize", fmt, B, n)
        d_ref = quant.dequantize(ref, n, fmt=fmt, block_size=B, backend="native")
        d_got = quant.dequantize(ref.cuda(), n, fmt=fmt, block_size=B, backend="native")
        assert same(d_got.cpu(), d_ref), ("dequantize", fmt, B, n)
        r_ref = torch.full((n,), 1e-39)
        r_got = r_ref.cuda()
        e_ref = quant.quantize_error_feedback(xs, r_ref, fmt=fmt, block_size=B, backend="native")
        e_got = quant.quantize_error_feedback(xs.cuda(), r_got, fmt=fmt, block_size=B, backend="native")
        assert torch.equal(e_got.cpu(), e_ref) and same(r_got.cpu(), r_ref), ("error feedback", fmt, B, n)
        # subnormal residuals survive (no flush to zero): the CPU keeps some, so must the GPU
        sub = (r_ref != 0) & (r_ref.abs() < torch.finfo(torch.float32).tiny)
        assert sub.any() == (r_got.cpu()[sub] != 0).any()


@pytest.mark.gpu
def test_cuda_misaligned_buffer_is_rejected_not_a_sticky_error():
    x = torch.randn(1000, device="cuda")
    nbytes = quant.encoded_nbytes(1000, "int8", 256)
    buf = torch.zeros(nbytes + 16, dtype=torch.uint8, device="cuda")[1: 1 + nbytes]
    with pytest.raises(RuntimeError, match="4-byte aligned address"):
        torch.ops.flcomm.quantize(x, buf, "int8", 256)
    torch.cuda.synchronize()  # the context is still healthy
    assert quant.quantize(x, fmt="int8", backend="native").is_cuda

