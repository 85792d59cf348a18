"""Run a function on N spawned processes with torch.distributed (gloo by default).

Every distributed test uses :func:`run_distributed`: it hosts the rendezvous store, spawns the
ranks, gives each a process group with a timeout, collects each rank's return value, re-raises the first rank's
exception with its traceback, and kills everything that outlives ``timeout`` so a hang fails
the test instead of blocking CI.
"""

from __future__ import annotations

import os
import pickle
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp


STORE = None  # the job's store, in a rank (tests of the elastic federation use it directly)


def _worker(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, q, timeout_s: float,
            group_worlds: int | None = None) -> None:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # NOTE: two cores shared by up to 8 ranks: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timedelta(seconds=timeout_s))
        global STORE
        STORE = store
        if group_worlds:  # NOTE: each federation group (contiguous ranks) its own world
            G = group_worlds
            dist.init_process_group(backend, rank=rank % G, world_size=G, timeout=timedelta(seconds=timeout_s),
                                    store=dist.PrefixStore(f"flcomm/group{rank // G}/", store))
        else:
            dist.init_process_group(backend, rank=rank, world_size=world, store=store,
                                    timeout=timedelta(seconds=timeout_s))
        result = fn(rank, world, *args)
        q.put((rank, "ok", pickle.dumps(result)))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        q.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    backend: str = "gloo", group_worlds: int | None = None,
                    may_die: frozenset[int] = frozenset()) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the results in
    rank order. ``fn`` must be importable (module level) and its result picklable.

    ``group_worlds=G``: every block of G ranks is its own torch.distributed world (rank r is
    rank r % G there); :data:`STORE` is the job's store. ``may_die``: ranks that may end
    without a result (their result is None)."""
    from flcomm.train.launch import bound_store

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    # NOTE: the parent hosts the store on a port the kernel picked (no race for a free port)
    store = bound_store("127.0.0.1", world_size + 1, timedelta(seconds=timeout + 60))
    port = store.port
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, q, timeout, group_worlds),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    import time

    deadline = time.monotonic() + timeout + 30  # + start-up (imports) of the ranks
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        gone: set[int] = set()
        while len(results) + len(errors) + len(gone) < world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed test timed out after {timeout + 30:.0f} s; ranks done: "
                                   f"{sorted(results)}, failed: {sorted(errors)}")
            if q.empty():
                dead = [r for r, p in enumerate(procs)
                        if not p.is_alive() and p.exitcode not in (0, None) and r not in results and r not in errors]
                gone |= {r for r in dead if r in may_die}
                dead = [r for r in dead if r not in may_die]
                if dead and q.empty():
                    time.sleep(0.5)
                    if q.empty():
                        raise RuntimeError(f"ranks {dead} died with exit codes "
                                           f"{[procs[r].exitcode for r in dead]}")
                time.sleep(0.02)
                continue
            rank, status, payload = q.get()
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                # one failed rank usually leaves the others blocked in a collective: stop now
                break
        if errors:
            r = min(errors)
            raise AssertionError(f"rank {r} of {world_size} failed:\n{errors[r]}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results.get(r) for r in range(world_size)]
