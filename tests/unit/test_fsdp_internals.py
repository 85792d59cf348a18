"""What flcomm.fsdp relies on without a process group: the replicate all-reduce hook refuses error
feedback without a lossy codec, and the private FSDP2 and c10d names flcomm reaches into still
exist (the ones that need a process group are in tests/dist/test_fsdp_hooks.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("codec", ["int8"])
def test_hook_refuses_error_feedback_without_codec(codec):
    from flcomm.comm.base import CommStats, LinkTier, Transport
    from flcomm.fsdp.fsdp2 import ReplicateAllReduceHook

    class _Local(Transport):  # a one-rank transport; nothing is sent
        def __init__(self):
            super().__init__(0, 1, LinkTier.INTER_NODE, CommStats())

        def _all_reduce(self, t, op): return None
        def _reduce_scatter(self, o, i, op): return None
        def _all_gather(self, o, i): return None
        def _all_to_all(self, o, i): return None
        def _broadcast(self, t, s): return None

    with pytest.raises(ValueError, match="error_feedback needs a lossy codec"):
        ReplicateAllReduceHook(_Local(), codec=None, error_feedback=True)
    with pytest.raises(TypeError, match="must be a flcomm Transport"):
        ReplicateAllReduceHook(object())


# ---------------------------------------------------------------- FSDP internals flcomm relies on
# NOTE: flcomm.fsdp.fsdp2 reaches into these private FSDP2 names. Checked on torch 2.11.0 and
# 2.14.1 (the ends of the supported range; CI runs both). A failure here on a new torch names
# what moved, instead of a confusing error deep in a training run.

def test_fsdp2_internals_flcomm_relies_on():
    import torch.distributed.fsdp as fsdp
    from torch.distributed.fsdp._fully_shard import _fsdp_api

    # the custom-collective contracts subclassed by HierarchicalReduceScatter / AllGather
    assert isinstance(_fsdp_api.ReduceScatter, type) and isinstance(_fsdp_api.AllGather, type)
    for cls, methods in ((_fsdp_api.ReduceScatter, ("__call__", "allocate")),
                         (_fsdp_api.AllGather, ("__call__", "allocate"))):
        for m in methods:
            assert hasattr(cls, m), f"{cls.__name__}.{m} is gone in torch {torch.__version__}"
    # FSDPModule's public setters and its state accessor
    for m in ("set_custom_reduce_scatter", "set_custom_all_gather", "set_all_reduce_hook", "_get_fsdp_state"):
        assert hasattr(fsdp.FSDPModule, m), f"FSDPModule.{m} is gone in torch {torch.__version__}"


def test_c10d_internals_flcomm_relies_on():
    """flcomm.comm.nccl shares the NCCL unique id through c10d's default store and names the
    group by ProcessGroup.group_name; it reads ProcessGroup.bound_device_id for the device."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    assert callable(distributed_c10d._get_default_store)
    for attr in ("group_name", "bound_device_id"):
        assert hasattr(dist.ProcessGroup, attr), f"ProcessGroup.{attr} is gone in torch {torch.__version__}"
