"""The NCCL unique id travels through the c10d store (not a collective) on 2 gloo ranks: both ranks
get the same id, a subgroup its own; without a GPU, NcclTransport.from_group says it needs one."""

from __future__ import annotations

import pytest
import torch

from flcomm import _native
from flcomm.comm.nccl import NcclTransport, exchange_unique_id
from tests.common.dist import run_distributed

pytestmark = pytest.mark.skipif(not _native.available(), reason=f"flcomm._C not built: {_native.unavailable_reason()}")


def with_nccl() -> bool:
    return bool(_native.native().compiled_with_nccl())


def has_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _exchange(rank: int, world: int) -> tuple[bytes, bytes, str]:
    import torch.distributed as dist

    def no_collective(*args, **kwargs):
        raise AssertionError("the unique id must travel through the c10d store, not a collective")

    dist.broadcast_object_list = dist.broadcast = no_collective  # NOTE: issue 9 item 11
    uid = exchange_unique_id()
    uid_sub = exchange_unique_id(dist.new_group([0, 1]))
    try:
        NcclTransport.from_group()
        err = "no error"
    except RuntimeError as e:
        err = str(e)
    return uid, uid_sub, err


@pytest.mark.timeout(120)
def test_exchange_unique_id_over_gloo():
    if not with_nccl():
        pytest.skip("built without NCCL: no unique ids to exchange")
    results = run_distributed(_exchange, 2, timeout=60)
    (a, a_sub, err0), (b, b_sub, err1) = results
    assert len(a) == 128 and a == b, "ranks got different unique ids"
    assert a_sub == b_sub and a_sub != a, "the subgroup must get its own id"
    if not has_gpu():
        for err in (err0, err1):
            assert "NcclTransport.from_group" in err and "CUDA device" in err, err
