"""The ring byte formulas (wire_bytes), ReduceOp parsing, and TorchTransport's refusal without a
process group."""

import pytest

from flcomm.comm.base import ReduceOp, wire_bytes


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_wire_bytes_formulas(n):
    B = 1 << 20
    assert wire_bytes("all_reduce", B, n) == 2 * (n - 1) * B // n
    assert wire_bytes("reduce_scatter", B, n) == (n - 1) * B // n
    assert wire_bytes("all_gather", B, n) == (n - 1) * B // n
    assert wire_bytes("broadcast", B, n) == (B if n > 1 else 0)
    with pytest.raises(ValueError, match="got 'gather'"):
        wire_bytes("gather", B, n)


def test_reduce_op_parse():
    import torch.distributed as dist

    assert ReduceOp.parse("AVG") is ReduceOp.AVG
    assert ReduceOp.parse(dist.ReduceOp.SUM) is ReduceOp.SUM
    assert ReduceOp.parse(dist.ReduceOp.AVG) is ReduceOp.AVG
    with pytest.raises(ValueError, match="got 'min'"):
        ReduceOp.parse("min")


def test_transport_needs_init():
    from flcomm.comm.torch_pg import TorchTransport

    with pytest.raises(RuntimeError, match="init_process_group"):
        TorchTransport()
