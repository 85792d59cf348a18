"""Transport over a torch.distributed ProcessGroup: gloo on CPU, NCCL process groups on GPUs.

It is also the reference the native transport and every flcomm collective are tested against.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from flcomm.comm.base import DEFAULT_TIMEOUT, EXCHANGE_MAX_CTAS, CommStats, LinkTier, ReduceOp, Transport
from flcomm.comm.nccl import check_no_open_group
from flcomm.validate import integer

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

    def _run(self, collective: str, nbytes: int, issue: Any, result: Tensor, async_op: bool) -> Any:
        if self._stream_wait:  # NOTE: NCCL: it would join an open flcomm group (flcomm.comm.nccl)
            check_no_open_group(f"{type(self).__name__}.{collective} on torch's NCCL process group")
        return super()._run(collective, nbytes, issue, result, async_op)

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


_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_CLEANUP_ONLY = "2"  # abort the communicator on error or timeout; keep the process
_ENV_LOCK = threading.Lock()


NONBLOCKING_TIMEOUT_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"


def bound_nonblocking_init(timeout: timedelta) -> None:
    """Make torch bound a non-blocking NCCL communicator's init by ``timeout`` (N8).

    ProcessGroupNCCL waits for a non-blocking init up to ``TORCH_NCCL_NONBLOCKING_TIMEOUT``
    seconds (default 1800), which it reads once per process, at the first such group, whatever
    the group's own timeout says. Unset, it is set here to ``timeout`` (whole seconds, at least 1);
    set by the user, it is kept, with a warning when it is longer than ``timeout``."""
    import math
    import warnings

    secs = max(1, math.ceil(timeout.total_seconds()))
    raw = os.environ.get(NONBLOCKING_TIMEOUT_ENV)
    if raw is None or not raw.strip():
        os.environ[NONBLOCKING_TIMEOUT_ENV] = str(secs)
        return
    try:
        have = float(raw)
    except ValueError:
        raise ValueError(f"{NONBLOCKING_TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if have > secs:
        warnings.warn(f"{NONBLOCKING_TIMEOUT_ENV}={raw} bounds torch's NCCL communicator init, longer than the "
                      f"groups' timeout of {secs} s: a peer that never joins holds the init that long", stacklevel=3)


def nccl_options(timeout: timedelta, *, max_ctas: int | None = None,
                 nonblocking: bool = False) -> dist.ProcessGroupNCCL.Options:
    """``ProcessGroupNCCL.Options`` with ``timeout``; ``max_ctas`` caps the CTAs (SMs) each of
    the group's collectives may hold; ``nonblocking`` makes the communicator's initialization
    non-blocking, so torch bounds it by ``timeout`` (a blocking init waits forever for a peer
    that is gone). A field the installed torch does not expose is refused, naming it."""
    if max_ctas is not None:
        integer("max_ctas", max_ctas, 1, also=" or None")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    want = {"max_ctas": max_ctas, "blocking": 0 if nonblocking else None}
    for name, value in want.items():
        if value is None:
            continue
        if not hasattr(opts, "config") or not hasattr(opts.config, name):
            raise RuntimeError(f"torch {torch.__version__} does not expose ProcessGroupNCCL's config.{name}; "
                               f"flcomm needs it for the exchange's groups (supported torch: 2.11-2.14)")
        setattr(opts.config, name, value)
    return opts


def store_group(store: dist.Store, prefix: str, rank: int, size: int, backend: str,
                timeout: timedelta, *, max_ctas: int | None = EXCHANGE_MAX_CTAS) -> dist.ProcessGroup:
    """A process group of ``size`` ranks made from ``store`` under ``prefix``, outside
    torch.distributed's registry: only its members take part in creating it (no world-wide
    ``new_group``), and it can be dropped and replaced (elastic federation). ``rank`` is the
    caller's rank inside the group; every collective carries ``timeout``.

    On NCCL the group survives its peers: its communicator is initialized without blocking
    (bounded by ``timeout``), and an error or a timeout aborts the communicator (ending its
    kernels) and fails the work instead of killing the process, as torch's default error
    handling would. The caller finds out from the failed work, then drops the group with
    :func:`abort_group`. ``max_ctas`` caps the SMs its collectives hold (:func:`nccl_options`).
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    ps = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(ps, rank, size, timeout)
    opts = nccl_options(timeout, max_ctas=max_ctas, nonblocking=True)
    bound_nonblocking_init(timeout)  # NOTE: torch's bound of a non-blocking init is this, not opts._timeout
    # NOTE: ProcessGroupNCCL reads its error-handling mode from the environment in its
    # constructor only, so it is set around the construction, under a lock
    with _ENV_LOCK:
        before = os.environ.get(_ERROR_HANDLING)
        os.environ[_ERROR_HANDLING] = _CLEANUP_ONLY
        try:
            return dist.ProcessGroupNCCL(ps, rank, size, opts)
        finally:
            if before is None:
                del os.environ[_ERROR_HANDLING]
            else:
                os.environ[_ERROR_HANDLING] = before


def abort_group(group: Any) -> bool:
    """Abort ``group`` (a process group from :func:`store_group` that is being replaced): on NCCL
    this ends its collectives still queued or hung on a dead peer, so nothing keeps spinning on
    the GPU and the work waiting on them fails. True if the backend could abort."""
    abort = getattr(group, "abort", None)
    if abort is None:
        return False
    abort()
    return True


class ProcessGroupTransport(TorchTransport):
    """A :class:`Transport` on a process group from :func:`store_group` (not in torch's
    registry, so it issues on the group object itself). ``ranks`` are its members' global
    ranks, in group-rank order."""

    def __init__(self, group: dist.ProcessGroup, ranks: list[int], backend: str,
                 tier: LinkTier | str = LinkTier.INTER_GROUP, stats: CommStats | None = None,
                 timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        if group.size() != len(ranks):
            raise ValueError(f"the group has {group.size()} ranks, but {len(ranks)} global ranks were given")
        Transport.__init__(self, group.rank(), group.size(), LinkTier(tier), stats, timeout)
        self.group, self.ranks, self.backend = group, list(ranks), backend
        self._stream_wait = backend == "nccl"

    def _all_reduce(self, tensor: Tensor, op: ReduceOp) -> Any:
        top, post = self._op(op, tensor)
        opts = dist.AllreduceOptions()
        opts.reduceOp = top
        return self.group.allreduce([tensor], opts), post

    def _reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp) -> Any:
        top, post = self._op(op, output)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = top
        return self.group._reduce_scatter_base(output, input, opts), post

    def _all_gather(self, output: Tensor, input: Tensor) -> Any:
        return self.group._allgather_base(output, input)

    def _all_to_all(self, output: Tensor, input: Tensor) -> Any:
        return self.group.alltoall_base(output, input, [], [], dist.AllToAllOptions())

    def _broadcast(self, tensor: Tensor, src: int) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        return self.group.broadcast([tensor], opts)
