"""The replica check's hash (flcomm/federated/verify.py :func:`tensor_hash`) against a pure-Python
implementation of its documented formula (integers modulo 2**64), across chunks and dtypes; it
changes with one ulp or a swap of two elements; on CUDA it equals the CPU's."""

from __future__ import annotations

import pytest
import torch

import flcomm.federated.verify as verify

M = 1 << 64


def _mix(z: int) -> int:
    z %= M
    z = ((z ^ (z >> 30)) * verify.MIX1) % M
    z = ((z ^ (z >> 27)) * verify.MIX2) % M
    return z ^ (z >> 31)


def _reference(t: torch.Tensor, chunk: int) -> int:
    """The hash as its docstring states it, with Python ints: element bits as signed integers of
    their width, each mixed with its position, summed modulo 2**64, mixed with the length."""
    width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    bits = t.reshape(-1).view(width).tolist()
    acc = 0
    for i, x in enumerate(bits):
        off, j = (i // chunk) * chunk, i % chunk
        acc = (acc + _mix(x + (_mix(j * verify.GOLDEN) ^ off))) % M
    out = _mix(acc ^ len(bits))
    return out - M if out >= M // 2 else out  # NOTE: as int64


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(verify, "CHUNK", 16)
    monkeypatch.setattr(verify, "_POS", {})
    return 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 100])
def test_hash_is_the_documented_formula(small_chunks, dtype, n):
    t = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    assert int(verify.tensor_hash(t)) == _reference(t, small_chunks)


def test_hash_sees_one_ulp_and_a_swap_not_the_shape():
    t = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    h = int(verify.tensor_hash(t))
    assert int(verify.tensor_hash(t.clone())) == h
    assert int(verify.tensor_hash(t.view(30, 100).t())) != h  # NOTE: another element order
    assert int(verify.tensor_hash(t.view(30, 100))) == h  # the same bytes in the same order
    u = t.clone()
    u[1234] = torch.nextafter(u[1234], torch.tensor(float("inf")))
    assert int(verify.tensor_hash(u)) != h
    v = t.clone()
    v[[7, 8]] = v[[8, 7]]
    assert int(verify.tensor_hash(v)) != h


@pytest.mark.gpu
def test_hash_on_cuda_equals_the_cpu_hash():
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        t = torch.randn(verify.CHUNK + 12345, generator=torch.Generator().manual_seed(1)).to(dtype)
        assert int(verify.tensor_hash(t.cuda())) == int(verify.tensor_hash(t)), dtype
