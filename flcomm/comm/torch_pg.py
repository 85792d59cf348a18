"""Transport over a torch.distributed ProcessGroup: gloo on CPU, NCCL process groups on GPUs.

It is also the reference the native transport and every flcomm collective are tested against.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor

from flcomm.comm.base import DEFAULT_TIMEOUT, CommStats, LinkTier, ReduceOp, Transport

_TORCH_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVG: dist.ReduceOp.AVG, ReduceOp.MAX: dist.ReduceOp.MAX}

# NOTE: torch 2.13 deprecates the *_tensor names in favour of *_single; older torch has only
# the former. Use whichever exists, newest first.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchTransport(Transport):
    """A :class:`Transport` on ``group`` (None: the default group).

    AVG: NCCL reduces with AVG natively; on other backends (gloo) flcomm reduces with SUM and
    divides after completion, which is exact for the same summation order.
    """

    name = "torch"

    def __init__(self, group: dist.ProcessGroup | None = None, tier: LinkTier | str = LinkTier.INTRA_NODE,
                 stats: CommStats | None = None, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TorchTransport needs torch.distributed to be initialized "
                               "(dist.init_process_group) first")
        self.group = group if group is not None else dist.group.WORLD
        super().__init__(dist.get_rank(self.group), dist.get_world_size(self.group), LinkTier(tier),
                         stats, timeout)
        self.backend = str(dist.get_backend(self.group)).lower()
        self.ranks = dist.get_process_group_ranks(self.group)
        self._stream_wait = self.backend == "nccl"

    def _op(self, op: ReduceOp, out: Tensor) -> tuple[Any, Any]:
        """The torch op to issue, and the post-processing it needs."""
        if op is ReduceOp.AVG and self.backend != "nccl":
            n = self.size
            return dist.ReduceOp.SUM, (lambda: out.div_(n))
        return _TORCH_OPS[op], None

    def _all_reduce(self, tensor: Tensor, op: ReduceOp) -> Any:
        top, post = self._op(op, tensor)
        return dist.all_reduce(tensor, op=top, group=self.group, async_op=True), post

    def _reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp) -> Any:
        top, post = self._op(op, output)
        return _reduce_scatter(output, input, op=top, group=self.group, async_op=True), post

    def _all_gather(self, output: Tensor, input: Tensor) -> Any:
        return _all_gather(output, input, group=self.group, async_op=True)

    def _all_to_all(self, output: Tensor, input: Tensor) -> Any:
        return dist.all_to_all_single(output, input, group=self.group, async_op=True)

    def _broadcast(self, tensor: Tensor, src: int) -> Any:
        return dist.broadcast(tensor, src=self.ranks[src], group=self.group, async_op=True)

    @property
    def device(self):
        import torch

        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
