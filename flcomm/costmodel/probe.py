"""Measures the link tiers of the job it runs in (``flcomm-costmodel --measure``): the only
part of the cost model that touches torch.distributed."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from flcomm.comm.base import DEFAULT_TIMEOUT, LinkTier, wire_bytes
from flcomm.costmodel.model import placement
from flcomm.federated.mesh import init_fed_mesh
from flcomm.federated.strategy import Strategy
from flcomm.validate import integer

__all__ = ["measure_main", "measure_tiers"]


def measure_tiers(ranks_per_node: int, group_size: int | None = None, nbytes: int = 4 << 20,
                  iters: int = 3, warmup: int = 1, latency_iters: int = 20,
                  timeout: timedelta = DEFAULT_TIMEOUT) -> dict[str, Any]:
    """Probe each tier's bandwidth and latency with all_reduce on the running job.

    Collective: every rank calls it after ``torch.distributed`` is initialized. Steps:
      1. build FedMesh for FSDP over all ranks (hierarchical groups: ``shard_intra`` = my
         node's ranks, ``shard_inter`` = my local position on every node) and, with more than
         one group of ``group_size`` (default: one node), FL+FSDP (``fed``);
      2. per tier, in turn (world barrier between): ``warmup`` + ``iters`` all_reduces of
         ``nbytes``, then ``latency_iters`` of 4 bytes, on every group of that tier at once;
      3. time = the slowest rank's (all_reduce MAX); bus bandwidth = wire bytes / time per
         call; for inter tiers times the ranks of a node crossing at once (per-node figure);
         latency = small-call time / ring steps.
    Returns ``{nodes, ranks_per_node, group_size, backend, intra_node, inter_node,
    inter_group}``, each tier
    ``{bandwidth_Bps, latency_s, ranks, per}`` or None when the job has no such tier.
    """
    if not dist.is_initialized():
        raise RuntimeError("measure_tiers needs torch.distributed initialized (run under torchrun or "
                           "bench/cluster/netns.py run)")
    P = dist.get_world_size()
    L = integer("ranks_per_node", ranks_per_node, 1)
    if P % L:
        raise ValueError(f"world size {P} is not a whole number of nodes of {L} ranks")
    integer("nbytes", nbytes, 1)
    G = group_size or L
    fsdp = init_fed_mesh(Strategy.FSDP.topology(P, L), "cpu", timeout=timeout, node_tiers=True)
    fl = (init_fed_mesh(Strategy.FL_FSDP.topology(P, L, G), "cpu", timeout=timeout, node_tiers=False)
          if P // G > 1 else None)
    world = dist.group.WORLD

    def timed(transport, numel: int, n_iter: int) -> float:
        x = torch.ones(numel, dtype=torch.float32)
        dist.barrier(group=world)
        t0 = time.perf_counter()
        for _ in range(n_iter):
            transport.all_reduce(x)
        dt = torch.tensor([(time.perf_counter() - t0) / n_iter], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=world)
        return float(dt.item())

    def probe(transport, per_node: int) -> dict[str, Any]:
        n = transport.size
        numel = max(1, nbytes // 4)
        timed(transport, numel, warmup)
        t = timed(transport, numel, iters)
        lat = timed(transport, 1, latency_iters)
        bus = wire_bytes("all_reduce", numel * 4, n) / t
        return {"bandwidth_Bps": bus * per_node, "latency_s": lat / (2 * (n - 1)), "ranks": n,
                "per": "rank" if transport.tier is LinkTier.INTRA_NODE else "node",
                "bus_Bps_per_rank": bus, "time_s": t, "nbytes": numel * 4}

    out: dict[str, Any] = {"nodes": P // L, "ranks_per_node": L, "group_size": G,
                           "backend": str(dist.get_backend()).lower(),
                           "intra_node": None, "inter_node": None, "inter_group": None}
    if L > 1:
        out["intra_node"] = probe(fsdp.transport("shard_intra"), 1)
    if P // L > 1:
        out["inter_node"] = probe(fsdp.transport("shard_inter"), L)
    if fl is not None:
        _, _, sharing = placement(P // G, G, L)  # sets of shard peers crossing one node at once
        out["inter_group"] = probe(fl.transport("fed"), sharing)
    return out


def measure_main(a: argparse.Namespace) -> int:
    """``--measure``: initialize the job's process group, probe, print (rank 0) and write JSON."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("error: --measure runs on every rank of a job: launch it with torchrun or "
              "`python -m bench.cluster.netns run` (RANK/WORLD_SIZE not set)", file=sys.stderr)
        return 2
    if a.ranks_per_node is None:
        a.ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    timeout = timedelta(seconds=a.measure_timeout)
    dist.init_process_group(a.backend, timeout=timeout)
    try:
        res = measure_tiers(a.ranks_per_node, a.group_size, int(a.measure_mb * (1 << 20)), a.measure_iters,
                            timeout=timeout)
        if dist.get_rank() == 0:
            text = json.dumps(res, indent=2)
            if a.measure_json:
                with open(a.measure_json, "w") as f:
                    f.write(text)
            print(text)
    finally:
        dist.destroy_process_group()
    return 0

