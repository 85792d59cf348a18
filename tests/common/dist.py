"""Run a function on N processes with torch.distributed (gloo by default).

Every distributed test uses :func:`run_distributed`: it hosts the rendezvous store, starts the
ranks, gives each a process group, collects each rank's return value, and fails fast: the first
rank that raises (or dies) is reported with its rank and traceback and every other rank is killed
at once; whatever outlives ``timeout`` is killed too, so a hang fails the test instead of
blocking CI. The collectives time out well before the harness (:func:`collective_timeout`), so a
rank blocked on a peer that stopped talking raises where it waits.

The ranks are forked from a forkserver that has torch, torch.distributed and flcomm imported
(:data:`PRELOAD`): a rank starts in a fraction of a second instead of importing torch itself. The
forkserver never runs a torch op (no CUDA, no OpenMP pool) and has one thread, so a fork of it is
safe; each rank re-applies the caller's ``os.environ`` (a forkserver child inherits the
forkserver's environment, which is the one of the first call).
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

STORE = None  # the job's store, in a rank (tests of the elastic federation use it directly)

# NOTE: what the forkserver imports once for every rank; a missing one is skipped by the
# forkserver itself (ImportError is ignored there), this module last (it holds _worker)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.distributed.checkpoint", "flcomm.federated.fedavg", "flcomm.train", __name__)
START_SLACK_S = 30.0  # the harness's limit is ``timeout`` + this (the ranks' start-up)
# NOTE: gloo's full-mesh connect of init_process_group fails now and then on a loaded machine
# ("Connection closed by peer", also seen in PyTorch's own CI): the whole run is started again,
# before any rank ran ``fn``
INIT_ATTEMPTS = 3

_CTX = None


@contextmanager
def _environ(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _context():
    """The forkserver context, its server started with :data:`PRELOAD` on first use."""
    global _CTX
    if _CTX is None:
        from multiprocessing import forkserver

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        # NOTE: numpy's OpenBLAS (imported by torch) starts a thread pool at import; with one
        # thread the forkserver is single-threaded when it forks (each rank uses one thread anyway)
        with _environ(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1"):
            forkserver.ensure_running()
        _CTX = ctx
    return _CTX


def collective_timeout(timeout: float) -> float:
    """The process groups' timeout for a harness limit of ``timeout`` seconds: a quarter of it,
    between 30 s and 120 s, so a rank blocked on a dead or stuck peer raises (naming the
    collective) long before the harness gives up."""
    return min(120.0, max(30.0, timeout / 4))


def _worker(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, q, timeout_s: float,
            group_worlds: int | None, env: dict[str, str], store_timeout_s: float) -> None:
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # NOTE: two cores shared by up to 8 ranks: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    try:
        if torch.cuda._is_in_bad_fork():
            raise RuntimeError("the forkserver initialised CUDA: its children cannot use it (see PRELOAD)")
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False,
                              timeout=timedelta(seconds=store_timeout_s))
        global STORE
        STORE = store
        pg_timeout = timedelta(seconds=timeout_s)
        try:
            if group_worlds:  # NOTE: each federation group (contiguous ranks) its own world
                G = group_worlds
                dist.init_process_group(backend, rank=rank % G, world_size=G, timeout=pg_timeout,
                                        store=dist.PrefixStore(f"flcomm/group{rank // G}/", store))
            else:
                dist.init_process_group(backend, rank=rank, world_size=world, store=store, timeout=pg_timeout)
        except RuntimeError as e:
            if "connectFullMesh" not in str(e):
                raise
            q.put((rank, "retry", f"{type(e).__name__}: {e}"))
            return
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
                    may_die: frozenset[int] = frozenset(), collective_timeout_s: float | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the results in
    rank order. ``fn`` must be importable (module level) and its result picklable.

    ``timeout``: the harness's limit for the whole run (plus :data:`START_SLACK_S`); the process
    groups get ``collective_timeout_s`` (default :func:`collective_timeout`). ``group_worlds=G``:
    every block of G ranks is its own torch.distributed world (rank r is rank r % G there);
    :data:`STORE` is the job's store. ``may_die``: ranks that may end without a result (their
    result is None)."""
    pg_s = collective_timeout_s if collective_timeout_s is not None else collective_timeout(timeout)
    job = (fn, args, backend, pg_s, group_worlds, timeout)
    for attempt in range(INIT_ATTEMPTS):
        try:
            results = _run_once(job, world_size, may_die)
            return [results.get(r) for r in range(world_size)]
        except _InitFailed as e:
            if attempt + 1 == INIT_ATTEMPTS:
                raise RuntimeError(f"gloo's rendezvous failed {INIT_ATTEMPTS} times; the last: {e}") from None
    raise AssertionError("unreachable")


class _InitFailed(Exception):
    pass


def _run_once(job: tuple, world_size: int, may_die: frozenset[int]) -> dict[int, Any]:
    from flcomm.train.launch import bound_store

    fn, args, backend, pg_s, group_worlds, timeout = job
    ctx = _context()
    q = ctx.SimpleQueue()
    # NOTE: the parent hosts the store on a port the kernel picked (no race for a free port)
    store = bound_store("127.0.0.1", world_size + 1, timedelta(seconds=timeout + 60))
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, store.port, backend, fn, args, q, pg_s, group_worlds, env, timeout))
             for r in range(world_size)]
    for p in procs:
        p.start()
    ok = False
    try:
        results = _collect(procs, q, timeout + START_SLACK_S, may_die)
        ok = True
    finally:
        _stop(procs, grace_s=5.0 if ok else 0.0)
    return results


def run_parts(rank: int, world: int, parts: Iterable[tuple]) -> dict[str, Any]:
    """Several checks in one run of the ranks (starting ranks costs more than many checks):
    ``parts`` are ``(name, fn, args)``, run in order as ``fn(rank, world, *args)``; the results
    by name. The first part that raises ends the rank, and so the run: its peers would otherwise
    wait in that part's collectives, and every later part would start out of step."""
    out: dict[str, Any] = {}
    for name, fn, args in parts:
        try:
            out[name] = fn(rank, world, *args)
        except Exception as e:
            raise RuntimeError(f"part {name!r} failed on rank {rank}") from e
    return out


def _collect(procs: list, q, limit_s: float, may_die: frozenset[int]) -> dict[int, Any]:
    """Every rank's result; raises at the first rank that fails or dies (not in ``may_die``)."""
    world = len(procs)
    deadline = time.monotonic() + limit_s
    results: dict[int, Any] = {}
    gone: set[int] = set()
    while len(results) + len(gone) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"distributed test timed out after {limit_s:.0f} s; ranks done: {sorted(results)}, "
                               f"still running: {sorted(set(range(world)) - set(results) - gone)}")
        if not q.empty():
            rank, status, payload = q.get()
            if status == "retry":
                raise _InitFailed(f"rank {rank}: {payload}")
            if status != "ok":  # NOTE: the first failure: the others are killed (no wait on their collectives)
                _raise_first(procs, rank, payload, results, gone | may_die)
            results[rank] = pickle.loads(payload)
            continue
        dead = _dead(procs, set(results) | gone)
        gone |= dead & may_die
        if dead - may_die:
            time.sleep(0.5)  # NOTE: its error may still be in the pipe
            if q.empty():
                _raise_dead(procs, dead - may_die)
            continue
        time.sleep(0.01)
    return results


def _dead(procs: list, skip: set[int]) -> set[int]:
    return {r for r, p in enumerate(procs) if r not in skip and p.exitcode not in (0, None)}


def _raise_dead(procs: list, dead: set[int], then: str = "") -> None:
    raise RuntimeError(f"ranks {sorted(dead)} died with exit codes {[procs[r].exitcode for r in sorted(dead)]}"
                       + then)


def _raise_first(procs: list, rank: int, payload: str, results: dict, may_die: set[int]) -> None:
    """Report rank ``rank``'s error, unless a peer died first (the error is then its symptom:
    a closed connection), which its exit status shows within a moment."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        dead = _dead(procs, set(results) | may_die | {rank})
        if dead:
            _raise_dead(procs, dead, f"; then rank {rank} failed:\n{payload}")
        time.sleep(0.02)
    running = sorted(set(range(len(procs))) - set(results) - may_die - {rank})
    raise AssertionError(f"rank {rank} of {len(procs)} failed (ranks {running} still running, killed):\n{payload}")


def _stop(procs: Iterable, grace_s: float) -> None:
    """Give the ranks ``grace_s`` to exit (their process groups torn down); kill the rest."""
    procs = list(procs)
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
