"""The CUDA sparse top-k kernels (csrc/sparse_cuda.cu) against the CPU kernel (csrc/sparse.cpp)
and the plain-torch reference (flcomm/ops/topk.py, run on the CPU), bit for bit: every byte of the
encoding (written into a buffer of garbage), the error-feedback residual and the decoded and
accumulated outputs, compared as int32 so NaN bits count too (skipped without a GPU; see
tests/conftest.py).

Blocks 4096, 1000 and 256 (radix select on a block held in shared memory), 12000 and 65536 (the
block re-read from global memory), block 1 with more blocks than the grid (grid-stride); k = 1,
2% of the block and the whole block; 2, 4 and 8 bits; sizes with a partial last block, a single
partial block and n = 0; with and without a residual; unaligned x (the scalar load path). The
inputs hold the special blocks of sparse.h's rule: all zeros, all -0.0, ties of equal
magnitudes, NaN and +-Inf, subnormals, 2^-130-sized values.

NOTE: the inputs of the three-way tests only hold torch's default NaN (0x7fc00000): when both
operands of an add or a subtraction are NaNs with other bits, which one the result keeps is the
compiled code's operand order (torch's CPU add and sub keep the second, as csrc/sparse_cuda.cu
does; the CPU kernel's scalar `y - decoded` keeps y's). test_cuda_nan_bits_are_the_references
checks those against the reference only.
"""

from __future__ import annotations

import pytest
import torch

from flcomm.ops import quant, topk

pytestmark = pytest.mark.skipif(not quant.native_supports("cpu", topk.OPS),
                                reason="flcomm._C without the sparse top-k kernels (build with tools/dev_build.sh)")

BLOCKS = [4096, 1000, 256]
BITS = [2, 4, 8]
NAN = 0x7FC00000


def ks(block: int) -> list[int]:
    return sorted({1, max(1, block * 2 // 100), block})


def sizes(block: int) -> list[int]:
    """A partial last block, whole blocks only, one partial block, one element."""
    return [6 * block + block // 3, 6 * block, block // 2 + 1, 1]


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(bits_of(a.cpu()), bits_of(b.cpu()))


def special_input(n: int, block: int, seed: int) -> torch.Tensor:
    """Normal values, then (as far as n reaches) blocks of: zeros, -0.0, ties, NaN / +-Inf among
    ties, subnormals, 2^-130-sized values mixed with zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if n >= 40:
        x[3], x[4] = -0.0, 0.0
        x[10:20] = 2.0 ** -130 * torch.randn(10, generator=g)
        x[21:30] = 1.5  # ties among the largest of a small block
    specials = [
        lambda m: torch.zeros(m),
        lambda m: torch.full((m,), -0.0),
        lambda m: torch.randint(-3, 4, (m,), generator=g).float(),
        lambda m: torch.randint(-3, 4, (m,), generator=g).float(),
        lambda m: 2.0 ** -140 * torch.randn(m, generator=g),
        lambda m: 2.0 ** -130 * torch.randn(m, generator=g) * (torch.rand(m, generator=g) < 0.5),
    ]
    for j, make in enumerate(specials, start=1):
        lo, hi = j * block, min(n, (j + 1) * block)
        if lo >= n:
            break
        x[lo:hi] = make(hi - lo)
    if n > 4 * block:  # NaN / +-Inf among the ties of block 4 (0x7fc00000: torch's NaN)
        x[4 * block + 1], x[4 * block + 2], x[4 * block + 5] = float("nan"), float("inf"), float("-inf")
    if n > 3 * block + 7:  # a lone +Inf in block 3
        x[3 * block + 7] = float("inf")
    return x


def residual_input(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(n, generator=g) * 0.01
    r[::5] = 2.0 ** -140  # subnormal residuals
    r[::11] = -0.0
    return r


def encode3(x: torch.Tensor, block: int, k: int, bits: int, r: torch.Tensor | None):
    """(buffer, residual) of CUDA (into garbage), of the CPU kernel and of the reference."""
    out = []
    for dev, backend in (("cuda", "native"), ("cpu", "native"), ("cpu", "torch")):
        nbytes = topk.encoded_nbytes(x.numel(), block, k, bits)
        buf = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device=dev)
        res = r.clone().to(dev) if r is not None else None
        topk.topk_encode(x.to(dev), buf, block=block, k=k, bits=bits, residual=res, backend=backend)
        out.append((buf.cpu(), res.cpu() if res is not None else None))
    return out


def check_case(x: torch.Tensor, block: int, k: int, bits: int, r: torch.Tensor | None) -> None:
    n = x.numel()
    case = (n, block, k, bits, r is not None)
    (g_buf, g_res), (c_buf, c_res), (t_buf, t_res) = encode3(x, block, k, bits, r)
    assert torch.equal(c_buf, t_buf), ("CPU kernel vs reference", *case)
    assert torch.equal(g_buf, c_buf), ("CUDA vs CPU encoding", *case, (g_buf != c_buf).nonzero()[:8].flatten())
    if r is not None:
        assert same(c_res, t_res), ("CPU kernel vs reference residual", *case)
        assert same(g_res, c_res), ("CUDA vs CPU residual", *case)
    g = torch.Generator().manual_seed(n + k)
    base = torch.randn(n, generator=g)
    base[::7] = -0.0
    base.view(torch.int32)[::13] = NAN
    for acc in (False, True):
        got = topk.topk_decode(g_buf.cuda(), n, base.cuda() if acc else torch.full((n,), 7.0, device="cuda"),
                                 block=block, k=k, bits=bits, accumulate=acc, backend="native")
        cpu = topk.topk_decode(c_buf, n, base.clone() if acc else None, block=block, k=k, bits=bits,
                                 accumulate=acc, backend="native")
        ref = topk.topk_decode(c_buf, n, base.clone() if acc else None, block=block, k=k, bits=bits,
                                 accumulate=acc, backend="torch")
        assert same(cpu, ref), ("CPU kernel vs reference decode", *case, acc)
        assert same(got, cpu), ("CUDA vs CPU decode", *case, acc)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", BLOCKS)
def test_cuda_matches_cpu_and_reference(block, bits):
    assert quant.native_supports("cuda", topk.OPS), "flcomm._C without the CUDA sparse top-k kernels"
    for n in sizes(block):
        x = special_input(n + 1, block, n + block)
        for k in ks(block):
            for with_residual in (False, True):
                r = residual_input(n, n + k) if with_residual else None
                check_case(x[:n], block, k, bits, r)
                if k == ks(block)[1]:
                    check_case(x[1:], block, k, bits, r)  # x 4 bytes off a 16-byte boundary


@pytest.mark.gpu
@pytest.mark.parametrize(("block", "k"), [(12000, 1), (12000, 240), (65536, 1311), (65536, 65536)])
def test_cuda_large_blocks_match_cpu(block, k):
    """Blocks too large for shared memory (read again from global memory in every pass)."""
    n = 2 * block + 1000
    x = special_input(n, block, block + k)
    for bits in (2, 8):
        check_case(x, block, k, bits, None)
    check_case(x, block, k, 4, residual_input(n, k))


@pytest.mark.gpu
def test_cuda_more_blocks_than_the_grid():
    """block = k = 1: 1.1M blocks, more than the launch grid (grid-stride loop)."""
    n = 1_100_000
    x = special_input(n, 1, 3)
    check_case(x, 1, 1, 4, residual_input(n, 4))


@pytest.mark.gpu
def test_cuda_empty():
    for r in (None, torch.zeros(0, device="cuda")):
        buf = topk.topk_encode(torch.zeros(0, device="cuda"), block=256, k=5, bits=4, residual=r, backend="native")
        assert buf.numel() == 0 and buf.is_cuda
    out = topk.topk_decode(buf, 0, block=256, k=5, bits=4, backend="native")
    assert out.numel() == 0
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_nan_bits_are_the_references():
    """NaNs other than torch's own: -NaN, payloads, a signaling NaN, NaN in both x and the
    residual, Inf + -Inf (x86's default NaN 0xffc00000), accumulated onto NaN outputs: CUDA gives
    the reference's bits (torch's CPU add / sub keep the second NaN operand)."""
    block, k, bits = 256, 6, 4
    n = 3 * block
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    r = torch.randn(n, generator=torch.Generator().manual_seed(6)) * 0.1
    xi, ri = x.view(torch.int32), r.view(torch.int32)
    xi[3], xi[4], xi[5] = -0x400000, 0x7FC12345, 0x7F800001  # -NaN (0xffc00000), payload, signaling
    xi[6], ri[6] = -0x400000, 0x7FC54321  # both NaN
    x[7], r[7] = float("inf"), float("-inf")  # invalid: NaN made by the addition
    xi[block + 9] = -0x3EDCBB  # 0xffc12345 in a block of its own, without a residual NaN
    for res in (None, r):
        (g_buf, g_res), _, (t_buf, t_res) = encode3(x, block, k, bits, res)
        assert torch.equal(g_buf, t_buf), ("encoding", res is not None)
        if res is not None:
            assert same(g_res, t_res), [hex(v & 0xFFFFFFFF) for v in bits_of(g_res)[:10].tolist()]
    base = torch.randn(n)
    base.view(torch.int32)[::3] = -0x3EDCBB  # accumulate onto 0xffc12345
    got = topk.topk_decode(t_buf.cuda(), n, base.cuda(), block=block, k=k, bits=bits, accumulate=True,
                             backend="native")
    ref = topk.topk_decode(t_buf, n, base.clone(), block=block, k=k, bits=bits, accumulate=True, backend="torch")
    assert same(got, ref)


@pytest.mark.gpu
def test_cuda_runs_on_the_callers_stream():
    x = special_input(5 * 4096 + 17, 4096, 11).cuda()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        buf = topk.topk_encode(x, block=4096, k=82, bits=4, backend="native")
        y = topk.topk_decode(buf, x.numel(), block=4096, k=82, bits=4, backend="native")
    s.synchronize()
    ref = topk.topk_encode(x.cpu(), block=4096, k=82, bits=4, backend="native")
    assert torch.equal(buf.cpu(), ref)
    assert same(y, topk.topk_decode(ref, x.numel(), block=4096, k=82, bits=4, backend="native"))


@pytest.mark.gpu
def test_cuda_misaligned_buffer_is_rejected_before_launch():
    n, block, k, bits = 1000, 256, 5, 4
    x = torch.randn(n, device="cuda")
    nbytes = topk.encoded_nbytes(n, block, k, bits)
    buf = torch.zeros(nbytes + 16, dtype=torch.uint8, device="cuda")[1: 1 + nbytes]
    with pytest.raises(ValueError, match="4-byte aligned address"):
        topk.topk_encode(x, buf, block=block, k=k, bits=bits, backend="native")
    with pytest.raises(ValueError, match="4-byte aligned address"):
        topk.topk_decode(buf, n, block=block, k=k, bits=bits, backend="native")
    # the operators themselves, under the Python checks
    with pytest.raises(RuntimeError, match="4-byte aligned address"):
        torch.ops.flcomm.topk_encode(x, None, buf, block, k, bits)
    with pytest.raises(RuntimeError, match="4-byte aligned address"):
        torch.ops.flcomm.topk_decode(buf, torch.empty(n, device="cuda"), block, k, bits, False)
    torch.cuda.synchronize()  # the context is still healthy
    assert torch.equal(buf, torch.zeros_like(buf)), "a misaligned buffer was written"
    assert topk.topk_encode(x, block=block, k=k, bits=bits, backend="native").is_cuda
