"""The native shard reorder of the hierarchical collectives against a plain-torch reference (CPU;
CUDA where a GPU is visible); bad input is refused with the numbers named."""

from __future__ import annotations

import pytest
import torch

from flcomm import _native
from flcomm.collectives.hierarchical import shard_transpose, shard_transpose_reference

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]
SHAPES = [(1, 1, 5), (2, 2, 1), (2, 2, 7), (2, 4, 3), (4, 2, 1000), (3, 5, 17), (8, 8, 64), (2, 3, 100_003)]

needs_native = pytest.mark.skipif(not _native.available() or not hasattr(_native.ops(), "shard_transpose_out"),
                                  reason=f"flcomm._C without shard_transpose: {_native.unavailable_reason()}")


def _data(numel: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(numel)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype).to(device)
    return torch.randint(0, 100, (numel,), generator=g).to(dtype).to(device)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_shard_transpose_cpu_matches_reference(dtype):
    ops = _native.ops()
    for rows, cols, chunk in SHAPES:
        x = _data(rows * cols * chunk, dtype)
        ref = shard_transpose_reference(x, rows, cols)
        out = torch.empty_like(x)
        assert ops.shard_transpose_out(x, rows, cols, out).data_ptr() == out.data_ptr()
        assert torch.equal(out, ref), (rows, cols, chunk)
        assert torch.equal(ops.shard_transpose(x, rows, cols), ref)
        # its own inverse with rows and cols swapped
        assert torch.equal(shard_transpose(shard_transpose(x, rows, cols), cols, rows), x)


@needs_native
def test_shard_transpose_refuses_bad_input():
    ops = _native.ops()
    x = torch.arange(12, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="does not split into rows\\*cols = 5\\*1 = 5"):
        ops.shard_transpose_out(x, 5, 1, torch.empty_like(x))
    with pytest.raises(RuntimeError, match="dtype of input"):
        ops.shard_transpose_out(x, 2, 2, torch.empty(12, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="as many elements as input \\(12\\), got 8"):
        ops.shard_transpose_out(x, 2, 2, torch.empty(8))
    with pytest.raises(RuntimeError, match="must not overlap"):
        ops.shard_transpose_out(x, 2, 2, x)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        ops.shard_transpose_out(torch.arange(24.0)[::2], 2, 2, torch.empty(12))
    with pytest.raises(RuntimeError, match="rows and cols must be >= 1"):
        ops.shard_transpose_out(x, 0, 2, torch.empty_like(x))
    with pytest.raises(ValueError, match="does not split into rows\\*cols = 5\\*1 = 5"):
        shard_transpose(x, 5, 1)


@needs_native
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_shard_transpose_cuda_matches_reference(dtype):
    ops = _native.ops()
    for rows, cols, chunk in SHAPES:
        x = _data(rows * cols * chunk, dtype, "cuda")
        ref = shard_transpose_reference(x, rows, cols)
        assert torch.equal(ops.shard_transpose(x, rows, cols), ref), (rows, cols, chunk)
        # unaligned base address: the narrow-vector path
        xu = _data(rows * cols * chunk + 1, dtype, "cuda")[1:]
        out = torch.empty(xu.numel() + 1, dtype=dtype, device="cuda")[1:]
        ops.shard_transpose_out(xu, rows, cols, out)
        assert torch.equal(out, shard_transpose_reference(xu, rows, cols))
